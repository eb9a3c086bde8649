//! A stream rsocket's connection: its RC QP, buffers and the rsockets protocol on the
//! wire, so that a peer running rdma-core's rsockets reads what this side writes.
//!
//! The protocol (rdma-core's `librdmacm/rsocket.c`, version 1):
//! - Each side has a receive buffer (`rbuf`), registered for remote writes, in two
//!   halves. The connection's private data (40 bytes, big-endian) offers the first half
//!   (`data_buf`), the receive credits (the receive queue's size) and where the peer may
//!   write buffer offers later (`target_sgl`, two 16-byte entries: address, rkey,
//!   length, in the writer's byte order unless it knows the reader's differs).
//! - Data is an RDMA WRITE WITH IMMEDIATE into the offered buffer; the immediate is
//!   `op << 29 | length` (op 0: data). Each one uses a receive credit.
//! - A receiver that has drained half of its buffer offers it again: an RDMA WRITE WITH
//!   IMMEDIATE of the entry into the peer's `target_sgl` (op 4, SGL), whose immediate
//!   also grants credits up to a sequence number; with no buffer to offer, a bare
//!   immediate grants credits.
//! - Control messages (op 7) say DISCONNECT (0) or SHUTDOWN (2, no more data); a
//!   KEEPALIVE (1) is a zero-length RDMA WRITE that asks for nothing.
//! - Direct writes (`riowrite`) are plain RDMA WRITEs into regions the peer offered with
//!   `riomap` (op 6, IOMAP_SGL: a 24-byte entry written after the SGL entries).

use std::ffi::{c_int, c_void};
use std::ptr;

use super::super::abi;
use super::super::id as cmid;
use super::super::qp as cmqp;
use crate::{cq, device, mr, sys, zeroed};

/// The first data transfer of a send, doubled per transfer up to [`MAX_TRANSFER`].
pub(super) const OLAP_START: u32 = 2048;
pub(super) const MAX_TRANSFER: u32 = 65536;
/// A send waits for this much free send buffer.
pub(super) const SNDLOWAT: u32 = 2048;
const QP_MIN: u16 = 16;
const QP_MAX: u16 = 0xFFFE;
/// Control messages outstanding at once (a power of two).
const CTRL_SIZE: u32 = 4;
/// Entries of the target SGL (the halves of the peer's receive buffer).
const SGL_SIZE: usize = 2;
const SGE_BYTES: usize = 16;
pub(super) const IOMAP_BYTES: usize = 24;
/// `struct rs_conn_data`.
pub(super) const CONN_DATA_LEN: usize = 40;
const CONN_FLAG_NET: u8 = 1;
const CONN_FLAG_IOMAP: u8 = 2;

/// Message types: the top three bits of an immediate.
pub(super) const OP_DATA: u32 = 0;
pub(super) const OP_WRITE: u32 = 2;
const OP_SGL: u32 = 4;
const OP_IOMAP_SGL: u32 = 6;
pub(super) const OP_CTRL: u32 = 7;
pub(super) const CTRL_DISCONNECT: u32 = 0;
pub(super) const CTRL_KEEPALIVE: u32 = 1;
pub(super) const CTRL_SHUTDOWN: u32 = 2;
const WR_RECV: u64 = 1 << 63;

pub(super) fn msg(op: u32, data: u32) -> u32 {
    (op << 29) | (data & 0x1FFF_FFFF)
}
fn msg_op(m: u32) -> u32 {
    m >> 29
}
fn msg_data(m: u32) -> u32 {
    m & 0x1FFF_FFFF
}

/// Socket states, ordered passive, connecting, connected, disconnected.
pub(super) mod st {
    pub const INIT: u32 = 0;
    pub const BOUND: u32 = 0x1;
    pub const LISTENING: u32 = 0x2;
    pub const OPENING: u32 = 0x4;
    pub const RESOLVING_ADDR: u32 = OPENING | 0x10;
    pub const RESOLVING_ROUTE: u32 = OPENING | 0x20;
    pub const CONNECTING: u32 = OPENING | 0x40;
    pub const ACCEPTING: u32 = OPENING | 0x80;
    /// A connect's step done, the next to start in the same call (so never left in a
    /// socket's state when the call returns).
    pub const ADDR_RESOLVED: u32 = RESOLVING_ADDR | 0x8000;
    pub const ROUTE_RESOLVED: u32 = RESOLVING_ROUTE | 0x8000;
    pub const CONNECTED: u32 = 0x100;
    pub const WRITABLE: u32 = 0x200;
    pub const READABLE: u32 = 0x400;
    pub const CONNECT_RDWR: u32 = CONNECTED | READABLE | WRITABLE;
    pub const CONNECT_ERROR: u32 = 0x800;
    pub const DISCONNECTED: u32 = 0x1000;
    pub const ERROR: u32 = 0x2000;
}

/// `value` in `bits` bits: exact up to 2^(bits-1), above that a coarse scale (the
/// iomap size in the connection data).
pub(super) fn value_to_scale(value: u32, bits: u32) -> u32 {
    let half = 1 << (bits - 1);
    if value <= half {
        value
    } else {
        half | (value >> bits)
    }
}

pub(super) fn scale_to_value(value: u32, bits: u32) -> u32 {
    let half = 1 << (bits - 1);
    if value <= half {
        value
    } else {
        (value & !half) << bits
    }
}

/// `struct rs_sge`: where a peer may write.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(super) struct Sge {
    pub addr: u64,
    pub key: u32,
    pub length: u32,
}

/// Sizes a socket is made with (inherited by the sockets a listener accepts).
#[derive(Clone, Copy, Debug)]
pub(super) struct Config {
    pub sq_size: u16,
    pub rq_size: u16,
    pub sq_inline: u32,
    pub sbuf_size: u32,
    pub rbuf_size: u32,
    pub iomap_size: u16,
}

impl Default for Config {
    /// rsockets' defaults (384-deep queues, 64 bytes inline, 128 KiB buffers, no iomap),
    /// or what the administrator set in rsockets' configuration directory.
    fn default() -> Config {
        *defaults()
    }
}

