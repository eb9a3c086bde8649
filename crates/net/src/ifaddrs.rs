//! The host's interfaces and their addresses, from `getifaddrs(3)`: which interface
//! holds an address (the UDP driver's IPv6 multicast interface, the device's netdev, MTU
//! and second address all ask).

use std::ffi::{CStr, CString};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One address of an interface, as `getifaddrs` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfAddr {
    /// The interface's name (`lo`, `eth0`).
    pub name: String,
    /// Whether it is a loopback interface.
    pub loopback: bool,
    /// The address.
    pub addr: IpAddr,
    /// Prefix length of the address's network.
    pub prefix: u32,
}

/// The index of the interface named `name` (`if_nametoindex`), if there is one.
pub fn index_of(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (index != 0).then_some(index)
}

/// Every IPv4 and IPv6 address of every interface; empty if `getifaddrs` fails.
pub fn interface_addrs() -> Vec<IfAddr> {
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
