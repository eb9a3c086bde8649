//! Completion channels and CQs: creating them, their events, and (in `poll`) taking
//! their completions.

mod poll;

use std::ffi::{c_int, c_void};

use softrdma_device::verbs::{self, Arm, ChannelId, CqId};
use softrdma_device::{CqPoller, Rnic};

use crate::device::Ctx;
use crate::object::{ctx_of, destroy, errno, leak, obj, Destroy};
use crate::{guard, minus_one, null_errno, sys, zeroed};

pub(crate) use poll::poll_cq;

#[repr(C)]
pub(crate) struct Chan {
    pub(crate) c: sys::ibv_comp_channel,
    pub(crate) id: ChannelId,
}

impl Destroy for Chan {
    type C = sys::ibv_comp_channel;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.destroy_channel(self.id)
    }
    fn unregister(&self, ctx: &Ctx) {
        ctx.dev().remove_channel_fd(self.id);
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    context: *mut sys::ibv_context,
) -> *mut sys::ibv_comp_channel {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        let id = match ctx.dev().create_channel() {
            Ok(id) => id,
            Err(e) => return null_errno(errno(&e)),
        };
        let fd = match ctx.dev().add_channel_fd(id) {
            Ok(fd) => fd,
            Err(e) => {
                let _ = ctx.dev().destroy_channel(id);
                return null_errno(e.raw_os_error().unwrap_or(libc::EMFILE));
            }
        };
        crate::make_fd_blocking(fd);
        let mut c: sys::ibv_comp_channel = zeroed();
        c.context = context;
        c.fd = fd;
        leak(Chan { c, id }).cast()
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut sys::ibv_comp_channel) -> c_int {
    // SAFETY: the caller passes a channel of this library and does not use it once destroyed.
    unsafe { destroy::<Chan>(channel) }
}

/// A CQ. Always an `ibv_cq_ex` (whose head is `ibv_cq`), so `ibv_cq_ex_to_cq` and
/// `ibv_create_cq_ex` share one object.
#[repr(C)]
pub(crate) struct Cq {
    pub(crate) c: sys::ibv_cq_ex,
    pub(crate) id: CqId,
    pub(crate) poller: CqPoller,
    /// State of the `ibv_start_poll` API.
    pub(crate) poll_state: std::cell::UnsafeCell<poll::CqPoll>,
    /// The parent domain it was made in (`IBV_CQ_INIT_ATTR_MASK_PD`), or null.
    parent_domain: *mut sys::ibv_pd,
}

impl Destroy for Cq {
    type C = sys::ibv_cq;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.destroy_cq(self.id)
    }
    fn unregister(&self, ctx: &Ctx) {
        ctx.shared.registry().cqs.remove(&self.id.0);
    }
    fn pd(&self) -> *mut sys::ibv_pd {
        self.parent_domain
    }
}

impl Cq {
    pub(crate) fn ctx(&self) -> Option<&Ctx> {
        // SAFETY: a CQ's context is a live context.
        unsafe { ctx_of(self.c.context) }
    }
    pub(crate) fn c_ptr(&self) -> *mut sys::ibv_cq {
        std::ptr::addr_of!(self.c).cast_mut().cast()
    }
}

