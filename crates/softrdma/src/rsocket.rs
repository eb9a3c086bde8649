//! rsockets: byte streams over RDMA that speak rdma-core's rsockets protocol, so a Rust
//! program talks to `rstream`, `rcopy` or any program using `<rdma/rsocket.h>` (on this
//! host through softrdma's drop-in librdmacm, or on another host over Linux's
//! Soft-RoCE) with no C.
//!
//! [`RStream`] implements [`std::io::Read`] and [`std::io::Write`] (also for `&RStream`,
//! so one thread may read while another writes); [`RListener`] accepts them. Under the
//! `tokio` feature, `AsyncRStream` implements tokio's `AsyncRead` and `AsyncWrite`,
//! none of whose calls (nor its shutdown, nor its drop) hold the runtime's thread:
//! `AsyncRStream::connect` awaits a connection, `AsyncRListener::accept` awaits one
//! from a listener (`RListener::into_async`), `RStream::into_async` turns a stream into
//! one.
//!
//! The protocol and its driver are the `softrdma-rsocket` crate's, shared with the C
//! face: a connection is an RC QP set up through the rdma_cm, whose private data carries
//! each side's receive buffer and credits; data moves as RDMA WRITE WITH IMMEDIATE into
//! the peer's buffer.
//!
//! ```
//! use std::io::{Read, Write};
//! use softrdma::rsocket::{RListener, RStream};
//! use softrdma::Device;
//! # fn main() -> softrdma::Result<()> {
//! let server_dev = Device::open_default()?;
//! let listener = RListener::bind(&server_dev, "0.0.0.0:0".parse().unwrap())?;
//! let port = listener.local_addr()?.port();
//! let server = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
//!     let (mut stream, _peer) = listener.accept()?;
//!     let mut got = Vec::new();
//!     stream.read_to_end(&mut got)?; // until the client shuts down its writing
//!     Ok(got)
//! });
//! let dev = Device::open_default()?;
//! let mut stream = RStream::connect(&dev, ([127, 0, 0, 1], port).into())?;
//! stream.write_all(b"over RDMA")?;
//! stream.shutdown(std::net::Shutdown::Write)?;
//! assert_eq!(server.join().unwrap()?, b"over RDMA");
//! # Ok(()) }
//! ```

use std::io;
use std::net::{Shutdown, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use softrdma_rsocket::{Config, Listener, Phase, Shutdown as How, Socket};

use crate::{Device, Error, Result};

pub use softrdma_rsocket::Config as RsocketConfig;

/// How a stream is made: its sizes (rsockets' defaults, or what rdma-core's
/// configuration directory sets) and how long a connect may take.
#[derive(Debug, Clone, Copy)]
pub struct RsocketOptions {
    /// Queue depths, inline size and buffer sizes.
    pub config: Config,
    /// The longest a connect waits for the server (None: the CM's own verdict, about a
    /// minute for a server that never answers).
    pub timeout: Option<Duration>,
}

impl Default for RsocketOptions {
    fn default() -> RsocketOptions {
        RsocketOptions {
            config: Config::from_system(),
            timeout: None,
        }
    }
}

fn io_err(e: io::Error, what: &str) -> Error {
    let msg = format!("{what}: {e}");
    Error::io(e, libc::EIO, msg)
}

/// A connected rsockets stream.
#[derive(Debug)]
pub struct RStream {
    sock: Arc<Socket>,
    nonblocking: bool,
}

impl RStream {
    /// Connect to the rsockets server at `addr` with the default options.
    pub fn connect(dev: &Device, addr: SocketAddr) -> Result<RStream> {
        RStream::connect_with(dev, addr, &RsocketOptions::default())
    }

    /// Connect with `opts`. ECONNREFUSED when nothing listens there (or the server is
    /// not an rsockets server), ETIMEDOUT past the timeout.
    pub fn connect_with(dev: &Device, addr: SocketAddr, opts: &RsocketOptions) -> Result<RStream> {
        let sock = Socket::connect(&dev.inner.dev, addr, opts.config, opts.timeout)
            .map_err(|e| io_err(e, &format!("rsocket connect to {addr}")))?;
        Ok(RStream {
            sock: Arc::new(sock),
            nonblocking: false,
        })
    }

    /// The local address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.sock
            .addrs()
            .0
            .ok_or_else(|| Error::new(libc::ENOTCONN, "no local address"))
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        self.sock
            .addrs()
            .1
            .ok_or_else(|| Error::new(libc::ENOTCONN, "no peer address"))
    }

    /// Reads and writes give `WouldBlock` instead of waiting.
    pub fn set_nonblocking(&mut self, on: bool) {
        self.nonblocking = on;
    }

    /// Close reading, writing or both; the peer's reads end once it has read what was
    /// sent before a write shutdown.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.sock.shutdown(match how {
            Shutdown::Read => How::Read,
            Shutdown::Write => How::Write,
            Shutdown::Both => How::Both,
        })
    }

    /// Read without taking: the bytes stay to be read again.
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.recv(buf, true, self.nonblocking)
    }

    /// The connection is up (neither side closed it, nothing failed).
    pub fn is_connected(&self) -> bool {
        self.sock.phase() == Phase::Connected
    }

    /// Send a keepalive: a zero-length RDMA WRITE that a peer which is gone fails, so a
    /// later read or write reports the loss.
    pub fn keepalive(&self) {
        self.sock.keepalive();
    }

    /// The stream for tokio (feature `tokio`): `AsyncRead` and `AsyncWrite`. Needs a
    /// runtime with I/O enabled.
    #[cfg(feature = "tokio")]
    pub fn into_async(self) -> Result<AsyncRStream> {
        AsyncRStream::new(self.sock)
    }
}

