//! One connected stream rsocket's protocol, sans-IO: the buffers, credits, sequence
//! numbers and offers of rdma-core's rsockets (version 1), as a state machine that asks
//! for work requests ([`Conn::poll_post`]) and is told of completions
//! ([`Conn::on_completions`]). Its driver owns the QP, CQ and memory registrations and
//! waits; the faces (C `rsend`…, Rust `Read`/`Write`) sit on the driver.
//!
//! The protocol:
//! - Each side has a receive buffer registered for remote writes, offered in two halves.
//!   The connection data ([`ConnData`]) offers the first half, the receive credits (the
//!   receive queue's depth) and where the peer writes later offers (the target SGL, two
//!   16-byte entries, followed by the iomap table).
//! - Data is an RDMA WRITE WITH IMMEDIATE into the current offer, the immediate
//!   [`Msg::Data`] with the length; each uses one receive credit.
//! - A receiver that has drained half its buffer offers it again with a WRITE WITH
//!   IMMEDIATE of the entry into the peer's target SGL ([`Msg::Sgl`], which also grants
//!   credits up to a sequence number); with no half free, a bare immediate grants
//!   credits.
//! - Control messages ([`Msg::Ctrl`]) say DISCONNECT or SHUTDOWN; a keepalive is a
//!   zero-length RDMA WRITE.
//! - Direct writes (`riowrite`) are RDMA WRITEs into regions the peer offered in its
//!   iomap table ([`Msg::IomapSgl`] announces an entry).

use std::collections::VecDeque;

use softrdma_verbs::{RecvWr, SendFlags, SendOp, SendWr, Sge as VSge, WcStatus, WorkCompletion};
use softrdma_wire::rsocket::{ConnData, Ctrl, IomapEntry, Msg, Order, Sge, IOMAP_LEN, SGE_LEN};

use crate::config::{Config, SNDLOWAT};
use crate::region::Region;

/// The work request id of every receive (the receives carry no buffers: immediates only).
pub const RECV_WR_ID: u64 = 1 << 63;
/// The first data transfer of a send longer than [`MAX_TRANSFER`]; each next one is
/// twice the last, up to [`MAX_TRANSFER`] ([`TransferSizes`]).
pub const FIRST_TRANSFER: u32 = 2048;
/// The largest data transfer.
pub const MAX_TRANSFER: u32 = 65536;
/// Control messages outstanding at once (a power of two).
const CTRL_SIZE: u32 = 4;
/// Entries of the target SGL (the halves of the peer's receive buffer).
const SGL_SIZE: usize = 2;

/// A work request the connection asks its driver to post on its QP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Post {
    /// A send queue work request (an RDMA WRITE, with or without immediate).
    Send(SendWr),
    /// A receive (no buffers).
    Recv(RecvWr),
}

/// The keys of the connection's three regions, from the driver's registrations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Keys {
    /// The send buffer's lkey (registered for local access).
    pub send_lkey: u32,
    /// The target buffer's rkey (registered for remote write).
    pub target_rkey: u32,
    /// The receive buffer's rkey (registered for remote write).
    pub recv_rkey: u32,
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Buffers made, the peer's connection data not yet taken.
    Ready,
    /// Connected: data may flow in the directions [`Conn::readable`] and
    /// [`Conn::writable`] say.
    Connected,
    /// Closed by either side (or the peer shut down both ways).
    Disconnected,
    /// Failed with this errno (EIO: a work request failed; EPROTO: the peer broke the
    /// protocol; others: a post failed).
    Failed(i32),
}

/// Which directions a shutdown closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// No more reads.
    Read,
    /// No more writes.
    Write,
    /// Neither.
    Both,
}

/// The sizes of one send's data transfers: all its bytes in one when they fit in
/// [`MAX_TRANSFER`]; else from [`FIRST_TRANSFER`], each twice the last, up to
/// [`MAX_TRANSFER`].
///
/// rdma-core's rsockets start every send at 2 KiB and double, so that the NIC starts
/// moving the first bytes while the CPU copies the next into the send buffer. softrdma
/// has that overlap only for a send of several transfers: on the same-host path the
/// first one (under the 4 KiB placement size) goes as packets, the placed ones behind it
/// wait for its acknowledgement, and the device's progress thread that takes the
/// acknowledgement copies them into the peer's memory while this thread copies the rest
/// of the send into the send buffer (a 1 MiB ping-pong takes about a fifth longer in
/// 64 KiB transfers from the start). A send that fits in one transfer has nothing to
/// overlap and would pay that round trip in full: a 64 KiB send was six transfers, the
/// placed ones a round trip behind the first. The sizes are the sender's choice: a
/// receiver takes any length within its offer.
#[derive(Debug, Clone, Copy)]
pub struct TransferSizes(u32);

