//! The real UDP datagram driver (Linux).
//!
//! A [`Driver`] is one non-blocking UDP socket bound to a device address (by default
//! port [`ROCE_PORT`], 4791). It moves opaque payloads in batches: [`Driver::send_batch`]
//! uses `sendmmsg(2)` (and UDP GSO when enabled), [`Driver::recv_batch`] uses
//! `recvmmsg(2)` into buffers preallocated in a [`RecvBatch`] (and splits UDP GRO
//! buffers when enabled). Nothing on either path allocates.
//!
//! Socket setup, and why:
//!
//! - **Don't fragment, never connected.** The RoCEv2 ICRC covers the IPv4 ID, so a
//!   sender must know the ID its kernel will write. Linux writes ID 0 for a datagram
//!   with DF set sent from an *unconnected* socket (a connected one gets a per-socket
//!   counter), so the socket is set to `IP_PMTUDISC_DO` and `connect(2)` is never
//!   called. IPv6 has no ID field; `IPV6_DONTFRAG` keeps the same "too big is an error,
//!   not a fragment" behaviour.
//! - **Per-datagram traffic class.** The traffic class of an address vector is the IP
//!   TOS byte (DSCP and ECN), and it differs per destination, so it rides in an
//!   `IP_TOS` / `IPV6_TCLASS` control message on every datagram whose class is not 0
//!   rather than a socket option (the socket's own class stays 0, so 0 needs no message);
//!   received datagrams report theirs (`IP_RECVTOS` / `IPV6_RECVTCLASS`).
//! - **Destination address on receive.** The ICRC also covers the destination IP, and a
//!   socket bound to a wildcard address does not otherwise know it, so every datagram
//!   reports it (`IP_PKTINFO` / `IPV6_RECVPKTINFO`).
//! - **No address reuse.** `SO_REUSEADDR`/`SO_REUSEPORT` are left off so that a bound
//!   address is one device: a second bind fails with `EADDRINUSE`, which
//!   [`bind_first_free_loopback`] relies on. The exception is the receive socket of a
//!   multicast group ([`Driver::bind_multicast`]), which every member device shares.
//! - **IPv6 sockets are IPv6-only**, so an IPv4 peer never shows up as a mapped address.
//!
//! GSO caveat, measured on Linux 6.18: when the kernel (or a NIC) splits a UDP GSO
//! buffer, segment *k* of the run gets IPv4 ID *k* (`inet_gso_segment` numbers them),
//! not 0. Only the first datagram of a run then matches an ICRC computed for ID 0, so
//! GSO is **off by default**; [`Driver::set_gso`] turns it on for traffic whose IP ID
//! does not matter (or whose sender accounts for it). On loopback the GSO buffer
//! crosses `lo` whole and the receiving socket splits it (or, with GRO on, hands it
//! over whole for [`RecvBatch::iter`] to split). GRO on receive has no wire effect
//! but needs 64 KiB receive slots, so it is off by default too ([`Driver::set_gro`]).

use std::io;
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr;
use std::time::{Duration, Instant};

/// UDP destination port of RoCEv2.
pub use softrdma_wire::ROCEV2_UDP_PORT as ROCE_PORT;

/// Largest UDP payload of one IPv4 datagram: 65535 − 20 (IP header) − 8 (UDP header).
pub const MAX_PAYLOAD_V4: usize = 65_507;

/// Largest UDP payload of one IPv6 datagram without jumbograms: 65535 − 8 (UDP header).
pub const MAX_PAYLOAD_V6: usize = 65_527;

/// Receive slot size that holds any UDP GRO buffer: GRO never coalesces beyond one
/// 64 KiB IP datagram. [`Driver::recv_batch`] refuses smaller slots while GRO is on,
/// because the kernel would silently cut a coalesced buffer to the slot size.
pub const GRO_BUF_SIZE: usize = 65_536;

/// Largest slot count of a [`RecvBatch`]; the kernel's `UIO_MAXIOV` bounds one
/// `recvmmsg` call the same way.
pub const MAX_RECV_BATCH: usize = 1024;

/// Segments per GSO buffer. The kernel limit (`UDP_MAX_SEGMENTS`) was 64 before
/// Linux 6.9; staying at 64 works everywhere.
const MAX_GSO_SEGMENTS: usize = 64;

/// Messages per `sendmmsg` call; a larger `send_batch` loops.
const MSGS_PER_CALL: usize = 64;

/// Datagrams (one iovec each) per `sendmmsg` call.
const IOVS_PER_CALL: usize = MSGS_PER_CALL * 4;

/// Room for every control message we send (TOS, UDP_SEGMENT) or ask to receive
/// (PKTINFO, TOS/TCLASS, UDP_GRO); the largest, `in6_pktinfo`, needs 40 bytes.
const CMSG_BUF: usize = 128;

/// Socket buffer size requested at bind (best effort): a burst of RoCE packets from
/// a peer must not be dropped because the progress thread was descheduled briefly.
const SOCKET_BUF_BYTES: usize = 4 << 20;

/// A datagram to send: destination, IP TOS byte (traffic class) and UDP payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutDatagram<'a> {
    /// Destination address and UDP port. An IPv4-mapped IPv6 address is sent as IPv4
    /// from an IPv4 socket (GIDs are written that way).
    pub dst: SocketAddr,
    /// IP TOS / IPv6 traffic class byte (DSCP in the upper six bits, ECN in the lower two).
    pub tos: u8,
    /// UDP payload.
    pub data: &'a [u8],
}

/// A received datagram, borrowed from a [`RecvBatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InDatagram<'a> {
    /// Sender's address and UDP source port.
    pub src: SocketAddr,
    /// The IP destination address of the datagram (from `IP_PKTINFO`, so it is the real
    /// one even on a wildcard-bound socket) and the local port.
    pub dst: SocketAddr,
    /// IP TOS / IPv6 traffic class byte as received.
    pub tos: u8,
    /// UDP payload.
    pub data: &'a [u8],
    /// Whether it came through a same-host ring rather than a socket.
    pub shm: bool,
}

