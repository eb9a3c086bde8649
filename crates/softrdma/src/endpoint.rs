//! What one side of a connection tells the other: [`Endpoint`], in one value, with its
//! serde form, its versioned byte form and the text form of rdma-core's pingpong examples.
//!
//! A connection needs each side's GID, QP number and first PSN, and usually the memory
//! the peer may read or write. Exchanged piece by piece, the PSN had to be passed twice
//! (once to the peer, once to our own RTS) and a mismatch compiled and ended in
//! RETRY_EXC_ERR; carried together, and with the PSN chosen by the QP
//! ([`QueuePair::endpoint`]), there is nothing to get out of step.

use std::net::Ipv6Addr;

use softrdma_transport::verbs::{Gid, Mtu};

use crate::pingpong;
use crate::qp::RemoteQp;
use crate::{Error, ErrorKind, QueuePair, RemoteMemory, Result};

/// One side of a connection: what a peer needs to connect its QP to ours, and the memory
/// it may access there.
///
/// Made by [`QueuePair::endpoint`] (with the PSN the QP chose) and
/// [`Endpoint::with_memory`]; taken by [`QueuePair::connect_to`] and the one-call helpers
/// of [`tcp`](crate::tcp) and [`cm`](crate::cm). To send it yourself, use serde (with the
/// default `serde` feature), [`Endpoint::to_bytes`] or, towards rdma-core's
/// `ibv_rc_pingpong`, [`Endpoint::to_pingpong_string`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// The GID of the QP's device (index 0): where its packets go.
    pub gid: Gid,
    /// The QP number (24 bits).
    pub qpn: u32,
    /// The first PSN this side sends with (24 bits), which the peer's receive side must
    /// expect.
    pub psn: u32,
    /// The largest path MTU this side takes. Both sides connect with the lower of the
    /// two endpoints' MTUs (and of their own [`PathOptions`](crate::PathOptions)), so
    /// they agree without a second exchange; [`QueuePair::endpoint`] offers 1024, the
    /// default path MTU, and [`Endpoint::with_mtu`] more.
    pub mtu: Mtu,
    /// Memory the peer may access with RDMA WRITE, READ or atomics, if any.
    pub memory: Option<RemoteMemory>,
}

/// The four bytes that open the byte form, so that a stray peer (another protocol on the
/// port) is told apart from a softrdma one of another version.
const MAGIC: [u8; 4] = *b"SRep";
/// The byte form this code writes and reads.
pub const ENDPOINT_VERSION: u8 = 1;
/// Bytes before the body: magic, version, body length.
const HEADER: usize = 6;
/// Body of version 1 without memory: flags, MTU, QPN, PSN, GID.
const BODY: usize = 1 + 1 + 4 + 4 + 16;
/// Memory in the body: addr, rkey, len.
const MEMORY: usize = 8 + 4 + 8;
/// Flag: the body carries memory.
const HAS_MEMORY: u8 = 1;
/// Bytes of an `ibv_*_pingpong` address message, NUL included.
pub const PINGPONG_MSG_LEN: usize = pingpong::MSG_LEN;

fn malformed(what: impl std::fmt::Display) -> Error {
    Error::new(libc::EPROTO, format!("not a softrdma endpoint: {what}"))
        .with_kind(ErrorKind::Protocol)
}

impl Endpoint {
    /// An endpoint of QP `qpn` on the device of `gid`, sending from `psn`, offering the
    /// default path MTU (1024) and no memory. For a peer's values received in a format
    /// of your own; the local side comes from [`QueuePair::endpoint`].
    pub fn new(gid: Gid, qpn: u32, psn: u32) -> Endpoint {
        Endpoint {
            gid,
            qpn: qpn & 0xff_ffff,
            psn: psn & 0xff_ffff,
            mtu: Mtu::Mtu1024,
            memory: None,
        }
    }

    /// The same endpoint, offering `memory` to the peer.
    pub fn with_memory(mut self, memory: RemoteMemory) -> Endpoint {
        self.memory = Some(memory);
        self
    }