impl TransferSizes {
    /// The sizes for a send of `len` bytes.
    pub fn new(len: usize) -> TransferSizes {
        if len <= MAX_TRANSFER as usize {
            TransferSizes(MAX_TRANSFER)
        } else {
            TransferSizes(FIRST_TRANSFER)
        }
    }

    /// The size of the next transfer with `left` bytes to go.
    pub fn next(&mut self, left: usize) -> u32 {
        if (self.0 as usize) < left {
            let x = self.0;
            if self.0 < MAX_TRANSFER {
                self.0 <<= 1;
            }
            x
        } else {
            left as u32
        }
    }
}

/// The result of a transfer loop that may stop part way: the bytes moved, or the error
/// when none moved (as `send(2)` reports a short send).
pub fn partial_result(done: usize, err: Option<i32>) -> Result<usize, i32> {
    match err {
        Some(e) if done == 0 => Err(e),
        _ => Ok(done),
    }
}

/// A region offered for direct writes, or mapped for local use only (`index` None).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalIomap {
    /// Its entry in the peer's iomap table.
    pub index: Option<usize>,
    /// The offset the peer's writes name.
    pub offset: u64,
    /// The registered region.
    pub sge: Sge,
    /// Its entry went to the peer.
    pub sent: bool,
}

/// The lengths of the data messages received and not yet read, oldest first: a ring
/// of the receive queue's depth (what a peer within its credits can have unread), so a
/// peer that ignores its credits cannot grow it.
#[derive(Debug)]
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
    fn push(&mut self, v: u32) -> bool {
        if self.len == self.buf.len() {
            return false;
        }
        let i = (self.head + self.len) % self.buf.len();
        self.buf[i] = v;
        self.len += 1;
        true
    }
    fn get(&self, i: usize) -> u32 {
        self.buf[(self.head + i) % self.buf.len()]
    }
    fn front_mut(&mut self) -> Option<&mut u32> {
        (self.len > 0).then(|| &mut self.buf[self.head])
    }
    fn pop_front(&mut self) {
        if self.len > 0 {
            self.head = (self.head + 1) % self.buf.len();
            self.len -= 1;
        }
    }
}

/// One stream rsocket's protocol state and buffers.
#[derive(Debug)]
pub struct Conn {
    cfg: Config,
    phase: Phase,
    readable: bool,
    writable: bool,
    /// The order the peer reads offers and iomap entries in.
    peer_order: Order,
    keys: Keys,
    /// The send buffer, then `CTRL_SIZE` 16-byte slots for control entries.
    sbuf: Region,
    /// The target SGL (the peer's offers) then the iomap table, written by the peer.
    target: Region,
    rbuf: Region,

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
    rmsg: MsgRing,
    iomaps: Vec<LocalIomap>,
    posts: VecDeque<Post>,
}

impl Conn {
    /// A connection's buffers for `cfg` (whose depths already fit the device: see
    /// [`Config::fit_device`]); ENOMEM when memory is short. Its first posts fill the
    /// receive queue: post them once the QP is made (in INIT), before the connection
    /// data goes, so that the peer's first messages find receives.
    pub fn new(cfg: Config) -> Result<Conn, i32> {
        let region = |n: usize| Region::new(n).ok_or(libc::ENOMEM);
        let sbuf = region(cfg.sbuf_size as usize + SGE_LEN * CTRL_SIZE as usize)?;
        let target = region(SGE_LEN * SGL_SIZE + IOMAP_LEN * usize::from(cfg.iomap_size))?;
        let rbuf = region(cfg.rbuf_size as usize)?;
        let mut c = Conn {
            cfg,
            phase: Phase::Ready,
            readable: false,
            writable: false,
            peer_order: Order::NATIVE,
            keys: Keys::default(),
            sbuf,
            target,
            rbuf,
            ctrl_seqno: 0,
            ctrl_max_seqno: CTRL_SIZE,
            sseq_no: 0,
            sseq_comp: 0,
            rseq_no: 0,
            rseq_comp: cfg.rq_size >> 1,
            remote_sge: 0,
            remote_sgl: Sge::default(),
            remote_iomap: Sge::default(),
            target_sge: 0,
            rbuf_bytes_avail: cfg.rbuf_size >> 1,
            rbuf_free_offset: cfg.rbuf_size >> 1,
            rbuf_offset: 0,
            sbuf_bytes_avail: cfg.sbuf_size,
            spos: 0,
            sqe_avail: i32::from(cfg.sq_size) - CTRL_SIZE as i32,
            rmsg: MsgRing::new(usize::from(cfg.rq_size)),
            iomaps: Vec::new(),
            posts: VecDeque::new(),
        };
        for _ in 0..cfg.rq_size {
            c.post_recv();
        }
        Ok(c)
    }