impl io::Read for &RStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.recv(buf, false, self.nonblocking)
    }
}

impl io::Read for RStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl io::Write for &RStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock.send(buf, self.nonblocking)
    }
    /// Nothing is held back: a write's bytes are posted before it returns.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl io::Write for RStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A listening rsockets socket.
#[derive(Debug)]
pub struct RListener {
    l: Listener,
}

impl RListener {
    /// Listen on `addr` of `dev` (the wildcard address and port 0 allowed; a wildcard
    /// listener is found at 127.0.0.1 by other processes of the host).
    pub fn bind(dev: &Device, addr: SocketAddr) -> Result<RListener> {
        RListener::bind_with(dev, addr, Config::from_system())
    }

    /// Listen with the sizes `config` gives the streams it accepts.
    pub fn bind_with(dev: &Device, addr: SocketAddr, config: Config) -> Result<RListener> {
        let l = Listener::bind(&dev.inner.dev, addr, 0, config)
            .map_err(|e| io_err(e, &format!("rsocket listen on {addr}")))?;
        Ok(RListener { l })
    }

    /// The bound address (with the port chosen for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.l
            .local_addr()
            .ok_or_else(|| Error::new(libc::EINVAL, "not bound"))
    }

    /// The next connection and its peer's address, waiting for it on this thread.
    pub fn accept(&self) -> io::Result<(RStream, SocketAddr)> {
        self.accept_timeout(None)
    }

    /// The next connection, waiting at most `timeout` (ETIMEDOUT after).
    pub fn accept_timeout(&self, timeout: Option<Duration>) -> io::Result<(RStream, SocketAddr)> {
        let sock = Arc::new(self.l.accept(timeout)?);
        let peer = sock
            .addrs()
            .1
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOTCONN))?;
        Ok((
            RStream {
                sock,
                nonblocking: false,
            },
            peer,
        ))
    }

    /// The connections as they come (an endless iterator, as `TcpListener::incoming`).
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<RStream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }

    /// The listener for tokio (feature `tokio`): connections accepted with `.await`.
    /// Needs a runtime with I/O enabled.
    #[cfg(feature = "tokio")]
    pub fn into_async(self) -> Result<AsyncRListener> {
        AsyncRListener::new(Arc::new(self.l))
    }
}

#[cfg(feature = "tokio")]
pub use self::async_stream::{AsyncRListener, AsyncRStream};

#[cfg(feature = "tokio")]
mod async_stream {
    use std::io;
    use std::net::SocketAddr;
    use std::os::fd::{AsRawFd, RawFd};
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use ::tokio::io::unix::AsyncFd;
    use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use softrdma_rsocket::{Config, Listener, Shutdown as How, Socket};

    use super::{io_err, RsocketOptions};
    use crate::tokio_support::{register, OwnedStableFd};
    use crate::{Device, Error, ErrorKind, Result};

    /// One of a socket's two descriptors, kept open by the socket it holds.
    struct SockFd {
        sock: Arc<Socket>,
        which: usize,
    }

