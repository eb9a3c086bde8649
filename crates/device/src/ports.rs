//! rdma_cm's port rules, pure: which port a bind gets, which binds conflict, when a
//! listen is refused and which listener a connection reaches (Linux
//! `drivers/infiniband/core/cma.c`; the rules are spelled out in the
//! [`registry`](crate::registry) docs).
//!
//! Nothing here touches a file, a socket or the clock: the callers bring the bindings
//! that live, the host's facts ([`HostFacts`]) and the randomness. The registry's file
//! store applies these rules to the records it scans under its lock; [`PortTable`]
//! applies them to bindings held in memory, for models and tests of one host.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::ops::RangeInclusive;

use rustix::io::Errno;
pub use softrdma_wire::cm::PortSpace;

/// Ports handed out for port 0: Linux's default `net.ipv4.ip_local_port_range`, which
/// `cma_alloc_any_port` draws from.
pub const EPHEMERAL_PORTS: RangeInclusive<u16> = 32768..=60999;

/// Ports below this need `CAP_NET_BIND_SERVICE` (cma.c: `PROT_SOCK`).
const PROT_SOCK: u16 = 1024;

/// The per-id options that change how a bind conflicts, as the CM id had them set when
/// it bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BindOptions {
    /// `RDMA_OPTION_ID_REUSEADDR`: share the port with other REUSEADDR bindings until
    /// listening.
    pub reuse_addr: bool,
    /// `RDMA_OPTION_ID_AFONLY` if the program set it; None takes Linux's default (IPv4:
    /// on; IPv6: `net.ipv6.bindv6only`).
    pub af_only: Option<bool>,
    /// The peer an active-side id will connect to: lets port-0 binds to different peers
    /// share a source port, as `cma_port_is_unique` allows.
    pub dst: Option<SocketAddr>,
}

/// What a bind depends on besides the other bindings: facts of the host and the process,
/// which the caller reads (the rules stay pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostFacts {
    /// The process has `CAP_NET_BIND_SERVICE` (ports below 1024).
    pub may_bind_service_ports: bool,
    /// `net.ipv6.bindv6only`: the default AFONLY of IPv6 bindings.
    pub bindv6only: bool,
}

impl Default for HostFacts {
    /// Linux's defaults for a privileged process: low ports allowed, `bindv6only` 0.
    fn default() -> Self {
        HostFacts {
            may_bind_service_ports: true,
            bindv6only: false,
        }
    }
}

/// Where a port-0 bind looks (`cma_alloc_any_port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ephemeral {
    /// The ports handed out ([`EPHEMERAL_PORTS`]).
    pub range: RangeInclusive<u16>,
    /// The port handed out last, which the next search skips.
    pub last: Option<u16>,
    /// Picks where the search starts.
    pub random: u64,
}

/// One binding as the rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// Its port space.
    pub ps: PortSpace,
    /// The bound address and port (the port is never 0).
    pub addr: SocketAddr,
    /// The peer of an active-side binding ([`BindOptions::dst`]).
    pub dst: Option<SocketAddr>,
    /// Connections reach it ([`lookup`]).
    pub listening: bool,
    /// REUSEADDR.
    pub reuse: bool,
    /// AFONLY.
    pub afonly: bool,
    /// Orders bindings: the newest is highest (the kernel's owner lists are newest
    /// first, and the first conflict found decides the errno).
    pub seq: u64,
}

