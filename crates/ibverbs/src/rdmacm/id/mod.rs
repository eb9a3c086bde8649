//! CM ids and event channels: `rdma_create_event_channel`, `rdma_create_id`,
//! `rdma_destroy_id` and channel migration, with librdmacm's synchronous mode (an id
//! created without a channel gets its own, and each call that librdmacm completes waits
//! for its event there). Binding and resolving are in `route`, listening, connecting,
//! accepting, rejecting and disconnecting in `connection`, options in `options`.
//!
//! An `rdma_cm_id` the program holds is the head of a [`CmId`]; the id's state lives in
//! the CM model (`softrdma_cm::cma`), addressed by the id's handle.

use std::collections::BTreeSet;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use softrdma_cm::agent::EventChannel;
use softrdma_cm::cma::{self, Cma, IdHandle, Service};

use super::abi;
use super::cm::{self, Cm};
use super::event;
use crate::object::{leak, obj};
use crate::{guard, minus_one, sys, zeroed};

mod connection;
mod options;
mod route;

// The entry points other modules (the one-call helpers) call by path.
pub use options::rdma_set_option;
// rsockets' tests make half-open requests by hand.
#[cfg(test)]
pub(crate) use connection::rdma_connect;
pub(crate) use route::{query_route, set_path};
pub use route::{rdma_bind_addr, rdma_resolve_addr, rdma_resolve_route};

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