    impl AsRawFd for SockFd {
        fn as_raw_fd(&self) -> RawFd {
            self.sock.fds()[self.which].as_raw_fd()
        }
    }

    // SAFETY: a socket's completion channel fd and CM channel fd are made with it and
    // closed only when it is dropped, which the `Arc` held here prevents; `fds` returns
    // the same two descriptors for the socket's whole life.
    unsafe impl OwnedStableFd for SockFd {}

    /// An rsockets stream on tokio: `AsyncRead` and `AsyncWrite`. A pending read, write
    /// or shutdown arms the socket's completion channel and sleeps on it and on the CM
    /// channel; nothing waits on the runtime's thread.
    pub struct AsyncRStream {
        sock: Arc<Socket>,
        comp: AsyncFd<SockFd>,
        cm: AsyncFd<SockFd>,
    }

    impl std::fmt::Debug for AsyncRStream {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("AsyncRStream")
                .field("sock", &self.sock)
                .finish()
        }
    }

    impl AsyncRStream {
        /// Connect to the rsockets server at `addr` with the default options
        /// ([`RStream::connect`](super::RStream::connect) awaited).
        pub async fn connect(dev: &Device, addr: SocketAddr) -> Result<AsyncRStream> {
            AsyncRStream::connect_with(dev, addr, &RsocketOptions::default()).await
        }

        /// Connect with `opts` ([`RStream::connect_with`](super::RStream::connect_with)
        /// awaited). The rdma_cm exchange
        /// (address and route, REQ, REP, RTU) waits on the CM's replies, so it runs on
        /// tokio's blocking pool, bounded by `opts.timeout`; the runtime's thread is
        /// free meanwhile. Dropping the future before it is done closes the connection
        /// once it is made. Inside a runtime with I/O enabled (InvalidArgument
        /// otherwise).
        pub async fn connect_with(
            dev: &Device,
            addr: SocketAddr,
            opts: &RsocketOptions,
        ) -> Result<AsyncRStream> {
            let Ok(rt) = ::tokio::runtime::Handle::try_current() else {
                return Err(Error::new(
                    libc::EINVAL,
                    "rsocket connect: not inside a tokio runtime",
                )
                .with_kind(ErrorKind::InvalidArgument));
            };
            let d = Arc::clone(&dev.inner.dev);
            let (config, timeout) = (opts.config, opts.timeout);
            let sock = rt
                .spawn_blocking(move || Socket::connect(&d, addr, config, timeout))
                .await
                .map_err(|e| Error::new(libc::EIO, format!("rsocket connect to {addr}: {e}")))?
                .map_err(|e| io_err(e, &format!("rsocket connect to {addr}")))?;
            AsyncRStream::new(Arc::new(sock))
        }

        pub(super) fn new(sock: Arc<Socket>) -> Result<AsyncRStream> {
            let fd = |which| SockFd {
                sock: Arc::clone(&sock),
                which,
            };
            let comp = register(fd(0), "rsocket completion channel")?;
            let cm = register(fd(1), "rsocket CM channel")?;
            Ok(AsyncRStream { sock, comp, cm })
        }

        /// Run `op` (non-blocking) until it does not say `WouldBlock`, sleeping on the
        /// socket's descriptors in between.
        fn poll_op<R>(
            &self,
            cx: &mut Context<'_>,
            mut op: impl FnMut(&Socket) -> io::Result<R>,
        ) -> Poll<io::Result<R>> {
            loop {
                match op(&self.sock) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    r => return Poll::Ready(r),
                }
                if !self.sock.arm() {
                    continue; // work came in meanwhile
                }
                let mut woke = false;
                if let Poll::Ready(g) = self.comp.poll_read_ready(cx) {
                    g?.clear_ready();
                    self.sock.take_events();
                    woke = true;
                }
                if let Poll::Ready(g) = self.cm.poll_read_ready(cx) {
                    // The CM events are taken by the socket's next progress pass.
                    g?.clear_ready();
                    woke = true;
                }
                if !woke {
                    return Poll::Pending;
                }
            }
        }
    }

    /// Dropping closes the stream without holding the runtime's thread: a close that
    /// must wait for the peer (to make room for the last sends and the DISCONNECT)
    /// finishes on tokio's blocking pool, bounded as [`RStream`](super::RStream)'s close
    /// is. Dropped outside a runtime, it waits where it is dropped.
    impl Drop for AsyncRStream {
        fn drop(&mut self) {
            let Err(e) = self.sock.try_shutdown(How::Both) else {
                return;
            };
            if e.kind() != io::ErrorKind::WouldBlock {
                return;
            }
            if let Ok(rt) = ::tokio::runtime::Handle::try_current() {
                let sock = Arc::clone(&self.sock);
                // Detached. The socket's own close continues the shutdown begun here,
                // and whichever reference goes last (this task's or the registrations')
                // does not wait again.
                drop(rt.spawn_blocking(move || {
                    let _ = sock.shutdown(How::Both);
                }));
            }
        }
    }

    impl AsyncRead for AsyncRStream {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let dst = buf.initialize_unfilled();
            let r = std::task::ready!(self.poll_op(cx, |s| s.recv(dst, false, true)));
            let n = r?;
            buf.advance(n);
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for AsyncRStream {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.poll_op(cx, |s| s.send(buf, true))
        }
        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        /// Shuts down writing (the peer's reads end once it has read what came
        /// before): Pending until the peer is told and every send before has
        /// completed, which waits on the peer making room when it has not read. Polling
        /// again continues the same shutdown.
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.poll_op(cx, |s| s.try_shutdown(How::Write))
        }
    }

    /// A listener's CM channel descriptor, kept open by the listener it holds.
    struct ListenFd(Arc<Listener>);

    impl AsRawFd for ListenFd {
        fn as_raw_fd(&self) -> RawFd {
            self.0.fd().as_raw_fd()
        }
    }

    // SAFETY: a listener's CM channel fd is made with it and closed only when it is
    // dropped, which the `Arc` held here prevents; `fd` returns that descriptor for the
    // listener's whole life.
    unsafe impl OwnedStableFd for ListenFd {}

    /// A listening rsockets socket on tokio: `accept().await` gives the next connection
    /// as an [`AsyncRStream`]. It sleeps on the listener's CM channel, which wakes for a
    /// request and for the RTU that establishes an answered one; nothing waits on the
    /// runtime's thread. Cancel-safe: a connection established while no accept is
    /// pending waits for the next.
    pub struct AsyncRListener {
        l: Arc<Listener>,
        fd: AsyncFd<ListenFd>,
    }

    impl std::fmt::Debug for AsyncRListener {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("AsyncRListener")
                .field("listener", &self.l)
                .finish()
        }
    }

    impl AsyncRListener {
        /// Listen on `addr` of `dev` ([`RListener::bind`](super::RListener::bind)), inside
        /// a runtime with I/O enabled.
        pub fn bind(dev: &Device, addr: SocketAddr) -> Result<AsyncRListener> {
            super::RListener::bind(dev, addr)?.into_async()
        }

        /// Listen with the sizes `config` gives the streams it accepts.
        pub fn bind_with(dev: &Device, addr: SocketAddr, config: Config) -> Result<AsyncRListener> {
            super::RListener::bind_with(dev, addr, config)?.into_async()
        }

        pub(super) fn new(l: Arc<Listener>) -> Result<AsyncRListener> {
            let fd = register(ListenFd(Arc::clone(&l)), "rsocket listener CM channel")?;
            Ok(AsyncRListener { l, fd })
        }

        /// The bound address (with the port chosen for port 0).
        pub fn local_addr(&self) -> Result<SocketAddr> {
            self.l
                .local_addr()
                .ok_or_else(|| Error::new(libc::EINVAL, "not bound"))
        }

        /// The next connection and its peer's address.
        pub async fn accept(&self) -> io::Result<(AsyncRStream, SocketAddr)> {
            std::future::poll_fn(|cx| self.poll_accept(cx)).await
        }

        /// [`AsyncRListener::accept`] as a poll: Pending until a connection is
        /// established (answering the requests that come meanwhile).
        pub fn poll_accept(
            &self,
            cx: &mut Context<'_>,
        ) -> Poll<io::Result<(AsyncRStream, SocketAddr)>> {
            loop {
                if let Some(s) = self.l.poll_accept() {
                    let sock = Arc::new(s);
                    let peer = sock
                        .addrs()
                        .1
                        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOTCONN));
                    return Poll::Ready(peer.and_then(|p| Ok((AsyncRStream::new(sock)?, p))));
                }
                match self.fd.poll_read_ready(cx) {
                    Poll::Ready(Ok(mut g)) => g.clear_ready(),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
        }
    }
}
