//! Which network interface holds a device's IP address: the netdev a GID entry names
//! (`ndev_ifindex` in the drop-in's GID table, `gid_attrs/ndevs` in the sysfs view of
//! `softrdma run`), as the kernel's RoCE GID table names the interface an address is on.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use softrdma_transport::verbs::Mtu;

/// A network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetDev {
    /// Its name (`lo`, `eth0`).
    pub name: String,
    /// Its index (`if_nametoindex`).
    pub index: u32,
}

/// One address of an interface, as `getifaddrs` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct IfAddr {
    name: String,
    loopback: bool,
    addr: IpAddr,
    /// Prefix length of the address's network.
    prefix: u32,
}

/// The interface holding `ip`: the one with exactly that address, else a loopback
/// interface whose network contains it (Linux answers every 127.0.0.x on `lo`, which
/// lists only 127.0.0.1/8). None if no interface does.
pub fn holding(ip: IpAddr) -> Option<NetDev> {
    let list = interface_addrs();
    let name = pick(&list, ip)?;
    let c = std::ffi::CString::new(name.as_str()).ok()?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (index != 0).then_some(NetDev { name, index })
}

/// The IB MTU of RoCE over a link that carries IP packets of `link_mtu` bytes: the
/// largest that fits once the headers a RoCEv2 packet may carry are taken off (the
/// 40-byte GRH/IPv6 header, UDP, BTH, an XRC extension, the AtomicETH and the ICRC: 96
/// bytes, as Linux's `iboe_get_mtu` counts them). 1500 gives 1024, loopback's 65536 gives
/// 4096. None below 352 (not even 256 fits).
pub fn roce_mtu(link_mtu: u32) -> Option<Mtu> {
    const OVERHEAD: u32 = 40 + 8 + 12 + 4 + 28 + 4;
    let room = link_mtu.checked_sub(OVERHEAD)?;
    [
        Mtu::Mtu4096,
        Mtu::Mtu2048,
        Mtu::Mtu1024,
        Mtu::Mtu512,
        Mtu::Mtu256,
    ]
    .into_iter()
    .find(|m| m.bytes() as u32 <= room)
}

/// The IB MTU of RoCE from the device at `ip`: [`roce_mtu`] of the MTU of the interface
/// holding it. None if that interface or its MTU cannot be found.
pub fn roce_mtu_at(ip: IpAddr) -> Option<Mtu> {
    holding(ip).and_then(|d| d.mtu()).and_then(roce_mtu)
}

impl NetDev {
    /// The interface's MTU (`SIOCGIFMTU`): the largest IP packet it carries. None if the
    /// interface is gone or the query fails.
    pub fn mtu(&self) -> Option<u32> {
        // SAFETY: ifreq is plain data, valid all zeroes.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        let name = self.name.as_bytes();
        if name.len() >= req.ifr_name.len() {
            return None;
        }
        for (d, &b) in req.ifr_name.iter_mut().zip(name) {
            *d = b as libc::c_char;
        }
        // SAFETY: plain socket(2); the descriptor is closed below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: SIOCGIFMTU reads the NUL-terminated name in `req` and writes its MTU
        // into `req`, which outlives the call.
        let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
        // SAFETY: `fd` is the socket opened above, closed once.
        unsafe { libc::close(fd) };
        // SAFETY: after a successful SIOCGIFMTU the union holds the MTU.
        let mtu = unsafe { req.ifr_ifru.ifru_mtu };
        (rc == 0).then_some(mtu).and_then(|m| u32::try_from(m).ok())
    }
}

/// The address of the other IP version on the interface holding `ip`, for a device that
/// serves both (its GID index 1): for an IPv4 address the interface's first IPv6 address
/// that needs no scope (not link-local, which a socket can only name with its interface),
/// for an IPv6 address the interface's first IPv4 address. On `lo`: `::1` beside any
/// 127.0.0.x, 127.0.0.1 beside `::1`. None if the interface has no such address.
pub fn other_version(ip: IpAddr) -> Option<IpAddr> {
    other_in(&interface_addrs(), ip)
}

fn other_in(list: &[IfAddr], ip: IpAddr) -> Option<IpAddr> {
    let name = pick(list, ip)?;
    let v4 = ip.to_canonical().is_ipv4();
    list.iter()
        .filter(|a| a.name == name && a.addr.is_ipv4() != v4)
        .map(|a| a.addr)
        .find(|a| match a {
            IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
            IpAddr::V4(_) => true,
        })
}

fn pick(list: &[IfAddr], ip: IpAddr) -> Option<String> {
    let ip = ip.to_canonical();
    if let Some(a) = list.iter().find(|a| a.addr == ip) {
        return Some(a.name.clone());
    }
    list.iter()
        .find(|a| a.loopback && contains(a.addr, a.prefix, ip))
        .map(|a| a.name.clone())
}

fn contains(net: IpAddr, prefix: u32, ip: IpAddr) -> bool {
    match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(i)) => {
            let mask = u32::MAX.checked_shl(32 - prefix.min(32)).unwrap_or(0);
            u32::from(n) & mask == u32::from(i) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(i)) => {
            let mask = u128::MAX.checked_shl(128 - prefix.min(128)).unwrap_or(0);
            u128::from(n) & mask == u128::from(i) & mask
        }
        _ => false,
    }
}

