//! Connection setup in one call over a TCP side channel, for peers that are plain verbs
//! programs: exchange [`Endpoint`]s over a `std` [`TcpStream`] and move the QP to RTS.
//!
//! ```no_run
//! use softrdma::{tcp, Access, Device, QpInit, QpType};
//! # fn main() -> softrdma::Result<()> {
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq(128, None)?;
//! let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
//! let opts = tcp::Options::new(Access::REMOTE_WRITE).with_memory(mr.remote());
//! // Server: `tcp::accept(&std::net::TcpListener::bind("0.0.0.0:18516")?, &qp, &opts)`.
//! let link = tcp::connect("192.0.2.1:18516", &qp, &opts)?;
//! let peer_memory = link.peer.memory; // where we may WRITE on the server
//! # Ok(()) }
//! ```
//!
//! Two wire formats ([`Format`]): softrdma's own byte form ([`Endpoint::to_bytes`]),
//! which carries the MTU and the memory, and the text exchange of rdma-core's
//! `ibv_rc_pingpong` (and `ibv_uc_pingpong`), so that a Rust program pairs with those
//! programs, on softrdma or on Linux Soft-RoCE and hardware.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use softrdma_transport::verbs::Access;

use crate::endpoint::{lower_mtu, PINGPONG_MSG_LEN};
use crate::pingpong;
use crate::{Endpoint, Error, ErrorKind, PathOptions, QueuePair, RemoteMemory, Result};

/// The default TCP port of the exchange: `ibv_rc_pingpong`'s.
pub const DEFAULT_PORT: u16 = 18515;

/// What is said on the TCP stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// softrdma's byte form ([`Endpoint::to_bytes`]) each way, then one byte each way
    /// once both QPs are in RTS. Carries the MTU and the memory.
    #[default]
    Softrdma,
    /// rdma-core's `ibv_rc_pingpong` exchange: the client writes its 52-byte address
    /// message, the server connects its QP and answers with its own, the client
    /// connects and writes `"done\0"`. No memory and no MTU travel: the path MTU is
    /// [`PathOptions::mtu`] (the programs' `-m`, 1024 by default); port
    /// [`DEFAULT_PORT`], GID index 0 on both sides (`-g 0`).
    Pingpong,
}

/// How [`connect`] and [`accept`] set the QP up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// What the peer may do to our memory through this QP (INIT's access flags).
    pub access: Access,
    /// Memory to offer the peer ([`Endpoint::memory`]); softrdma format only.
    pub memory: Option<RemoteMemory>,
    /// Path and retry options; the path MTU is the lower of `path.mtu` and the peer's.
    pub path: PathOptions,
    /// How long the TCP connect keeps trying while the server starts, and how long each
    /// read waits for the peer. None: without limit.
    pub timeout: Option<Duration>,
    /// The wire format.
    pub format: Format,
}

impl Options {
    /// Granting `access`, no memory offered, default path options, 10 s, softrdma's
    /// format.
    pub fn new(access: Access) -> Options {
        Options {
            access,
            memory: None,
            path: PathOptions::default(),
            timeout: Some(Duration::from_secs(10)),
            format: Format::Softrdma,
        }
    }
    /// The same, offering `memory` to the peer.
    pub fn with_memory(mut self, memory: RemoteMemory) -> Options {
        self.memory = Some(memory);
        self
    }
    /// The same, with path options `path`.
    pub fn with_path(mut self, path: PathOptions) -> Options {
        self.path = path;
        self
    }
    /// The same, speaking `format`.
    pub fn with_format(mut self, format: Format) -> Options {
        self.format = format;
        self
    }
}

/// A QP connected over TCP: the peer's endpoint and the stream, kept for the program's
/// own messages (a barrier, a "done") after the exchange.
#[derive(Debug)]
pub struct Link {
    /// What the peer sent: its QP number, PSN, GID, MTU and the memory it offers.
    pub peer: Endpoint,
    /// The TCP stream the exchange went over.
    pub stream: TcpStream,
}

impl Link {
    /// Wait until the peer calls `barrier` too: one byte each way. For "my receives are
    /// posted" or "the data is in place" between the two programs.
    pub fn barrier(&mut self) -> Result<()> {
        self.stream
            .write_all(b"b")
            .map_err(|e| Error::io(e, libc::EIO, "barrier: sending"))?;
        let mut b = [0u8; 1];
        self.stream
            .read_exact(&mut b)
            .map_err(|e| Error::io(e, libc::EIO, "barrier: waiting for the peer"))?;
        if &b != b"b" {
            return Err(
                Error::new(libc::EPROTO, "barrier: the peer sent something else")
                    .with_kind(ErrorKind::Protocol),
            );
        }
        Ok(())
    }
}

/// Refuse options that cannot work before anything is done: memory in a format that has
/// no room for it would be dropped silently, and the peer would find none.
fn check(opts: &Options) -> Result<()> {
    if opts.format == Format::Pingpong && opts.memory.is_some() {
        return Err(Error::invalid(
            "the pingpong exchange carries no memory: use Format::Softrdma",
        ));
    }
    Ok(())
}