/// Where rdma-core's rsockets read their defaults (one number per file).
pub(super) const CONF_DIR: &str = "/etc/rdma/rsocket";

pub(super) fn conf_value(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string(format!("{CONF_DIR}/{name}")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// The process's defaults, read once: `sqsize_default`, `rqsize_default`,
/// `inline_default`, `mem_default`, `wmem_default` and `iomap_size` of [`CONF_DIR`],
/// with rsockets' limits (a send buffer of at least twice [`SNDLOWAT`] when one below
/// it is given, an iomap size that the connection data can carry).
fn defaults() -> &'static Config {
    static D: std::sync::OnceLock<Config> = std::sync::OnceLock::new();
    D.get_or_init(|| {
        let u16_of = |v: u32| v.min(u32::from(u16::MAX)) as u16;
        let mut c = Config {
            sq_size: 384,
            rq_size: 384,
            sq_inline: 64,
            sbuf_size: 1 << 17,
            rbuf_size: 1 << 17,
            iomap_size: 0,
        };
        if let Some(v) = conf_value("sqsize_default") {
            c.sq_size = u16_of(v);
        }
        if let Some(v) = conf_value("rqsize_default") {
            c.rq_size = u16_of(v);
        }
        if let Some(v) = conf_value("inline_default") {
            c.sq_inline = v.min(u32::from(u16::MAX));
        }
        if let Some(v) = conf_value("mem_default") {
            c.rbuf_size = v.clamp(1, 1 << 28);
        }
        if let Some(v) = conf_value("wmem_default") {
            c.sbuf_size = if v < SNDLOWAT {
                SNDLOWAT << 1
            } else {
                v.min(1 << 28)
            };
        }
        if let Some(v) = conf_value("iomap_size") {
            c.iomap_size = u16_of(scale_to_value(value_to_scale(v.min(0xFFFF), 8) & 0xFF, 8));
        }
        c
    })
}

/// Page-aligned zeroed memory that the device reads and writes: used only through raw
/// pointers, never as a Rust reference, since a peer's RDMA writes change it.
pub(super) struct Mem {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Mem {
    fn new(len: usize) -> Result<Mem, c_int> {
        let layout =
            std::alloc::Layout::from_size_align(len.max(1), 4096).map_err(|_| libc::ENOMEM)?;
        // SAFETY: the layout's size is not zero.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(libc::ENOMEM);
        }
        Ok(Mem { ptr, layout })
    }
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// A local region offered with `riomap`, or mapped for local use only (`index` None).
pub(super) struct IoMap {
    pub index: Option<usize>,
    pub offset: u64,
    pub mr: *mut sys::ibv_mr,
    /// Written to the peer's iomap table.
    pub sent: bool,
}

/// The registered buffers of a connected socket.
struct Bufs {
    sbuf: Mem,
    smr: *mut sys::ibv_mr,
    target: Mem,
    tmr: *mut sys::ibv_mr,
    rbuf: Mem,
    rmr: *mut sys::ibv_mr,
}

/// The lengths of the data messages received and not yet read, oldest first: a ring of
/// fixed size (the receive queue's, which bounds what a peer within its credits has
/// unread), so a peer that ignores its credits cannot grow it.
struct MsgRing {
    buf: Box<[u32]>,
    head: usize,
    len: usize,
}

impl MsgRing {
    fn new(cap: usize) -> MsgRing {
        MsgRing {
            buf: vec![0; cap].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    /// Add one at the end: false when the ring is full.
    fn push(&mut self, v: u32) -> bool {
        if self.len == self.buf.len() {
            return false;
        }
        let i = (self.head + self.len) % self.buf.len();
        self.buf[i] = v;
        self.len += 1;
        true
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `i`-th oldest (`i < len`).
    fn get(&self, i: usize) -> u32 {
        self.buf[(self.head + i) % self.buf.len()]
    }

    fn front_mut(&mut self) -> Option<&mut u32> {
        if self.len == 0 {
            None
        } else {
            Some(&mut self.buf[self.head])
        }
    }

    fn pop_front(&mut self) {
        if self.len > 0 {
            self.head = (self.head + 1) % self.buf.len();
            self.len -= 1;
        }
    }
}

/// One stream rsocket.
pub(super) struct Stream {
    pub id: *mut abi::rdma_cm_id,
    pub state: u32,
    /// SO_ERROR.
    pub err: c_int,
    pub fs_flags: c_int,
    pub fd_flags: c_int,
    pub cfg: Config,
    /// The peer's byte order differs: entries written to it are swapped.
    swap: bool,
    pub so_opts: u64,
    pub tcp_opts: u64,
    pub ipv6_opts: u64,
    pub ipv4_tos: c_int,
    pub keepalive_time: u32,
    /// A route given with RDMA_ROUTE, used by the next connect.
    pub route: Option<Vec<u8>>,
    pub retries: u32,

    ctrl_seqno: u32,
    ctrl_max_seqno: u32,
    sseq_no: u16,
    sseq_comp: u16,
    rseq_no: u16,
    rseq_comp: u16,
    remote_sge: u32,
    remote_sgl: Sge,
    remote_iomap: Sge,
    target_sge: usize,
    rbuf_bytes_avail: u32,
    rbuf_free_offset: u32,
    rbuf_offset: u32,
    sbuf_bytes_avail: u32,
    /// Where the next copy into the send buffer goes.
    spos: u32,
    sqe_avail: i32,
    /// Lengths of the data messages received and not yet read.
    rmsg: MsgRing,
    bufs: Option<Bufs>,
    pub cq_armed: bool,
    pub iomaps: Vec<IoMap>,
}

// SAFETY: the raw pointers are this library's objects (CM id, CQ, MRs) and memory the
// socket owns; every use is under the socket's mutex.
unsafe impl Send for Stream {}

fn post_send(qp: *mut sys::ibv_qp, wr: &mut sys::ibv_send_wr) -> Result<(), c_int> {
    let mut bad = ptr::null_mut();
    // SAFETY: `qp` is the socket's live QP; `wr` and the SGEs it points at live across
    // the call (inline data is copied by the post).
    match unsafe { crate::qp::post_send(qp, wr, &mut bad) } {
        0 => Ok(()),
        e => Err(e),
    }
}

impl Stream {
    /// A socket on `id` (already made), with `cfg`'s sizes.
    pub(super) fn new(id: *mut abi::rdma_cm_id, cfg: Config) -> Stream {
        Stream {
            id,
            state: st::INIT,
            err: 0,
            fs_flags: 0,
            fd_flags: 0,
            cfg,
            swap: false,
            so_opts: 0,
            tcp_opts: 0,
            ipv6_opts: 0,
            ipv4_tos: 0,
            keepalive_time: 0,
            route: None,
            retries: 0,
            ctrl_seqno: 0,
            ctrl_max_seqno: CTRL_SIZE,
            sseq_no: 0,
            sseq_comp: 0,
            rseq_no: 0,
            rseq_comp: 0,
            remote_sge: 0,
            remote_sgl: Sge::default(),
            remote_iomap: Sge::default(),
            target_sge: 0,
            rbuf_bytes_avail: 0,
            rbuf_free_offset: 0,
            rbuf_offset: 0,
            sbuf_bytes_avail: 0,
            spos: 0,
            sqe_avail: 0,
            rmsg: MsgRing::new(0),
            bufs: None,
            cq_armed: false,
            iomaps: Vec::new(),
        }
    }

    /// `rclose` freed it (a thread that was waiting in it must not go on).
    pub(super) fn closed(&self) -> bool {
        self.id.is_null()
    }

    pub(super) fn has_ep(&self) -> bool {
        self.bufs.is_some()
    }

    fn qp(&self) -> *mut sys::ibv_qp {
        // SAFETY: the id is live while the socket is.
        unsafe { (*self.id).qp }
    }

    pub(super) fn cq(&self) -> *mut sys::ibv_cq {
        // SAFETY: as above.
        unsafe { (*self.id).recv_cq }
    }

    pub(super) fn comp_fd(&self) -> Option<c_int> {
        // SAFETY: as above; the channel, when set, is ours and live.
        unsafe {
            let ch = (*self.id).recv_cq_channel;
            (!ch.is_null()).then(|| (*ch).fd)
        }
    }

    pub(super) fn cm_fd(&self) -> c_int {
        // SAFETY: a socket's id is synchronous: it has its own live channel.
        unsafe { (*(*self.id).channel).fd }
    }

    /// The target SGL entry `i` (the peer's offers), which the peer writes remotely.
    fn target_sgl(&self, i: usize) -> *mut Sge {
        let b = self.bufs.as_ref().expect("connected socket has buffers");
        // SAFETY: the target buffer holds SGL_SIZE entries first.
        unsafe { b.target.ptr().cast::<Sge>().add(i) }
    }

    fn target_len(&self) -> u32 {
        // SAFETY: a valid entry (above); volatile, as the peer writes it remotely.
        unsafe { ptr::read_volatile(ptr::addr_of!((*self.target_sgl(self.target_sge)).length)) }
    }

    /// The peer's iomap entry `i` in this socket's target buffer.
    pub(super) fn target_iomap(&self, i: usize) -> (u64, Sge) {
        let b = self.bufs.as_ref().expect("connected socket has buffers");
        // SAFETY: the target buffer holds `iomap_size` 24-byte entries after the SGL.
        unsafe {
            let p = b.target.ptr().add(SGL_SIZE * SGE_BYTES + i * IOMAP_BYTES);
            let offset = ptr::read_volatile(p.cast::<u64>());
            let sge = ptr::read_volatile(p.add(8).cast::<Sge>());
            (offset, sge)
        }
    }

    /// rsockets' `rs_create_ep`: the CQ and its channel, the RC QP, the buffers, and the
    /// receive queue filled.
    pub(super) fn create_ep(&mut self) -> Result<(), c_int> {
        // SAFETY: the id is live and bound to a device (its address is resolved, or it
        // came from a connection request); the calls are this library's.
        unsafe {
            let verbs = (*self.id).verbs;
            if verbs.is_null() {
                return Err(libc::ENODEV);
            }
            let mut attr: sys::ibv_device_attr = zeroed();
            let max = if device::ibv_query_device(verbs, &mut attr) == 0 {
                (attr.max_qp_wr.clamp(0, i32::from(QP_MAX)) as u16).max(QP_MIN)
            } else {
                QP_MAX
            };
            self.cfg.sq_size = self.cfg.sq_size.clamp(QP_MIN, max);
            self.cfg.rq_size = self.cfg.rq_size.clamp(QP_MIN, max);
            let ch = cq::ibv_create_comp_channel(verbs);
            if ch.is_null() {
                return Err(crate::errno_now());
            }
            // Waits poll the fd and then take the event without blocking.
            let fl = libc::fcntl((*ch).fd, libc::F_GETFL);
            libc::fcntl((*ch).fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            let depth = c_int::from(self.cfg.sq_size) + c_int::from(self.cfg.rq_size);
            let c = cq::ibv_create_cq(verbs, depth, self.id.cast(), ch, 0);
            if c.is_null() {
                let e = crate::errno_now();
                cq::ibv_destroy_comp_channel(ch);
                return Err(e);
            }
            // rdma_destroy_qp destroys what the id names.
            (*self.id).recv_cq_channel = ch;
            (*self.id).send_cq_channel = ch;
            (*self.id).recv_cq = c;
            (*self.id).send_cq = c;
            self.arm();
            let mut qa: sys::ibv_qp_init_attr = zeroed();
            qa.send_cq = c;
            qa.recv_cq = c;
            qa.qp_type = sys::IBV_QPT_RC;
            qa.sq_sig_all = 1;
            qa.cap.max_send_wr = u32::from(self.cfg.sq_size);
            qa.cap.max_recv_wr = u32::from(self.cfg.rq_size);
            qa.cap.max_send_sge = 2;
            qa.cap.max_recv_sge = 1;
            qa.cap.max_inline_data = self.cfg.sq_inline;
            if cmqp::rdma_create_qp(self.id, ptr::null_mut(), &mut qa) != 0 {
                return Err(crate::errno_now());
            }
            self.cfg.sq_inline = qa.cap.max_inline_data;
            self.init_bufs()?;
        }
        self.rmsg = MsgRing::new(usize::from(self.cfg.rq_size));
        for _ in 0..self.cfg.rq_size {
            self.post_recv()?;
        }
        Ok(())
    }

    fn reg(&self, m: &Mem, len: usize, access: u32) -> Result<*mut sys::ibv_mr, c_int> {
        // SAFETY: the id's PD is live; `m` holds `len` bytes and outlives the region
        // (deregistered in `free` before the memory is dropped).
        let r = unsafe { mr::ibv_reg_mr((*self.id).pd, m.ptr().cast(), len, access as c_int) };
        if r.is_null() {
            Err(crate::errno_now())
        } else {
            Ok(r)
        }
    }

    fn init_bufs(&mut self) -> Result<(), c_int> {
        let c = self.cfg;
        let mut sbuf_len = c.sbuf_size as usize;
        if (c.sq_inline as usize) < SGE_BYTES {
            // Control messages too long to go inline are copied here.
            sbuf_len += SGE_BYTES * CTRL_SIZE as usize;
        }
        let local = sys::IBV_ACCESS_LOCAL_WRITE;
        let remote = local | sys::IBV_ACCESS_REMOTE_WRITE;
        let sbuf = Mem::new(sbuf_len)?;
        let tlen = SGE_BYTES * SGL_SIZE + IOMAP_BYTES * usize::from(c.iomap_size);
        let target = Mem::new(tlen)?;
        let rbuf = Mem::new(c.rbuf_size as usize)?;
        let smr = self.reg(&sbuf, sbuf_len, local)?;
        let tmr = match self.reg(&target, tlen, remote) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: just registered, used by nothing.
                unsafe { mr::ibv_dereg_mr(smr) };
                return Err(e);
            }
        };
        let rmr = match self.reg(&rbuf, c.rbuf_size as usize, remote) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: as above.
                unsafe {
                    mr::ibv_dereg_mr(smr);
                    mr::ibv_dereg_mr(tmr);
                }
                return Err(e);
            }
        };
        self.bufs = Some(Bufs {
            sbuf,
            smr,
            target,
            tmr,
            rbuf,
            rmr,
        });
        self.spos = 0;
        self.sbuf_bytes_avail = c.sbuf_size;
        self.rbuf_free_offset = c.rbuf_size >> 1;
        self.rbuf_bytes_avail = c.rbuf_size >> 1;
        self.sqe_avail = i32::from(c.sq_size) - self.ctrl_max_seqno as i32;
        self.rseq_comp = c.rq_size >> 1;
        Ok(())
    }

    /// The connection data this side offers (`rs_format_conn_data`).
    pub(super) fn format_conn_data(&self) -> [u8; CONN_DATA_LEN] {
        let b = self.bufs.as_ref().expect("connected socket has buffers");
        let mut d = [0u8; CONN_DATA_LEN];
        d[0] = 1;
        d[1] = CONN_FLAG_IOMAP
            | if cfg!(target_endian = "big") {
                CONN_FLAG_NET
            } else {
                0
            };
        d[2..4].copy_from_slice(&self.cfg.rq_size.to_be_bytes());
        d[7] = value_to_scale(u32::from(self.cfg.iomap_size), 8) as u8;
        // SAFETY: the regions are live.
        let (tkey, rkey) = unsafe { ((*b.tmr).rkey, (*b.rmr).rkey) };
        d[8..16].copy_from_slice(&(b.target.ptr() as u64).to_be_bytes());
        d[16..20].copy_from_slice(&tkey.to_be_bytes());
        d[20..24].copy_from_slice(&(SGL_SIZE as u32).to_be_bytes());
        d[24..32].copy_from_slice(&(b.rbuf.ptr() as u64).to_be_bytes());
        d[32..36].copy_from_slice(&rkey.to_be_bytes());
        d[36..40].copy_from_slice(&(self.cfg.rbuf_size >> 1).to_be_bytes());
        d
    }

    /// Take the peer's connection data (`rs_save_conn_data`); EPROTO when it is not
    /// version 1 or too short.
    pub(super) fn save_conn_data(&mut self, d: &[u8]) -> Result<(), c_int> {
        if d.len() < CONN_DATA_LEN || d[0] != 1 {
            return Err(libc::EPROTO);
        }
        let be64 = |o: usize| u64::from_be_bytes(d[o..o + 8].try_into().expect("8 bytes"));
        let be32 = |o: usize| u32::from_be_bytes(d[o..o + 4].try_into().expect("4 bytes"));
        self.remote_sgl = Sge {
            addr: be64(8),
            key: be32(16),
            length: be32(20),
        };
        if self.remote_sgl.length == 0 {
            return Err(libc::EPROTO);
        }
        self.remote_sge = 1 % self.remote_sgl.length;
        let peer_net = d[1] & CONN_FLAG_NET != 0;
        self.swap = peer_net != cfg!(target_endian = "big");
        if d[1] & CONN_FLAG_IOMAP != 0 {
            self.remote_iomap = Sge {
                addr: self.remote_sgl.addr + SGE_BYTES as u64 * u64::from(self.remote_sgl.length),
                key: self.remote_sgl.key,
                length: scale_to_value(u32::from(d[7]), 8),
            };
        }
        let first = Sge {
            addr: be64(24),
            key: be32(32),
            length: be32(36),
        };
        // SAFETY: entry 0 of the target SGL; written before the peer can write it.
        unsafe { ptr::write_volatile(self.target_sgl(0), first) };
        self.sseq_comp = u16::from_be_bytes([d[2], d[3]]);
        Ok(())
    }

    fn post_recv(&mut self) -> Result<(), c_int> {
        let mut wr: sys::ibv_recv_wr = zeroed();
        wr.wr_id = WR_RECV;
        let mut bad = ptr::null_mut();
        // SAFETY: the socket's live QP; a receive with no SGE (immediates only).
        match unsafe { crate::qp::post_recv(self.qp(), &mut wr, &mut bad) } {
            0 => Ok(()),
            e => Err(e),
        }
    }

    /// An RDMA WRITE (`imm` None) or WRITE WITH IMMEDIATE of `sgl` to `addr`/`rkey`;
    /// `wr_data` names the message in its completion.
    fn post_write(
        &self,
        sgl: &mut [sys::ibv_sge],
        inline: bool,
        wr_data: u32,
        imm: Option<u32>,
        addr: u64,
        rkey: u32,
    ) -> Result<(), c_int> {
        let mut wr: sys::ibv_send_wr = zeroed();
        wr.wr_id = u64::from(wr_data);
        wr.sg_list = if sgl.is_empty() {
            ptr::null_mut()
        } else {
            sgl.as_mut_ptr()
        };
        wr.num_sge = sgl.len() as c_int;
        wr.send_flags = if inline { sys::IBV_SEND_INLINE } else { 0 };
        match imm {
            Some(m) => {
                wr.opcode = sys::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.__bindgen_anon_1.imm_data = m.to_be();
            }
            None => wr.opcode = sys::IBV_WR_RDMA_WRITE,
        }
        wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: addr,
            rkey,
        };
        post_send(self.qp(), &mut wr)
    }

    /// A bare message: a WRITE WITH IMMEDIATE of nothing.
    pub(super) fn post_msg(&self, m: u32) -> Result<(), c_int> {
        self.post_write(&mut [], false, m, Some(m), 0, 0)
    }

    pub(super) fn ctrl_avail(&self) -> bool {
        self.ctrl_seqno != self.ctrl_max_seqno
    }

    /// `rs_send_credits`: offer the next half of the receive buffer if it is free, and
    /// grant receive credits.
    fn send_credits(&mut self) {
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.rseq_comp = self.rseq_no.wrapping_add(self.cfg.rq_size >> 1);
        let grant = msg(
            OP_SGL,
            u32::from(self.rseq_no.wrapping_add(self.cfg.rq_size)),
        );
        let half = self.cfg.rbuf_size >> 1;
        if self.rbuf_bytes_avail >= half {
            let b = self.bufs.as_ref().expect("connected socket has buffers");
            // SAFETY: the region is live.
            let rkey = unsafe { (*b.rmr).rkey };
            let addr = b.rbuf.ptr() as u64 + u64::from(self.rbuf_free_offset);
            let mut e = [0u8; SGE_BYTES];
            if self.swap {
                e[0..8].copy_from_slice(&addr.swap_bytes().to_ne_bytes());
                e[8..12].copy_from_slice(&rkey.swap_bytes().to_ne_bytes());
                e[12..16].copy_from_slice(&half.swap_bytes().to_ne_bytes());
            } else {
                e[0..8].copy_from_slice(&addr.to_ne_bytes());
                e[8..12].copy_from_slice(&rkey.to_ne_bytes());
                e[12..16].copy_from_slice(&half.to_ne_bytes());
            }
            let (mut sge, inline) = self.ctrl_sge(&e);
            let raddr = self.remote_sgl.addr + u64::from(self.remote_sge) * SGE_BYTES as u64;
            let r = self.post_write(
                std::slice::from_mut(&mut sge),
                inline,
                grant,
                Some(grant),
                raddr,
                self.remote_sgl.key,
            );
            if let Err(e) = r {
                self.fail(e);
                return;
            }
            self.rbuf_bytes_avail -= half;
            self.rbuf_free_offset += half;
            if self.rbuf_free_offset >= self.cfg.rbuf_size {
                self.rbuf_free_offset = 0;
            }
            self.remote_sge += 1;
            if self.remote_sge == self.remote_sgl.length {
                self.remote_sge = 0;
            }
        } else if let Err(e) = self.post_msg(grant) {
            self.fail(e);
        }
    }

    /// An SGE for a control message's bytes: inline when the QP allows, else copied to
    /// the control area after the send buffer (one slot per outstanding message).
    fn ctrl_sge(&self, bytes: &[u8]) -> (sys::ibv_sge, bool) {
        if self.cfg.sq_inline as usize >= bytes.len() {
            let sge = sys::ibv_sge {
                addr: bytes.as_ptr() as u64,
                length: bytes.len() as u32,
                lkey: 0,
            };
            return (sge, true);
        }
        let b = self.bufs.as_ref().expect("connected socket has buffers");
        let slot = (self.ctrl_seqno & (CTRL_SIZE - 1)) as usize;
        // SAFETY: the control area (CTRL_SIZE slots of 16 bytes) follows the send
        // buffer when the inline size is below 16 bytes; the slot is free (at most
        // CTRL_SIZE control messages are outstanding).
        let p = unsafe {
            b.sbuf
                .ptr()
                .add(self.cfg.sbuf_size as usize + slot * SGE_BYTES)
        };
        // SAFETY: `p` has room for `bytes` (at most 16 bytes; see above).
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
        // SAFETY: the region is live.
        let lkey = unsafe { (*b.smr).lkey };
        let sge = sys::ibv_sge {
            addr: p as u64,
            length: bytes.len() as u32,
            lkey,
        };
        (sge, false)
    }

    fn give_credits(&self) -> bool {
        let half = self.cfg.rbuf_size >> 1;
        (self.rbuf_bytes_avail >= half || (self.rseq_no.wrapping_sub(self.rseq_comp) as i16) >= 0)
            && self.ctrl_avail()
            && self.state & st::CONNECTED != 0
    }

    pub(super) fn update_credits(&mut self) {
        if self.bufs.is_some() && self.give_credits() {
            self.send_credits();
        }
    }

    /// A failure of the connection: the socket is in error with `e` for SO_ERROR.
    fn fail(&mut self, e: c_int) {
        self.state = st::ERROR;
        self.err = e;
    }

    /// `rs_poll_cq`: take every completion, then repost the receives they used.
    pub(super) fn poll_cq(&mut self) -> Result<(), c_int> {
        if self.bufs.is_none() {
            return Ok(());
        }
        let cq = self.cq();
        let mut wcs: [sys::ibv_wc; 16] = [zeroed(); 16];
        let mut rcnt = 0u32;
        let mut protocol_error = false;
        'outer: loop {
            // SAFETY: the socket's live CQ; room for 16 completions.
            let n = unsafe { crate::cq::poll_cq(cq, wcs.len() as c_int, wcs.as_mut_ptr()) };
            if n <= 0 {
                break;
            }
            for wc in &wcs[..n as usize] {
                if wc.wr_id & WR_RECV != 0 {
                    if wc.status != sys::IBV_WC_SUCCESS {
                        continue;
                    }
                    rcnt += 1;
                    if wc.wc_flags & sys::IBV_WC_WITH_IMM == 0 {
                        continue;
                    }
                    // SAFETY: a completion WITH_IMM carries its immediate.
                    let m = u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data });
                    match msg_op(m) {
                        OP_SGL => self.sseq_comp = msg_data(m) as u16,
                        OP_IOMAP_SGL | OP_WRITE => {}
                        OP_CTRL => match msg_data(m) {
                            CTRL_DISCONNECT => {
                                self.state = st::DISCONNECTED;
                                break 'outer;
                            }
                            CTRL_SHUTDOWN => {
                                if self.state & st::WRITABLE != 0 {
                                    self.state &= !st::READABLE;
                                } else {
                                    self.state = st::DISCONNECTED;
                                    break 'outer;
                                }
                            }
                            _ => {}
                        },
                        _ => {
                            if !self.take_data_msg(msg_data(m)) {
                                protocol_error = true;
                                break 'outer;
                            }
                        }
                    }
                } else {
                    let m = wc.wr_id as u32;
                    match msg_op(m) {
                        OP_SGL => self.ctrl_max_seqno = self.ctrl_max_seqno.wrapping_add(1),
                        OP_CTRL => {
                            self.ctrl_max_seqno = self.ctrl_max_seqno.wrapping_add(1);
                            if msg_data(m) == CTRL_DISCONNECT {
                                self.state = st::DISCONNECTED;
                            }
                        }
                        OP_IOMAP_SGL => {
                            self.sqe_avail += 1;
                            self.sbuf_bytes_avail += IOMAP_BYTES as u32;
                        }
                        _ => {
                            self.sqe_avail += 1;
                            self.sbuf_bytes_avail += msg_data(m);
                        }
                    }
                    if wc.status != sys::IBV_WC_SUCCESS && self.state & st::CONNECTED != 0 {
                        self.fail(libc::EIO);
                    }
                }
            }
        }
        if protocol_error {
            // The peer ignores its credits: the connection ends (its QP to error, a DREQ
            // to the peer), as a TCP peer's reset would.
            // SAFETY: the socket's live id; its channel is non-blocking (connected).
            unsafe { cmid::rdma_disconnect(self.id) };
            return Err(libc::EPROTO);
        }
        if self.state & st::CONNECTED != 0 {
            for _ in 0..rcnt {
                if let Err(e) = self.post_recv() {
                    self.fail(e);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// A data message of `len` bytes arrived: noted for the reader, unless the peer sent
    /// more than its credits allow (then the connection fails with EPROTO and false).
    /// Credits are granted up to `rq_size` messages past the last one read, so a peer
    /// within them never has more unread; rdma-core's ring of that size is overwritten
    /// by one that does not stop there.
    fn take_data_msg(&mut self, len: u32) -> bool {
        if self.rmsg.push(len) {
            return true;
        }
        self.fail(libc::EPROTO);
        false
    }

    /// Ask for an event at the next completion.
    pub(super) fn arm(&mut self) {
        let cq = self.cq();
        if cq.is_null() {
            return;
        }
        // SAFETY: the socket's live CQ.
        unsafe { crate::cq::req_notify_cq(cq, 0) };
        self.cq_armed = true;
    }

    /// Take a completion event if one is pending (the channel fd is non-blocking).
    pub(super) fn take_cq_event(&mut self) {
        // SAFETY: the id's live channel and CQ.
        unsafe {
            let ch = (*self.id).recv_cq_channel;
            if ch.is_null() {
                return;
            }
            let mut c = ptr::null_mut();
            let mut ctx: *mut c_void = ptr::null_mut();
            if cq::ibv_get_cq_event(ch, &mut c, &mut ctx) == 0 {
                cq::ibv_ack_cq_events(c, 1);
                self.cq_armed = false;
            }
        }
    }

    /// A CM event of a connected socket (its channel is non-blocking): DISCONNECTED
    /// ends the connection.
    pub(super) fn take_cm_event(&mut self) {
        // SAFETY: the id is live and synchronous.
        unsafe {
            if cmid::complete(self.id) != 0 {
                return;
            }
            let ev = (*self.id).event;
            if !ev.is_null()
                && (*ev).event == abi::RDMA_CM_EVENT_DISCONNECTED
                && self.state & st::CONNECTED != 0
            {
                self.state = st::DISCONNECTED;
            }
        }
    }

    pub(super) fn can_send(&self) -> bool {
        self.bufs.is_some()
            && self.sqe_avail > 0
            && self.sbuf_bytes_avail >= SNDLOWAT
            && self.sseq_no != self.sseq_comp
            && self.target_len() != 0
    }

    /// Data messages received and not yet read.
    #[cfg(test)]
    pub(super) fn unread_msgs(&self) -> usize {
        self.rmsg.len()
    }

    pub(super) fn have_rdata(&self) -> bool {
        !self.rmsg.is_empty()
    }

    pub(super) fn all_sends_done(&self) -> bool {
        self.ctrl_max_seqno.wrapping_sub(self.ctrl_seqno) as i32 + self.sqe_avail
            == i32::from(self.cfg.sq_size)
            || self.state & st::CONNECTED == 0
    }

    /// The most the next data transfer may carry: `want`, within the send buffer's free
    /// bytes and `room` at the target.
    pub(super) fn xfer_limit(&self, want: u32, room: u32) -> u32 {
        want.min(self.sbuf_bytes_avail).min(room)
    }

    pub(super) fn target_room(&self) -> u32 {
        self.target_len()
    }

    /// Stage `len` bytes (produced by `fill`, called with a destination and a length at
    /// most twice) in the send buffer, or point at them when they go inline, and post
    /// `post` with the SGEs.
    fn stage(
        &mut self,
        len: u32,
        src_inline: Option<*const u8>,
        fill: &mut dyn FnMut(*mut u8, usize),
    ) -> ([sys::ibv_sge; 2], usize, bool) {
        if let Some(p) = src_inline.filter(|_| len <= self.cfg.sq_inline) {
            let sge = sys::ibv_sge {
                addr: p as u64,
                length: len,
                lkey: 0,
            };
            return ([sge, sge], 1, true);
        }
        let b = self.bufs.as_ref().expect("connected socket has buffers");
        let base = b.sbuf.ptr();
        // SAFETY: the region is live.
        let lkey = unsafe { (*b.smr).lkey };
        let size = self.cfg.sbuf_size;
        let first = len.min(size - self.spos);
        // SAFETY: `spos + first <= sbuf_size`; the bytes are free (the send buffer's
        // free count never exceeds its free span after `spos`).
        let p0 = unsafe { base.add(self.spos as usize) };
        fill(p0, first as usize);
        let s0 = sys::ibv_sge {
            addr: p0 as u64,
            length: first,
            lkey,
        };
        if first == len {
            self.spos += len;
            if self.spos == size {
                self.spos = 0;
            }
            return ([s0, s0], 1, len <= self.cfg.sq_inline);
        }
        let rest = len - first;
        fill(base, rest as usize);
        let s1 = sys::ibv_sge {
            addr: base as u64,
            length: rest,
            lkey,
        };
        self.spos = rest;
        ([s0, s1], 2, len <= self.cfg.sq_inline)
    }

    /// `rs_write_data`: one data message of `len` bytes into the peer's current offer.
    pub(super) fn write_data(
        &mut self,
        len: u32,
        src_inline: Option<*const u8>,
        fill: &mut dyn FnMut(*mut u8, usize),
    ) -> Result<(), c_int> {
        let (mut sgl, n, inline) = self.stage(len, src_inline, fill);
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= len;
        let t = self.target_sgl(self.target_sge);
        // SAFETY: a valid entry; the peer does not write it while it is on offer.
        let (addr, key) = unsafe {
            let e = ptr::read_volatile(t);
            ptr::write_volatile(
                t,
                Sge {
                    addr: e.addr + u64::from(len),
                    key: e.key,
                    length: e.length - len,
                },
            );
            (e.addr, e.key)
        };
        if self.target_len() == 0 {
            self.target_sge = (self.target_sge + 1) % SGL_SIZE;
        }
        let m = msg(OP_DATA, len);
        self.post_write(&mut sgl[..n], inline, m, Some(m), addr, key)
    }

    /// `rs_write_direct`: `len` bytes into the peer's iomap entry at `raddr`.
    pub(super) fn write_direct(
        &mut self,
        len: u32,
        raddr: u64,
        rkey: u32,
        src_inline: Option<*const u8>,
        fill: &mut dyn FnMut(*mut u8, usize),
    ) -> Result<(), c_int> {
        let (mut sgl, n, inline) = self.stage(len, src_inline, fill);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= len;
        self.post_write(&mut sgl[..n], inline, msg(OP_WRITE, len), None, raddr, rkey)
    }

    /// Send the offers of `riomap` regions not yet sent (`rs_send_iomaps`); the caller
    /// has checked `can_send`.
    pub(super) fn send_one_iomap(&mut self, k: usize) -> Result<(), c_int> {
        let im = &self.iomaps[k];
        let index = im.index.expect("remote iomap");
        // SAFETY: the region is live.
        let (addr, len, rkey) =
            unsafe { ((*im.mr).addr as u64, (*im.mr).length as u32, (*im.mr).rkey) };
        let mut e = [0u8; IOMAP_BYTES];
        let sw = self.swap;
        let put64 = |v: u64| if sw { v.swap_bytes() } else { v }.to_ne_bytes();
        let put32 = |v: u32| if sw { v.swap_bytes() } else { v }.to_ne_bytes();
        e[0..8].copy_from_slice(&put64(im.offset));
        e[8..16].copy_from_slice(&put64(addr));
        e[16..20].copy_from_slice(&put32(rkey));
        e[20..24].copy_from_slice(&put32(len));
        let size = IOMAP_BYTES as u32;
        let (mut sgl, n, inline) = if self.cfg.sq_inline >= size {
            let s = sys::ibv_sge {
                addr: e.as_ptr() as u64,
                length: size,
                lkey: 0,
            };
            ([s, s], 1, true)
        } else {
            // The entry may wrap the send buffer: its two pieces in order.
            let mut off = 0usize;
            let mut fill = |dst: *mut u8, n: usize| {
                // SAFETY: `dst` has room for `n` bytes (stage); `off + n <= IOMAP_BYTES`.
                unsafe { ptr::copy_nonoverlapping(e.as_ptr().add(off), dst, n) };
                off += n;
            };
            self.stage(size, None, &mut fill)
        };
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= size;
        let raddr = self.remote_iomap.addr + index as u64 * IOMAP_BYTES as u64;
        let m = msg(OP_IOMAP_SGL, index as u32);
        let r = self.post_write(
            &mut sgl[..n],
            inline,
            m,
            Some(m),
            raddr,
            self.remote_iomap.key,
        );
        self.iomaps[k].sent = true;
        r
    }

    pub(super) fn remote_iomap_len(&self) -> u32 {
        self.remote_iomap.length
    }

    /// Copy up to `len` received bytes to `dst` (`rrecv`'s loop); `peek` leaves them.
    pub(super) fn read_data(&mut self, dst: *mut u8, len: usize, peek: bool) -> usize {
        let Some(b) = self.bufs.as_ref() else {
            return 0;
        };
        let base = b.rbuf.ptr();
        let size = self.cfg.rbuf_size as usize;
        let mut left = len;
        let mut out = dst;
        let mut off = self.rbuf_offset as usize;
        let mut i = 0;
        let mut consumed_msgs = 0;
        let mut partial = 0u32;
        while left > 0 && i < self.rmsg.len() {
            let avail = self.rmsg.get(i) as usize;
            let take = if left < avail {
                partial = left as u32;
                left
            } else {
                consumed_msgs += 1;
                i += 1;
                avail
            };
            let mut rem = take;
            while rem > 0 {
                let chunk = rem.min(size - off);
                // SAFETY: `off + chunk <= rbuf_size`; the bytes were written by the peer
                // before the completion that queued this message; `out` has room for
                // `len` bytes (the caller's buffer).
                unsafe { ptr::copy_nonoverlapping(base.add(off), out, chunk) };
                // SAFETY: within the caller's buffer.
                out = unsafe { out.add(chunk) };
                off += chunk;
                if off == size {
                    off = 0;
                }
                rem -= chunk;
            }
            left -= take;
            if partial > 0 {
                break;
            }
        }
        let done = len - left;
        if !peek {
            for _ in 0..consumed_msgs {
                self.rmsg.pop_front();
                self.rseq_no = self.rseq_no.wrapping_add(1);
            }
            if partial > 0 {
                if let Some(f) = self.rmsg.front_mut() {
                    *f -= partial;
                }
            }
            self.rbuf_offset = off as u32;
            self.rbuf_bytes_avail += done as u32;
        }
        done
    }

    /// Send a control message (shutdown or disconnect).
    pub(super) fn send_ctrl(&mut self, ctrl: u32) -> Result<(), c_int> {
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.post_msg(msg(OP_CTRL, ctrl))
    }

    /// A keepalive: a zero-length RDMA WRITE, when a control slot is free.
    pub(super) fn send_keepalive(&mut self) {
        if self.ctrl_avail() && self.state & st::CONNECTED != 0 {
            self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
            let m = msg(OP_CTRL, CTRL_KEEPALIVE);
            if let Err(e) = self.post_write(&mut [], false, m, None, 0, 0) {
                self.fail(e);
            }
        }
    }

    /// Move the QP to the error state, which flushes its queues (librdmacm's
    /// `ucma_shutdown` for RoCE).
    pub(super) fn flush(&mut self) {
        if self.qp().is_null() {
            return;
        }
        // SAFETY: the id is live.
        if let Some(me) = unsafe { cmid::id_of(self.id) } {
            let _ = cmqp::modify_qp_err(me);
        }
    }

    /// Release everything: the QP and CQ, the regions, the memory and the id.
    pub(super) fn free(&mut self) {
        if self.closed() {
            return;
        }
        // SAFETY: the id is live until here and used by nothing after; the QP is
        // destroyed before the regions it could still write, and the regions are
        // deregistered before their memory is freed.
        unsafe {
            if !(*self.id).qp.is_null() {
                cmqp::rdma_destroy_qp(self.id);
            } else if !(*self.id).recv_cq.is_null() {
                cq::ibv_destroy_cq((*self.id).recv_cq);
                cq::ibv_destroy_comp_channel((*self.id).recv_cq_channel);
                (*self.id).recv_cq = ptr::null_mut();
                (*self.id).send_cq = ptr::null_mut();
                (*self.id).recv_cq_channel = ptr::null_mut();
                (*self.id).send_cq_channel = ptr::null_mut();
            }
            for im in self.iomaps.drain(..) {
                mr::ibv_dereg_mr(im.mr);
            }
            if let Some(b) = self.bufs.take() {
                mr::ibv_dereg_mr(b.smr);
                mr::ibv_dereg_mr(b.tmr);
                mr::ibv_dereg_mr(b.rmr);
                drop(b);
            }
            cmid::rdma_destroy_id(self.id);
        }
        self.id = ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_round_trips_small_and_coarsens_large() {
        for v in 0..=128 {
            assert_eq!(scale_to_value(value_to_scale(v, 8), 8), v);
        }
        // 1024 in 8 bits: 0x80 | 1024 >> 8 = 0x84, read back as 4 << 8.
        assert_eq!(value_to_scale(1024, 8), 0x84);
        assert_eq!(scale_to_value(0x84, 8), 1024);
    }

    #[test]
    fn msg_ring_holds_its_size_in_order() {
        let mut r = MsgRing::new(3);
        assert!(r.push(1) && r.push(2) && r.push(3));
        assert!(!r.push(4), "full");
        assert_eq!((r.len(), r.get(0), r.get(2)), (3, 1, 3));
        r.pop_front();
        *r.front_mut().expect("two left") -= 1;
        assert!(r.push(5), "room again, wrapping");
        assert_eq!((r.len(), r.get(0), r.get(1), r.get(2)), (3, 1, 3, 5));
        assert!(!MsgRing::new(0).push(1));
    }

    /// A peer within its credits has at most `rq_size` messages unread; one more is a
    /// protocol error (EPROTO), and the records stay within the ring.
    #[test]
    fn data_past_the_credits_fails_the_connection() {
        let cfg = Config {
            rq_size: 16,
            ..Config::default()
        };
        let mut s = Stream::new(ptr::null_mut(), cfg);
        s.rmsg = MsgRing::new(usize::from(cfg.rq_size));
        s.state = st::CONNECT_RDWR;
        for i in 0..16 {
            assert!(s.take_data_msg(i), "message {i} within the credits");
        }
        assert_eq!(s.rmsg.len(), 16);
        assert_eq!(s.state, st::CONNECT_RDWR);
        for i in 0..1000 {
            assert!(!s.take_data_msg(i), "message {} past the credits", 16 + i);
            assert_eq!(s.rmsg.len(), 16);
        }
        assert_eq!((s.state, s.err), (st::ERROR, libc::EPROTO));
        assert_eq!(s.rmsg.buf.len(), 16, "the ring never grew");
    }

    #[test]
    fn messages_pack_op_and_data() {
        let m = msg(OP_SGL, 0x1234);
        assert_eq!(m, 0x8000_1234);
        assert_eq!(msg_op(m), OP_SGL);
        assert_eq!(msg_data(m), 0x1234);
        assert_eq!(msg(OP_CTRL, CTRL_SHUTDOWN), 0xE000_0002);
    }
}