    /// The sizes it was made with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The regions to register: the send buffer (local access), the target buffer and
    /// the receive buffer (remote write). Tell the keys with [`Conn::set_keys`].
    pub fn regions(&self) -> [&Region; 3] {
        [&self.sbuf, &self.target, &self.rbuf]
    }

    /// The keys of the registrations of [`Conn::regions`].
    pub fn set_keys(&mut self, keys: Keys) {
        self.keys = keys;
    }

    /// The connection data this side offers (rsockets' `rs_format_conn_data`).
    pub fn conn_data(&self) -> ConnData {
        ConnData {
            net_order: Order::NATIVE == Order::Big,
            iomap: true,
            credits: self.cfg.rq_size,
            iomap_size: u32::from(self.cfg.iomap_size),
            target_sgl: Sge {
                addr: self.target.addr(),
                key: self.keys.target_rkey,
                length: SGL_SIZE as u32,
            },
            data_buf: Sge {
                addr: self.rbuf.addr(),
                key: self.keys.recv_rkey,
                length: self.cfg.rbuf_size >> 1,
            },
        }
    }

    /// Take the peer's connection data (rsockets' `rs_save_conn_data`): the connection
    /// is up in both directions.
    pub fn start(&mut self, peer: &ConnData) {
        self.remote_sgl = peer.target_sgl;
        self.remote_sge = 1 % peer.target_sgl.length.max(1);
        self.peer_order = peer.order();
        if peer.iomap {
            self.remote_iomap = Sge {
                addr: peer.target_sgl.addr + SGE_LEN as u64 * u64::from(peer.target_sgl.length),
                key: peer.target_sgl.key,
                length: peer.iomap_size,
            };
        }
        self.target
            .write_volatile(0, peer.data_buf.emit(Order::NATIVE));
        self.sseq_comp = peer.credits;
        self.phase = Phase::Connected;
        self.readable = true;
        self.writable = true;
    }

    /// The next work request to post, oldest first.
    pub fn poll_post(&mut self) -> Option<Post> {
        self.posts.pop_front()
    }

    /// Where it is.
    pub fn phase(&self) -> Phase {
        self.phase
    }
    /// Connected (whatever the directions).
    pub fn is_connected(&self) -> bool {
        self.phase == Phase::Connected
    }
    /// Connected and the peer may still send.
    pub fn readable(&self) -> bool {
        self.is_connected() && self.readable
    }
    /// Connected and this side may still send.
    pub fn writable(&self) -> bool {
        self.is_connected() && self.writable
    }
    /// The errno of a failure.
    pub fn error(&self) -> Option<i32> {
        match self.phase {
            Phase::Failed(e) => Some(e),
            _ => None,
        }
    }

    /// The connection failed with `errno` (a post failed, the peer is gone).
    pub fn fail(&mut self, errno: i32) {
        self.phase = Phase::Failed(errno);
        self.readable = false;
        self.writable = false;
    }

    /// The CM reported the connection closed.
    pub fn disconnected(&mut self) {
        if self.is_connected() {
            self.set_disconnected();
        }
    }

    fn set_disconnected(&mut self) {
        self.phase = Phase::Disconnected;
        self.readable = false;
        self.writable = false;
    }

    fn post_recv(&mut self) {
        self.posts.push_back(Post::Recv(RecvWr {
            wr_id: RECV_WR_ID,
            sg_list: Vec::new(),
        }));
    }

