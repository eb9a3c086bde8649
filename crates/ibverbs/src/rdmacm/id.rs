//! CM ids and event channels: `rdma_create_event_channel`, `rdma_create_id`,
//! `rdma_destroy_id`, bind, resolve, listen, connect, accept, reject, disconnect,
//! options and channel migration, with librdmacm's synchronous mode (an id created
//! without a channel gets its own, and each call that librdmacm completes waits for its
//! event there).
//!
//! An `rdma_cm_id` the program holds is the head of a [`CmId`]; the id's state lives in
//! the CM model (`softrdma_cm::cma`), addressed by the id's handle.

use std::collections::BTreeSet;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use softrdma_cm::agent::EventChannel;
use softrdma_cm::cma::{self, Cma, ConnParam, IdHandle, IdOption, Service};
use softrdma_cm::conn::{self, Depth, RdLimits, Ready};
use softrdma_cm::rej_reason;

use super::abi;
use super::cm::{self, gid_of, sockaddr_from_c, sockaddr_to_c, Cm};
use super::event;
use super::qp;
use crate::object::{leak, obj};
use crate::{guard, minus_one, sys, zeroed};

/// An event channel: `rdma_event_channel` (its fd) over the CM's [`EventChannel`].
#[repr(C)]
pub(crate) struct Channel {
    pub(crate) c: abi::rdma_event_channel,
    pub(crate) ch: EventChannel,
}

/// What librdmacm keeps beside an id (`struct cma_id_private`).
pub(crate) struct Priv {
    /// The id has its own channel (created without one); calls wait for their events.
    pub(crate) sync: bool,
    /// Events handed out for this id, and those acknowledged: destroying or migrating
    /// the id waits until every one handed out is acknowledged, as librdmacm does.
    pub(crate) reported: u64,
    pub(crate) completed: u64,
    pub(crate) initiator_depth: u8,
    pub(crate) responder_resources: u8,
    /// Private data `rdma_create_ep` keeps from `ai_connect` for the connect.
    pub(crate) connect: Vec<u8>,
    /// `rdma_create_ep`'s QP attributes for the ids `rdma_get_request` returns.
    pub(crate) qp_init_attr: Option<sys::ibv_qp_init_attr>,
    /// The response could not be completed (CONNECT_ERROR was reported): later
    /// REJECTED/DISCONNECTED events of the id are not reported.
    pub(crate) connect_error: bool,
    /// `route.path_rec` points here.
    pub(crate) path: Option<Box<abi::ibv_sa_path_rec>>,
}

/// A CM id: the program's `rdma_cm_id` first, so the program's pointer is ours.
#[repr(C)]
pub(crate) struct CmId {
    pub(crate) c: abi::rdma_cm_id,
    pub(crate) handle: IdHandle,
    pub(crate) cm: Arc<Cm>,
    p: Mutex<Priv>,
    cond: Condvar,
}