    /// The same endpoint, taking path MTUs up to `mtu`.
    pub fn with_mtu(mut self, mtu: Mtu) -> Endpoint {
        self.mtu = mtu;
        self
    }

    /// The verbs-level description of the peer's QP that [`QueuePair::to_rtr`] takes.
    pub fn remote_qp(&self) -> RemoteQp {
        RemoteQp {
            gid: self.gid,
            qpn: self.qpn,
            psn: self.psn,
        }
    }

    /// The byte form, for a side channel of your own: `"SRep"`, the version
    /// ([`ENDPOINT_VERSION`]), the body's length, then flags, MTU (its `IBV_MTU_*`
    /// code), QPN, PSN (big-endian), GID, and with memory its addr, rkey, len
    /// (big-endian): 32 bytes, 52 with memory. The length lets a reader take a whole
    /// message off a stream ([`Endpoint::read_from`]) and lets later versions grow.
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = BODY + if self.memory.is_some() { MEMORY } else { 0 };
        let mut b = Vec::with_capacity(HEADER + body);
        b.extend_from_slice(&MAGIC);
        b.push(ENDPOINT_VERSION);
        b.push(body as u8);
        b.push(if self.memory.is_some() { HAS_MEMORY } else { 0 });
        b.push(self.mtu as u8);
        b.extend_from_slice(&(self.qpn & 0xff_ffff).to_be_bytes());
        b.extend_from_slice(&(self.psn & 0xff_ffff).to_be_bytes());
        b.extend_from_slice(&self.gid.0);
        if let Some(m) = &self.memory {
            b.extend_from_slice(&m.addr.to_be_bytes());
            b.extend_from_slice(&m.rkey.to_be_bytes());
            b.extend_from_slice(&m.len.to_be_bytes());
        }
        b
    }

    /// Parse [`Endpoint::to_bytes`]: all of `b` must be one endpoint. A wrong magic, a
    /// short or long buffer, a bad field is [`ErrorKind::Protocol`] (EPROTO); another
    /// version is [`ErrorKind::NotSupported`] (EPROTONOSUPPORT), saying both versions.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        let body_len = Self::check_header(b)?;
        let body = &b[HEADER..];
        if body.len() != body_len {
            return Err(malformed(format!(
                "{} bytes, the header says {}",
                b.len(),
                HEADER + body_len
            )));
        }
        Self::parse_body(body)
    }

    /// Check the header at the start of `b` and return the body's length.
    fn check_header(b: &[u8]) -> Result<usize> {
        if b.len() < HEADER {
            return Err(malformed(format!("{} bytes, less than a header", b.len())));
        }
        if b[..4] != MAGIC {
            return Err(malformed(format!("it starts with {:02x?}", &b[..4])));
        }
        if b[4] != ENDPOINT_VERSION {
            return Err(Error::new(
                libc::EPROTONOSUPPORT,
                format!(
                    "endpoint byte form version {}; this softrdma reads version {ENDPOINT_VERSION}",
                    b[4]
                ),
            )
            .with_kind(ErrorKind::NotSupported));
        }
        Ok(usize::from(b[5]))
    }

    fn parse_body(body: &[u8]) -> Result<Endpoint> {
        let take = |at: usize, n: usize| -> Result<&[u8]> {
            body.get(at..at + n)
                .ok_or_else(|| malformed(format!("body of {} bytes is short", body.len())))
        };
        let u32_at = |at| -> Result<u32> {
            let mut a = [0u8; 4];
            a.copy_from_slice(take(at, 4)?);
            Ok(u32::from_be_bytes(a))
        };
        let u64_at = |at| -> Result<u64> {
            let mut a = [0u8; 8];
            a.copy_from_slice(take(at, 8)?);
            Ok(u64::from_be_bytes(a))
        };
        let flags = take(0, 1)?[0];
        if flags & !HAS_MEMORY != 0 {
            return Err(malformed(format!("unknown flags {flags:#04x}")));
        }
        let code = take(1, 1)?[0];
        let mtu = Mtu::from_raw(u32::from(code))
            .ok_or_else(|| malformed(format!("MTU code {code} is none of 1-5")))?;
        let (qpn, psn) = (u32_at(2)?, u32_at(6)?);
        if qpn > 0xff_ffff || psn > 0xff_ffff {
            return Err(malformed("QPN or PSN wider than 24 bits"));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(take(10, 16)?);
        let mut len = BODY;
        let memory = if flags & HAS_MEMORY != 0 {
            len += MEMORY;
            Some(RemoteMemory {
                addr: u64_at(BODY)?,
                rkey: u32_at(BODY + 8)?,
                len: u64_at(BODY + 12)?,
            })
        } else {
            None
        };
        if body.len() != len {
            return Err(malformed(format!(
                "body of {} bytes, version {ENDPOINT_VERSION} has {len}",
                body.len()
            )));
        }
        Ok(Endpoint {
            gid: Gid(gid),
            qpn,
            psn,
            mtu,
            memory,
        })
    }

    /// Write the byte form to `w` (a `TcpStream`, say) in one write.
    pub fn write_to(&self, w: &mut impl std::io::Write) -> Result<()> {
        w.write_all(&self.to_bytes())
            .and_then(|()| w.flush())
            .map_err(|e| Error::io(e, libc::EIO, "sending the endpoint"))
    }

    /// Read one endpoint in byte form from `r`: the header first, then as many bytes as
    /// it announces, so that nothing after it is consumed.
    pub fn read_from(r: &mut impl std::io::Read) -> Result<Endpoint> {
        let mut h = [0u8; HEADER];
        r.read_exact(&mut h)
            .map_err(|e| Error::io(e, libc::EIO, "reading the peer's endpoint"))?;
        let n = Self::check_header(&h)?;
        let mut body = vec![0u8; n];
        r.read_exact(&mut body)
            .map_err(|e| Error::io(e, libc::EIO, "reading the peer's endpoint"))?;
        Self::parse_body(&body)
    }

    /// The address message of rdma-core's `ibv_rc_pingpong` (and `ibv_uc_`, `ibv_ud_`
    /// pingpong), see [`pingpong`](crate::pingpong): LID 0 (RoCE has none), 51
    /// characters. The programs send it as a 52-byte buffer, NUL included
    /// ([`PINGPONG_MSG_LEN`]); memory and MTU are not part of it.
    pub fn to_pingpong_string(&self) -> String {
        self.pingpong_address().to_text()
    }

    /// Parse a pingpong address message ([`pingpong::Address::parse`]); text after a NUL
    /// is ignored, so the 52-byte buffer can be given whole. The MTU is the default 1024
    /// (the programs' `-m` default) and there is no memory. Anything malformed is
    /// [`ErrorKind::Protocol`].
    pub fn parse_pingpong(msg: &[u8]) -> Result<Endpoint> {
        let a = pingpong::Address::parse(msg)?;
        Ok(Endpoint::new(a.gid, a.qpn, a.psn))
    }

    /// The 52-byte buffer the pingpong programs write: [`Endpoint::to_pingpong_string`]
    /// and a NUL.
    pub fn to_pingpong_msg(&self) -> [u8; PINGPONG_MSG_LEN] {
        self.pingpong_address().to_msg()
    }

    fn pingpong_address(&self) -> pingpong::Address {
        pingpong::Address {
            lid: 0,
            qpn: self.qpn,
            psn: self.psn,
            gid: self.gid,
        }
    }

    /// The GID as an IPv6 address (`::ffff:a.b.c.d` for an IPv4 device), for messages.
    pub fn gid_addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.gid.0)
    }
}

