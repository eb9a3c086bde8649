//! Events: `rdma_get_cm_event` and `rdma_ack_cm_event`. What the CM model reports is
//! turned into the `rdma_cm_event` a program reads, with librdmacm's own work on the way:
//! a connection request gets its new id; a connection response on an id with a QP moves
//! the QP to RTR and RTS and sends the RTU, and is reported as ESTABLISHED (or
//! CONNECT_ERROR); REJECTED moves the QP to ERR, which flushes it (DISCONNECTED does not:
//! rdma_disconnect does).

use std::ffi::c_int;

use softrdma_cm::cma::{CmaEvent, ConnParam, EventParam, EventType, UdParam};
use softrdma_cm::conn::{self, Ready};

use super::abi;
use super::id::{self, channel_of, id_of, CmId};
use super::qp;
use crate::ah::ah_to_c;
use crate::object::leak;
use crate::{guard, minus_one, zeroed};

/// An event handed to the program: `rdma_cm_event` first, then the private data its
/// parameters point at, and the id whose count of acknowledged events the ack advances.
#[repr(C)]
struct Event {
    c: abi::rdma_cm_event,
    private: [u8; 256],
    owner: *const CmId,
}

/// Copy private data into the event, for its parameters to point at: (pointer or NULL,
/// length).
fn private_to_c(ev: &mut Event, data: &[u8]) -> (*const std::ffi::c_void, u8) {
    let n = data.len().min(ev.private.len()).min(255);
    ev.private[..n].copy_from_slice(&data[..n]);
    let p = if n > 0 {
        ev.private.as_ptr().cast()
    } else {
        std::ptr::null()
    };
    (p, n as u8)
}

fn conn_to_c(ev: &mut Event, p: &ConnParam) {
    let mut c: abi::rdma_conn_param = zeroed();
    (c.private_data, c.private_data_len) = private_to_c(ev, &p.private_data);
    c.responder_resources = p.responder_resources;
    c.initiator_depth = p.initiator_depth;
    c.flow_control = p.flow_control;
    c.retry_count = p.retry_count;
    c.rnr_retry_count = p.rnr_retry_count;
    c.srq = p.srq;
    c.qp_num = p.qp_num;
    ev.c.param.conn = c;
}

fn ud_to_c(ev: &mut Event, p: &UdParam) {
    let mut u: abi::rdma_ud_param = zeroed();
    (u.private_data, u.private_data_len) = private_to_c(ev, &p.private_data);
    u.ah_attr = ah_to_c(&p.ah_attr);
    u.qp_num = p.qp_num;
    u.qkey = p.qkey;
    ev.c.param.ud = u;
}

fn param_to_c(ev: &mut Event, p: &EventParam) {
    match p {
        EventParam::None => {}
        EventParam::Conn(c) => conn_to_c(ev, c),
        EventParam::Ud(u) => ud_to_c(ev, u),
    }
}

/// The id a connection request made, as librdmacm's `ucma_process_conn_req` makes it:
/// the listener's channel, context, port space and QP type (its own channel when the
/// listener is synchronous), its addresses and route, and the resources to answer with.
///
/// # Safety
/// `listen` is a live id of this library.
unsafe fn new_conn_id(
    listen: *mut abi::rdma_cm_id,
    ev: &CmaEvent,
) -> Result<*mut abi::rdma_cm_id, c_int> {
    // SAFETY: per the contract.
    let l = unsafe { id_of(listen) }.ok_or(libc::EINVAL)?;
    let sync = l.lock().sync;
    let child = id::alloc_id(
        std::sync::Arc::clone(&l.cm),
        ev.id,
        l.c.channel,
        l.c.context,
        l.c.ps,
        l.c.qp_type,
        false,
    )
    .cast::<abi::rdma_cm_id>();
    // SAFETY: just made.
    let c = unsafe { id_of(child) }.ok_or(libc::EINVAL)?;
    if let EventParam::Conn(p) = &ev.param {
        let mut g = c.lock();
        g.initiator_depth = p.initiator_depth;
        g.responder_resources = p.responder_resources;
    }
    if sync {
        // SAFETY: the new id is live; NULL asks for a channel of its own.
        if let Err(e) = unsafe { id::migrate_id(child, std::ptr::null_mut()) } {
            // SAFETY: the new id, never handed out.
            unsafe { id::destroy_id(child) };
            return Err(e);
        }
    }
    // SAFETY: the new id is live.
    unsafe {
        id::query_route(child);
        id::set_path(child);
    }
    Ok(child)
}

/// librdmacm's `ucma_process_conn_resp`: the CM layer's step on CONNECT_RESPONSE (the
/// QP to RTR and RTS with what the REP carried, then the RTU; on failure the QP to ERR).
fn conn_resp(me: &CmId) -> Result<(), c_int> {
    let ready = qp::ready_if_qp(me, Ready::default());
    conn::complete_connect(me.cm.agent(), me.handle, ready, qp::modifier(me), || {
        let _ = qp::modify_qp_err(me);
    })
    .map_err(|qp::Errno(e)| e)
}