impl CmId {
    /// Run a call of the CM model on this id (`f` gets the model, the device's time and
    /// the id's handle), with the model's error as its errno.
    pub(crate) fn model<R>(
        &self,
        f: impl FnOnce(&mut Cma, u64, IdHandle) -> cma::Result<R>,
    ) -> Result<R, c_int> {
        let h = self.handle;
        self.cm.call(|c, now| f(c, now, h)).map_err(cm::errno)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Priv> {
        self.p.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One more event was handed out for this id.
    pub(crate) fn event_reported(&self) {
        self.lock().reported += 1;
    }

    /// One event of this id was acknowledged (or dropped after being counted).
    pub(crate) fn event_completed(&self) {
        self.lock().completed += 1;
        self.cond.notify_all();
    }

    /// Wait until every event handed out for this id is acknowledged.
    fn wait_completed(&self) {
        let mut g = self.lock();
        while g.completed < g.reported {
            g = self.cond.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Addresses of the ids and channels this library has handed out and not freed: a
/// pointer that is not one of them (a destroyed id a program still uses, a stray value)
/// gets EINVAL instead of being followed.
static LIVE: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn live() -> MutexGuard<'static, BTreeSet<usize>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The id behind a program's pointer, if it is a live id of this library.
///
/// # Safety
/// A live id is not freed while the reference is used (the program does not destroy an
/// id while it uses it, as librdmacm requires).
pub(crate) unsafe fn id_of<'a>(p: *mut abi::rdma_cm_id) -> Option<&'a CmId> {
    if !live().contains(&(p as usize)) {
        return None;
    }
    // SAFETY: a live CmId (checked above).
    unsafe { obj::<CmId, _>(p) }
}

/// The channel behind a program's pointer, if it is a live channel of this library.
///
/// # Safety
/// As [`id_of`], for channels.
pub(crate) unsafe fn channel_of<'a>(p: *mut abi::rdma_event_channel) -> Option<&'a Channel> {
    if !live().contains(&(p as usize)) {
        return None;
    }
    // SAFETY: a live Channel (checked above).
    unsafe { obj::<Channel, _>(p) }
}

/// A new channel whose events the CM delivers.
pub(crate) fn new_channel(cm: &Cm) -> Result<*mut Channel, c_int> {
    let ch = EventChannel::new().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    cm.agent().attach(&ch);
    let p = leak(Channel {
        c: abi::rdma_event_channel {
            fd: std::os::fd::AsRawFd::as_raw_fd(&ch),
        },
        ch,
    });
    live().insert(p as usize);
    Ok(p)
}

/// Free a channel made by [`new_channel`].
///
/// # Safety
/// `p` came from [`new_channel`] and is freed once.
unsafe fn free_channel(p: *mut abi::rdma_event_channel) {
    live().remove(&(p as usize));
    // SAFETY: per the contract; a Channel starts with its rdma_event_channel.
    drop(unsafe { Box::from_raw(p.cast::<Channel>()) });
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut abi::rdma_event_channel {
    guard(std::ptr::null_mut(), || {
        let cm = match super::devices::check().and_then(|()| cm::get()) {
            Ok(c) => c,
            Err(e) => return crate::null_errno(e),
        };
        match new_channel(&cm) {
            Ok(c) => c.cast(),
            Err(e) => crate::null_errno(e),
        }
    })
}

/// Close a channel. The program destroys or migrates its ids first, as librdmacm requires.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut abi::rdma_event_channel) {
    guard((), || {
        // SAFETY: the caller passes a channel of this library, not used again.
        if unsafe { channel_of(channel) }.is_some() {
            // SAFETY: as above.
            unsafe { free_channel(channel) };
        }
    })
}

fn service_of(qp_type: sys::ibv_qp_type) -> Option<Service> {
    match qp_type {
        sys::IBV_QPT_RC => Some(Service::Rc),
        sys::IBV_QPT_UC => Some(Service::Uc),
        sys::IBV_QPT_UD => Some(Service::Ud),
        _ => None,
    }
}

/// A new id on `channel` (NULL: its own, synchronous), as `rdma_create_id2` makes it.
pub(crate) fn create_id(
    channel: *mut abi::rdma_event_channel,
    context: *mut c_void,
    ps: abi::rdma_port_space,
    qp_type: sys::ibv_qp_type,
) -> Result<*mut CmId, c_int> {
    let cm = cm::get()?;
    let sync = channel.is_null();
    let channel = if sync {
        new_channel(&cm)?.cast::<abi::rdma_event_channel>()
    } else {
        channel
    };
    // SAFETY: a channel of this library (the program's, or the one just made).
    let Some(ch) = (unsafe { channel_of(channel) }) else {
        return Err(libc::EINVAL);
    };
    let chan_id = ch.ch.id();
    let ps16 = u16::try_from(ps).map_err(|_| libc::EINVAL)?;
    let made = cm.call(|c, _| c.create_id(chan_id, ps16, service_of(qp_type)));
    let handle = match made {
        Ok(h) => h,
        Err(e) => {
            if sync {
                // SAFETY: made above, not handed out.
                unsafe { free_channel(channel) };
            }
            return Err(cm::errno(e));
        }
    };
    Ok(alloc_id(cm, handle, channel, context, ps, qp_type, sync))
}

/// Hand out a `CmId` for `handle` and register it.
pub(crate) fn alloc_id(
    cm: Arc<Cm>,
    handle: IdHandle,
    channel: *mut abi::rdma_event_channel,
    context: *mut c_void,
    ps: abi::rdma_port_space,
    qp_type: sys::ibv_qp_type,
    sync: bool,
) -> *mut CmId {
    let mut c: abi::rdma_cm_id = zeroed();
    c.channel = channel;
    c.context = context;
    c.ps = ps;
    c.qp_type = qp_type;
    let p = leak(CmId {
        c,
        handle,
        cm: Arc::clone(&cm),
        p: Mutex::new(Priv {
            sync,
            reported: 0,
            completed: 0,
            initiator_depth: 0,
            responder_resources: 0,
            connect: Vec::new(),
            qp_init_attr: None,
            connect_error: false,
            path: None,
        }),
        cond: Condvar::new(),
    });
    live().insert(p as usize);
    cm.register(handle, p);
    p
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut abi::rdma_event_channel,
    id: *mut *mut abi::rdma_cm_id,
    context: *mut c_void,
    ps: abi::rdma_port_space,
) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        let qp_type = if ps == abi::RDMA_PS_UDP || ps == abi::RDMA_PS_IPOIB {
            sys::IBV_QPT_UD
        } else {
            sys::IBV_QPT_RC
        };
        match create_id(channel, context, ps, qp_type) {
            Ok(p) => {
                // SAFETY: `id` is the caller's out-pointer.
                unsafe { *id = p.cast() };
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

/// Destroy an id (`rdma_destroy_id`), waiting for the program to acknowledge the events
/// it was handed for it.
///
/// # Safety
/// `p` is a live id of this library, not used by the caller again.
pub(crate) unsafe fn destroy_id(p: *mut abi::rdma_cm_id) -> c_int {
    // SAFETY: per the contract.
    let Some(me) = (unsafe { id_of(p) }) else {
        return minus_one(libc::EINVAL);
    };
    let cm = Arc::clone(&me.cm);
    let h = me.handle;
    live().remove(&(p as usize));
    cm.unregister(h);
    // Requests that arrived for a listener and were never reported go with it, as the
    // kernel destroys them with their listener.
    // SAFETY: the id's channel is live (the program destroys ids before channels).
    if let Some(ch) = unsafe { channel_of(me.c.channel) } {
        let dropped = ch.ch.withdraw_if(|e| e.id == h || e.listen_id == Some(h));
        for e in dropped.iter().filter(|e| e.id != h) {
            let _ = cm.call(|c, now| c.destroy_id(now, e.id));
        }
    }
    let _ = cm.call(|c, now| c.destroy_id(now, h));
    if !me.c.event.is_null() {
        // SAFETY: a sync id's pending event, made by this library.
        unsafe { event::rdma_ack_cm_event(me.c.event) };
    }
    me.wait_completed();
    let sync = me.lock().sync;
    let channel = me.c.channel;
    // SAFETY: made by `alloc_id` via `leak`; unregistered, every event acknowledged.
    drop(unsafe { Box::from_raw(p.cast::<CmId>()) });
    if sync {
        // SAFETY: a sync id's own channel, made by `new_channel`, used by nothing else.
        unsafe { free_channel(channel) };
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut abi::rdma_cm_id) -> c_int {
    // SAFETY: the caller passes a live id and does not use it again.
    guard(-1, || unsafe { destroy_id(id) })
}

/// Refresh what the program reads of the id from the model: its addresses, its device
/// (`verbs`, `pd`, `port_num`) once bound to it, and the GIDs of the route.
///
/// # Safety
/// `p` is a live id of this library.
pub(crate) unsafe fn query_route(p: *mut abi::rdma_cm_id) {
    // SAFETY: per the contract.
    let Some(me) = (unsafe { id_of(p) }) else {
        return;
    };
    let h = me.handle;
    let (addrs, has_dev, peer) = me.cm.call(|c, _| {
        (
            c.addrs(h).unwrap_or((None, None)),
            c.has_device(h).unwrap_or(false),
            c.peer_device(h).ok().flatten(),
        )
    });
    let dev_ip = me.cm.device_ip();
    // SAFETY: the id is live; the program reads these fields only between calls, as
    // librdmacm's own updates of them assume.
    unsafe {
        let c = &mut *p;
        if let Some(s) = addrs.0 {
            c.route.addr.src = sockaddr_to_c(s);
        }
        if let Some(d) = addrs.1 {
            c.route.addr.dst = sockaddr_to_c(d);
        }
        let ib = &mut c.route.addr.addr.ibaddr;
        if has_dev || peer.is_some() {
            ib.sgid = gid_of(dev_ip);
            ib.pkey = 0xFFFFu16.to_be();
        }
        if let Some(peer) = peer {
            ib.dgid = gid_of(peer);
        }
        if has_dev && c.verbs.is_null() {
            c.verbs = me.cm.ctx();
            c.pd = me.cm.pd();
            c.port_num = 1;
        }
    }
}

/// Give the id its one RoCE path record (`route.path_rec`), as the kernel reports it once
/// the route is resolved: its traffic class is the id's type of service (what
/// `RDMA_OPTION_ID_TOS` set; for a connection request's id, the REQ path's), its MTU the
/// route's (for a connection request's id, the REQ's).
///
/// # Safety
/// `p` is a live id of this library.
pub(crate) unsafe fn set_path(p: *mut abi::rdma_cm_id) {
    // SAFETY: per the contract.
    let Some(me) = (unsafe { id_of(p) }) else {
        return;
    };
    let h = me.handle;
    let tos = me.cm.call(|c, _| c.tos(h)).unwrap_or(0);
    let mtu = me.cm.call(|c, _| c.path_mtu(h)).map_or(3, |m| m as u8);
    // SAFETY: the id is live.
    let ib = unsafe { (*p).route.addr.addr.ibaddr };
    let mut r: abi::ibv_sa_path_rec = zeroed();
    r.dgid = ib.dgid;
    r.sgid = ib.sgid;
    r.hop_limit = 64;
    r.traffic_class = tos;
    r.reversible = 1;
    r.numb_path = 1;
    r.pkey = 0xFFFFu16.to_be();
    // IBA "exactly" selectors (2), the route's MTU, 10 Gb/s (3) and the packet lifetime
    // RoCE paths get.
    r.mtu_selector = 2;
    r.mtu = mtu;
    r.rate_selector = 2;
    r.rate = 3;
    r.packet_life_time_selector = 2;
    r.packet_life_time = 16;
    let mut g = me.lock();
    let b = g.path.insert(Box::new(r));
    let ptr: *mut abi::ibv_sa_path_rec = &mut **b;
    // SAFETY: the id is live; the record lives as long as the id.
    unsafe {
        (*p).route.path_rec = ptr;
        (*p).route.num_paths = 1;
    }
}

/// librdmacm's `ucma_complete`: for a synchronous id, take the event the call caused
/// (acknowledging the previous one) and turn a failed one into -1 with errno.
///
/// # Safety
/// `p` is a live id of this library.
pub(crate) unsafe fn complete(p: *mut abi::rdma_cm_id) -> c_int {
    // SAFETY: per the contract.
    let Some(me) = (unsafe { id_of(p) }) else {
        return minus_one(libc::EINVAL);
    };
    if !me.lock().sync {
        return 0;
    }
    // SAFETY: the id is live; `event` is its pending event or null.
    unsafe {
        if !(*p).event.is_null() {
            event::rdma_ack_cm_event((*p).event);
            (*p).event = std::ptr::null_mut();
        }
        let mut ev = std::ptr::null_mut();
        if event::rdma_get_cm_event((*p).channel, &mut ev) != 0 {
            return -1;
        }
        (*p).event = ev;
        status_errno(&*ev)
    }
}

/// 0, or -1 with errno for a failed event, as `ucma_complete` maps it.
pub(crate) fn status_errno(ev: &abi::rdma_cm_event) -> c_int {
    if ev.status == 0 {
        0
    } else if ev.event == abi::RDMA_CM_EVENT_REJECTED {
        minus_one(libc::ECONNREFUSED)
    } else {
        minus_one(ev.status.saturating_abs())
    }
}

/// Run `f` on the id's model handle, mapping a model error to -1 with errno.
///
/// # Safety
/// `p` is null or a live id of this library.
unsafe fn with_id(
    p: *mut abi::rdma_cm_id,
    f: impl FnOnce(&CmId) -> Result<(), c_int>,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let me = unsafe { id_of(p) }.ok_or(libc::EINVAL)?;
    f(me)
}

/// The C return of a call: its value, or -1 with errno.
pub(crate) fn done(r: Result<c_int, c_int>) -> c_int {
    match r {
        Ok(v) => v,
        Err(e) => minus_one(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_bind_addr(
    id: *mut abi::rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and a socket address (or null).
        done(
            unsafe {
                with_id(id, |me| {
                    let a = sockaddr_from_c(addr)?.ok_or(libc::EINVAL)?;
                    me.model(|c, _, h| c.bind(h, a))
                })
            }
            .map(|()| {
                // SAFETY: as above.
                unsafe { query_route(id) };
                0
            }),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut abi::rdma_cm_id,
    src_addr: *mut libc::sockaddr,
    dst_addr: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and socket addresses (src may be null).
        let r = unsafe {
            with_id(id, |me| {
                let dst = sockaddr_from_c(dst_addr)?.ok_or(libc::EINVAL)?;
                let src = sockaddr_from_c(src_addr)?;
                (*id).route.addr.dst = sockaddr_to_c(dst);
                me.model(|c, _, h| c.resolve_addr(h, src, dst))
            })
        };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut abi::rdma_cm_id, _timeout_ms: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let r = unsafe { with_id(id, |me| me.model(|c, _, h| c.resolve_route(h))) };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_listen(id: *mut abi::rdma_cm_id, backlog: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let r = unsafe { with_id(id, |me| me.model(|c, _, h| c.listen(h, backlog))) };
        done(r.map(|()| {
            // SAFETY: as above.
            unsafe { query_route(id) };
            0
        }))
    })
}

/// The device's READ/atomic limits, for the CM layer's depth rules.
fn limits(cm: &Cm) -> RdLimits {
    RdLimits::of(cm.agent().device())
}

/// A depth field of the program's `rdma_conn_param` (none: as much as may be had).
fn depth(v: Option<u8>) -> Depth {
    v.map_or(Depth::Most, Depth::from_c)
}

/// librdmacm's `ucma_valid_param`: in the TCP port space an id without a QP needs
/// parameters, and the depths asked must fit the device ([`RdLimits::check`]).
fn valid_param(
    me: &CmId,
    param: Option<&abi::rdma_conn_param>,
    lim: RdLimits,
) -> Result<(), c_int> {
    if me.c.ps != abi::RDMA_PS_TCP {
        return Ok(());
    }
    let Some(p) = param else {
        return if me.c.qp.is_null() {
            Err(libc::EINVAL)
        } else {
            Ok(())
        };
    };
    lim.check(
        Depth::from_c(p.responder_resources),
        Depth::from_c(p.initiator_depth),
    )
    .map_err(cm::errno)
}

/// The model's parameters from the program's and the id's, as
/// `ucma_copy_conn_param_to_kern` builds them.
///
/// # Safety
/// `param`'s private data pointer is valid for its length.
unsafe fn to_model(
    g: &Priv,
    param: Option<&abi::rdma_conn_param>,
    qp_num: u32,
    srq: u8,
) -> ConnParam {
    let mut out = ConnParam {
        private_data: g.connect.clone(),
        responder_resources: g.responder_resources,
        initiator_depth: g.initiator_depth,
        qp_num,
        srq,
        ..ConnParam::default()
    };
    match param {
        Some(p) => {
            out.flow_control = p.flow_control;
            out.retry_count = p.retry_count;
            out.rnr_retry_count = p.rnr_retry_count;
            if !p.private_data.is_null() && p.private_data_len > 0 {
                // SAFETY: per the contract.
                let pd = unsafe {
                    std::slice::from_raw_parts(
                        p.private_data.cast::<u8>(),
                        usize::from(p.private_data_len),
                    )
                };
                out.private_data.extend_from_slice(pd);
            }
        }
        None => {
            out.retry_count = 7;
            out.rnr_retry_count = 7;
        }
    }
    out
}

/// The QP number and SRQ flag of the id's QP, else the parameters'.
///
/// # Safety
/// `me.c.qp` is null or a live QP.
unsafe fn qp_of(me: &CmId, param: Option<&abi::rdma_conn_param>) -> (u32, u8) {
    if me.c.qp.is_null() {
        param.map_or((0, 0), |p| (p.qp_num, p.srq))
    } else {
        // SAFETY: per the contract.
        let q = unsafe { &*me.c.qp };
        (q.qp_num, u8::from(!q.srq.is_null()))
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_connect(
    id: *mut abi::rdma_cm_id,
    conn_param: *mut abi::rdma_conn_param,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or valid parameters.
        let r = unsafe {
            with_id(id, |me| {
                let param = conn_param.as_ref();
                let lim = limits(&me.cm);
                valid_param(me, param, lim)?;
                let (qp_num, srq) = qp_of(me, param);
                let cp = {
                    let mut g = me.lock();
                    (g.responder_resources, g.initiator_depth) = lim.offer(
                        depth(param.map(|p| p.responder_resources)),
                        depth(param.map(|p| p.initiator_depth)),
                    );
                    let cp = to_model(&g, param, qp_num, srq);
                    g.connect.clear();
                    cp
                };
                me.model(|c, now, h| c.connect(now, h, &cp))
            })
        };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_accept(
    id: *mut abi::rdma_cm_id,
    conn_param: *mut abi::rdma_conn_param,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or valid parameters.
        let r = unsafe {
            with_id(id, |me| {
                let param = conn_param.as_ref();
                let lim = limits(&me.cm);
                valid_param(me, param, lim)?;
                if me.c.qp.is_null() && param.is_none() {
                    return Err(libc::EINVAL);
                }
                let (resp_res, init_depth) = {
                    let mut g = me.lock();
                    // What the request offered, seen from this side (set with its event).
                    let settled = lim.settle(
                        depth(param.map(|p| p.responder_resources)),
                        depth(param.map(|p| p.initiator_depth)),
                        g.responder_resources,
                        g.initiator_depth,
                    );
                    (g.responder_resources, g.initiator_depth) = settled;
                    settled
                };
                let ready = (me.c.qp_type != sys::IBV_QPT_UD).then_some(Ready {
                    responder: Some(resp_res),
                    initiator: Some(init_depth),
                    min_rnr_timer: None,
                });
                let ready = ready.and_then(|r| qp::ready_if_qp(me, r));
                let (qp_num, srq) = qp_of(me, param);
                let cp = to_model(&me.lock(), param, qp_num, srq);
                conn::accept(
                    me.cm.agent(),
                    me.handle,
                    ready,
                    &cp,
                    qp::modifier(me),
                    || {
                        let _ = qp::modify_qp_err(me);
                    },
                )
                .map_err(|qp::Errno(e)| e)
            })
        };
        done(r.map(|()| {
            // SAFETY: as above.
            unsafe {
                if (*id).qp_type == sys::IBV_QPT_UD {
                    // A UD accept completes at once; a sync id's request event is done.
                    let me = id_of(id).expect("checked");
                    if me.lock().sync && !(*id).event.is_null() {
                        event::rdma_ack_cm_event((*id).event);
                        (*id).event = std::ptr::null_mut();
                    }
                    0
                } else {
                    complete(id)
                }
            }
        }))
    })
}

/// `rdma_reject` with private data (REJ "consumer reject").
#[no_mangle]
pub unsafe extern "C" fn rdma_reject(
    id: *mut abi::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    // SAFETY: as the caller's contract.
    unsafe {
        reject_with(
            id,
            private_data,
            private_data_len,
            rej_reason::CONSUMER_REJECT,
        )
    }
}

/// `rdma_reject_ece`: reject because the requested ECE options are not supported (REJ
/// reason 35).
#[no_mangle]
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut abi::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    // SAFETY: as the caller's contract.
    unsafe {
        reject_with(
            id,
            private_data,
            private_data_len,
            rej_reason::VENDOR_OPTION_NOT_SUPPORTED,
        )
    }
}

/// ECE (vendor options negotiated in the REQ and REP) needs device options softrdma's
/// devices do not have: `rdma_set_local_ece` is EOPNOTSUPP (after librdmacm's own
/// argument checks), so a program learns it rather than believing options were sent.
#[no_mangle]
pub unsafe extern "C" fn rdma_set_local_ece(
    id: *mut abi::rdma_cm_id,
    ece: *mut sys::ibv_ece,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or its ECE struct.
        let bad = unsafe {
            id_of(id).is_none() || ece.is_null() || (*ece).vendor_id == 0 || (*ece).comp_mask != 0
        };
        minus_one(if bad { libc::EINVAL } else { libc::EOPNOTSUPP })
    })
}

/// The peer's ECE options: EOPNOTSUPP (see [`rdma_set_local_ece`]); EINVAL for an id
/// with a QP, as librdmacm.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_remote_ece(
    id: *mut abi::rdma_cm_id,
    ece: *mut sys::ibv_ece,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or its ECE struct.
        let bad = unsafe { id_of(id) }.map_or(true, |me| !me.c.qp.is_null()) || ece.is_null();
        minus_one(if bad { libc::EINVAL } else { libc::EOPNOTSUPP })
    })
}

/// Reject a connection request with `reason`.
///
/// # Safety
/// `id` is a live id; `private_data` points at `private_data_len` bytes (or is null).
unsafe fn reject_with(
    id: *mut abi::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
    reason: u16,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and private data of the given length.
        done(
            unsafe {
                with_id(id, |me| {
                    let pd = if private_data.is_null() || private_data_len == 0 {
                        &[][..]
                    } else {
                        std::slice::from_raw_parts(
                            private_data.cast::<u8>(),
                            usize::from(private_data_len),
                        )
                    };
                    me.model(|c, now, h| c.reject_with_reason(now, h, reason, pd))
                })
            }
            .map(|()| 0),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(id: *mut abi::rdma_cm_id) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        let r = unsafe {
            with_id(id, |me| {
                if me.c.verbs.is_null() {
                    return Err(libc::EINVAL);
                }
                // The QP stops first (it flushes), then the DREQ (or DREP) goes out.
                qp::modify_qp_err(me)?;
                me.model(|c, now, h| c.disconnect(now, h))
            })
        };
        // SAFETY: as above.
        done(r.map(|()| unsafe { complete(id) }))
    })
}

/// The active side completes a connection whose QP the program drives itself: the RTU
/// goes out (`rdma_establish`, for ids without a QP after CONNECT_RESPONSE).
#[no_mangle]
pub unsafe extern "C" fn rdma_establish(id: *mut abi::rdma_cm_id) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        done(
            unsafe {
                with_id(id, |me| {
                    if !me.c.qp.is_null() {
                        return Err(libc::EINVAL);
                    }
                    conn::complete_connect(me.cm.agent(), me.handle, None, qp::modifier(me), || {})
                        .map_err(|qp::Errno(e)| e)
                })
            }
            .map(|()| 0),
        )
    })
}

/// `rdma_notify`: the QP's COMM_EST event (a packet arrived before the RTU) establishes
/// the connection; other events are not the CM's (EINVAL, as Linux's `ib_cm_notify`
/// answers all but path migration, and there are no alternate paths here).
#[no_mangle]
pub unsafe extern "C" fn rdma_notify(
    id: *mut abi::rdma_cm_id,
    event: sys::ibv_event_type,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id.
        done(
            unsafe {
                with_id(id, |me| {
                    if event != sys::IBV_EVENT_COMM_EST {
                        return Err(libc::EINVAL);
                    }
                    me.model(|c, now, h| c.establish(now, h))
                })
            }
            .map(|()| 0),
        )
    })
}