/// Counters of what a UDP driver (a device's socket, `Driver`) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams the kernel accepted (a GSO buffer counts each segment).
    pub sent_datagrams: u64,
    /// `sendmmsg` calls that accepted at least one message.
    pub sent_batches: u64,
    /// Messages sent as one UDP GSO buffer of two or more datagrams.
    pub gso_batches: u64,
    /// Datagrams handed out by the driver's `recv_batch` (after splitting GRO buffers).
    pub recv_datagrams: u64,
    /// `recvmmsg` calls that returned at least one message.
    pub recv_batches: u64,
    /// Datagrams that arrived inside a coalesced GRO buffer of two or more.
    pub gro_segments: u64,
    /// Errors returned to the caller, plus received messages dropped as truncated or
    /// without a usable address.
    pub errors: u64,
    /// Datagrams sent through a same-host ring rather than the socket
    /// ([`crate::shm::HostLink`]).
    pub shm_sent_datagrams: u64,
    /// Datagrams received from a same-host ring.
    pub shm_recv_datagrams: u64,
    /// Sends that found a same-host ring full (the caller retried, or dropped the rest as
    /// for a full socket buffer).
    pub shm_full: u64,
}

/// A socket address in the C layout the kernel reads and writes.
#[repr(C)]
#[derive(Clone, Copy)]
union RawAddr {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

impl RawAddr {
    fn zeroed() -> Self {
        // SAFETY: both variants are plain C structs of integers, for which all-zero
        // bytes are a valid value.
        unsafe { mem::zeroed() }
    }
}

/// An aligned control-message buffer (`cmsghdr` needs `size_t` alignment).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Cmsg([u8; CMSG_BUF]);

const CMSG_HDR: usize = mem::size_of::<libc::cmsghdr>();

const fn cmsg_align(len: usize) -> usize {
    // glibc aligns control messages to size_t.
    let a = mem::size_of::<usize>();
    (len + a - 1) & !(a - 1)
}

const fn cmsg_space(len: usize) -> usize {
    cmsg_align(CMSG_HDR) + cmsg_align(len)
}

const fn cmsg_len(len: usize) -> usize {
    cmsg_align(CMSG_HDR) + len
}

/// Write one control message at `off` in `buf`; returns the offset of the next one.
/// Callers only write a few fixed-size messages, far below `CMSG_BUF`.
fn put_cmsg(buf: &mut Cmsg, off: usize, level: libc::c_int, ty: libc::c_int, data: &[u8]) -> usize {
    let end = off + cmsg_space(data.len());
    if end > CMSG_BUF {
        // Unreachable with the messages this module writes; refuse rather than overrun.
        return off;
    }
    let hdr = libc::cmsghdr {
        cmsg_len: cmsg_len(data.len()) as _,
        cmsg_level: level,
        cmsg_type: ty,
    };
    // SAFETY: `off + CMSG_HDR <= end <= CMSG_BUF`, so the write stays inside `buf`;
    // `cmsghdr` is plain integers and `write_unaligned` needs no alignment.
    unsafe { ptr::write_unaligned(buf.0.as_mut_ptr().add(off).cast::<libc::cmsghdr>(), hdr) };
    let d = off + cmsg_align(CMSG_HDR);
    buf.0[d..d + data.len()].copy_from_slice(data);
    buf.0[d + data.len()..end].fill(0);
    end
}

/// Preallocated `sendmmsg` arguments. They hold raw pointers into the caller's
/// payloads only for the duration of one `send_batch` call.
struct SendScratch {
    hdrs: Vec<libc::mmsghdr>,
    iovs: Vec<libc::iovec>,
    addrs: Vec<RawAddr>,
    ctrl: Vec<Cmsg>,
    /// Datagrams carried by each message of the current call.
    dgrams: Vec<usize>,
    /// Index in `iovs` of each message's first iovec.
    iov_start: Vec<usize>,
}

// SAFETY: the raw pointers in `hdrs` and `iovs` are written and handed to the kernel
// within a single `&mut self` call and never read by Rust afterwards, so moving the
// scratch to another thread moves nothing that is still in use.
unsafe impl Send for SendScratch {}
// SAFETY: no `&self` method touches the scratch; shared references cannot reach the
// pointers at all.
unsafe impl Sync for SendScratch {}

impl SendScratch {
    fn new() -> Self {
        SendScratch {
            // SAFETY: `mmsghdr` and `iovec` are C structs of integers and raw pointers,
            // for which all-zero (null) is a valid value.
            hdrs: vec![unsafe { mem::zeroed::<libc::mmsghdr>() }; MSGS_PER_CALL],
            // SAFETY: as above.
            iovs: vec![unsafe { mem::zeroed::<libc::iovec>() }; IOVS_PER_CALL],
            addrs: vec![RawAddr::zeroed(); MSGS_PER_CALL],
            ctrl: vec![Cmsg([0; CMSG_BUF]); MSGS_PER_CALL],
            dgrams: vec![0; MSGS_PER_CALL],
            iov_start: vec![0; MSGS_PER_CALL],
        }
    }
}

/// Whether UDP GSO may be used on sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gso {
    /// The kernel has no `UDP_SEGMENT`, or it failed at run time.
    Unsupported,
    /// Supported but not wanted (the default; see the module docs).
    Off,
    /// Supported and used for runs of equal-size datagrams.
    On,
}