/// Turn the model's event into the program's, or `None` when librdmacm would not report
/// it (its id is gone, or the id had a connect error).
///
/// # Safety
/// `channel` is a live channel of this library.
unsafe fn process(ev: CmaEvent) -> Option<*mut abi::rdma_cm_event> {
    let cm = super::cm::get().ok()?;
    let owner_handle = match ev.event {
        EventType::ConnectRequest => ev.listen_id?,
        _ => ev.id,
    };
    let Some(owner) = cm.claim(owner_handle) else {
        if ev.event == EventType::ConnectRequest {
            // Its listener is gone: so is the request.
            let _ = cm.call(|c, now| c.destroy_id(now, ev.id));
        }
        return None;
    };
    let owner_c = owner.cast::<abi::rdma_cm_id>();
    // SAFETY: `claim` returned a live id, kept alive until this event is acknowledged.
    let me = unsafe { &*owner };
    let mut out = Box::new(Event {
        c: zeroed(),
        private: [0; 256],
        owner,
    });
    out.c.id = owner_c;
    out.c.event = ev.event as u32;
    out.c.status = ev.status;
    let skip = |me: &CmId| {
        me.event_completed();
        None
    };
    match ev.event {
        EventType::AddrResolved => {
            // SAFETY: the id is live.
            unsafe { id::query_route(owner_c) };
            if me.c.verbs.is_null() {
                out.c.event = abi::RDMA_CM_EVENT_ADDR_ERROR;
                out.c.status = -libc::ENODEV;
            }
        }
        EventType::RouteResolved => {
            // SAFETY: the id is live.
            unsafe {
                id::query_route(owner_c);
                id::set_path(owner_c);
            }
        }
        EventType::ConnectRequest => {
            // SAFETY: the listener is live.
            match unsafe { new_conn_id(owner_c, &ev) } {
                Ok(child) => {
                    out.c.listen_id = owner_c;
                    out.c.id = child;
                    param_to_c(&mut out, &ev.param);
                }
                Err(_) => {
                    let _ = cm.call(|c, now| c.destroy_id(now, ev.id));
                    return skip(me);
                }
            }
        }
        EventType::ConnectResponse => {
            param_to_c(&mut out, &ev.param);
            if !me.c.qp.is_null() {
                match conn_resp(me) {
                    Ok(()) => out.c.event = abi::RDMA_CM_EVENT_ESTABLISHED,
                    Err(e) => {
                        crate::set_errno(e);
                        // librdmacm reports its -1 return here.
                        out.c.event = abi::RDMA_CM_EVENT_CONNECT_ERROR;
                        out.c.status = -1;
                        me.lock().connect_error = true;
                    }
                }
            }
        }
        EventType::Rejected => {
            if me.lock().connect_error {
                return skip(me);
            }
            param_to_c(&mut out, &ev.param);
            let _ = qp::modify_qp_err(me);
        }
        EventType::Disconnected => {
            if me.lock().connect_error {
                return skip(me);
            }
            // The QP is left as it is: librdmacm moves it to ERR (which flushes it) in
            // rdma_disconnect, which programs call on DISCONNECTED, not here.
            param_to_c(&mut out, &ev.param);
        }
        EventType::MulticastJoin | EventType::MulticastError => {
            param_to_c(&mut out, &ev.param);
            let (context, send_only) = ev
                .mc
                .as_ref()
                .map_or((0, false), |j| (j.context, j.send_only));
            // Writing the ud member just filled (or zeroed): the join's context.
            out.c.param.ud.private_data = context as *const std::ffi::c_void;
            out.c.param.ud.private_data_len = 0;
            if ev.event == EventType::MulticastJoin {
                // SAFETY: the ud member was filled from the event's parameters.
                let ah = unsafe { out.c.param.ud.ah_attr };
                let e = super::mcast::attach_on_join(me, &ah, send_only);
                if e != 0 {
                    out.c.event = abi::RDMA_CM_EVENT_MULTICAST_ERROR;
                    out.c.status = -e;
                }
            }
        }
        _ => param_to_c(&mut out, &ev.param),
    }
    Some(leak(*out).cast())
}

/// Take the next event of `channel`, waiting as its fd's blocking mode says.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut abi::rdma_event_channel,
    event: *mut *mut abi::rdma_cm_event,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a channel of this library.
        let Some(ch) = (unsafe { channel_of(channel) }) else {
            return minus_one(libc::EINVAL);
        };
        if event.is_null() {
            return minus_one(libc::EINVAL);
        }
        loop {
            let ev = match ch.ch.get() {
                Ok(ev) => ev,
                Err(e) => return minus_one(e.raw_os_error().unwrap_or(libc::EIO)),
            };
            // SAFETY: the channel is live.
            if let Some(p) = unsafe { process(ev) } {
                // SAFETY: `event` is the caller's out-pointer.
                unsafe { *event = p };
                return 0;
            }
        }
    })
}

/// Free an event; its id may now be destroyed.
#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut abi::rdma_cm_event) -> c_int {
    guard(-1, || {
        if event.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: every rdma_cm_event handed out is the head of a leaked `Event`, freed
        // once here.
        let ev = unsafe { Box::from_raw(event.cast::<Event>()) };
        // SAFETY: the owner lives until its events are acknowledged (rdma_destroy_id waits).
        unsafe { (*ev.owner).event_completed() };
        0
    })
}