    /// Queue an RDMA WRITE (`imm` None) or WRITE WITH IMMEDIATE of `local` (pieces of
    /// the send buffer) to `addr`/`rkey`; `msg` names it in its completion.
    fn post_write(
        &mut self,
        local: &[(u32, u32)],
        inline: bool,
        msg: Msg,
        imm: Option<u32>,
        addr: u64,
        rkey: u32,
    ) {
        let lkey = self.keys.send_lkey;
        let base = self.sbuf.addr();
        let sg_list = local
            .iter()
            .map(|&(off, len)| VSge {
                addr: base + u64::from(off),
                length: len,
                lkey,
            })
            .collect();
        let op = match imm {
            Some(imm) => SendOp::WriteWithImm {
                remote_addr: addr,
                rkey,
                imm,
            },
            None => SendOp::Write {
                remote_addr: addr,
                rkey,
            },
        };
        let mut flags = SendFlags::SIGNALED;
        if inline {
            flags |= SendFlags::INLINE;
        }
        self.posts.push_back(Post::Send(SendWr {
            wr_id: u64::from(msg.to_imm()),
            op,
            flags,
            sg_list,
            inline_data: None,
            ud: None,
        }));
    }

    /// A bare message: a WRITE WITH IMMEDIATE of nothing.
    fn post_msg(&mut self, m: Msg) {
        self.post_write(&[], false, m, Some(m.to_imm()), 0, 0);
    }

    /// A control message may go now.
    pub fn ctrl_avail(&self) -> bool {
        self.ctrl_seqno != self.ctrl_max_seqno
    }

    /// rsockets' `rs_send_credits`: offer the next half of the receive buffer if it is
    /// free, and grant receive credits.
    fn send_credits(&mut self) {
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.rseq_comp = self.rseq_no.wrapping_add(self.cfg.rq_size >> 1);
        let grant = Msg::Sgl(self.rseq_no.wrapping_add(self.cfg.rq_size));
        let half = self.cfg.rbuf_size >> 1;
        if self.rbuf_bytes_avail >= half {
            let offer = Sge {
                addr: self.rbuf.addr() + u64::from(self.rbuf_free_offset),
                key: self.keys.recv_rkey,
                length: half,
            };
            let slot = self.ctrl_slot(&offer.emit(self.peer_order));
            let raddr = self.remote_sgl.addr + u64::from(self.remote_sge) * SGE_LEN as u64;
            let inline = self.cfg.sq_inline as usize >= SGE_LEN;
            let key = self.remote_sgl.key;
            self.post_write(&[slot], inline, grant, Some(grant.to_imm()), raddr, key);
            self.rbuf_bytes_avail -= half;
            self.rbuf_free_offset += half;
            if self.rbuf_free_offset >= self.cfg.rbuf_size {
                self.rbuf_free_offset = 0;
            }
            self.remote_sge += 1;
            if self.remote_sge == self.remote_sgl.length {
                self.remote_sge = 0;
            }
        } else {
            self.post_msg(grant);
        }
    }

    /// Copy a control entry to its slot after the send buffer (one per outstanding
    /// control message): `(offset, length)` in the send buffer.
    fn ctrl_slot(&mut self, bytes: &[u8]) -> (u32, u32) {
        let slot = self.ctrl_seqno & (CTRL_SIZE - 1);
        let off = self.cfg.sbuf_size + slot * SGE_LEN as u32;
        self.sbuf.write(off as usize, bytes);
        (off, bytes.len() as u32)
    }

    fn give_credits(&self) -> bool {
        let half = self.cfg.rbuf_size >> 1;
        (self.rbuf_bytes_avail >= half || (self.rseq_no.wrapping_sub(self.rseq_comp) as i16) >= 0)
            && self.ctrl_avail()
            && self.is_connected()
    }

    /// Grant credits and offer buffer if the reader has made room (rsockets call this
    /// around every completion pass and after every read).
    pub fn update_credits(&mut self) {
        if self.give_credits() {
            self.send_credits();
        }
    }