/// Connect to the server at `addr` over TCP (retrying while it starts, up to
/// `opts.timeout`), exchange endpoints and move `qp` (in RESET) to RTS. When this returns
/// both QPs are in RTS.
pub fn connect(addr: impl ToSocketAddrs, qp: &QueuePair, opts: &Options) -> Result<Link> {
    connect_with(addr, qp, opts, |_| Ok(()))
}

/// [`connect`], running `prepare` on the QP once it is in INIT and before the peer can
/// send: post receives there, so that the peer's first messages find them.
pub fn connect_with(
    addr: impl ToSocketAddrs,
    qp: &QueuePair,
    opts: &Options,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<Link> {
    check(opts)?;
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(e, libc::EINVAL, "resolving the server's address"))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::invalid("the server's address resolves to nothing"));
    }
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    let stream = loop {
        let mut failed = None;
        match addrs.iter().find_map(|a| match TcpStream::connect(a) {
            Ok(s) => Some(s),
            Err(e) => {
                failed = Some(e);
                None
            }
        }) {
            Some(s) => break s,
            None if deadline.is_some_and(|d| Instant::now() >= d) => {
                let e = failed.unwrap_or_else(|| std::io::ErrorKind::TimedOut.into());
                return Err(Error::io(e, libc::ECONNREFUSED, "connecting to the server"));
            }
            // The server may not be listening yet.
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    handshake_with(stream, Role::Client, qp, opts, prepare)
}

/// Wait for one client on `listener`, exchange endpoints and move `qp` (in RESET) to RTS.
/// When this returns both QPs are in RTS.
pub fn accept(listener: &TcpListener, qp: &QueuePair, opts: &Options) -> Result<Link> {
    accept_with(listener, qp, opts, |_| Ok(()))
}

/// [`accept`], running `prepare` on the QP once it is in INIT (see [`connect_with`]).
pub fn accept_with(
    listener: &TcpListener,
    qp: &QueuePair,
    opts: &Options,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<Link> {
    check(opts)?;
    let (stream, _) = listener
        .accept()
        .map_err(|e| Error::io(e, libc::EIO, "accepting a TCP connection"))?;
    handshake_with(stream, Role::Server, qp, opts, prepare)
}

/// Which side of the exchange this is: it matters to the pingpong format only, where the
/// client speaks first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Client,
    /// The side that accepted.
    Server,
}

/// The exchange over a stream the program connected itself: INIT, `prepare`, endpoints
/// each way, RTR and RTS.
pub fn handshake_with(
    mut stream: TcpStream,
    role: Role,
    qp: &QueuePair,
    opts: &Options,
    prepare: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<Link> {
    check(opts)?;
    stream
        .set_read_timeout(opts.timeout)
        .map_err(|e| Error::io(e, libc::EIO, "setting the TCP read timeout"))?;
    // Small messages each way: without it, the second write of the pingpong client
    // would wait for the first one's ACK.
    let _ = stream.set_nodelay(true);
    qp.to_init(opts.access)?;
    prepare(qp)?;
    let local = qp.endpoint().with_mtu(opts.path.mtu);
    let peer = match opts.format {
        Format::Softrdma => {
            let local = match opts.memory {
                Some(m) => local.with_memory(m),
                None => local,
            };
            local.write_to(&mut stream)?;
            let peer = Endpoint::read_from(&mut stream)?;
            qp.ready_to(&peer, &opts.path)?;
            let mut link = Link { peer, stream };
            link.barrier()?;
            return Ok(link);
        }
        Format::Pingpong => pingpong(&mut stream, role, qp, &local, &opts.path)?,
    };
    Ok(Link { peer, stream })
}

/// The `ibv_rc_pingpong` exchange (see [`Format::Pingpong`]); returns the peer's
/// endpoint with the QP in RTS.
fn pingpong(
    s: &mut TcpStream,
    role: Role,
    qp: &QueuePair,
    local: &Endpoint,
    path: &PathOptions,
) -> Result<Endpoint> {
    let io = |what: &'static str| move |e| Error::io(e, libc::EIO, what);
    let mut msg = [0u8; PINGPONG_MSG_LEN];
    // The programs take the path MTU from their own -m; so do we, from `path`.
    let with_mtu = |e: Endpoint| e.with_mtu(lower_mtu(path.mtu, local.mtu));
    match role {
        Role::Client => {
            s.write_all(&local.to_pingpong_msg())
                .map_err(io("sending our address"))?;
            s.read_exact(&mut msg)
                .map_err(io("reading the server's address"))?;
            let peer = with_mtu(Endpoint::parse_pingpong(&msg)?);
            qp.ready_to(&peer, path)?;
            s.write_all(pingpong::DONE)
                .map_err(io("sending \"done\""))?;
            Ok(peer)
        }
        Role::Server => {
            s.read_exact(&mut msg)
                .map_err(io("reading the client's address"))?;
            let peer = with_mtu(Endpoint::parse_pingpong(&msg)?);
            // The server is in RTS before the client learns where it is, as in
            // rdma-core: the client may send as soon as it has read our answer.
            qp.ready_to(&peer, path)?;
            s.write_all(&local.to_pingpong_msg())
                .map_err(io("sending our address"))?;
            let mut done = [0u8; pingpong::DONE.len()];
            s.read_exact(&mut done)
                .map_err(io("reading the client's \"done\""))?;
            Ok(peer)
        }
    }
}