impl std::fmt::Display for Endpoint {
    /// `QPN 0x… PSN 0x… GID …`, and the memory when there is some.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QPN {:#08x} PSN {:#08x} GID {} MTU {}",
            self.qpn,
            self.psn,
            self.gid.to_ip(),
            self.mtu.bytes()
        )?;
        if let Some(m) = &self.memory {
            write!(f, ", memory {:#x}+{} rkey {:#x}", m.addr, m.len, m.rkey)?;
        }
        Ok(())
    }
}

impl QueuePair {
    /// What the peer needs to connect to this QP: its GID, number and the first PSN it
    /// sends with, chosen at random when the QP was created (and again by
    /// [`QueuePair::reset`]), so the same PSN is always the one [`QueuePair::connect_to`]
    /// sends from. Offers the default path MTU (1024, see [`Endpoint::mtu`]) and no
    /// memory ([`Endpoint::with_memory`] adds it).
    pub fn endpoint(&self) -> Endpoint {
        Endpoint::new(self.device().gid(), self.qpn(), self.psn())
    }

    /// RESET → INIT → RTR → RTS towards the peer's `peer` endpoint, sending from this
    /// QP's own PSN (the one [`QueuePair::endpoint`] gave the peer), granting `access`,
    /// with the default path options.
    pub fn connect_to(
        &self,
        peer: &Endpoint,
        access: softrdma_transport::verbs::Access,
    ) -> Result<()> {
        self.connect_to_with(peer, access, &crate::PathOptions::default())
    }