    /// Take a batch of completions of the connection's CQ (rsockets' `rs_poll_cq`), then
    /// repost the receives they used. Err(EPROTO) when the peer broke the protocol (sent
    /// more data messages than its credits allow): the connection has failed and the
    /// driver ends it (its QP to error, a DREQ to the peer), as a TCP reset would.
    /// Completions after a DISCONNECT in the batch are not looked at.
    pub fn on_completions(&mut self, wcs: &[WorkCompletion]) -> Result<(), i32> {
        let mut received = 0u32;
        for wc in wcs {
            if wc.wr_id & RECV_WR_ID != 0 {
                if wc.status != WcStatus::Success {
                    continue;
                }
                received += 1;
                if !wc.wc_flags.contains(softrdma_verbs::WcFlags::WITH_IMM) {
                    continue;
                }
                match Msg::from_imm(wc.imm_data) {
                    Msg::Sgl(seq) => self.sseq_comp = seq,
                    Msg::IomapSgl(_) | Msg::Write(_) => {}
                    Msg::Ctrl(Ctrl::Disconnect) => {
                        self.set_disconnected();
                        break;
                    }
                    Msg::Ctrl(Ctrl::Shutdown) => {
                        if self.writable {
                            self.readable = false;
                        } else {
                            self.set_disconnected();
                            break;
                        }
                    }
                    Msg::Ctrl(_) => {}
                    Msg::Data(len) | Msg::Reserved(_, len) => {
                        if !self.rmsg.push(len) {
                            self.fail(libc::EPROTO);
                            return Err(libc::EPROTO);
                        }
                    }
                }
            } else {
                match Msg::from_imm(wc.wr_id as u32) {
                    Msg::Sgl(_) => self.ctrl_max_seqno = self.ctrl_max_seqno.wrapping_add(1),
                    Msg::Ctrl(c) => {
                        self.ctrl_max_seqno = self.ctrl_max_seqno.wrapping_add(1);
                        if c == Ctrl::Disconnect {
                            self.set_disconnected();
                        }
                    }
                    Msg::IomapSgl(_) => {
                        self.sqe_avail += 1;
                        self.sbuf_bytes_avail += IOMAP_LEN as u32;
                    }
                    Msg::Data(n) | Msg::Write(n) | Msg::Reserved(_, n) => {
                        self.sqe_avail += 1;
                        self.sbuf_bytes_avail += n;
                    }
                }
                if wc.status != WcStatus::Success && self.is_connected() {
                    self.fail(libc::EIO);
                }
            }
        }
        if self.is_connected() {
            for _ in 0..received {
                self.post_recv();
            }
        }
        Ok(())
    }

    fn target_offer(&self, i: usize) -> Sge {
        let b = self.target.read_volatile::<SGE_LEN>(i * SGE_LEN);
        Sge::parse(&b, Order::NATIVE).unwrap_or_default()
    }

    /// Bytes the current offer has room for (0: wait for the peer's next offer).
    pub fn target_room(&self) -> u32 {
        self.target_offer(self.target_sge).length
    }

    /// A data message may go now (a send queue entry, send buffer, a credit and an
    /// offer).
    pub fn can_send(&self) -> bool {
        self.is_connected()
            && self.sqe_avail > 0
            && self.sbuf_bytes_avail >= SNDLOWAT
            && self.sseq_no != self.sseq_comp
            && self.target_room() != 0
    }

    /// Data messages received and not yet read.
    pub fn unread_msgs(&self) -> usize {
        self.rmsg.len
    }

    /// Received bytes wait to be read.
    pub fn have_rdata(&self) -> bool {
        self.rmsg.len > 0
    }

    /// Every work request posted has completed (or the connection is down).
    pub fn all_sends_done(&self) -> bool {
        self.ctrl_max_seqno.wrapping_sub(self.ctrl_seqno) as i32 + self.sqe_avail
            == i32::from(self.cfg.sq_size)
            || !self.is_connected()
    }

    /// Stage `len` bytes from `src` in the send buffer (in two pieces where it wraps),
    /// taking a send queue entry and `len` bytes of the buffer until the send completes:
    /// the pieces and whether they go inline.
    fn stage(&mut self, len: u32, src: &mut dyn FnMut(&mut [u8])) -> (Vec<(u32, u32)>, bool) {
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= len;
        let size = self.cfg.sbuf_size;
        let first = len.min(size - self.spos);
        self.sbuf
            .fill(self.spos as usize, first as usize, &mut *src);
        let mut pieces = vec![(self.spos, first)];
        if first == len {
            self.spos += len;
            if self.spos == size {
                self.spos = 0;
            }
        } else {
            let rest = len - first;
            self.sbuf.fill(0, rest as usize, &mut *src);
            pieces.push((0, rest));
            self.spos = rest;
        }
        (pieces, len <= self.cfg.sq_inline)
    }