/// Read an option value of exactly `T`'s size.
///
/// # Safety
/// `v` points at `len` readable bytes.
unsafe fn opt<T: Copy>(v: *const c_void, len: usize) -> Result<T, c_int> {
    if v.is_null() || len != std::mem::size_of::<T>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract and the size check.
    Ok(unsafe { v.cast::<T>().read_unaligned() })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut abi::rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and `optlen` bytes at `optval`.
        done(
            unsafe {
                with_id(id, |me| {
                    let o = match (level, optname) {
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_TOS) => {
                            IdOption::Tos(opt::<u8>(optval, optlen)?)
                        }
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_REUSEADDR) => {
                            IdOption::ReuseAddr(opt::<c_int>(optval, optlen)? != 0)
                        }
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_AFONLY) => {
                            IdOption::AfOnly(opt::<c_int>(optval, optlen)? != 0)
                        }
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_ACK_TIMEOUT) => {
                            IdOption::AckTimeout(opt::<u8>(optval, optlen)?)
                        }
                        (abi::RDMA_OPTION_IB, abi::RDMA_OPTION_IB_PATH) => {
                            return set_ib_path(me, optval, optlen);
                        }
                        _ => return Err(libc::ENOSYS),
                    };
                    me.model(|c, _, h| c.set_option(h, o))
                })
            }
            .map(|()| 0),
        )
    })
}

