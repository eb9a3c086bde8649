//! A minimal stand-in for `softrdma_net::udp` with the same names, over `std::net::UdpSocket`,
//! used until that driver lands. No per-datagram TOS, no batching syscalls, no GRO/GSO.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// One datagram to send.
#[derive(Debug, Clone)]
pub struct OutDatagram<'a> {
    /// Destination.
    pub dst: SocketAddr,
    /// IP TOS byte (ignored by the stand-in).
    pub tos: u8,
    /// UDP payload.
    pub data: &'a [u8],
}

/// One received datagram.
#[derive(Debug)]
pub struct InDatagram<'a> {
    /// Sender.
    pub src: SocketAddr,
    /// Our address it was sent to.
    pub dst: SocketAddr,
    /// IP TOS byte (0 in the stand-in).
    pub tos: u8,
    /// UDP payload.
    pub data: &'a [u8],
}

/// Receive buffers for a batch.
#[derive(Debug)]
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    meta: Vec<(SocketAddr, usize)>,
    dst: Option<SocketAddr>,
}

impl RecvBatch {
    /// `count` buffers of `buf_size` bytes.
    pub fn new(count: usize, buf_size: usize) -> RecvBatch {
        RecvBatch {
            bufs: (0..count.max(1)).map(|_| vec![0u8; buf_size]).collect(),
            meta: Vec::new(),
            dst: None,
        }
    }
    /// The datagrams of the last `recv_batch`.
    pub fn iter(&self) -> impl Iterator<Item = InDatagram<'_>> {
        let dst = self
            .dst
            .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        self.meta
            .iter()
            .zip(self.bufs.iter())
            .map(move |(&(src, n), b)| InDatagram {
                src,
                dst,
                tos: 0,
                data: &b[..n],
            })
    }
}

/// A non-blocking UDP endpoint.
#[derive(Debug)]
pub struct Driver {
    sock: UdpSocket,
    local: SocketAddr,
}

impl Driver {
    /// Bind `addr`.
    pub fn bind(addr: SocketAddr) -> io::Result<Driver> {
        let sock = UdpSocket::bind(addr)?;
        sock.set_nonblocking(true)?;
        let local = sock.local_addr()?;
        Ok(Driver { sock, local })
    }
    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
    /// Send datagrams in order; stops at the first that would block.
    pub fn send_batch(&mut self, out: &[OutDatagram<'_>]) -> io::Result<usize> {
        let mut n = 0;
        for d in out {
            match self.sock.send_to(d.data, d.dst) {
                Ok(_) => n += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && n > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }
    /// Receive up to the batch's count of datagrams without blocking.
    pub fn recv_batch(&mut self, batch: &mut RecvBatch) -> io::Result<usize> {
        batch.meta.clear();
        batch.dst = Some(self.local);
        for i in 0..batch.bufs.len() {
            match self.sock.recv_from(&mut batch.bufs[i]) {
                Ok((n, src)) => batch.meta.push((src, n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if batch.meta.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        if batch.meta.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(batch.meta.len())
    }
    /// Wait until readable.
    pub fn wait_readable(&self, _timeout: Option<Duration>) -> io::Result<bool> {
        Ok(true)
    }
}

impl AsRawFd for Driver {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

/// Bind the first free 127.0.0.x (x = 1..=254) on `port`.
pub fn bind_first_free_loopback(port: u16) -> io::Result<Driver> {
    let mut last = io::Error::from(io::ErrorKind::AddrInUse);
    for x in 1..=254u8 {
        match Driver::bind(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, x)),
            port,
        )) {
            Ok(d) => return Ok(d),
            Err(e) => last = e,
        }
    }
    Err(last)
}
