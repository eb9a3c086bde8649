//! Which network interface holds a device's IP address: the netdev a GID entry names
//! (`ndev_ifindex` in the drop-in's GID table, `gid_attrs/ndevs` in the sysfs view of
//! `softrdma run`), as the kernel's RoCE GID table names the interface an address is on.

use std::net::IpAddr;

use softrdma_net::ifaddrs::{index_of, interface_addrs, IfAddr};

use softrdma_transport::verbs::Mtu;

/// A network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetDev {
    /// Its name (`lo`, `eth0`).
    pub name: String,
    /// Its index (`if_nametoindex`).
    pub index: u32,
}

/// The interface holding `ip`: the one with exactly that address, else a loopback
/// interface whose network contains it (Linux answers every 127.0.0.x on `lo`, which
/// lists only 127.0.0.1/8). None if no interface does.
pub fn holding(ip: IpAddr) -> Option<NetDev> {
    let list = interface_addrs();
    let name = pick(&list, ip)?;
    let index = index_of(&name)?;
    Some(NetDev { name, index })
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