    /// rsockets' `rs_write_data`: one data message of at most `want` bytes (within the
    /// send buffer and the current offer), filled by `src` (called once, or twice where
    /// the send buffer wraps, with the next bytes' destination). The bytes queued; 0
    /// when [`Conn::can_send`] does not hold.
    pub fn send_data(&mut self, want: u32, src: &mut dyn FnMut(&mut [u8])) -> u32 {
        if !self.can_send() || !self.writable {
            return 0;
        }
        let room = self.target_room();
        let len = want.min(self.sbuf_bytes_avail).min(room);
        if len == 0 {
            return 0;
        }
        let (pieces, inline) = self.stage(len, src);
        self.sseq_no = self.sseq_no.wrapping_add(1);
        let t = self.target_offer(self.target_sge);
        let rest = Sge {
            addr: t.addr + u64::from(len),
            key: t.key,
            length: t.length - len,
        };
        self.target
            .write_volatile(self.target_sge * SGE_LEN, rest.emit(Order::NATIVE));
        if rest.length == 0 {
            self.target_sge = (self.target_sge + 1) % SGL_SIZE;
        }
        let m = Msg::Data(len);
        self.post_write(&pieces, inline, m, Some(m.to_imm()), t.addr, t.key);
        len
    }

    /// Copy up to `dst.len()` received bytes into `dst` (`rrecv`); `peek` leaves them
    /// to be read again. Call [`Conn::update_credits`] after.
    pub fn recv(&mut self, dst: &mut [u8], peek: bool) -> usize {
        let size = self.cfg.rbuf_size as usize;
        let len = dst.len();
        let mut left = len;
        let mut off = self.rbuf_offset as usize;
        let mut i = 0;
        let mut consumed = 0;
        let mut partial = 0u32;
        while left > 0 && i < self.rmsg.len {
            let avail = self.rmsg.get(i) as usize;
            let take = if left < avail {
                partial = left as u32;
                left
            } else {
                consumed += 1;
                i += 1;
                avail
            };
            let mut rem = take;
            while rem > 0 {
                let chunk = rem.min(size - off);
                let at = len - left + (take - rem);
                self.rbuf.read(off, &mut dst[at..at + chunk]);
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
            for _ in 0..consumed {
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

    /// What closing the directions of `how` sends the peer, with the socket's
    /// directions updated (rsockets' `rshutdown`): DISCONNECT once neither is open,
    /// SHUTDOWN when only this side's writing ends. Send it with [`Conn::send_ctrl`]
    /// once [`Conn::ctrl_avail`] holds. None when nothing is to be said (or the
    /// connection is down).
    pub fn shutdown(&mut self, how: Shutdown) -> Option<Ctrl> {
        if !self.is_connected() {
            return None;
        }
        match how {
            Shutdown::Both => {
                self.readable = false;
                self.writable = false;
                Some(Ctrl::Disconnect)
            }
            Shutdown::Write => {
                self.writable = false;
                Some(if self.readable {
                    Ctrl::Shutdown
                } else {
                    Ctrl::Disconnect
                })
            }
            Shutdown::Read => {
                self.readable = false;
                (!self.writable).then_some(Ctrl::Disconnect)
            }
        }
    }

    /// Queue a control message (when [`Conn::ctrl_avail`]; false otherwise).
    pub fn send_ctrl(&mut self, c: Ctrl) -> bool {
        if !self.ctrl_avail() || !self.is_connected() {
            return false;
        }
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.post_msg(Msg::Ctrl(c));
        true
    }

    /// A keepalive: a zero-length RDMA WRITE, which a peer that is gone fails with an
    /// error completion. Queued when a control slot is free.
    pub fn send_keepalive(&mut self) {
        if self.ctrl_avail() && self.is_connected() {
            self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
            let m = Msg::Ctrl(Ctrl::Keepalive);
            self.post_write(&[], false, m, None, 0, 0);
        }
    }

    /// The local iomaps (`riomap`).
    pub fn iomaps(&self) -> &[LocalIomap] {
        &self.iomaps
    }

    /// Map a registered region for the peer's direct writes at `offset`: its entry goes
    /// at the free index (or `index` when it is free) of the peer's table, with the next
    /// send. None when the table is full or `index` taken (ENOMEM / EBUSY for the face).
    pub fn map_iomap(&mut self, offset: u64, sge: Sge, index: Option<usize>) -> Result<usize, i32> {
        let size = self.remote_iomap.length as usize;
        let taken = |i: usize| self.iomaps.iter().any(|m| m.index == Some(i));
        let i = match index {
            Some(i) if i >= size => return Err(libc::EINVAL),
            Some(i) if taken(i) => return Err(libc::EBUSY),
            Some(i) => i,
            None => (0..size).find(|&i| !taken(i)).ok_or(libc::ENOMEM)?,
        };
        self.iomaps.push(LocalIomap {
            index: Some(i),
            offset,
            sge,
            sent: false,
        });
        Ok(i)
    }

    /// Drop the iomap of the region at `addr`; it is returned.
    pub fn unmap_iomap(&mut self, addr: u64) -> Option<LocalIomap> {
        let k = self.iomaps.iter().position(|m| m.sge.addr == addr)?;
        Some(self.iomaps.remove(k))
    }

    /// An iomap entry not yet sent.
    pub fn iomap_to_send(&self) -> Option<usize> {
        self.iomaps
            .iter()
            .position(|m| m.index.is_some() && !m.sent)
    }

    /// Send iomap `k`'s entry (rsockets' `rs_send_iomaps`, one entry): when
    /// [`Conn::can_send`] holds; false otherwise.
    pub fn send_iomap(&mut self, k: usize) -> bool {
        if !self.can_send() {
            return false;
        }
        let Some(im) = self.iomaps.get(k).copied() else {
            return false;
        };
        let Some(index) = im.index else { return false };
        let e = IomapEntry {
            offset: im.offset,
            sge: im.sge,
        }
        .emit(self.peer_order);
        let mut off = 0;
        let (pieces, inline) = self.stage(IOMAP_LEN as u32, &mut |dst: &mut [u8]| {
            dst.copy_from_slice(&e[off..off + dst.len()]);
            off += dst.len();
        });
        self.sseq_no = self.sseq_no.wrapping_add(1);
        let raddr = self.remote_iomap.addr + index as u64 * IOMAP_LEN as u64;
        let m = Msg::IomapSgl(index as u32);
        let key = self.remote_iomap.key;
        self.post_write(&pieces, inline, m, Some(m.to_imm()), raddr, key);
        self.iomaps[k].sent = true;
        true
    }

    /// The peer's iomap entry that holds `offset`, as its table in this side's target
    /// buffer says now.
    pub fn peer_iomap(&self, offset: u64) -> Option<IomapEntry> {
        (0..usize::from(self.cfg.iomap_size))
            .map(|i| {
                let b = self
                    .target
                    .read_volatile::<IOMAP_LEN>(SGE_LEN * SGL_SIZE + i * IOMAP_LEN);
                IomapEntry::parse(&b, Order::NATIVE).unwrap_or_default()
            })
            .find(|e| offset >= e.offset && offset - e.offset < u64::from(e.sge.length))
    }

    /// rsockets' `rs_write_direct`: at most `want` bytes (within the send buffer and
    /// the peer's region holding `offset`) to that region, filled by `src`. The bytes
    /// queued; 0 when nothing can go now (Err(EINVAL)... none: see
    /// [`Conn::peer_iomap`]).
    pub fn write_direct(
        &mut self,
        offset: u64,
        want: u32,
        src: &mut dyn FnMut(&mut [u8]),
    ) -> Option<u32> {
        let e = self.peer_iomap(offset)?;
        if !self.can_send() {
            return Some(0);
        }
        let room = (e.offset + u64::from(e.sge.length) - offset).min(u64::from(u32::MAX)) as u32;
        let len = want.min(self.sbuf_bytes_avail).min(room);
        if len == 0 {
            return Some(0);
        }
        let (pieces, inline) = self.stage(len, src);
        let raddr = e.sge.addr + (offset - e.offset);
        self.post_write(&pieces, inline, Msg::Write(len), None, raddr, e.sge.key);
        Some(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_sends_transfers_double_up_to_the_largest() {
        let mut t = TransferSizes::new(1 << 20);
        let sizes: Vec<u32> = (0..8).map(|_| t.next(1 << 20)).collect();
        assert_eq!(sizes, [2048, 4096, 8192, 16384, 32768, 65536, 65536, 65536]);
        assert_eq!(TransferSizes::new(1 << 20).next(100), 100);
    }

    /// A send that fits in one transfer is one data message, one WRITE WITH IMMEDIATE of
    /// all its bytes (which the same-host path places whole), not a 2 KiB one and its
    /// doublings.
    #[test]
    fn a_64k_send_is_one_write_with_immediate() {
        assert_eq!(TransferSizes::new(4096).next(4096), 4096);
        let mut c = Conn::new(small()).unwrap();
        c.start(&c.conn_data());
        while c.poll_post().is_some() {}
        let want = TransferSizes::new(65536).next(65536);
        let n = c.send_data(want, &mut |d: &mut [u8]| d.fill(7));
        assert_eq!(n, 65536);
        let Some(Post::Send(wr)) = c.poll_post() else {
            panic!("no send posted");
        };
        let len: u32 = wr.sg_list.iter().map(|s| s.length).sum();
        assert_eq!(len, 65536);
        assert!(
            matches!(wr.op, SendOp::WriteWithImm { imm, .. } if imm == Msg::Data(65536).to_imm())
        );
        assert!(c.poll_post().is_none());
    }

    #[test]
    fn a_partial_result_is_the_bytes_moved_unless_none() {
        assert_eq!(partial_result(5, Some(libc::EAGAIN)), Ok(5));
        assert_eq!(partial_result(0, Some(libc::EAGAIN)), Err(libc::EAGAIN));
        assert_eq!(partial_result(0, None), Ok(0));
    }

    fn small() -> Config {
        Config {
            rq_size: 16,
            sq_size: 16,
            ..Config::RSOCKETS
        }
    }

    fn recv_imm(m: Msg) -> WorkCompletion {
        WorkCompletion {
            wr_id: RECV_WR_ID,
            imm_data: m.to_imm(),
            wc_flags: softrdma_verbs::WcFlags::WITH_IMM,
            ..WorkCompletion::default()
        }
    }

    /// A peer within its credits has at most `rq_size` messages unread; one more is a
    /// protocol error (EPROTO), and the records stay within the ring.
    #[test]
    fn data_past_the_credits_fails_the_connection() {
        let mut c = Conn::new(small()).unwrap();
        c.start(&c.conn_data());
        let wcs: Vec<_> = (0..16).map(|i| recv_imm(Msg::Data(i))).collect();
        assert_eq!(c.on_completions(&wcs), Ok(()));
        assert_eq!(c.unread_msgs(), 16);
        assert!(c.is_connected());
        assert_eq!(
            c.on_completions(&[recv_imm(Msg::Data(1))]),
            Err(libc::EPROTO)
        );
        assert_eq!(c.unread_msgs(), 16);
        assert_eq!(c.phase(), Phase::Failed(libc::EPROTO));
        assert_eq!(c.rmsg.buf.len(), 16, "the ring never grew");
    }

    #[test]
    fn a_new_connection_fills_its_receive_queue_and_a_started_one_may_send() {
        let mut c = Conn::new(small()).unwrap();
        c.set_keys(Keys {
            send_lkey: 1,
            target_rkey: 2,
            recv_rkey: 3,
        });
        let d = c.conn_data();
        assert_eq!((d.credits, d.target_sgl.key, d.data_buf.key), (16, 2, 3));
        assert_eq!(d.data_buf.length, c.config().rbuf_size / 2);
        assert_eq!(d.target_sgl.addr, c.regions()[1].addr());
        let mut recvs = 0;
        while let Some(p) = c.poll_post() {
            assert!(matches!(p, Post::Recv(_)));
            recvs += 1;
        }
        assert_eq!(recvs, 16);
        assert!(!c.can_send(), "no peer yet");
        c.start(&d);
        assert!(c.poll_post().is_none(), "the receives went before");
        assert!(
            c.can_send(),
            "the peer's first offer and credits are in place"
        );
        assert_eq!(c.target_room(), c.config().rbuf_size / 2);
    }
}
