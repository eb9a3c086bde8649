//! A context's async events (`ibv_get_async_event`, `ibv_ack_async_event`).

use std::ffi::c_int;

use softrdma_device::verbs::AsyncEvent;

use super::*;
use crate::sys;
use crate::{guard, minus_one, zeroed};

impl DevShared {
    /// A new context's async queue and descriptor.
    pub(crate) fn new_ctx_async(&self) -> Result<Arc<CtxAsync>, i32> {
        Ok(Arc::new(CtxAsync::new(self.dev.async_event_fd())?))
    }
    /// Route the events of the context at `ctx` (the program's `ibv_context *`) to `a`.
    pub(crate) fn add_ctx(&self, ctx: usize, a: Arc<CtxAsync>) {
        lock(&self.ctxs).push((ctx, a));
    }
    /// A context closes: its queue gets no more events.
    pub(crate) fn remove_ctx(&self, ctx: usize) {
        lock(&self.ctxs).retain(|(c, _)| *c != ctx);
    }

    /// Take every event the device has and queue each on the context it belongs to: an
    /// object's event on the context the object was created on (the `context` field every
    /// verbs object begins with), a device-wide one on every context. Events of objects
    /// already destroyed are dropped.
    fn route_async_events(&self) {
        let ctxs = lock(&self.ctxs);
        while let Some(ev) = self.dev.next_async_event() {
            let reg = self.registry();
            let (elem, ty) = match ev {
                AsyncEvent::CqErr(c) => (reg.cqs.get(&c.0).copied(), sys::IBV_EVENT_CQ_ERR),
                AsyncEvent::QpFatal(q) => (reg.qps.get(&q).copied(), sys::IBV_EVENT_QP_FATAL),
                AsyncEvent::QpReqErr(q) => (reg.qps.get(&q).copied(), sys::IBV_EVENT_QP_REQ_ERR),
                AsyncEvent::QpAccessErr(q) => {
                    (reg.qps.get(&q).copied(), sys::IBV_EVENT_QP_ACCESS_ERR)
                }
                AsyncEvent::CommEst(q) => (reg.qps.get(&q).copied(), sys::IBV_EVENT_COMM_EST),
                AsyncEvent::SqDrained(q) => (reg.qps.get(&q).copied(), sys::IBV_EVENT_SQ_DRAINED),
                AsyncEvent::QpLastWqeReached(q) => {
                    (reg.qps.get(&q).copied(), sys::IBV_EVENT_QP_LAST_WQE_REACHED)
                }
                AsyncEvent::SrqLimitReached(s) => (
                    reg.srqs.get(&s.0).copied(),
                    sys::IBV_EVENT_SRQ_LIMIT_REACHED,
                ),
                AsyncEvent::PortActive(p) => {
                    let e = QueuedEvent {
                        ty: sys::IBV_EVENT_PORT_ACTIVE,
                        element: 0,
                        port: p as c_int,
                    };
                    ctxs.iter().for_each(|(_, a)| a.push(e));
                    continue;
                }
                AsyncEvent::DeviceFatal => {
                    let e = QueuedEvent {
                        ty: sys::IBV_EVENT_DEVICE_FATAL,
                        element: 0,
                        port: 0,
                    };
                    ctxs.iter().for_each(|(_, a)| a.push(e));
                    continue;
                }
            };
            let Some(elem) = elem else {
                continue;
            };
            // SAFETY: a registered object is live while it is in the registry (its
            // destroy removes it under this lock first) and begins with the C struct the
            // program holds, whose first field is its context.
            let owner = unsafe {
                match ty {
                    sys::IBV_EVENT_CQ_ERR => (*(elem as *const sys::ibv_cq)).context,
                    sys::IBV_EVENT_SRQ_LIMIT_REACHED => (*(elem as *const sys::ibv_srq)).context,
                    _ => (*(elem as *const sys::ibv_qp)).context,
                }
            } as usize;
            drop(reg);
            if let Some((_, a)) = ctxs.iter().find(|(c, _)| *c == owner) {
                a.push(QueuedEvent {
                    ty,
                    element: elem,
                    port: 0,
                });
            }
        }
    }
}

/// Blocks until the context has an async event (the fd `context->async_fd` is readable
/// while one may be pending). If the program set O_NONBLOCK on that fd, returns -1 with
/// EAGAIN when none is pending.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut sys::ibv_context,
    event: *mut sys::ibv_async_event,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if event.is_null() {
            return minus_one(libc::EINVAL);
        }
        loop {
            ctx.shared.route_async_events();
            let Some(e) = ctx.asyn.pop() else {
                if crate::fd_nonblocking(ctx.asyn.fd()) {
                    return minus_one(libc::EAGAIN);
                }
                let mut p = libc::pollfd {
                    fd: ctx.asyn.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one live pollfd. A signal (EINTR) or a failure just loops.
                let _ = unsafe { libc::poll(&mut p, 1, -1) };
                continue;
            };
            let mut o: sys::ibv_async_event = zeroed();
            match e.ty {
                // Registered objects begin with the C struct the program holds.
                sys::IBV_EVENT_CQ_ERR => o.element.cq = e.element as *mut sys::ibv_cq,
                sys::IBV_EVENT_SRQ_LIMIT_REACHED => o.element.srq = e.element as *mut sys::ibv_srq,
                sys::IBV_EVENT_PORT_ACTIVE => o.element.port_num = e.port,
                sys::IBV_EVENT_DEVICE_FATAL => {}
                _ => o.element.qp = e.element as *mut sys::ibv_qp,
            }
            o.event_type = e.ty;
            // SAFETY: `event` points at the caller's struct.
            unsafe { event.write(o) };
            return 0;
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut sys::ibv_async_event) {
    guard((), || {
        if event.is_null() {
            return;
        }
        // SAFETY: `event` is one the program got from ibv_get_async_event; its element
        // is a live object of this library (the program acks before destroying it).
        unsafe {
            let e = &*event;
            match e.event_type {
                sys::IBV_EVENT_CQ_ERR if !e.element.cq.is_null() => {
                    let c = &mut *e.element.cq;
                    c.async_events_completed = c.async_events_completed.wrapping_add(1);
                }
                sys::IBV_EVENT_SRQ_LIMIT_REACHED | sys::IBV_EVENT_SRQ_ERR
                    if !e.element.srq.is_null() =>
                {
                    let s = &mut *e.element.srq;
                    s.events_completed = s.events_completed.wrapping_add(1);
                }
                sys::IBV_EVENT_QP_FATAL
                | sys::IBV_EVENT_QP_REQ_ERR
                | sys::IBV_EVENT_QP_ACCESS_ERR
                | sys::IBV_EVENT_COMM_EST
                | sys::IBV_EVENT_SQ_DRAINED
                | sys::IBV_EVENT_PATH_MIG
                | sys::IBV_EVENT_PATH_MIG_ERR
                | sys::IBV_EVENT_QP_LAST_WQE_REACHED
                    if !e.element.qp.is_null() =>
                {
                    let q = &mut *e.element.qp;
                    q.events_completed = q.events_completed.wrapping_add(1);
                }
                _ => {}
            }
        }
    })
}