/// A bound, non-blocking UDP socket that sends and receives datagrams in batches.
pub struct Driver {
    fd: OwnedFd,
    local: SocketAddr,
    v6: bool,
    gso: Gso,
    gro_supported: bool,
    gro: bool,
    stats: Stats,
    send: SendScratch,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("fd", &self.fd.as_raw_fd())
            .field("local", &self.local)
            .field("gso", &self.gso)
            .field("gro", &self.gro)
            .field("stats", &self.stats)
            .finish()
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    val: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `val` lives across the call and its exact size is passed; the kernel only
    // reads it.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&val as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// The C form of `addr` for a socket of the given family, or `None` if that family
/// cannot reach it. An IPv4-mapped IPv6 address goes out of an IPv4 socket as IPv4.
fn to_raw(addr: SocketAddr, v6_socket: bool) -> Option<(RawAddr, libc::socklen_t)> {
    let mut raw = RawAddr::zeroed();
    match (addr, v6_socket) {
        (SocketAddr::V6(a), true) => {
            raw.v6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            Some((raw, mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t))
        }
        (SocketAddr::V4(_), true) => None,
        (addr, false) => {
            let (ip, port) = match addr {
                SocketAddr::V4(a) => (*a.ip(), a.port()),
                SocketAddr::V6(a) => (a.ip().to_ipv4_mapped()?, a.port()),
            };
            raw.v4 = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: port.to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(ip).to_be(),
                },
                sin_zero: [0; 8],
            };
            Some((raw, mem::size_of::<libc::sockaddr_in>() as libc::socklen_t))
        }
    }
}