/// Create a CQ object (shared by `ibv_create_cq` and `ibv_create_cq_ex`).
fn create_cq_obj(
    ctx: &Ctx,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut sys::ibv_comp_channel,
    comp_vector: i64,
    timestamps: bool,
    parent_domain: *mut sys::ibv_pd,
) -> Result<*mut Cq, c_int> {
    if cqe <= 0 {
        return Err(libc::EINVAL);
    }
    // A completion vector names one of the context's `num_comp_vectors` interrupt
    // vectors; a program that asks for one the device lacks gets EINVAL, as from a
    // kernel device, rather than a CQ whose events it would look for elsewhere.
    if !(0..i64::from(ctx.vctx.context.num_comp_vectors)).contains(&comp_vector) {
        return Err(libc::EINVAL);
    }
    let ch = if channel.is_null() {
        None
    } else {
        // SAFETY: the caller passes a channel of this library.
        Some(unsafe { obj::<Chan, _>(channel) }.ok_or(libc::EINVAL)?.id)
    };
    let (id, cap) = ctx
        .dev()
        .create_cq(cqe as u32, ch, timestamps)
        .map_err(|e| errno(&e))?;
    let mut c: sys::ibv_cq_ex = zeroed();
    c.context = ctx.c_ptr();
    c.channel = channel;
    c.cq_context = cq_context;
    c.handle = id.0;
    c.cqe = cap as c_int;
    let p = leak(Cq {
        c,
        id,
        poller: CqPoller::new(id),
        poll_state: Default::default(),
        parent_domain,
    });
    // SAFETY: null or the live parent domain the CQ is made in.
    unsafe { crate::pd::hold(parent_domain) };
    ctx.shared.registry().cqs.insert(id.0, p as usize);
    Ok(p)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut sys::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut sys::ibv_comp_channel,
    comp_vector: c_int,
) -> *mut sys::ibv_cq {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        match create_cq_obj(
            ctx,
            cqe,
            cq_context,
            channel,
            comp_vector.into(),
            false,
            std::ptr::null_mut(),
        ) {
            Ok(p) => p.cast(),
            Err(e) => null_errno(e),
        }
    })
}

/// The completion fields an `ibv_cq_ex` can be asked for that softrdma fills.
const WC_EX_SUPPORTED: u64 = (sys::IBV_WC_EX_WITH_BYTE_LEN
    | sys::IBV_WC_EX_WITH_IMM
    | sys::IBV_WC_EX_WITH_QP_NUM
    | sys::IBV_WC_EX_WITH_SRC_QP
    | sys::IBV_WC_EX_WITH_SLID
    | sys::IBV_WC_EX_WITH_SL
    | sys::IBV_WC_EX_WITH_DLID_PATH_BITS
    | sys::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP
    | sys::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK) as u64;

/// The `wc_flags` that ask for a completion's time, on the device clock or the wall clock.
const WC_EX_TIMES: u64 = (sys::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP
    | sys::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK) as u64;

