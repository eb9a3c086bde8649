//! A stream rsocket of the C face: its synchronous CM id, the C objects of its connection
//! (completion channel, CQ, RC QP, the registrations of the protocol's buffers), its
//! socket state and options, and the rsockets protocol it drives, which is the
//! `softrdma-rsocket` crate's ([`Conn`]): this file posts what the protocol asks, feeds it
//! the CQ's completions, and translates its state into the socket's.

use std::ffi::{c_int, c_void};
use std::ptr;

use softrdma_device::verbs::WorkCompletion;
use softrdma_rsocket::conn::{Keys, Phase, Post, Shutdown};
use softrdma_rsocket::{Config, Conn};
use softrdma_wire::rsocket::{ConnData, Ctrl, IomapEntry, Sge};

use super::super::abi;
use super::super::id as cmid;
use super::super::qp as cmqp;
use crate::cq::Cq;
use crate::object::obj;
use crate::qp::Qp;
use crate::{cq, device, mr, sys, zeroed};

/// Where a socket is in its life before (and once) its connection runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Stage {
    /// Made, nothing else.
    Init,
    /// Bound to an address.
    Bound,
    /// Listening (its accept thread answers requests).
    Listening,
    /// `rconnect`: resolving the address.
    ResolvingAddr,
    /// Resolving the route.
    ResolvingRoute,
    /// The request went; waiting for the answer.
    Connecting,
    /// Answered by a listener; waiting for the requester's RTU.
    Accepting,
    /// Connected: the protocol ([`Conn::phase`]) says how it goes on.
    Open,
    /// The connect failed (the error is in SO_ERROR).
    ConnectError,
}

/// One stream rsocket.
pub(super) struct Stream {
    pub id: *mut abi::rdma_cm_id,
    pub stage: Stage,
    /// SO_ERROR.
    pub err: c_int,
    /// The protocol's failure was given to SO_ERROR already.
    err_taken: bool,
    pub fs_flags: c_int,
    pub fd_flags: c_int,
    pub cfg: Config,
    pub so_opts: u64,
    pub tcp_opts: u64,
    pub ipv6_opts: u64,
    pub ipv4_tos: c_int,
    pub keepalive_time: u32,
    /// A route given with RDMA_ROUTE, used by the next connect.
    pub route: Option<Vec<u8>>,
    pub retries: u32,
    conn: Option<Conn>,
    /// The registrations of the protocol's send, target and receive buffers.
    mrs: [*mut sys::ibv_mr; 3],
    pub cq_armed: bool,
    /// The regions `riomap` registered, by address.
    iomap_mrs: Vec<*mut sys::ibv_mr>,
}

// SAFETY: the raw pointers are this library's objects (CM id, CQ, MRs) and memory the
// protocol core owns; every use is under the socket's mutex.
unsafe impl Send for Stream {}

impl Stream {
    /// A socket on `id` (already made), with `cfg`'s sizes.
    pub(super) fn new(id: *mut abi::rdma_cm_id, cfg: Config) -> Stream {
        Stream {
            id,
            stage: Stage::Init,
            err: 0,
            err_taken: false,
            fs_flags: 0,
            fd_flags: 0,
            cfg,
            so_opts: 0,
            tcp_opts: 0,
            ipv6_opts: 0,
            ipv4_tos: 0,
            keepalive_time: 0,
            route: None,
            retries: 0,
            conn: None,
            mrs: [ptr::null_mut(); 3],
            cq_armed: false,
            iomap_mrs: Vec::new(),
        }
    }

    /// `rclose` freed it (a thread that was waiting in it must not go on).
    pub(super) fn closed(&self) -> bool {
        self.id.is_null()
    }

    /// It has its QP and buffers.
    pub(super) fn has_ep(&self) -> bool {
        self.conn.is_some()
    }

    /// Its connect is under way.
    pub(super) fn opening(&self) -> bool {
        matches!(
            self.stage,
            Stage::ResolvingAddr | Stage::ResolvingRoute | Stage::Connecting | Stage::Accepting
        )
    }

    fn phase(&self) -> Option<Phase> {
        (self.stage == Stage::Open)
            .then(|| self.conn.as_ref().map(Conn::phase))
            .flatten()
    }