/// `RDMA_OPTION_IB_PATH`: the program supplies the route (as `rdma_create_ep` does with
/// `ai_route`); the RoCE path needs nothing from it but a primary bidirectional record,
/// and the route is resolved (ROUTE_RESOLVED), as Linux does.
///
/// # Safety
/// `optval` points at `optlen` readable bytes.
unsafe fn set_ib_path(me: &CmId, optval: *const c_void, optlen: usize) -> Result<(), c_int> {
    const PRIMARY: u32 = 1 << 4;
    const GMP: u32 = 1 << 5;
    const BIDIRECTIONAL: u32 = (1 << 2) | (1 << 3);
    let n = std::mem::size_of::<abi::ibv_path_data>();
    if optval.is_null() || optlen == 0 || optlen % n != 0 {
        return Err(libc::EINVAL);
    }
    let found = (0..optlen / n).any(|i| {
        // SAFETY: per the contract, record `i` lies within `optlen`.
        let d = unsafe { optval.cast::<abi::ibv_path_data>().add(i).read_unaligned() };
        d.flags & (PRIMARY | GMP) == PRIMARY | GMP && d.flags & BIDIRECTIONAL == BIDIRECTIONAL
    });
    if !found {
        return Err(libc::EINVAL);
    }
    me.model(|c, _, h| c.resolve_route(h))
}