/// `rdma_bind_addr`: the binding that `addr` in `ps` with `opts` becomes among the `live`
/// bindings, or the errno Linux gives (`EINVAL` for an IPv6 link-local address without a
/// scope, `EACCES` for a low port without the capability, `EADDRINUSE`,
/// `EADDRNOTAVAIL`). Port 0 takes a port as `eph` says.
pub fn bind(
    ps: PortSpace,
    addr: SocketAddr,
    opts: BindOptions,
    host: HostFacts,
    live: &[&Bound],
    eph: Ephemeral,
) -> Result<Bound, Errno> {
    if let SocketAddr::V6(a) = addr {
        if is_link_local(a.ip()) && a.scope_id() == 0 {
            return Err(Errno::INVAL);
        }
    }
    if addr.port() != 0 && addr.port() < PROT_SOCK && !host.may_bind_service_ports {
        return Err(Errno::ACCESS);
    }
    let afonly = opts.af_only.unwrap_or(match addr {
        SocketAddr::V4(_) => true,
        SocketAddr::V6(_) => host.bindv6only,
    });
    let seq = live
        .iter()
        .map(|b| b.seq)
        .max()
        .map_or(0, |s| s.saturating_add(1));
    let mut new = Bound {
        ps,
        addr,
        dst: opts.dst,
        listening: false,
        reuse: opts.reuse_addr,
        afonly,
        seq,
    };
    if addr.port() == 0 {
        let port = alloc_any_port(eph.range, eph.last, eph.random, &new, live)?;
        new.addr.set_port(port);
    } else {
        check_port(&new, &owners(live, ps, addr.port()), new.reuse)?;
    }
    Ok(new)
}

/// `rdma_listen`: `b` as a listener, with `others` the other live bindings. A binding
/// made with REUSEADDR is checked again as if it had none, and loses it for good; one
/// without is not checked again; one made for a peer cannot listen (`EINVAL`).
pub fn listen(b: &Bound, others: &[&Bound]) -> Result<Bound, Errno> {
    if b.dst.is_some() {
        return Err(Errno::INVAL);
    }
    let mut new = b.clone();
    if b.reuse {
        check_port(b, &owners(others, b.ps, b.addr.port()), false)?;
        new.reuse = false;
    }
    new.listening = true;
    Ok(new)
}

/// Whether a connection to `dst` in `ps` reaches the binding `l`
/// (`cma_match_private_data`).
pub fn reaches(l: &Bound, ps: PortSpace, dst: SocketAddr) -> bool {
    l.ps == ps && l.listening && l.addr.port() == dst.port() && match_rank(l, dst.ip()).is_some()
}

/// The listener among `live` that a connection to `dst` in `ps` reaches: an exact address
/// before the zero address before a loopback one, then the newest. Whether `dst` is an
/// address of this host is the caller's question.
pub fn lookup<'a, I>(live: I, ps: PortSpace, dst: SocketAddr) -> Option<&'a Bound>
where
    I: IntoIterator<Item = &'a Bound>,
{
    live.into_iter()
        .filter(|l| reaches(l, ps, dst))
        .filter_map(|l| Some(((match_rank(l, dst.ip())?, l.seq), l)))
        .max_by_key(|(k, _)| *k)
        .map(|(_, l)| l)
}

/// The bindings of `live` on `port` in `ps`, newest first (the kernel's owner list order).
fn owners<'a>(live: &[&'a Bound], ps: PortSpace, port: u16) -> Vec<&'a Bound> {
    let mut v: Vec<&Bound> = live
        .iter()
        .copied()
        .filter(|b| b.ps == ps && b.addr.port() == port)
        .collect();
    v.sort_by_key(|b| std::cmp::Reverse(b.seq));
    v
}

/// cma.c `cma_any_addr`: the zero network or loopback.
fn any_addr(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.octets()[0] == 0 || a.is_loopback(),
        IpAddr::V6(a) => a.is_unspecified() || a.is_loopback(),
    }
}