    /// Connected (whatever the directions).
    pub(super) fn connected(&self) -> bool {
        self.phase() == Some(Phase::Connected)
    }
    /// Connected and the peer may still send.
    pub(super) fn readable(&self) -> bool {
        self.stage == Stage::Open && self.conn.as_ref().is_some_and(Conn::readable)
    }
    /// Connected and this side may still send.
    pub(super) fn writable(&self) -> bool {
        self.stage == Stage::Open && self.conn.as_ref().is_some_and(Conn::writable)
    }
    /// Closed by either side.
    pub(super) fn disconnected(&self) -> bool {
        self.phase() == Some(Phase::Disconnected)
    }
    /// The connection failed.
    pub(super) fn failed(&self) -> bool {
        matches!(self.phase(), Some(Phase::Failed(_)))
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

    /// rsockets' `rs_create_ep`: the CQ and its channel, the RC QP, the protocol's
    /// buffers registered, and its receive queue filled.
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
                attr.max_qp_wr.max(0) as u32
            } else {
                u32::from(softrdma_rsocket::config::QP_MAX)
            };
            self.cfg.fit_device(max);
            let ch = cq::ibv_create_comp_channel(verbs);
            if ch.is_null() {
                return Err(crate::errno_now());
            }
            // Waits poll the fd and then take the event without blocking.
            let fl = libc::fcntl((*ch).fd, libc::F_GETFL);
            libc::fcntl((*ch).fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            let depth = self.cfg.cq_depth() as c_int;
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
            let cap = self.cfg.qp_cap();
            qa.cap.max_send_wr = cap.max_send_wr;
            qa.cap.max_recv_wr = cap.max_recv_wr;
            qa.cap.max_send_sge = cap.max_send_sge;
            qa.cap.max_recv_sge = cap.max_recv_sge;
            qa.cap.max_inline_data = cap.max_inline_data;
            if cmqp::rdma_create_qp(self.id, ptr::null_mut(), &mut qa) != 0 {
                return Err(crate::errno_now());
            }
            self.cfg.sq_inline = qa.cap.max_inline_data;
        }
        let mut conn = Conn::new(self.cfg)?;
        let local = sys::IBV_ACCESS_LOCAL_WRITE;
        let remote = local | sys::IBV_ACCESS_REMOTE_WRITE;
        for (k, region) in conn.regions().into_iter().enumerate() {
            let access = if k == 0 { local } else { remote };
            // SAFETY: the id's PD is live; the region's memory lives in `conn`, which is
            // dropped only in `free`, after the QP is destroyed and the regions are
            // deregistered.
            let m = unsafe {
                mr::ibv_reg_mr(
                    (*self.id).pd,
                    region.as_ptr().cast::<c_void>(),
                    region.len(),
                    access as c_int,
                )
            };
            if m.is_null() {
                return Err(crate::errno_now());
            }
            self.mrs[k] = m;
        }
        // SAFETY: just registered.
        let keys = unsafe {
            Keys {
                send_lkey: (*self.mrs[0]).lkey,
                target_rkey: (*self.mrs[1]).rkey,
                recv_rkey: (*self.mrs[2]).rkey,
            }
        };
        conn.set_keys(keys);
        self.conn = Some(conn);
        self.flush_posts();
        Ok(())
    }

    /// The connection data this side offers (`rs_format_conn_data`).
    pub(super) fn format_conn_data(&self) -> [u8; softrdma_wire::rsocket::CONN_DATA_LEN] {
        self.conn
            .as_ref()
            .map(|c| c.conn_data().emit())
            .unwrap_or([0; softrdma_wire::rsocket::CONN_DATA_LEN])
    }

    /// Take the peer's connection data (`rs_save_conn_data`): the protocol runs.
    /// EPROTO when it is not rsockets' version 1.
    pub(super) fn save_conn_data(&mut self, d: &[u8]) -> Result<(), c_int> {
        let peer = ConnData::parse(d).map_err(|_| libc::EPROTO)?;
        let c = self.conn.as_mut().ok_or(libc::ENOTCONN)?;
        c.start(&peer);
        Ok(())
    }

    /// Post what the protocol asks for; a refused post fails the connection.
    fn flush_posts(&mut self) {
        if self.conn.is_none() {
            return;
        }
        let qp = self.qp();
        let c = self.conn.as_mut().expect("checked");
        // SAFETY: the socket's QP, live while the socket is.
        let q = unsafe { obj::<Qp, _>(qp) };
        while let Some(p) = c.poll_post() {
            let Some(q) = q else {
                c.fail(libc::EINVAL);
                continue;
            };
            let r = match p {
                Post::Send(wr) => crate::qp::post::post_sends(q, vec![wr]).map_err(|(_, e)| e),
                Post::Recv(wr) => match q.ctx() {
                    Some(ctx) => ctx.dev().post_recv(q.qpn, wr).map_err(|e| e.errno.code()),
                    None => Err(libc::EINVAL),
                },
            };
            if let Err(e) = r {
                c.fail(e);
            }
        }
        self.note_error();
    }

    /// A failure of the protocol goes to SO_ERROR once.
    fn note_error(&mut self) {
        if let Some(e) = self.conn.as_ref().and_then(Conn::error) {
            if !self.err_taken {
                self.err = e;
                self.err_taken = true;
            }
        }
    }

    pub(super) fn ctrl_avail(&self) -> bool {
        self.conn.as_ref().is_some_and(Conn::ctrl_avail)
    }

    /// Grant credits and offer buffer where the reader made room.
    pub(super) fn update_credits(&mut self) {
        if self.stage != Stage::Open {
            return;
        }
        if let Some(c) = self.conn.as_mut() {
            c.update_credits();
        }
        self.flush_posts();
    }

    /// `rs_poll_cq`: take every completion, then repost the receives they used.
    pub(super) fn poll_cq(&mut self) -> Result<(), c_int> {
        if self.conn.is_none() {
            return Ok(());
        }
        // SAFETY: the socket's live CQ.
        let Some(q) = (unsafe { obj::<Cq, _>(self.cq()) }) else {
            return Ok(());
        };
        let Some(ctx) = q.ctx() else { return Ok(()) };
        let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(16);
        let mut result = Ok(());
        loop {
            wcs.clear();
            let n = q
                .poller
                .poll_each(ctx.dev(), 16, |_, w| wcs.push(*w))
                .unwrap_or(0);
            if n == 0 {
                break;
            }
            let c = self.conn.as_mut().expect("checked");
            if c.on_completions(&wcs).is_err() {
                // The peer ignores its credits: the connection ends (its QP to error, a
                // DREQ to the peer), as a TCP peer's reset would.
                // SAFETY: the socket's live id; its channel is non-blocking (connected).
                unsafe { cmid::rdma_disconnect(self.id) };
                result = Err(libc::EPROTO);
                break;
            }
        }
        self.flush_posts();
        result
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
            if !ev.is_null() && (*ev).event == abi::RDMA_CM_EVENT_DISCONNECTED {
                if let Some(c) = self.conn.as_mut() {
                    c.disconnected();
                }
            }
        }
    }

    pub(super) fn can_send(&self) -> bool {
        self.stage == Stage::Open && self.conn.as_ref().is_some_and(Conn::can_send)
    }

    /// An empty data message straight on the QP, whatever the credits say (a peer that
    /// ignores them, for tests).
    #[cfg(test)]
    pub(super) fn post_past_credits(&self) -> Result<(), c_int> {
        use softrdma_device::verbs::{SendFlags, SendOp, SendWr};
        // SAFETY: the socket's live QP.
        let q = unsafe { obj::<Qp, _>(self.qp()) }.ok_or(libc::EINVAL)?;
        let wr = SendWr {
            wr_id: 0,
            op: SendOp::WriteWithImm {
                remote_addr: 0,
                rkey: 0,
                imm: 0,
            },
            flags: SendFlags::SIGNALED,
            sg_list: Vec::new(),
            inline_data: None,
            ud: None,
        };
        crate::qp::post::post_sends(q, vec![wr]).map_err(|(_, e)| e)
    }

    /// Data messages received and not yet read.
    #[cfg(test)]
    pub(super) fn unread_msgs(&self) -> usize {
        self.conn.as_ref().map_or(0, Conn::unread_msgs)
    }

    pub(super) fn have_rdata(&self) -> bool {
        self.conn.as_ref().is_some_and(Conn::have_rdata)
    }

    pub(super) fn all_sends_done(&self) -> bool {
        self.conn.as_ref().map_or(true, Conn::all_sends_done)
    }

    /// `rs_write_data`: one data message of at most `want` bytes, filled by `fill`.
    pub(super) fn write_data(&mut self, want: u32, fill: &mut dyn FnMut(&mut [u8])) -> u32 {
        let n = self.conn.as_mut().map_or(0, |c| c.send_data(want, fill));
        self.flush_posts();
        n
    }

    /// Copy up to `dst.len()` received bytes (`rrecv`'s loop); `peek` leaves them.
    pub(super) fn read_data(&mut self, dst: &mut [u8], peek: bool) -> usize {
        self.conn.as_mut().map_or(0, |c| c.recv(dst, peek))
    }

    /// Close directions (`rshutdown`): the control message to send, if any.
    pub(super) fn shutdown(&mut self, how: Shutdown) -> Option<Ctrl> {
        self.conn.as_mut().and_then(|c| c.shutdown(how))
    }

    /// Send a control message (shutdown or disconnect) when a slot is free.
    pub(super) fn send_ctrl(&mut self, ctrl: Ctrl) {
        if let Some(c) = self.conn.as_mut() {
            c.send_ctrl(ctrl);
        }
        self.flush_posts();
    }

    /// A keepalive: a zero-length RDMA WRITE, when a control slot is free.
    pub(super) fn send_keepalive(&mut self) {
        if let Some(c) = self.conn.as_mut() {
            c.send_keepalive();
        }
        self.flush_posts();
    }

    /// Map `m` (registered by `riomap`) for the peer's direct writes at `offset`, or for
    /// local use only (`remote` false). Its entry goes with the next send.
    pub(super) fn map_iomap(
        &mut self,
        m: *mut sys::ibv_mr,
        offset: u64,
        remote: bool,
    ) -> Result<(), c_int> {
        // SAFETY: a live region of this library.
        let sge = unsafe {
            Sge {
                addr: (*m).addr as u64,
                key: (*m).rkey,
                length: (*m).length as u32,
            }
        };
        if remote {
            let c = self.conn.as_mut().ok_or(libc::EINVAL)?;
            c.map_iomap(offset, sge, None)?;
        }
        self.iomap_mrs.push(m);
        Ok(())
    }

    /// Drop the mapping of `buf` (`len` bytes): its region, deregistered by the caller.
    pub(super) fn unmap_iomap(&mut self, buf: *mut c_void, len: usize) -> Option<*mut sys::ibv_mr> {
        // SAFETY: the regions are live.
        let k = self
            .iomap_mrs
            .iter()
            .position(|&m| unsafe { (*m).addr == buf && (*m).length == len })?;
        let m = self.iomap_mrs.remove(k);
        if let Some(c) = self.conn.as_mut() {
            c.unmap_iomap(buf as u64);
        }
        Some(m)
    }

    /// An iomap entry still to send.
    pub(super) fn iomap_to_send(&self) -> Option<usize> {
        self.conn.as_ref().and_then(Conn::iomap_to_send)
    }

    /// Send iomap entry `k` (when a send may go).
    pub(super) fn send_iomap(&mut self, k: usize) {
        if let Some(c) = self.conn.as_mut() {
            c.send_iomap(k);
        }
        self.flush_posts();
    }

    /// The peer's mapping that holds `offset`.
    pub(super) fn peer_iomap(&self, offset: u64) -> Option<IomapEntry> {
        self.conn.as_ref().and_then(|c| c.peer_iomap(offset))
    }

    /// `rs_write_direct`: at most `want` bytes to the peer's mapping at `offset`.
    pub(super) fn write_direct(
        &mut self,
        offset: u64,
        want: u32,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Option<u32> {
        let n = self
            .conn
            .as_mut()
            .and_then(|c| c.write_direct(offset, want, fill));
        self.flush_posts();
        n
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
        // deregistered before their memory (in the protocol core) is freed.
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
            for m in self.iomap_mrs.drain(..) {
                mr::ibv_dereg_mr(m);
            }
            for m in &mut self.mrs {
                if !m.is_null() {
                    mr::ibv_dereg_mr(*m);
                    *m = ptr::null_mut();
                }
            }
            self.conn = None;
            cmid::rdma_destroy_id(self.id);
        }
        self.id = ptr::null_mut();
    }
}
