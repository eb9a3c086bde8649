//! The process's connection manager: the CM agent of the device the rdma_cm uses (the
//! first listed, whose context `rdma_get_devices` hands out first), its default PD (what
//! librdmacm gives every id as `id->pd`), and the ids by their handle in the CM model, so
//! that an event finds its `rdma_cm_id`.
//!
//! One device serves every id: each process is its own RDMA device, and a server bound to
//! the wildcard address is found at any of the host's addresses through the registry.

use std::collections::HashMap;
use std::ffi::c_int;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::{Arc, Mutex, MutexGuard};

use softrdma_cm::agent::Agent;
use softrdma_cm::cma::{Cma, CmaError, IdHandle};

use super::abi;
use super::id::CmId;
use crate::device::Ctx;
use crate::{pd, sys, zeroed};

/// The CM of this process.
pub(crate) struct Cm {
    agent: Arc<Agent>,
    /// The context ids use (`id->verbs`), kept open for the life of the process.
    ctx: usize,
    /// The PD every id starts with (`id->pd`).
    pd: usize,
    /// `CmId` addresses by handle (see [`Cm::claim`]).
    ids: Mutex<HashMap<IdHandle, usize>>,
    /// The process that started it: a forked child starts its own (see
    /// [`crate::this_process`]).
    pid: u32,
}

static CM: Mutex<Option<Arc<Cm>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The errno of a CM model error.
pub(crate) fn errno(e: CmaError) -> c_int {
    e.errno
}

/// The process's CM, started on first use.
pub(crate) fn get() -> Result<Arc<Cm>, c_int> {
    let mut g = lock(&CM);
    if let Some(c) = g.as_ref() {
        if c.pid == crate::this_process() {
            return Ok(Arc::clone(c));
        }
        // The parent's CM, inherited by fork: its thread is not in this process, so
        // dropping it would wait forever; it is left as it is.
        std::mem::forget(g.take());
    }
    let ctx = *super::devices::contexts()?.first().ok_or(libc::ENODEV)?;
    // SAFETY: `contexts` returns live contexts of this library, never closed.
    let c = unsafe { Ctx::from_ptr(ctx) }.ok_or(libc::ENODEV)?;
    let agent = Agent::for_device(&c.shared.dev).map_err(|e| {
        eprintln!("librdmacm (softrdma): starting the CM: {e}");
        e.raw_os_error().unwrap_or(libc::EIO)
    })?;
    // SAFETY: `ctx` is a live context of this library.
    let pd = unsafe { pd::ibv_alloc_pd(ctx) };
    if pd.is_null() {
        return Err(libc::ENOMEM);
    }
    let cm = Arc::new(Cm {
        agent,
        ctx: ctx as usize,
        pd: pd as usize,
        ids: Mutex::new(HashMap::new()),
        pid: crate::this_process(),
    });
    *g = Some(Arc::clone(&cm));
    // Once per program: a forked child inherits the registration and the handler finds
    // the child's own CM.
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: registering a plain function with no arguments; atexit copies the pointer.
    AT_EXIT.call_once(|| unsafe {
        libc::atexit(at_exit);
    });
    Ok(cm)
}

/// At exit, the CM says goodbye for the process's ids (see `Cma::shutdown`): the kernel
/// does this for a process whose rdma_cm file closes, and peers count on it (a program
/// that exits while connected leaves its peer a DISCONNECTED, not a minute of DREQ
/// retries against a device that is gone).
extern "C" fn at_exit() {
    // Only this process's CM: a parent's, inherited by fork, has no thread here to answer.
    let cm = CM.try_lock().ok().and_then(|g| {
        g.as_ref()
            .filter(|c| c.pid == crate::this_process())
            .map(Arc::clone)
    });
    if let Some(cm) = cm {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cm.call(|c, now| c.shutdown(now));
        }));
    }
}

impl Cm {
    /// Run `f` on the CM model (see [`Agent::call`]).
    pub(crate) fn call<R>(&self, f: impl FnOnce(&mut Cma, u64) -> R) -> R {
        self.agent.call(f)
    }

    pub(crate) fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The context ids bound to the device use.
    pub(crate) fn ctx(&self) -> *mut sys::ibv_context {
        self.ctx as *mut sys::ibv_context
    }

    /// The default PD.
    pub(crate) fn pd(&self) -> *mut sys::ibv_pd {
        self.pd as *mut sys::ibv_pd
    }

    /// The device's address (its GID's IP).
    pub(crate) fn device_ip(&self) -> IpAddr {
        self.agent.device().addr().ip()
    }

    pub(crate) fn register(&self, h: IdHandle, id: *mut CmId) {
        lock(&self.ids).insert(h, id as usize);
    }

    pub(crate) fn unregister(&self, h: IdHandle) {
        lock(&self.ids).remove(&h);
    }

    /// The id of handle `h`, counted as having one more event handed out (under the
    /// table's lock, so that `rdma_destroy_id`, which unregisters first, then waits for
    /// every counted event's ack, never frees an id an event is about to name).
    pub(crate) fn claim(&self, h: IdHandle) -> Option<*mut CmId> {
        let ids = lock(&self.ids);
        let p = *ids.get(&h)? as *mut CmId;
        // SAFETY: registered ids are live until unregistered, which takes this lock.
        unsafe { (*p).event_reported() };
        Some(p)
    }
}

/// A socket address from C: `Ok(None)` for NULL; EAFNOSUPPORT for AF_IB (softrdma
/// addresses are IP); EINVAL for another family (librdmacm's `ucma_addrlen` is 0).
///
/// # Safety
/// `sa` is null or points at a socket address of the family it names.
pub(crate) unsafe fn sockaddr_from_c(
    sa: *const libc::sockaddr,
) -> Result<Option<SocketAddr>, c_int> {
    if sa.is_null() {
        return Ok(None);
    }
    // SAFETY: per the contract; the family field is at offset 0 of every socket address,
    // and the struct read matches the family.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let s = &*sa.cast::<libc::sockaddr_in>();
                let ip = Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr));
                Ok(Some(SocketAddr::V4(SocketAddrV4::new(
                    ip,
                    u16::from_be(s.sin_port),
                ))))
            }
            libc::AF_INET6 => {
                let s = &*sa.cast::<libc::sockaddr_in6>();
                Ok(Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(s.sin6_addr.s6_addr),
                    u16::from_be(s.sin6_port),
                    s.sin6_flowinfo,
                    s.sin6_scope_id,
                ))))
            }
            abi::AF_IB => Err(libc::EAFNOSUPPORT),
            _ => Err(libc::EINVAL),
        }
    }
}

/// A socket address for C, in the `rdma_addr` union.
pub(crate) fn sockaddr_to_c(a: SocketAddr) -> abi::rdma_sockaddr {
    let mut u: abi::rdma_sockaddr = zeroed();
    match a {
        SocketAddr::V4(v4) => {
            // SAFETY: writing a whole union member of plain integers.
            let s = unsafe { &mut u.sin };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above.
            let s = unsafe { &mut u.sin6 };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            s.sin6_flowinfo = v6.flowinfo();
            s.sin6_scope_id = v6.scope_id();
        }
    }
    u
}

/// The RoCE GID of an IP address (IPv4-mapped for IPv4), as the C `ibv_gid`.
pub(crate) fn gid_of(ip: IpAddr) -> sys::ibv_gid {
    sys::ibv_gid {
        raw: softrdma_device::verbs::Gid::from_ip(ip).0,
    }
}