/// Move an id's events to another channel (NULL: a new one of its own, synchronous).
#[no_mangle]
pub unsafe extern "C" fn rdma_migrate_id(
    id: *mut abi::rdma_cm_id,
    channel: *mut abi::rdma_event_channel,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and null or a live channel.
        done(unsafe { migrate_id(id, channel) })
    })
}

/// See [`rdma_migrate_id`].
///
/// # Safety
/// `id` is a live id, `channel` null or a live channel of this library.
pub(crate) unsafe fn migrate_id(
    id: *mut abi::rdma_cm_id,
    channel: *mut abi::rdma_event_channel,
) -> Result<c_int, c_int> {
    // SAFETY: per the contract.
    let me = unsafe { id_of(id) }.ok_or(libc::EINVAL)?;
    let old_sync = me.lock().sync;
    if old_sync && channel.is_null() {
        return Err(libc::EINVAL);
    }
    let sync = channel.is_null();
    let channel = if sync {
        new_channel(&me.cm)?.cast::<abi::rdma_event_channel>()
    } else {
        channel
    };
    // SAFETY: per the contract / made above.
    let (Some(new), Some(old)) = (unsafe { channel_of(channel) }, unsafe {
        channel_of(me.c.channel)
    }) else {
        return Err(libc::EINVAL);
    };
    let new_id = new.ch.id();
    me.model(|c, _, h| {
        let r = c.migrate(h, new_id);
        // Events already queued for the id follow it, in order.
        for mut e in old.ch.withdraw_if(|e| e.id == h) {
            e.channel = new_id;
            new.ch.deliver(e);
        }
        r
    })?;
    let old_ptr = me.c.channel;
    // SAFETY: the id is live; its pending event (sync ids) is this library's.
    unsafe {
        if old_sync && !(*id).event.is_null() {
            event::rdma_ack_cm_event((*id).event);
            (*id).event = std::ptr::null_mut();
        }
        (*id).channel = channel;
    }
    me.lock().sync = sync;
    me.wait_completed();
    if old_sync {
        // SAFETY: the id's own former channel, now unused.
        unsafe { free_channel(old_ptr) };
    }
    Ok(0)
}