    /// [`QueuePair::connect_to`] with path options; the path MTU is the lowest of
    /// `o.mtu` and the peer's [`Endpoint::mtu`].
    pub fn connect_to_with(
        &self,
        peer: &Endpoint,
        access: softrdma_transport::verbs::Access,
        o: &crate::PathOptions,
    ) -> Result<()> {
        self.to_init(access)?;
        self.ready_to(peer, o)
    }

    /// INIT → RTR → RTS towards `peer` (the second half of
    /// [`QueuePair::connect_to_with`], for helpers that post receives in INIT).
    pub(crate) fn ready_to(&self, peer: &Endpoint, o: &crate::PathOptions) -> Result<()> {
        let o = crate::PathOptions {
            mtu: lower_mtu(o.mtu, peer.mtu),
            ..*o
        };
        self.to_rtr_with(&peer.remote_qp(), &o)?;
        self.to_rts_with(self.psn(), &o)
    }
}

/// The lower of two MTUs.
pub(crate) fn lower_mtu(a: Mtu, b: Mtu) -> Mtu {
    if (a as u8) <= (b as u8) {
        a
    } else {
        b
    }
}

#[cfg(feature = "serde")]
mod serde_impl {
    //! serde through plain representations: the GID as an IPv6 address (a string in
    //! human-readable formats such as JSON), the MTU as its byte count, so that the form
    //! reads as what it means and does not depend on the verbs crate's types.

    use super::*;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct MemoryRepr {
        addr: u64,
        rkey: u32,
        len: u64,
    }

    #[derive(Serialize, Deserialize)]
    struct EndpointRepr {
        gid: Ipv6Addr,
        qpn: u32,
        psn: u32,
        mtu: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        memory: Option<MemoryRepr>,
    }

    impl Serialize for RemoteMemory {
        fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            MemoryRepr {
                addr: self.addr,
                rkey: self.rkey,
                len: self.len,
            }
            .serialize(s)
        }
    }

    impl<'de> Deserialize<'de> for RemoteMemory {
        fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            let m = MemoryRepr::deserialize(d)?;
            Ok(RemoteMemory {
                addr: m.addr,
                rkey: m.rkey,
                len: m.len,
            })
        }
    }

    impl Serialize for Endpoint {
        fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            EndpointRepr {
                gid: Ipv6Addr::from(self.gid.0),
                qpn: self.qpn,
                psn: self.psn,
                mtu: self.mtu.bytes() as u16,
                memory: self.memory.map(|m| MemoryRepr {
                    addr: m.addr,
                    rkey: m.rkey,
                    len: m.len,
                }),
            }
            .serialize(s)
        }
    }

    impl<'de> Deserialize<'de> for Endpoint {
        fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            use serde::de::Error as _;
            let r = EndpointRepr::deserialize(d)?;
            if r.qpn > 0xff_ffff || r.psn > 0xff_ffff {
                return Err(D::Error::custom("QPN and PSN are 24-bit numbers"));
            }
            let mtu = Mtu::from_bytes(u32::from(r.mtu)).ok_or_else(|| {
                D::Error::custom(format!(
                    "MTU {} is none of 256, 512, 1024, 2048, 4096",
                    r.mtu
                ))
            })?;
            Ok(Endpoint {
                gid: Gid(r.gid.octets()),
                qpn: r.qpn,
                psn: r.psn,
                mtu,
                memory: r.memory.map(|m| RemoteMemory {
                    addr: m.addr,
                    rkey: m.rkey,
                    len: m.len,
                }),
            })
        }
    }
}