fn is_link_local(a: &Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// cma.c `cma_addr_cmp(a, b) == 0`.
fn same_addr(a: &SocketAddr, b: &SocketAddr) -> bool {
    match (a, b) {
        (SocketAddr::V4(a), SocketAddr::V4(b)) => a.ip() == b.ip(),
        (SocketAddr::V6(a), SocketAddr::V6(b)) => {
            a.ip() == b.ip() && (!is_link_local(b.ip()) || a.scope_id() == b.scope_id())
        }
        _ => false,
    }
}

/// cma.c `cma_check_port`: may `new` join the bindings `owners` of its port (newest
/// first)? `reuse` is the REUSEADDR the check runs with (off when listening).
fn check_port(new: &Bound, owners: &[&Bound], reuse: bool) -> Result<(), Errno> {
    for cur in owners {
        if reuse && cur.reuse {
            continue;
        }
        if new.afonly && cur.afonly && new.addr.is_ipv4() != cur.addr.is_ipv4() {
            continue;
        }
        if any_addr(new.addr.ip()) || any_addr(cur.addr.ip()) {
            return Err(Errno::ADDRNOTAVAIL);
        }
        if same_addr(&new.addr, &cur.addr) {
            return Err(Errno::ADDRINUSE);
        }
    }
    Ok(())
}

/// cma.c `cma_port_is_unique`: may a port-0 bind `new` share a port with `owners`? A
/// missing destination is an any address with port 0.
fn port_is_unique(new: &Bound, owners: &[&Bound]) -> Result<(), Errno> {
    let port_of = |d: Option<SocketAddr>| d.map_or(0, |d| d.port());
    let specific = |d: Option<SocketAddr>| d.filter(|d| !any_addr(d.ip()));
    for cur in owners {
        let (dport, cur_dport) = (port_of(new.dst), port_of(cur.dst));
        if dport != 0 && cur_dport != 0 && dport != cur_dport {
            continue;
        }
        if !any_addr(new.addr.ip()) && !any_addr(cur.addr.ip()) && !same_addr(&new.addr, &cur.addr)
        {
            continue;
        }
        if let (Some(d), Some(cd)) = (specific(new.dst), specific(cur.dst)) {
            if !same_addr(&d, &cd) {
                continue;
            }
        }
        return Err(Errno::ADDRNOTAVAIL);
    }
    Ok(())
}

/// cma.c `cma_alloc_any_port`: a port of `range` for `new`, starting at a point that
/// `random` picks, never `last` (the port handed out last).
fn alloc_any_port(
    range: RangeInclusive<u16>,
    last: Option<u16>,
    random: u64,
    new: &Bound,
    live: &[&Bound],
) -> Result<u16, Errno> {
    let (low, high) = (*range.start(), *range.end());
    if low > high {
        return Err(Errno::ADDRNOTAVAIL);
    }
    let mut by_port: HashMap<u16, Vec<&Bound>> = HashMap::new();
    for b in live
        .iter()
        .filter(|b| b.ps == new.ps && (low..=high).contains(&b.addr.port()))
    {
        by_port.entry(b.addr.port()).or_default().push(b);
    }
    for v in by_port.values_mut() {
        v.sort_by_key(|b| std::cmp::Reverse(b.seq));
    }
    let mut remaining = u32::from(high - low) + 1;
    // `remaining` is at most 65536, so the sum stays within u16.
    let mut rover = low + (random % u64::from(remaining)) as u16;
    loop {
        if last != Some(rover) {
            let free = by_port
                .get(&rover)
                .map_or(true, |o| port_is_unique(new, o).is_ok());
            if free {
                return Ok(rover);
            }
        }
        remaining -= 1;
        if remaining == 0 {
            return Err(Errno::ADDRNOTAVAIL);
        }
        rover = if rover >= high { low } else { rover + 1 };
    }
}

/// A port of a block another process leases (the registry's port leases), as the rules
/// see it: a binding of every address of both families, without REUSEADDR, so that every
/// bind on the port conflicts and no port-0 bind shares it. Whether the leasing process has
/// handed the port to one of its ids yet, others cannot know; the port is taken either way.
pub fn leased(ps: PortSpace, port: u16, seq: u64) -> Bound {
    Bound {
        ps,
        addr: SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        dst: None,
        listening: false,
        reuse: false,
        afonly: false,
        seq,
    }
}

/// A block of `size` consecutive ports of `range` on which no binding of `live` in `ps`
/// sits, for a port lease: the first such run upwards from a point `random` picks, with
/// wrap-around (a block itself never wraps). None if there is no such run.
pub fn free_block(
    ps: PortSpace,
    range: RangeInclusive<u16>,
    size: u16,
    random: u64,
    live: &[&Bound],
) -> Option<RangeInclusive<u16>> {
    let (low, high) = (*range.start(), *range.end());
    if low > high || size == 0 {
        return None;
    }
    let n = usize::from(high - low) + 1;
    let size = usize::from(size);
    if size > n {
        return None;
    }
    let mut used = vec![false; n];
    for b in live.iter().filter(|b| b.ps == ps) {
        if let Some(i) = b.addr.port().checked_sub(low).map(usize::from) {
            if i < n {
                used[i] = true;
            }
        }
    }
    let start = (random % n as u64) as usize;
    // From `start` to the end, then from the beginning to just past `start` (a run that
    // reaches `start` from below may go on above it).
    let order = (start..n).chain(0..(start + size).min(n));
    let mut run = 0;
    for i in order {
        if i == 0 {
            run = 0;
        }
        run = if used[i] { 0 } else { run + 1 };
        if run == size {
            // `i < n <= 65536` and `low + i <= high`, so both fit in u16.
            let lo = low + (i + 1 - size) as u16;
            return Some(lo..=low + i as u16);
        }
    }
    None
}

/// How well listener `l` matches destination `dst` (higher is better), or None if a
/// connection to `dst` does not reach it (cma.c `cma_match_private_data`).
fn match_rank(l: &Bound, dst: IpAddr) -> Option<u8> {
    let ip = l.addr.ip();
    let exact = ip == dst;
    let matches =
        (any_addr(ip) && !l.afonly) || (ip.is_ipv4() == dst.is_ipv4() && (any_addr(ip) || exact));
    matches.then_some(if exact {
        2
    } else if ip.is_unspecified() || matches!(ip, IpAddr::V4(a) if a.octets()[0] == 0) {
        1
    } else {
        0
    })
}

/// A handle to a binding in a [`PortTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key(u64);

/// One host's bindings held in memory under the same rules as the registry's files, each
/// carrying a value of the caller's (the device a listener's connections go to, say).
/// For models and tests that need the rules without files or processes.
#[derive(Debug, Clone)]
pub struct PortTable<T> {
    host: HostFacts,
    range: RangeInclusive<u16>,
    bindings: Vec<(Key, Bound, T)>,
    next_key: u64,
    last_port: Option<u16>,
    /// xorshift64 state: where port-0 searches start.
    random: u64,
}

impl<T> PortTable<T> {
    /// An empty table on a host with `host`'s facts; `seed` picks the ephemeral ports.
    pub fn new(host: HostFacts, seed: u64) -> PortTable<T> {
        PortTable {
            host,
            range: EPHEMERAL_PORTS,
            bindings: Vec::new(),
            next_key: 0,
            last_port: None,
            random: seed | 1,
        }
    }

    /// Reserve `addr` in `ps` ([`bind`]); `value` rides with the binding.
    pub fn bind(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        opts: BindOptions,
        value: T,
    ) -> Result<(Key, &Bound), Errno> {
        self.random ^= self.random << 13;
        self.random ^= self.random >> 7;
        self.random ^= self.random << 17;
        let live: Vec<&Bound> = self.bindings.iter().map(|(_, b, _)| b).collect();
        let eph = Ephemeral {
            range: self.range.clone(),
            last: self.last_port,
            random: self.random,
        };
        let b = bind(ps, addr, opts, self.host, &live, eph)?;
        if addr.port() == 0 {
            self.last_port = Some(b.addr.port());
        }
        let key = Key(self.next_key);
        self.next_key += 1;
        self.bindings.push((key, b, value));
        Ok((key, &self.bindings[self.bindings.len() - 1].1))
    }

    /// Start or stop listening ([`listen`]); on failure the binding stays as it was.
    /// An unknown key is `EINVAL`.
    pub fn set_listening(&mut self, key: Key, on: bool) -> Result<(), Errno> {
        let i = self.index(key)?;
        if self.bindings[i].1.listening == on {
            return Ok(());
        }
        if !on {
            self.bindings[i].1.listening = false;
            return Ok(());
        }
        let others: Vec<&Bound> = self
            .bindings
            .iter()
            .filter(|(k, _, _)| *k != key)
            .map(|(_, b, _)| b)
            .collect();
        let b = listen(&self.bindings[i].1, &others)?;
        self.bindings[i].1 = b;
        Ok(())
    }

    /// REUSEADDR set after bind: later binds and listens count it.
    pub fn set_reuse_addr(&mut self, key: Key, on: bool) -> Result<(), Errno> {
        let i = self.index(key)?;
        self.bindings[i].1.reuse = on;
        Ok(())
    }

    /// AFONLY set after bind: later binds and listens count it.
    pub fn set_af_only(&mut self, key: Key, on: bool) -> Result<(), Errno> {
        let i = self.index(key)?;
        self.bindings[i].1.afonly = on;
        Ok(())
    }

    /// Release a binding; its value comes back.
    pub fn release(&mut self, key: Key) -> Option<T> {
        let i = self.index(key).ok()?;
        Some(self.bindings.remove(i).2)
    }

    /// The binding of `key` and its value.
    pub fn get(&self, key: Key) -> Option<(&Bound, &T)> {
        let i = self.index(key).ok()?;
        let (_, b, v) = &self.bindings[i];
        Some((b, v))
    }

    /// The listener a connection to `dst` in `ps` reaches ([`lookup`]), with its value.
    pub fn lookup(&self, ps: PortSpace, dst: SocketAddr) -> Option<(&Bound, &T)> {
        let l = lookup(self.bindings.iter().map(|(_, b, _)| b), ps, dst)?;
        self.bindings
            .iter()
            .find(|(_, b, _)| std::ptr::eq(b, l))
            .map(|(_, b, v)| (b, v))
    }

    fn index(&self, key: Key) -> Result<usize, Errno> {
        self.bindings
            .iter()
            .position(|(k, _, _)| *k == key)
            .ok_or(Errno::INVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    const TCP: PortSpace = PortSpace::Tcp;

    fn rec(addr: &str) -> Bound {
        Bound {
            ps: TCP,
            addr: sa(addr),
            dst: None,
            listening: false,
            reuse: false,
            afonly: sa(addr).is_ipv4(),
            seq: 0,
        }
    }

    #[test]
    fn port_space_values() {
        for ps in [
            PortSpace::Tcp,
            PortSpace::Udp,
            PortSpace::Ib,
            PortSpace::IpoIb,
        ] {
            assert_eq!(PortSpace::from_raw(ps.raw()), Some(ps));
        }
        assert_eq!(PortSpace::Tcp.raw(), 0x0106);
        assert_eq!(PortSpace::from_raw(0x0107), None);
    }

    #[test]
    fn check_port_rules() {
        let chk = |new: &Bound, cur: &Bound, reuse| check_port(new, &[cur], reuse);
        // Loopback counts as any, like the zero network.
        for (a, b, want) in [
            ("192.0.2.1:7", "192.0.2.1:7", Err(Errno::ADDRINUSE)),
            ("192.0.2.1:7", "192.0.2.2:7", Ok(())),
            ("0.0.0.0:7", "192.0.2.1:7", Err(Errno::ADDRNOTAVAIL)),
            ("192.0.2.1:7", "0.0.0.0:7", Err(Errno::ADDRNOTAVAIL)),
            ("0.0.0.0:7", "0.0.0.0:7", Err(Errno::ADDRNOTAVAIL)),
            ("127.0.0.1:7", "127.0.0.1:7", Err(Errno::ADDRNOTAVAIL)),
            ("127.0.0.1:7", "127.0.0.2:7", Err(Errno::ADDRNOTAVAIL)),
            ("0.1.2.3:7", "192.0.2.1:7", Err(Errno::ADDRNOTAVAIL)),
            ("[::1]:7", "[2001:db8::1]:7", Err(Errno::ADDRNOTAVAIL)),
            ("[2001:db8::1]:7", "[2001:db8::1]:7", Err(Errno::ADDRINUSE)),
            ("[fe80::1%1]:7", "[fe80::1%2]:7", Ok(())),
            ("[fe80::1%1]:7", "[fe80::1%1]:7", Err(Errno::ADDRINUSE)),
            // IPv4 and IPv6 specific addresses never compare equal.
            ("192.0.2.1:7", "[::ffff:192.0.2.1]:7", Ok(())),
        ] {
            assert_eq!(chk(&rec(a), &rec(b), false), want, "{a} vs {b}");
        }
        // REUSEADDR: only when both have it (and the check runs with it).
        let (mut a, mut b) = (rec("192.0.2.1:7"), rec("192.0.2.1:7"));
        a.reuse = true;
        assert_eq!(chk(&a, &b, true), Err(Errno::ADDRINUSE));
        b.reuse = true;
        assert_eq!(chk(&a, &b, true), Ok(()));
        assert_eq!(chk(&a, &b, false), Err(Errno::ADDRINUSE));
        // AFONLY: other families are skipped only if both are AFONLY.
        let v4 = rec("0.0.0.0:7");
        let mut v6 = rec("[::]:7");
        v6.afonly = false;
        assert_eq!(chk(&v6, &v4, false), Err(Errno::ADDRNOTAVAIL));
        assert_eq!(chk(&v4, &v6, false), Err(Errno::ADDRNOTAVAIL));
        v6.afonly = true;
        assert_eq!(chk(&v6, &v4, false), Ok(()));
        let mut v4 = rec("0.0.0.0:7");
        v4.afonly = false;
        assert_eq!(chk(&v6, &v4, false), Err(Errno::ADDRNOTAVAIL));
        // The first conflicting owner decides: the newest one comes first.
        let (any, same) = (rec("0.0.0.0:7"), rec("192.0.2.1:7"));
        let new = rec("192.0.2.1:7");
        assert_eq!(
            check_port(&new, &[&same, &any], false),
            Err(Errno::ADDRINUSE)
        );
        assert_eq!(
            check_port(&new, &[&any, &same], false),
            Err(Errno::ADDRNOTAVAIL)
        );
    }

    #[test]
    fn port_is_unique_rules() {
        let with_dst = |src: &str, dst: Option<&str>| Bound {
            dst: dst.map(sa),
            ..rec(src)
        };
        let uniq = |a: &Bound, b: &Bound| port_is_unique(a, &[b]);
        let na = Err(Errno::ADDRNOTAVAIL);
        // No destinations: only different specific sources share.
        assert_eq!(uniq(&rec("0.0.0.0:0"), &rec("0.0.0.0:9")), na);
        assert_eq!(uniq(&rec("192.0.2.1:0"), &rec("192.0.2.2:9")), Ok(()));
        assert_eq!(uniq(&rec("192.0.2.1:0"), &rec("192.0.2.1:9")), na);
        assert_eq!(uniq(&rec("127.0.0.1:0"), &rec("127.0.0.2:9")), na);
        // Destinations: a different port or a different specific address shares.
        let a = with_dst("0.0.0.0:0", Some("192.0.2.9:5000"));
        assert_eq!(
            uniq(&a, &with_dst("0.0.0.0:9", Some("192.0.2.9:5001"))),
            Ok(())
        );
        assert_eq!(
            uniq(&a, &with_dst("0.0.0.0:9", Some("192.0.2.8:5000"))),
            Ok(())
        );
        assert_eq!(uniq(&a, &with_dst("0.0.0.0:9", Some("192.0.2.9:5000"))), na);
        assert_eq!(uniq(&a, &with_dst("0.0.0.0:9", None)), na);
        assert_eq!(uniq(&a, &with_dst("0.0.0.0:9", Some("127.0.0.1:5000"))), na);
        // REUSEADDR plays no part.
        let mut r = rec("0.0.0.0:9");
        r.reuse = true;
        let mut n = rec("0.0.0.0:0");
        n.reuse = true;
        assert_eq!(uniq(&n, &r), na);
    }

    #[test]
    fn alloc_any_port_walks_the_range() {
        let at = |port: u16| rec(&format!("0.0.0.0:{port}"));
        let new = rec("0.0.0.0:0");
        // Every start lands inside the range.
        for random in [0, 1, 4, 5, 1 << 40, u64::MAX] {
            let p = alloc_any_port(10..=14, None, random, &new, &[]).unwrap();
            assert!((10..=14).contains(&p), "{p}");
        }
        assert_eq!(alloc_any_port(10..=14, None, 2, &new, &[]), Ok(12));
        // Used ports are passed over, upwards with wrap-around.
        let used = [at(12), at(13), at(14)];
        let used: Vec<&Bound> = used.iter().collect();
        assert_eq!(alloc_any_port(10..=14, None, 2, &new, &used), Ok(10));
        // The port handed out last is skipped even if free.
        assert_eq!(alloc_any_port(10..=14, Some(10), 2, &new, &used), Ok(11));
        // Other port spaces do not count.
        let mut udp = at(12);
        udp.ps = PortSpace::Udp;
        assert_eq!(alloc_any_port(10..=14, None, 2, &new, &[&udp]), Ok(12));
        // Nothing left.
        let all: Vec<Bound> = (10..=14).map(at).collect();
        let all: Vec<&Bound> = all.iter().collect();
        assert_eq!(
            alloc_any_port(10..=14, None, 3, &new, &all),
            Err(Errno::ADDRNOTAVAIL)
        );
        assert_eq!(
            alloc_any_port(10..=10, Some(10), 0, &new, &[]),
            Err(Errno::ADDRNOTAVAIL)
        );
        // A used port is shared when cma_port_is_unique allows it.
        let spec = rec("192.0.2.1:10");
        let other = rec("192.0.2.2:0");
        assert_eq!(alloc_any_port(10..=10, None, 0, &other, &[&spec]), Ok(10));
    }

    #[test]
    fn free_block_finds_a_run_of_unused_ports() {
        let at = |port: u16| rec(&format!("192.0.2.1:{port}"));
        // From the random point upwards.
        assert_eq!(free_block(TCP, 10..=29, 4, 3, &[]), Some(13..=16));
        // A used port breaks a run; the search goes on past it.
        let used = [at(14), at(20)];
        let used: Vec<&Bound> = used.iter().collect();
        assert_eq!(free_block(TCP, 10..=29, 4, 3, &used), Some(15..=18));
        assert_eq!(free_block(TCP, 10..=29, 5, 3, &used), Some(15..=19));
        assert_eq!(free_block(TCP, 10..=29, 6, 3, &used), Some(21..=26));
        // A block never wraps: from 27, the run 27..=29 is too short, and the search goes
        // on at the start of the range...
        assert_eq!(free_block(TCP, 10..=29, 4, 17, &used), Some(10..=13));
        // ...up into the ports above the random point, for a run that reaches it.
        let one = [at(11)];
        let one: Vec<&Bound> = one.iter().collect();
        assert_eq!(free_block(TCP, 10..=15, 4, 3, &one), Some(12..=15));
        // Other port spaces do not count; nothing long enough is None.
        let mut udp = at(12);
        udp.ps = PortSpace::Udp;
        assert_eq!(free_block(TCP, 10..=13, 4, 1, &[&udp]), Some(10..=13));
        assert_eq!(free_block(TCP, 10..=29, 10, 0, &used), None);
        assert_eq!(free_block(TCP, 10..=12, 4, 0, &[]), None);
        assert_eq!(free_block(TCP, 10..=12, 0, 0, &[]), None);
        // A leased port conflicts with every bind and is shared by no port-0 bind.
        let l = leased(TCP, 10, 5);
        for (addr, e) in [
            ("192.0.2.1:10", Errno::ADDRNOTAVAIL),
            ("[2001:db8::1]:10", Errno::ADDRNOTAVAIL),
        ] {
            let mut new = rec(addr);
            new.reuse = true;
            assert_eq!(check_port(&new, &[&l], true), Err(e));
        }
        let mut new = rec("192.0.2.1:0");
        new.dst = Some(sa("192.0.2.9:7174"));
        assert_eq!(
            alloc_any_port(10..=10, None, 0, &new, &[&l]),
            Err(Errno::ADDRNOTAVAIL)
        );
    }

    #[test]
    fn bind_checks_scope_capability_and_family_default() {
        let host = HostFacts::default();
        let b = |addr: &str, host: HostFacts| {
            let eph = Ephemeral {
                range: 10..=14,
                last: None,
                random: 0,
            };
            bind(TCP, sa(addr), BindOptions::default(), host, &[], eph)
        };
        assert_eq!(b("[fe80::1]:7174", host), Err(Errno::INVAL));
        assert!(b("[fe80::1%2]:7174", host).is_ok());
        let unprivileged = HostFacts {
            may_bind_service_ports: false,
            ..host
        };
        assert_eq!(b("0.0.0.0:80", unprivileged), Err(Errno::ACCESS));
        assert!(b("0.0.0.0:0", unprivileged).is_ok());
        assert!(b("0.0.0.0:80", host).is_ok());
        assert!(b("0.0.0.0:7", host).unwrap().afonly);
        assert!(!b("[::]:7", host).unwrap().afonly);
        let v6only = HostFacts {
            bindv6only: true,
            ..host
        };
        assert!(b("[::]:7", v6only).unwrap().afonly);
    }

    #[test]
    fn table_binds_listens_and_looks_up_by_the_rules() {
        let mut t: PortTable<&str> = PortTable::new(HostFacts::default(), 7);
        let reuse = BindOptions {
            reuse_addr: true,
            ..BindOptions::default()
        };
        let (a, _) = t.bind(TCP, sa("0.0.0.0:7174"), reuse, "a").unwrap();
        let (b, _) = t.bind(TCP, sa("0.0.0.0:7174"), reuse, "b").unwrap();
        // Two REUSEADDR wildcards share until one listens.
        assert_eq!(t.set_listening(a, true), Err(Errno::ADDRNOTAVAIL));
        assert_eq!(t.release(b), Some("b"));
        t.set_listening(a, true).unwrap();
        assert_eq!(
            t.bind(TCP, sa("0.0.0.0:7174"), reuse, "c").err(),
            Some(Errno::ADDRNOTAVAIL)
        );
        // Any local address reaches the wildcard listener; another port space does not.
        let (_, v) = t.lookup(TCP, sa("127.0.0.9:7174")).unwrap();
        assert_eq!(*v, "a");
        assert!(t.lookup(PortSpace::Udp, sa("127.0.0.9:7174")).is_none());
        // An exact address wins over the wildcard.
        let (s, _) = t
            .bind(TCP, sa("10.0.0.1:7175"), BindOptions::default(), "s")
            .unwrap();
        t.set_listening(s, true).unwrap();
        assert_eq!(
            t.lookup(TCP, sa("10.0.0.1:7175")).map(|(_, v)| *v),
            Some("s")
        );
        assert!(t.lookup(TCP, sa("10.0.0.2:7175")).is_none());
        // Port 0 gets distinct ephemeral ports.
        let (_, p) = t
            .bind(TCP, sa("0.0.0.0:0"), BindOptions::default(), "p")
            .unwrap();
        let p = p.addr.port();
        let (_, q) = t
            .bind(TCP, sa("0.0.0.0:0"), BindOptions::default(), "q")
            .unwrap();
        assert!(EPHEMERAL_PORTS.contains(&p));
        assert_ne!(p, q.addr.port());
    }
}