/// `verbs_context.create_cq_ex`: the same CQ, with the `ibv_start_poll` API set.
pub(crate) unsafe extern "C" fn create_cq_ex(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_cq_init_attr_ex,
) -> *mut sys::ibv_cq_ex {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = unsafe { &*attr };
        if a.wc_flags & !WC_EX_SUPPORTED != 0
            || a.comp_mask & !(sys::IBV_CQ_INIT_ATTR_MASK_FLAGS | sys::IBV_CQ_INIT_ATTR_MASK_PD)
                != 0
        {
            return null_errno(libc::EOPNOTSUPP);
        }
        // A CQ may be made in a parent domain (mlx5 then takes its buffer from the
        // domain's allocators; softrdma has none to take): it must be one of this context.
        // SAFETY: the caller passes null or a PD of this library.
        if a.comp_mask & sys::IBV_CQ_INIT_ATTR_MASK_PD != 0
            && !unsafe { crate::pd::is_parent_domain(a.parent_domain, context) }
        {
            return null_errno(libc::EINVAL);
        }
        let ts = a.wc_flags & WC_EX_TIMES != 0;
        let cqe = c_int::try_from(a.cqe).unwrap_or(c_int::MAX);
        let parent = if a.comp_mask & sys::IBV_CQ_INIT_ATTR_MASK_PD != 0 {
            a.parent_domain
        } else {
            std::ptr::null_mut()
        };
        match create_cq_obj(
            ctx,
            cqe,
            a.cq_context,
            a.channel,
            a.comp_vector.into(),
            ts,
            parent,
        ) {
            Ok(p) => {
                // SAFETY: `p` is the live CQ just made; nothing else uses it yet.
                poll::init_cq_ex(unsafe { &mut (*p).c });
                p.cast()
            }
            Err(e) => null_errno(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut sys::ibv_cq) -> c_int {
    // SAFETY: the caller passes a CQ of this library and does not use it once destroyed.
    unsafe { destroy::<Cq>(cq) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut sys::ibv_cq, cqe: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a CQ of this library.
        let Some(q) = (unsafe { obj::<Cq, _>(cq) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = q.ctx() else {
            return libc::EINVAL;
        };
        if cqe <= 0 {
            return libc::EINVAL;
        }
        let id = q.id;
        match ctx.dev().resize_cq(id, cqe as u32) {
            Ok(cap) => {
                // SAFETY: `cq` is live; `cqe` is the program-visible capacity.
                unsafe { (*cq).cqe = cap as c_int };
                0
            }
            Err(e) => errno(&e),
        }
    })
}

/// `ops.req_notify_cq`.
pub(crate) unsafe extern "C" fn req_notify_cq(
    cq: *mut sys::ibv_cq,
    solicited_only: c_int,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a CQ of this library.
        let Some(q) = (unsafe { obj::<Cq, _>(cq) }) else {
            return libc::EINVAL;
        };
        let Some(ctx) = q.ctx() else {
            return libc::EINVAL;
        };
        let arm = if solicited_only != 0 {
            Arm::Solicited
        } else {
            Arm::Next
        };
        let id = q.id;
        let r = ctx.dev().req_notify_cq(id, arm);
        // The program may now block on the channel's fd, out of the device's sight.
        ctx.dev().flush();
        match r {
            Ok(()) => 0,
            Err(e) => errno(&e),
        }
    })
}

/// Blocks until the channel has an event; the waiting thread drives the device's
/// progress meanwhile. (The channel fd is an eventfd, handed out blocking, that is
/// readable while events are pending, so programs may also poll(2) it first.) If the
/// program set O_NONBLOCK on the fd, returns -1 with EAGAIN when no event is pending,
/// as a read(2) of a kernel driver's channel fd does.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut sys::ibv_comp_channel,
    cq: *mut *mut sys::ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a channel of this library.
        let Some(ch) = (unsafe { obj::<Chan, _>(channel) }) else {
            return minus_one(libc::EINVAL);
        };
        // SAFETY: a channel's context is a live context.
        let Some(ctx) = (unsafe { ctx_of(ch.c.context) }) else {
            return minus_one(libc::EINVAL);
        };
        if cq.is_null() || cq_context.is_null() {
            return minus_one(libc::EINVAL);
        }
        let id = ch.id;
        let dev = ctx.dev();
        let nonblocking = crate::fd_nonblocking(ch.c.fd);
        let timeout = nonblocking.then_some(std::time::Duration::ZERO);
        loop {
            let got = dev.wait_for(timeout, || dev.get_cq_event(id));
            let Some(cq_id) = got else {
                if nonblocking {
                    return minus_one(libc::EAGAIN);
                }
                continue;
            };
            let p = ctx.shared.registry().cqs.get(&cq_id.0).copied();
            let Some(p) = p else {
                // The CQ was destroyed meanwhile: not an event for anyone.
                continue;
            };
            let q = p as *mut Cq;
            // SAFETY: registered CQs are live (removed from the registry before freeing);
            // `cq` and `cq_context` are the caller's out pointers.
            unsafe {
                *cq = (*q).c_ptr();
                *cq_context = (*q).c.cq_context;
            }
            return 0;
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut sys::ibv_cq, nevents: u32) {
    guard((), || {
        // SAFETY: the caller passes a CQ of this library.
        let Some(q) = (unsafe { obj::<Cq, _>(cq) }) else {
            return;
        };
        let Some(ctx) = q.ctx() else {
            return;
        };
        let id = q.id;
        if ctx.dev().ack_cq_events(id, nevents).is_ok() {
            // SAFETY: `cq` is live; the counter is the program-visible one.
            unsafe {
                (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(nevents)
            };
        }
    })
}