/// The private-data form of [`RemoteMemory`] the CM helpers send: a tag, so that a
/// program's own private data is never mistaken for memory, a version, then addr, rkey,
/// len (big-endian): 25 bytes, within the 56 a REQ carries.
const MEMORY_TAG: [u8; 4] = *b"SRmm";
const MEMORY_FORM: usize = 4 + 1 + MEMORY;

fn memory_private_data(m: &RemoteMemory) -> Vec<u8> {
    let mut b = Vec::with_capacity(MEMORY_FORM);
    b.extend_from_slice(&MEMORY_TAG);
    b.push(ENDPOINT_VERSION);
    b.extend_from_slice(&m.to_bytes());
    b
}

/// The memory in private data `p` (zero-padded as the CM delivers it), if it holds the
/// form [`memory_private_data`] writes.
fn memory_in(p: &[u8]) -> Option<RemoteMemory> {
    if p.len() < MEMORY_FORM || p[..4] != MEMORY_TAG || p[4] != ENDPOINT_VERSION {
        return None;
    }
    let mut m = [0u8; MEMORY];
    m.copy_from_slice(&p[5..MEMORY_FORM]);
    Some(RemoteMemory::from_bytes(&m))
}

impl crate::cm::ConnectOptions {
    /// Offer `memory` to the server: the request's private data becomes a tagged form of
    /// it (25 bytes), which the server reads with [`ConnectRequest::peer_memory`] or
    /// [`Connection::peer_memory`](crate::cm::Connection::peer_memory).
    ///
    /// [`ConnectRequest::peer_memory`]: crate::cm::ConnectRequest::peer_memory
    pub fn with_memory(mut self, memory: RemoteMemory) -> Self {
        self.private_data = memory_private_data(&memory);
        self
    }
}

impl crate::cm::AcceptOptions {
    /// Offer `memory` to the client, in the answer's private data (see
    /// [`ConnectOptions::with_memory`](crate::cm::ConnectOptions::with_memory)).
    pub fn with_memory(mut self, memory: RemoteMemory) -> Self {
        self.private_data = memory_private_data(&memory);
        self
    }
}

impl crate::cm::ConnectRequest {
    /// The memory the client offered with
    /// [`ConnectOptions::with_memory`](crate::cm::ConnectOptions::with_memory), if any.
    pub fn peer_memory(&self) -> Option<RemoteMemory> {
        memory_in(self.private_data())
    }
}

impl crate::cm::Connection {
    /// The memory the peer offered with `with_memory` on its options, if any.
    pub fn peer_memory(&self) -> Option<RemoteMemory> {
        memory_in(self.private_data())
    }

    /// The peer's endpoint as the connection manager set the QP up: its GID, QP number,
    /// first PSN and the path MTU, with the memory it offered. The QP is connected
    /// already; this is for programs that log or check what they are connected to.
    /// EINVAL for UD, which has no connected peer.
    pub fn peer_endpoint(&self) -> Result<Endpoint> {
        if self.qp().qp_type() == softrdma_transport::verbs::QpType::Ud {
            return Err(Error::invalid("a UD QP has no connected peer"));
        }
        let a = self.qp().query()?;
        Ok(Endpoint {
            gid: a.ah_attr.grh.dgid,
            qpn: a.dest_qp_num,
            psn: a.rq_psn,
            mtu: a.path_mtu,
            memory: self.peer_memory(),
        })
    }
}