/// Every IPv4 and IPv6 address of every interface; empty if `getifaddrs` fails.
fn interface_addrs() -> Vec<IfAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr/ifa_netmask are null or point at sockaddrs of the family they
        // name; ifa_name is a NUL-terminated string.
        let (addr, mask) = unsafe { (sockaddr_ip(ifa.ifa_addr), sockaddr_ip(ifa.ifa_netmask)) };
        let Some(addr) = addr else { continue };
        let prefix = match mask {
            Some(IpAddr::V4(m)) => u32::from(m).count_ones(),
            Some(IpAddr::V6(m)) => u128::from(m).count_ones(),
            None => {
                if addr.is_ipv4() {
                    32
                } else {
                    128
                }
            }
        };
        // SAFETY: see above.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
        out.push(IfAddr {
            name: name.to_string_lossy().into_owned(),
            loopback: ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0,
            addr,
            prefix,
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no reference into it remains.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The IP address in a sockaddr of family AF_INET or AF_INET6.
///
/// # Safety
/// `sa` is null or points at a sockaddr as large as its family says.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: per the contract; the family field is common to every sockaddr.
    match i32::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            Some(IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(name: &str, loopback: bool, addr: &str, prefix: u32) -> IfAddr {
        IfAddr {
            name: name.into(),
            loopback,
            addr: addr.parse().unwrap(),
            prefix,
        }
    }

    #[test]
    fn picks_exact_then_loopback_network() {
        let l = [
            a("lo", true, "127.0.0.1", 8),
            a("lo", true, "::1", 128),
            a("eth0", false, "192.0.2.2", 24),
            a("eth0", false, "fd00::2", 64),
        ];
        let p = |s: &str| pick(&l, s.parse().unwrap());
        assert_eq!(p("127.0.0.1").as_deref(), Some("lo"));
        assert_eq!(p("127.0.0.7").as_deref(), Some("lo"));
        assert_eq!(p("::ffff:127.0.0.3").as_deref(), Some("lo"));
        assert_eq!(p("192.0.2.2").as_deref(), Some("eth0"));
        assert_eq!(p("fd00::2").as_deref(), Some("eth0"));
        // Another host on eth0's network is not this host's address.
        assert_eq!(p("192.0.2.9"), None);
        assert_eq!(p("::2"), None);
    }

    #[test]
    fn other_version_is_on_the_same_interface_and_needs_no_scope() {
        let l = [
            a("lo", true, "127.0.0.1", 8),
            a("lo", true, "::1", 128),
            a("eth0", false, "192.0.2.2", 24),
            a("eth0", false, "fe80::2", 64),
            a("eth0", false, "fd00::2", 64),
            a("eth1", false, "198.51.100.1", 24),
            a("eth1", false, "fe80::3", 64),
        ];
        let o = |s: &str| other_in(&l, s.parse().unwrap());
        assert_eq!(o("127.0.0.5"), Some("::1".parse().unwrap()));
        assert_eq!(o("::1"), Some("127.0.0.1".parse().unwrap()));
        assert_eq!(o("192.0.2.2"), Some("fd00::2".parse().unwrap()));
        assert_eq!(o("fd00::2"), Some("192.0.2.2".parse().unwrap()));
        // Only a link-local IPv6 address: none that a socket can bind without a scope.
        assert_eq!(o("198.51.100.1"), None);
        // Not this host's address.
        assert_eq!(o("203.0.113.1"), None);
    }

    #[test]
    fn path_mtu_follows_the_links_mtu_as_linux_counts_it() {
        let m = roce_mtu;
        assert_eq!(m(65536), Some(Mtu::Mtu4096));
        assert_eq!(m(9000), Some(Mtu::Mtu4096));
        assert_eq!(m(4192), Some(Mtu::Mtu4096));
        assert_eq!(m(4191), Some(Mtu::Mtu2048));
        assert_eq!(m(1500), Some(Mtu::Mtu1024));
        assert_eq!(m(1120), Some(Mtu::Mtu1024));
        assert_eq!(m(1119), Some(Mtu::Mtu512));
        assert_eq!(m(352), Some(Mtu::Mtu256));
        assert_eq!(m(351), None);
        assert_eq!(m(0), None);
    }

    #[test]
    fn mtu_of_loopback_is_what_sysfs_says() {
        let lo = holding("127.0.0.1".parse().unwrap()).expect("lo holds 127.0.0.1");
        let mtu = lo.mtu().expect("lo has an MTU");
        if let Ok(s) = std::fs::read_to_string("/sys/class/net/lo/mtu") {
            assert_eq!(Some(mtu), s.trim().parse().ok());
        }
        assert!(mtu >= 1280, "lo MTU {mtu}");
        let gone = NetDev {
            name: "softrdma-none0".into(),
            index: 0,
        };
        assert_eq!(gone.mtu(), None);
        let long = NetDev {
            name: "x".repeat(40),
            index: 0,
        };
        assert_eq!(long.mtu(), None);
    }

    #[test]
    fn loopback_of_this_host() {
        let lo = holding("127.0.0.2".parse().unwrap()).expect("lo holds 127.0.0.2");
        assert_eq!(lo.name, "lo");
        assert!(lo.index > 0);
    }
}