/// The Rust form of an address the kernel wrote, checking family and length.
fn from_raw(raw: &RawAddr, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    if len < mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: every variant starts with the `sa_family_t` family field, and the union
    // is fully initialised (zeroed before the kernel wrote into it).
    let family = unsafe { raw.v4.sin_family } as libc::c_int;
    match family {
        libc::AF_INET if len >= mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the kernel wrote a `sockaddr_in`; any bytes are a
            // valid value of these integer fields anyway.
            let a = unsafe { raw.v4 };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len >= mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for `sockaddr_in6`.
            let a = unsafe { raw.v6 };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                u32::from_be(a.sin6_flowinfo),
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Driver {
    /// Bind a non-blocking UDP socket to `addr` (IPv4 or IPv6; port 0 picks a free port)
    /// and configure it as the module docs describe. Fails with `AddrInUse` if another
    /// socket holds the address.
    pub fn bind(addr: SocketAddr) -> io::Result<Driver> {
        let (fd, gso, gro_supported) = Driver::socket(addr.is_ipv6())?;
        Driver::bound(fd, addr, gso, gro_supported)
    }

    /// A non-blocking UDP socket of the family `v6` says, configured as the module docs
    /// describe, with what the probes found: GSO support and GRO support.
    fn socket(v6: bool) -> io::Result<(OwnedFd, Gso, bool)> {
        use rustix::net::{AddressFamily, SocketFlags, SocketType};
        let domain = if v6 {
            AddressFamily::INET6
        } else {
            AddressFamily::INET
        };
        let fd = rustix::net::socket_with(
            domain,
            SocketType::DGRAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        )?;
        let s = fd.as_raw_fd();
        // Typed calls where rustix has them; the options it lacks (packet info, IPv6
        // DONTFRAG, UDP GSO/GRO) through `setsockopt_int`.
        use rustix::net::sockopt;
        if v6 {
            sockopt::set_ipv6_v6only(&fd, true)?;
            sockopt::set_ipv6_mtu_discover(&fd, sockopt::Ipv6PathMtuDiscovery::DO)?;
            setsockopt_int(s, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1)?;
            setsockopt_int(s, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1)?;
            sockopt::set_ipv6_recvtclass(&fd, true)?;
        } else {
            sockopt::set_ip_mtu_discover(&fd, sockopt::Ipv4PathMtuDiscovery::DO)?;
            setsockopt_int(s, libc::IPPROTO_IP, libc::IP_PKTINFO, 1)?;
            sockopt::set_ip_recvtos(&fd, true)?;
        }
        // Best effort: FORCE works for root and ignores rmem_max; otherwise the plain
        // option is capped by the sysctl, which is still better than the default.
        if sockopt::set_socket_recv_buffer_size_force(&fd, SOCKET_BUF_BYTES).is_err() {
            let _ = sockopt::set_socket_recv_buffer_size(&fd, SOCKET_BUF_BYTES);
        }
        if sockopt::set_socket_send_buffer_size_force(&fd, SOCKET_BUF_BYTES).is_err() {
            let _ = sockopt::set_socket_send_buffer_size(&fd, SOCKET_BUF_BYTES);
        }
        // Probe once: setting a zero default segment size is a no-op on kernels that
        // know UDP_SEGMENT (4.18+) and ENOPROTOOPT on the others.
        let gso = if setsockopt_int(s, libc::SOL_UDP, libc::UDP_SEGMENT, 0).is_ok() {
            Gso::Off
        } else {
            Gso::Unsupported
        };
        // Likewise UDP_GRO (5.0+): probe by switching it off explicitly.
        let gro_supported = setsockopt_int(s, libc::SOL_UDP, libc::UDP_GRO, 0).is_ok();

        Ok((fd, gso, gro_supported))
    }

    /// Bind the configured socket `fd` to `addr`.
    fn bound(fd: OwnedFd, addr: SocketAddr, gso: Gso, gro_supported: bool) -> io::Result<Driver> {
        let v6 = addr.is_ipv6();
        let s = fd.as_raw_fd();
        let (raw_addr, len) =
            to_raw(addr, v6).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `raw_addr` is a valid sockaddr of length `len` for this family.
        cvt(unsafe { libc::bind(s, (&raw_addr as *const RawAddr).cast(), len) })?;
        let local = SocketAddr::try_from(rustix::net::getsockname(&fd)?)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
        Ok(Driver {
            fd,
            local,
            v6,
            gso,
            gro_supported,
            gro: false,
            stats: Stats::default(),
            send: SendScratch::new(),
        })
    }

    /// A receive-only socket for the multicast group `group` on UDP port `port`, joined
    /// on the interface that holds `local` (the device's address) and configured as
    /// [`Driver::bind`] does. It is bound to the group's address itself, with
    /// `SO_REUSEADDR`: the kernel hands a multicast datagram to every socket bound to its
    /// address and port, so every device on the host that joins the group gets each one,
    /// while the unicast device sockets, bound without reuse, still exclude each other
    /// (a wildcard socket on the port would collide with them; a group address does
    /// not). Closing it leaves the group. `InvalidInput` unless `group` is a multicast
    /// address of `local`'s family.
    ///
    /// IPv4 multicast works on `lo` without its MULTICAST flag (measured on Linux 6.18,
    /// host and fresh network namespace alike): a join by address finds `lo` for any
    /// 127.0.0.0/8 address, a socket bound to a local source address sends multicast out
    /// of that address's interface, and `IP_MULTICAST_LOOP` (on by default) gives the copy
    /// to every joined socket there. IPv6 multicast has no route on `lo`
    /// (`ENETUNREACH`): it needs an interface with the MULTICAST flag.
    pub fn bind_multicast(group: IpAddr, port: u16, local: IpAddr) -> io::Result<Driver> {
        use rustix::net::sockopt;
        let (fd, gso, gro_supported) = Driver::socket(group.is_ipv6())?;
        sockopt::set_socket_reuseaddr(&fd, true)?;
        let bind_to = match (group, local) {
            (IpAddr::V4(g), IpAddr::V4(l)) if g.is_multicast() => {
                // ip_mreqn with an address and no index: the kernel joins on the
                // interface that holds the address.
                sockopt::set_ip_add_membership_with_ifindex(&fd, &g, &l, 0)?;
                SocketAddr::new(group, port)
            }
            (IpAddr::V6(g), IpAddr::V6(l)) if g.is_multicast() => {
                let ifindex = interface_index(IpAddr::V6(l)).unwrap_or(0);
                sockopt::set_ipv6_add_membership(&fd, &g, ifindex)?;
                // Link-local groups need the interface as scope to be bound.
                SocketAddr::V6(SocketAddrV6::new(g, port, 0, ifindex))
            }
            _ => return Err(io::Error::from(io::ErrorKind::InvalidInput)),
        };
        Driver::bound(fd, bind_to, gso, gro_supported)
    }

    /// Send multicast out of the interface with index `ifindex` (IPv6 sockets:
    /// `IPV6_MULTICAST_IF`). IPv4 sockets need no such setting: one bound to a local
    /// address sends multicast out of that address's interface.
    pub fn set_multicast_interface(&self, ifindex: u32) -> io::Result<()> {
        if self.v6 {
            rustix::net::sockopt::set_ipv6_multicast_if(&self.fd, ifindex)?;
        }
        Ok(())
    }

    /// Bind a socket that is only used to send, from `addr` (a fixed source port, as a
    /// per-QP RoCEv2 source port is): configured as [`Driver::bind`] does (DF, never
    /// connected, so IPv4 ID 0), but with the smallest receive buffer the kernel allows,
    /// since nobody reads it. Fails with `AddrInUse` if another socket holds the address.
    pub fn bind_send_only(addr: SocketAddr) -> io::Result<Driver> {
        let d = Driver::bind(addr)?;
        // Best effort: the kernel rounds this up to its minimum.
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&d.fd, 1);
        Ok(d)
    }

    /// A second driver on the same socket (a duplicated descriptor), so that one thread
    /// can receive while another sends. Socket options (GRO, buffer sizes) are shared
    /// with the original; the GSO choice, counters and scratch buffers are not.
    pub fn try_clone(&self) -> io::Result<Driver> {
        let fd = self.fd.try_clone()?;
        Ok(Driver {
            fd,
            local: self.local,
            v6: self.v6,
            gso: self.gso,
            gro_supported: self.gro_supported,
            gro: self.gro,
            stats: Stats::default(),
            send: SendScratch::new(),
        })
    }

    /// Bytes of receive buffer the socket got, as the kernel counts them against its
    /// datagrams (`SO_RCVBUF`: twice what was set, capped by `rmem_max` unless set as
    /// root).
    pub fn recv_buffer_size(&self) -> io::Result<usize> {
        Ok(rustix::net::sockopt::socket_recv_buffer_size(&self.fd)?)
    }

    /// The bound address (with the real port if 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Whether the kernel accepts UDP GSO on this socket (probed at bind; cleared if a
    /// GSO send later fails with `EIO`/`EINVAL`).
    pub fn gso_supported(&self) -> bool {
        self.gso != Gso::Unsupported
    }

    /// Whether sends use UDP GSO for runs of equal-size datagrams.
    pub fn gso_enabled(&self) -> bool {
        self.gso == Gso::On
    }

    /// How many datagrams from the start of `pkts` the next [`Driver::send_batch`] sends
    /// in one GSO message (1 while GSO is off): the kernel segments it, numbering the
    /// segments' IPv4 IDs from the message's own (0 on a DF socket that is not
    /// connected) upwards, so a protocol whose checksum covers the IP ID (RoCEv2's ICRC)
    /// can seal segment *k* for ID *k*. `send_batch` only ever starts a message where a
    /// run starts, also when it returns early, so runs planned from the first datagram of
    /// a batch and of every run after it are the runs sent.
    pub fn gso_run_len(&self, pkts: &[OutDatagram<'_>]) -> usize {
        if self.gso != Gso::On || pkts.is_empty() {
            return pkts.len().min(1);
        }
        let max_payload = if self.v6 {
            MAX_PAYLOAD_V6
        } else {
            MAX_PAYLOAD_V4
        };
        gso_run(pkts, max_payload)
    }

    /// Use UDP GSO (`on`) or not. Returns whether it is now in use: `false` when the
    /// kernel lacks it. Off by default: segment *k* of a GSO run leaves with IPv4 ID *k*,
    /// not 0 (see the module docs).
    pub fn set_gso(&mut self, on: bool) -> bool {
        if self.gso != Gso::Unsupported {
            self.gso = if on { Gso::On } else { Gso::Off };
        }
        self.gso == Gso::On
    }

    /// Whether the kernel accepts `UDP_GRO` on this socket (probed at bind).
    pub fn gro_supported(&self) -> bool {
        self.gro_supported
    }

    /// Whether the kernel may hand us coalesced GRO buffers.
    pub fn gro_enabled(&self) -> bool {
        self.gro
    }

    /// Ask the kernel to coalesce received datagrams of one flow (`UDP_GRO`); the
    /// driver splits them again. Returns whether GRO is now on. While it is on,
    /// [`Driver::recv_batch`] needs slots of at least [`GRO_BUF_SIZE`] bytes.
    pub fn set_gro(&mut self, on: bool) -> io::Result<bool> {
        if !self.gro_supported {
            return Ok(false);
        }
        setsockopt_int(
            self.fd.as_raw_fd(),
            libc::SOL_UDP,
            libc::UDP_GRO,
            libc::c_int::from(on),
        )?;
        self.gro = on;
        Ok(on)
    }

    /// Block until a datagram (or a socket error) is waiting, or `timeout` passes
    /// (`None`: no limit). Returns `true` if readable, `false` on timeout.
    pub fn wait_readable(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let left = match (timeout, deadline) {
                (None, _) => None,
                // A timeout too large for an Instant waits "forever" in slices.
                (Some(_), None) => Some(Duration::from_secs(u32::MAX.into())),
                (Some(_), Some(d)) => Some(d.saturating_duration_since(Instant::now())),
            };
            let ts = left.map(|d| rustix::event::Timespec {
                tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
                tv_nsec: d.subsec_nanos().into(),
            });
            let mut pfd = [rustix::event::PollFd::new(
                &self.fd,
                rustix::event::PollFlags::IN,
            )];
            match rustix::event::poll(&mut pfd, ts.as_ref()) {
                Ok(n) if n > 0 => return Ok(true),
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            match deadline {
                Some(d) if Instant::now() >= d => return Ok(false),
                _ => {}
            }
        }
    }

    /// Send datagrams in order with as few system calls as possible.
    ///
    /// Returns how many datagrams from the front of `pkts` the kernel accepted. Fewer
    /// than `pkts.len()` means the socket send buffer is full (wait and retry the rest)
    /// or `pkts[n]` failed, in which case sending it again returns its error. An error
    /// is returned only when the first datagram fails: `EMSGSIZE` when it is larger
    /// than the path MTU allows with DF, `InvalidInput` when its address family does
    /// not match the socket. A full buffer is `Ok(0)`, never `WouldBlock`.
    pub fn send_batch(&mut self, pkts: &[OutDatagram<'_>]) -> io::Result<usize> {
        let mut done = 0;
        while done < pkts.len() {
            let use_gso = self.gso == Gso::On;
            let nmsgs = match self.build(&pkts[done..], use_gso) {
                Ok(n) => n,
                Err(e) if done == 0 => {
                    self.stats.errors += 1;
                    return Err(e);
                }
                // The invalid datagram is reported by the next call, where it is first.
                Err(_) => return Ok(done),
            };
            let fd = self.fd.as_raw_fd();
            // SAFETY: `build` filled the first `nmsgs` headers; their name, iovec and
            // control pointers point into `self.send` (not resized since) and into the
            // payload slices of `pkts`, all alive for this call. The kernel only reads
            // the payloads.
            let r = unsafe {
                libc::sendmmsg(
                    fd,
                    self.send.hdrs.as_mut_ptr(),
                    nmsgs as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // The first message was a GSO buffer the kernel or the route cannot
                    // take (no checksum offload, segment above the MTU...): stop using
                    // GSO for good and resend the same datagrams one by one.
                    Some(libc::EIO) | Some(libc::EINVAL) if use_gso && self.send.dgrams[0] > 1 => {
                        self.gso = Gso::Unsupported;
                        continue;
                    }
                    _ => {}
                }
                if would_block(&e) {
                    return Ok(done);
                }
                if done == 0 {
                    self.stats.errors += 1;
                    return Err(e);
                }
                return Ok(done);
            }
            let sent_msgs = r as usize;
            let mut sent = 0;
            for &n in &self.send.dgrams[..sent_msgs] {
                sent += n;
                if n > 1 {
                    self.stats.gso_batches += 1;
                }
            }
            if sent_msgs > 0 {
                self.stats.sent_batches += 1;
            }
            self.stats.sent_datagrams += sent as u64;
            done += sent;
            if sent_msgs < nmsgs {
                // The kernel stopped early: a full buffer or an error on the next
                // message, which the caller's retry will surface.
                return Ok(done);
            }
        }
        Ok(done)
    }

    /// Fill the send scratch with messages for the front of `pkts`; returns the
    /// message count (at least 1), or `InvalidInput` if `pkts[0]` cannot be addressed.
    fn build(&mut self, pkts: &[OutDatagram<'_>], use_gso: bool) -> io::Result<usize> {
        let v6 = self.v6;
        let max_payload = if v6 { MAX_PAYLOAD_V6 } else { MAX_PAYLOAD_V4 };
        let s = &mut self.send;
        let (mut i, mut m, mut iov) = (0usize, 0usize, 0usize);
        // Pass 1: addresses, control messages and iovecs, by index only.
        while i < pkts.len() && m < MSGS_PER_CALL && iov < IOVS_PER_CALL {
            let p = &pkts[i];
            let Some((raw, _)) = to_raw(p.dst, v6) else {
                break;
            };
            let n = if use_gso {
                gso_run(&pkts[i..], max_payload)
            } else {
                1
            };
            // A run that does not fit this call starts the next one, whole: callers that
            // plan runs with `gso_run_len` see exactly these runs.
            if iov + n > IOVS_PER_CALL {
                break;
            }
            s.addrs[m] = raw;
            let tos = libc::c_int::from(p.tos).to_ne_bytes();
            // Traffic class 0 is the socket's own (it never sets one): no control message,
            // which the kernel would parse for every datagram (a tenth of a ping-pong's
            // two-datagram send on loopback).
            let mut off = if p.tos == 0 {
                0
            } else if v6 {
                put_cmsg(
                    &mut s.ctrl[m],
                    0,
                    libc::IPPROTO_IPV6,
                    libc::IPV6_TCLASS,
                    &tos,
                )
            } else {
                put_cmsg(&mut s.ctrl[m], 0, libc::IPPROTO_IP, libc::IP_TOS, &tos)
            };
            if n > 1 {
                // `seg <= max_payload < 65536`, so it fits the u16 the kernel expects.
                let seg = u16::try_from(p.data.len()).unwrap_or(u16::MAX);
                off = put_cmsg(
                    &mut s.ctrl[m],
                    off,
                    libc::SOL_UDP,
                    libc::UDP_SEGMENT,
                    &seg.to_ne_bytes(),
                );
            }
            for (k, q) in pkts[i..i + n].iter().enumerate() {
                s.iovs[iov + k] = libc::iovec {
                    // The kernel only reads send buffers; the cast to *mut is what the
                    // C struct wants.
                    iov_base: q.data.as_ptr() as *mut libc::c_void,
                    iov_len: q.data.len(),
                };
            }
            s.dgrams[m] = n;
            s.iov_start[m] = iov;
            s.hdrs[m].msg_hdr.msg_controllen = off as _;
            i += n;
            iov += n;
            m += 1;
        }
        if m == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "destination address family does not match the socket",
            ));
        }
        // Pass 2: pointers, taken once the vectors are final.
        let addrs = s.addrs.as_mut_ptr();
        let ctrl = s.ctrl.as_mut_ptr();
        let iovs = s.iovs.as_mut_ptr();
        for k in 0..m {
            let start = s.iov_start[k];
            let alen = if v6 {
                mem::size_of::<libc::sockaddr_in6>()
            } else {
                mem::size_of::<libc::sockaddr_in>()
            };
            let h = &mut s.hdrs[k];
            // SAFETY (for the `add`s): `k < MSGS_PER_CALL` = len of `addrs` and `ctrl`,
            // `start < IOVS_PER_CALL` = len of `iovs`; in bounds of their allocations.
            unsafe {
                h.msg_hdr.msg_name = addrs.add(k).cast();
                h.msg_hdr.msg_iov = iovs.add(start);
                h.msg_hdr.msg_control = ctrl.add(k).cast();
            }
            h.msg_hdr.msg_namelen = alen as libc::socklen_t;
            h.msg_hdr.msg_iovlen = s.dgrams[k] as _;
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
        Ok(m)
    }

    /// Receive what is waiting, up to the batch's slot count, into its buffers; returns
    /// the number of datagrams [`RecvBatch::iter`] now yields (0 if nothing was
    /// waiting; never `WouldBlock`). Messages cut short by a too-small slot are dropped
    /// and counted in [`Stats::errors`]. While GRO is on, slots smaller than
    /// [`GRO_BUF_SIZE`] are refused with `InvalidInput`, since the kernel would silently
    /// cut a coalesced buffer.
    pub fn recv_batch(&mut self, out: &mut RecvBatch) -> io::Result<usize> {
        out.clear();
        self.recv_append(out)
    }

    /// [`Driver::recv_batch`] into the slots `out` has left after what it holds already
    /// (datagrams from another path of the same link); returns how many datagrams `out`
    /// holds in all.
    pub(crate) fn recv_append(&mut self, out: &mut RecvBatch) -> io::Result<usize> {
        let start = out.nmeta;
        if start >= out.count {
            return Ok(out.ndgrams);
        }
        let before = out.ndgrams;
        if self.gro && out.buf_size < GRO_BUF_SIZE {
            self.stats.errors += 1;
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "GRO is on: receive slots must hold GRO_BUF_SIZE bytes",
            ));
        }
        out.arm(start);
        let fd = self.fd.as_raw_fd();
        let r = loop {
            // SAFETY: `arm` pointed every header from `start < count` on at its own
            // name, iovec, control buffer and data slot inside `out`, all alive and not
            // moved during the call, with lengths equal to their sizes; the kernel writes
            // within them, for the `count - start` headers it is given.
            let r = unsafe {
                libc::recvmmsg(
                    fd,
                    out.hdrs.as_mut_ptr().add(start),
                    (out.count - start) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    ptr::null_mut(),
                )
            };
            if r >= 0 {
                break r as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if would_block(&e) {
                return Ok(out.ndgrams);
            }
            self.stats.errors += 1;
            return Err(e);
        };
        if r > 0 {
            self.stats.recv_batches += 1;
            out.written(start, (start + r).min(out.count));
        }
        let local_port = self.local.port();
        for k in start..(start + r).min(out.count) {
            let h = &out.hdrs[k];
            let len = (h.msg_len as usize).min(out.buf_size);
            let flags = h.msg_hdr.msg_flags;
            let src = from_raw(&out.names[k], h.msg_hdr.msg_namelen);
            let ctl = parse_cmsgs(&h.msg_hdr);
            let (Some(src), Some(dst_ip), false) = (src, ctl.dst, flags & libc::MSG_TRUNC != 0)
            else {
                self.stats.errors += 1;
                continue;
            };
            let seg = match ctl.gro_seg {
                Some(s) if s > 0 && s < len => s,
                _ => len,
            };
            // A zero-length datagram is one datagram, not zero segments.
            let n = if len == 0 { 1 } else { len.div_ceil(seg) };
            if n > 1 {
                self.stats.gro_segments += n as u64;
            }
            out.metas[out.nmeta] = Meta {
                slot: k,
                src,
                dst: SocketAddr::new(dst_ip, local_port),
                tos: ctl.tos,
                len,
                seg,
                shm: false,
            };
            out.nmeta += 1;
            out.ndgrams += n;
        }
        self.stats.recv_datagrams += (out.ndgrams - before) as u64;
        Ok(out.ndgrams)
    }
}

impl AsRawFd for Driver {
    /// The socket, for a progress thread's poll/epoll set. Do not read from it or
    /// change its options behind the driver's back.
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for Driver {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Length of the GSO run at the start of `pkts` (non-empty): same destination and TOS,
/// equal sizes except that the last may be shorter, within the kernel's segment and size
/// limits.
fn gso_run(pkts: &[OutDatagram<'_>], max_payload: usize) -> usize {
    let p = &pkts[0];
    let seg = p.data.len();
    if seg == 0 {
        return 1;
    }
    let mut n = 1;
    let mut total = seg;
    while n < pkts.len() && n < MAX_GSO_SEGMENTS {
        let q = &pkts[n];
        let len = q.data.len();
        if q.dst != p.dst || q.tos != p.tos || len == 0 || len > seg || total + len > max_payload {
            break;
        }
        total += len;
        n += 1;
        if len < seg {
            break;
        }
    }
    n
}

/// What the control messages of one received datagram said.
struct Ctl {
    dst: Option<IpAddr>,
    tos: u8,
    gro_seg: Option<usize>,
}

fn parse_cmsgs(h: &libc::msghdr) -> Ctl {
    let mut ctl = Ctl {
        dst: None,
        tos: 0,
        gro_seg: None,
    };
    // SAFETY: `h` is a header the kernel just filled: `msg_control` points to our
    // `CMSG_BUF`-byte buffer and `msg_controllen` is how much of it the kernel wrote
    // (clamped to the buffer size by the kernel). CMSG_FIRSTHDR/NXTHDR stay within
    // `msg_controllen`; each data read is checked against `cmsg_len` first and done
    // unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            let hdr = ptr::read_unaligned(c);
            let data = libc::CMSG_DATA(c);
            let dlen = (hdr.cmsg_len as usize).saturating_sub(cmsg_align(CMSG_HDR));
            match (hdr.cmsg_level, hdr.cmsg_type) {
                (libc::IPPROTO_IP, libc::IP_PKTINFO)
                    if dlen >= mem::size_of::<libc::in_pktinfo>() =>
                {
                    let pi = ptr::read_unaligned(data.cast::<libc::in_pktinfo>());
                    // ipi_addr is the header's destination; ipi_spec_dst is the local
                    // address a reply would use, which differs for broadcasts.
                    ctl.dst = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr))));
                }
                (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO)
                    if dlen >= mem::size_of::<libc::in6_pktinfo>() =>
                {
                    let pi = ptr::read_unaligned(data.cast::<libc::in6_pktinfo>());
                    ctl.dst = Some(IpAddr::V6(Ipv6Addr::from(pi.ipi6_addr.s6_addr)));
                }
                // IPv4 reports the TOS as one byte.
                (libc::IPPROTO_IP, libc::IP_TOS) if dlen >= 1 => ctl.tos = *data,
                // IPv6 reports the traffic class as an int.
                (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
                    if dlen >= mem::size_of::<libc::c_int>() =>
                {
                    ctl.tos = ptr::read_unaligned(data.cast::<libc::c_int>()) as u8;
                }
                (libc::SOL_UDP, libc::UDP_GRO) if dlen >= mem::size_of::<libc::c_int>() => {
                    let v = ptr::read_unaligned(data.cast::<libc::c_int>());
                    ctl.gro_seg = usize::try_from(v).ok();
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    ctl
}

/// Where one received message sits in a [`RecvBatch`].
#[derive(Debug, Clone, Copy)]
struct Meta {
    slot: usize,
    src: SocketAddr,
    dst: SocketAddr,
    tos: u8,
    len: usize,
    /// Datagram size inside the slot: `len` unless GRO coalesced several.
    seg: usize,
    /// Came through a same-host ring.
    shm: bool,
}

/// Preallocated receive buffers and `recvmmsg` arguments for [`Driver::recv_batch`].
pub struct RecvBatch {
    count: usize,
    buf_size: usize,
    bufs: Vec<u8>,
    hdrs: Vec<libc::mmsghdr>,
    iovs: Vec<libc::iovec>,
    names: Vec<RawAddr>,
    ctrl: Vec<Cmsg>,
    metas: Vec<Meta>,
    /// Valid entries of `metas`.
    nmeta: usize,
    /// Datagrams the valid entries hold after GRO splitting.
    ndgrams: usize,
    /// Headers the kernel may have written since they were last armed (all, at first):
    /// only these are armed again, so a receive that finds nothing (a busy poll's usual
    /// turn) rewrites no header.
    dirty: std::ops::Range<usize>,
}

// SAFETY: the raw pointers in `hdrs` and `iovs` point into this struct's own heap
// buffers (which move with it) and are only used during a `&mut` `recv_batch` call.
unsafe impl Send for RecvBatch {}
// SAFETY: `&self` methods read only `bufs` and `metas`, never through the pointers.
unsafe impl Sync for RecvBatch {}

impl std::fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBatch")
            .field("count", &self.count)
            .field("buf_size", &self.buf_size)
            .field("datagrams", &self.ndgrams)
            .finish()
    }
}

impl RecvBatch {
    /// Room for `count` messages of up to `buf_size` bytes each, allocated now and
    /// reused by every receive. `count` is clamped to 1..=[`MAX_RECV_BATCH`] and
    /// `buf_size` to 1..=[`GRO_BUF_SIZE`] (a larger slot could never be filled).
    pub fn new(count: usize, buf_size: usize) -> RecvBatch {
        let count = count.clamp(1, MAX_RECV_BATCH);
        let buf_size = buf_size.clamp(1, GRO_BUF_SIZE);
        let placeholder = Meta {
            slot: 0,
            src: SocketAddr::from(([0, 0, 0, 0], 0)),
            dst: SocketAddr::from(([0, 0, 0, 0], 0)),
            tos: 0,
            len: 0,
            seg: 0,
            shm: false,
        };
        RecvBatch {
            count,
            buf_size,
            bufs: vec![0; count * buf_size],
            // SAFETY: C structs of integers and raw pointers; all-zero is valid.
            hdrs: vec![unsafe { mem::zeroed::<libc::mmsghdr>() }; count],
            // SAFETY: as above.
            iovs: vec![unsafe { mem::zeroed::<libc::iovec>() }; count],
            names: vec![RawAddr::zeroed(); count],
            ctrl: vec![Cmsg([0; CMSG_BUF]); count],
            metas: vec![placeholder; count],
            nmeta: 0,
            ndgrams: 0,
            dirty: 0..count,
        }
    }

    /// Slot count given at construction (after clamping).
    pub fn capacity(&self) -> usize {
        self.count
    }

    /// Slot size given at construction (after clamping).
    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    /// Datagrams received by the last [`Driver::recv_batch`].
    pub fn len(&self) -> usize {
        self.ndgrams
    }

    /// Whether the last receive got nothing.
    pub fn is_empty(&self) -> bool {
        self.ndgrams == 0
    }

    /// The datagrams of the last receive, in arrival order, GRO buffers split.
    pub fn iter(&self) -> impl Iterator<Item = InDatagram<'_>> + '_ {
        self.metas[..self.nmeta].iter().flat_map(move |m| {
            let base = m.slot * self.buf_size;
            let slot = &self.bufs[base..base + m.len];
            // `chunks` yields nothing for an empty slice, but an empty datagram is
            // still a datagram.
            let empty: &[u8] = &[];
            let whole = if m.len == 0 { Some(empty) } else { None };
            whole
                .into_iter()
                .chain(slot.chunks(m.seg.max(1)))
                .map(move |data| InDatagram {
                    src: m.src,
                    dst: m.dst,
                    tos: m.tos,
                    data,
                    shm: m.shm,
                })
        })
    }

    /// Hold `datagrams` as if a receive had returned them, for drivers that are not
    /// sockets (the `sim` network's): as many as there are slots; one longer than a slot
    /// is cut to it, as a socket truncates. How many it holds.
    pub fn fill<'a>(&mut self, datagrams: impl IntoIterator<Item = InDatagram<'a>>) -> usize {
        let mut k = 0;
        for d in datagrams.into_iter().take(self.count) {
            let len = d.data.len().min(self.buf_size);
            let base = k * self.buf_size;
            self.bufs[base..base + len].copy_from_slice(&d.data[..len]);
            self.metas[k] = Meta {
                slot: k,
                src: d.src,
                dst: d.dst,
                tos: d.tos,
                len,
                seg: len,
                shm: d.shm,
            };
            k += 1;
        }
        self.nmeta = k;
        self.ndgrams = k;
        k
    }

    /// Forget what the batch holds.
    pub(crate) fn clear(&mut self) {
        self.nmeta = 0;
        self.ndgrams = 0;
    }

    /// The next free slot (one datagram per slot), for a path that copies datagrams in
    /// itself; [`RecvBatch::commit_slot`] then records what it put there.
    pub(crate) fn free_slot(&mut self) -> Option<&mut [u8]> {
        let k = self.nmeta;
        if k >= self.count {
            return None;
        }
        let base = k * self.buf_size;
        Some(&mut self.bufs[base..base + self.buf_size])
    }

    /// Record the datagram of `len` bytes just written into [`RecvBatch::free_slot`] (by a
    /// same-host ring).
    pub(crate) fn commit_slot(&mut self, len: usize, src: SocketAddr, dst: SocketAddr, tos: u8) {
        let k = self.nmeta;
        if k >= self.count {
            return;
        }
        let len = len.min(self.buf_size);
        self.metas[k] = Meta {
            slot: k,
            src,
            dst,
            tos,
            len,
            seg: len,
            shm: true,
        };
        self.nmeta += 1;
        self.ndgrams += 1;
    }

    /// Yield the datagrams of messages `first..` before those of `..first` (which were
    /// received first from a faster path, see the `shm` module).
    pub(crate) fn rotate_front(&mut self, first: usize) {
        if first < self.nmeta {
            self.metas[..self.nmeta].rotate_left(first);
        }
    }

    /// The kernel wrote headers `from..to` (it writes those of the datagrams it returns,
    /// and no other).
    fn written(&mut self, from: usize, to: usize) {
        self.dirty = if self.dirty.is_empty() {
            from..to
        } else {
            self.dirty.start.min(from)..self.dirty.end.max(to)
        };
    }

    /// Make every header from slot `start` on point at its slot, name and control buffer
    /// with the lengths reset, rewriting only those the kernel wrote since (see `dirty`).
    fn arm(&mut self, start: usize) {
        let bufs = self.bufs.as_mut_ptr();
        let iovs = self.iovs.as_mut_ptr();
        let names = self.names.as_mut_ptr();
        let ctrl = self.ctrl.as_mut_ptr();
        let (lo, hi) = (self.dirty.start.max(start), self.dirty.end);
        // Those below `start` stay as the kernel left them until a later call arms them.
        self.dirty = self.dirty.start..self.dirty.end.min(start);
        for k in lo..hi {
            let h = &mut self.hdrs[k];
            // SAFETY: `k < count`, the length of `iovs`, `names` and `ctrl`, and
            // `k * buf_size < count * buf_size`, the length of `bufs`, so every pointer
            // stays inside its allocation; `iovs` is not otherwise borrowed here.
            unsafe {
                *iovs.add(k) = libc::iovec {
                    iov_base: bufs.add(k * self.buf_size).cast(),
                    iov_len: self.buf_size,
                };
                h.msg_hdr.msg_name = names.add(k).cast();
                h.msg_hdr.msg_iov = iovs.add(k);
                h.msg_hdr.msg_control = ctrl.add(k).cast();
            }
            h.msg_hdr.msg_namelen = mem::size_of::<RawAddr>() as libc::socklen_t;
            h.msg_hdr.msg_iovlen = 1;
            h.msg_hdr.msg_controllen = CMSG_BUF as _;
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
    }
}

/// The index of the network interface that holds the address `ip` (from
/// `getifaddrs(3)`), if one does.
pub fn interface_index(ip: IpAddr) -> Option<u32> {
    crate::ifaddrs::interface_addrs()
        .into_iter()
        .find(|a| a.addr == ip)
        .and_then(|a| crate::ifaddrs::index_of(&a.name))
}

/// Bind to the first free loopback address 127.0.0.1, 127.0.0.2, ... 127.0.0.254 on
/// `port` (use [`ROCE_PORT`] for RoCEv2), so that every process on a host gets its own
/// device address with no configuration (Linux routes all of 127/8 to `lo`). An
/// address in use is skipped; any other bind error is returned. All taken: `AddrInUse`.
pub fn bind_first_free_loopback(port: u16) -> io::Result<Driver> {
    for host in 1..=254u8 {
        match Driver::bind(SocketAddr::from(([127, 0, 0, host], port))) {
            Ok(d) => return Ok(d),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        "every address 127.0.0.1..=127.0.0.254 is in use on this port",
    ))
}
