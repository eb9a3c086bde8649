//! Devices: the list, the device an open context shares with the process's other contexts
//! on it, what a context tells of its device (attributes, ports, GIDs, P_Keys), its async
//! events, and sysfs (the view `softrdma run` mounts for the program).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use softrdma_device::verbs::{self, AsyncEvent, Gid};
use softrdma_device::{config, DeviceAddr, DeviceConfig, DeviceEntry};

use crate::sys;
use crate::{guard, minus_one, null_errno, set_errno, zeroed};

/// One entry of the device list. Entries live for the whole process (programs keep
/// `ibv_device` pointers after `ibv_free_device_list`, as rdma-core allows while a context
/// is open), so they are leaked, once per device name.
#[repr(C)]
pub(crate) struct Dev {
    /// The C view; first, so an `ibv_device *` is a `Dev *`.
    pub(crate) dev: sys::ibv_device,
    pub(crate) entry: DeviceEntry,
    /// Index in the process's device list (`ibv_get_device_index`).
    index: c_int,
}

// SAFETY: the raw pointers inside `ibv_device` are none (only function pointers and
// arrays); a `Dev` is never mutated after it is published.
unsafe impl Sync for Dev {}
// SAFETY: as above.
unsafe impl Send for Dev {}

/// Every device entry ever listed, by name.
static DEVICES: Mutex<Vec<&'static Dev>> = Mutex::new(Vec::new());

/// An open softrdma device shared by every context of this process on it (every process
/// is its own NIC: opening a device twice must not take a second address).
pub(crate) struct DevShared {
    pub(crate) dev: Arc<softrdma_device::Device>,
    /// C objects by engine id, for CQ events and async events.
    pub(crate) reg: Mutex<Registry>,
    /// The open contexts' async-event queues, by the program's `ibv_context *`; whoever
    /// takes the device's events routes them here (held while routing, so each context
    /// sees its events in the device's order).
    pub(crate) ctxs: Mutex<Vec<(usize, Arc<CtxAsync>)>>,
}

/// One async event routed to a context, resolved to the program's object (stored as
/// usize: the queue is only a hand-over, the objects are owned by the program).
#[derive(Clone, Copy)]
struct QueuedEvent {
    ty: sys::ibv_event_type,
    /// The `ibv_cq`/`ibv_qp`/`ibv_srq` the event concerns; 0 for a device-wide event.
    element: usize,
    port: c_int,
}

/// A context's own async events. Each context has its own `async_fd`, as each open of a
/// kernel uverbs device has: programs key their handlers by that descriptor (UCX refuses
/// a second context on the device whose `async_fd` it already watches, and Open MPI opens
/// one for its point-to-point layer and another for one-sided windows), and an event
/// goes to the context that owns the object it concerns, device-wide ones to every
/// context.
pub(crate) struct CtxAsync {
    /// `context->async_fd`: an epoll set of the device's async fd (events not yet routed)
    /// and `pending` (events routed here), so it polls readable when either is; its own
    /// descriptor, so O_NONBLOCK on it is this context's alone.
    epoll: std::os::fd::OwnedFd,
    /// Readable while `queue` holds events (set and cleared under its lock).
    pending: softrdma_device::EventFd,
    queue: Mutex<std::collections::VecDeque<QueuedEvent>>,
}

impl CtxAsync {
    fn new(device_async_fd: c_int) -> Result<CtxAsync, i32> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let pending =
            softrdma_device::EventFd::new().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        // SAFETY: epoll_create1 takes no pointers; the descriptor is owned below.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO));
        }
        // SAFETY: `ep` is a new descriptor nothing else owns.
        let epoll = unsafe { std::os::fd::OwnedFd::from_raw_fd(ep) };
        for fd in [device_async_fd, pending.as_raw_fd()] {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: `ev` is a live epoll_event; both descriptors are open.
            if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
                return Err(std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO));
            }
        }
        Ok(CtxAsync {
            epoll,
            pending,
            queue: Mutex::new(std::collections::VecDeque::new()),
        })
    }
    pub(crate) fn fd(&self) -> c_int {
        use std::os::fd::AsRawFd;
        self.epoll.as_raw_fd()
    }
    fn push(&self, e: QueuedEvent) {
        let mut q = lock(&self.queue);
        q.push_back(e);
        self.pending.set();
    }
    fn pop(&self) -> Option<QueuedEvent> {
        let mut q = lock(&self.queue);
        let e = q.pop_front();
        if q.is_empty() {
            self.pending.clear();
        }
        e
    }
}

/// Addresses of this library's C objects by engine id (stored as usize: the registry is
/// only a lookup table, the objects are owned by the program's handles).
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) cqs: HashMap<u32, usize>,
    pub(crate) qps: HashMap<u32, usize>,
    pub(crate) srqs: HashMap<u32, usize>,
}

/// The open devices by name, each with the process that opened it (see
/// [`crate::this_process`]: a forked child does not use its parent's).
static OPEN: Mutex<Vec<(String, u32, Weak<DevShared>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DevShared {
    pub(crate) fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        lock(&self.reg)
    }
}

/// An open context. `verbs_context` comes first and ends with `struct ibv_context`, so a
/// program's `ibv_context *` points inside this struct and extended calls find the
/// `verbs_context` just before it, as in rdma-core.
#[repr(C)]
pub(crate) struct Ctx {
    pub(crate) vctx: sys::verbs_context,
    pub(crate) shared: Arc<DevShared>,
    pub(crate) dev: &'static Dev,
    /// This context's async events and its `async_fd`.
    pub(crate) asyn: Arc<CtxAsync>,
    /// The command file this context was opened on or imported from.
    pub(crate) cmd: Arc<CmdFile>,
    /// This context's descriptor of it (`cmd_fd`), closed with the context.
    pub(crate) cmd_fd: OwnedFd,
}

/// A context's command file, what `ibv_context::cmd_fd` refers to. On a kernel device it
/// is the open uverbs file that holds the context's objects, and `ibv_import_device` of a
/// dup of it makes another context on the same objects (rdma-core's shared PD/MR/DM).
/// softrdma's objects live in the engine of the process's device, so the file is a memfd
/// whose inode names the context: every descriptor of it (dup, and the contexts imported
/// from them) reaches the same `CmdFile`, and with it the same device and objects.
pub(crate) struct CmdFile {
    pub(crate) dev: &'static Dev,
    pub(crate) shared: Arc<DevShared>,
}

/// The live command files of this process by (st_dev, st_ino), each with the process that
/// made it (a forked child cannot import its parent's contexts: see
/// [`crate::this_process`]).
static CMD_FILES: Mutex<Vec<(u32, FileKey, Weak<CmdFile>)>> = Mutex::new(Vec::new());

/// A file's identity: (st_dev, st_ino).
type FileKey = (u64, u64);

impl Drop for CmdFile {
    fn drop(&mut self) {
        // This file's own entry no longer upgrades: drop it, and any other dead one.
        lock(&CMD_FILES).retain(|(_, _, w)| w.strong_count() > 0);
    }
}

/// The identity of the file behind `fd`; EBADF when `fd` is not open.
fn file_key(fd: BorrowedFd<'_>) -> Result<FileKey, c_int> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `fd` is an open descriptor and `st` has room for a stat buffer.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(crate::errno_now());
    }
    // SAFETY: fstat succeeded, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Ok((st.st_dev, st.st_ino))
}

/// A new command file for a context opened on `dev`.
pub(crate) fn new_cmd_file(
    dev: &'static Dev,
    shared: Arc<DevShared>,
) -> Result<(Arc<CmdFile>, OwnedFd), c_int> {
    let name =
        std::ffi::CString::new(format!("softrdma-{}", dev.entry.name)).map_err(|_| libc::EINVAL)?;
    // SAFETY: `name` is a NUL-terminated string; the result is checked.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(crate::errno_now());
    }
    // SAFETY: `raw` is a descriptor memfd_create just opened, owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let key = file_key(fd.as_fd())?;
    let file = Arc::new(CmdFile { dev, shared });
    let me = crate::this_process();
    let mut all = lock(&CMD_FILES);
    all.retain(|(pid, _, w)| *pid == me && w.strong_count() > 0);
    all.push((me, key, Arc::downgrade(&file)));
    Ok((file, fd))
}

/// The command file of this process that `fd` is a descriptor of. EBADF when `fd` is not
/// open; EOPNOTSUPP when it is no context's of this process: softrdma's objects live in
/// the process that made them, so a context of another process (passed over a socket, or
/// inherited through fork) cannot be imported, nor can a file that is no context's.
pub(crate) fn find_cmd_file(fd: BorrowedFd<'_>) -> Result<Arc<CmdFile>, c_int> {
    let key = file_key(fd)?;
    let me = crate::this_process();
    let found = lock(&CMD_FILES)
        .iter()
        .find(|(pid, k, _)| *pid == me && *k == key)
        .and_then(|(_, _, w)| w.upgrade());
    found.ok_or(libc::EOPNOTSUPP)
}

const CTX_OFFSET: usize = std::mem::offset_of!(sys::verbs_context, context);

impl Ctx {
    /// The context behind a program's `ibv_context *`.
    ///
    /// # Safety
    /// `p` is null or a context this library returned and not yet closed.
    pub(crate) unsafe fn from_ptr<'a>(p: *const sys::ibv_context) -> Option<&'a Ctx> {
        if p.is_null() {
            return None;
        }
        // SAFETY: every ibv_context this library hands out is the `context` field of the
        // `verbs_context` at offset 0 of a live `Ctx` (see `ibv_open_device`).
        unsafe { Some(&*p.cast::<u8>().sub(CTX_OFFSET).cast::<Ctx>()) }
    }
    /// The program's view of this context.
    pub(crate) fn c_ptr(&self) -> *mut sys::ibv_context {
        std::ptr::addr_of!(self.vctx.context).cast_mut()
    }
    pub(crate) fn dev(&self) -> &softrdma_device::Device {
        &self.shared.dev
    }
    /// Hand a new context to the program.
    pub(crate) fn into_raw(self: Box<Self>) -> *mut sys::ibv_context {
        let p = Box::into_raw(self);
        // SAFETY: `p` is the live Ctx just leaked; its context field is what we return.
        unsafe { (*p).c_ptr() }
    }
    /// Take back a context to close it.
    ///
    /// # Safety
    /// `p` came from [`Ctx::into_raw`] and is taken back once.
    pub(crate) unsafe fn from_raw(p: *mut sys::ibv_context) -> Box<Ctx> {
        // SAFETY: per the contract, `p` is the `context` field of a boxed Ctx.
        unsafe { Box::from_raw(p.cast::<u8>().sub(CTX_OFFSET).cast::<Ctx>()) }
    }
}

fn fill_cstr(dst: &mut [c_char], s: &str) {
    let n = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
}

/// The device entry for a configured device, created (and leaked) once per name.
fn dev_entry(list: &mut Vec<&'static Dev>, e: &DeviceEntry) -> &'static Dev {
    if let Some(d) = list.iter().find(|d| d.entry.name == e.name) {
        if d.entry == *e {
            return d;
        }
    }
    let mut dev: sys::ibv_device = zeroed();
    dev.node_type = sys::IBV_NODE_CA;
    dev.transport_type = sys::IBV_TRANSPORT_IB;
    let index = list.len() as c_int;
    fill_cstr(&mut dev.name, &e.name);
    fill_cstr(&mut dev.dev_name, &format!("uverbs{index}"));
    fill_cstr(
        &mut dev.dev_path,
        &format!("/sys/class/infiniband_verbs/uverbs{index}"),
    );
    fill_cstr(
        &mut dev.ibdev_path,
        &format!("/sys/class/infiniband/{}", e.name),
    );
    let d: &'static Dev = Box::leak(Box::new(Dev {
        dev,
        entry: e.clone(),
        index,
    }));
    list.push(d);
    d
}

/// The configured devices; a configuration error is reported once on stderr, as
/// rdma-core reports provider problems, and yields an empty list.
fn configured() -> Vec<DeviceEntry> {
    match config::devices() {
        Ok(l) => l,
        Err(e) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| eprintln!("libibverbs (softrdma): {e}"));
            Vec::new()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut sys::ibv_device {
    guard(std::ptr::null_mut(), || {
        softrdma_device::log::init_from_env();
        let entries = configured();
        let mut all = lock(&DEVICES);
        let mut v: Vec<*mut sys::ibv_device> = entries
            .iter()
            .map(|e| std::ptr::addr_of!(dev_entry(&mut all, e).dev).cast_mut())
            .collect();
        let n = v.len();
        v.push(std::ptr::null_mut());
        if !num_devices.is_null() {
            // SAFETY: the caller passes null or a valid int pointer.
            unsafe { *num_devices = n as c_int };
        }
        // Allocated with malloc so that a program freeing it with free() (wrongly) and
        // ibv_free_device_list agree.
        let bytes = v.len() * std::mem::size_of::<*mut sys::ibv_device>();
        // SAFETY: malloc of a nonzero size; the result is checked.
        let p = unsafe { libc::malloc(bytes) }.cast::<*mut sys::ibv_device>();
        if p.is_null() {
            return null_errno(libc::ENOMEM);
        }
        // SAFETY: `p` has room for `v.len()` pointers.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, v.len()) };
        p
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut sys::ibv_device) {
    guard((), || {
        // SAFETY: `list` is null or came from ibv_get_device_list (malloc).
        unsafe { libc::free(list.cast::<c_void>()) }
    })
}

/// The `Dev` behind an `ibv_device *`.
pub(crate) unsafe fn dev_of<'a>(d: *const sys::ibv_device) -> Option<&'a Dev> {
    if d.is_null() {
        return None;
    }
    // SAFETY: every ibv_device this library hands out is the first field of a leaked Dev.
    unsafe { Some(&*d.cast::<Dev>()) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(device: *mut sys::ibv_device) -> *const c_char {
    guard(std::ptr::null(), || {
        // SAFETY: caller passes a device from our list.
        match unsafe { dev_of(device) } {
            Some(d) => d.dev.name.as_ptr(),
            None => {
                set_errno(libc::EINVAL);
                std::ptr::null()
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_index(device: *mut sys::ibv_device) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a device from our list.
        match unsafe { dev_of(device) } {
            Some(d) => d.index,
            None => -1,
        }
    })
}

/// The address a device has (open) or would take now (not open).
fn device_addr(d: &Dev) -> SocketAddr {
    if let Some(sh) = find_open(&d.entry.name) {
        return sh.dev.addr();
    }
    match d.entry.addr {
        DeviceAddr::Fixed(a) => a,
        DeviceAddr::AutoLoopback(p) => config::probe_auto_loopback(p),
    }
}

fn find_open(name: &str) -> Option<Arc<DevShared>> {
    let me = crate::this_process();
    lock(&OPEN)
        .iter()
        .find(|(n, pid, _)| n == name && *pid == me)
        .and_then(|(_, _, w)| w.upgrade())
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_guid(device: *mut sys::ibv_device) -> u64 {
    guard(0, || {
        // SAFETY: caller passes a device from our list.
        let Some(d) = (unsafe { dev_of(device) }) else {
            set_errno(libc::EINVAL);
            return 0;
        };
        let guid = match find_open(&d.entry.name) {
            Some(sh) => sh.dev.read(|r| r.device_attr().node_guid),
            None => {
                // The engine's own GUID rule, for the address the device would take.
                let gid = Gid::from_ip(device_addr(d).ip());
                verbs::Context::new(vec![gid], 0).device_attr().node_guid
            }
        };
        guid.to_be()
    })
}

fn open_shared(d: &Dev) -> Result<Arc<DevShared>, i32> {
    let me = crate::this_process();
    let mut open = lock(&OPEN);
    // A parent's entries go too: its devices stay, unused, with the contexts that hold them.
    open.retain(|(_, pid, w)| *pid == me && w.strong_count() > 0);
    if let Some(sh) = open
        .iter()
        .find(|(n, _, _)| *n == d.entry.name)
        .and_then(|(_, _, w)| w.upgrade())
    {
        return Ok(sh);
    }
    // One device per name in the process, shared with the Rust face's handles of it.
    let cfg = DeviceConfig::from_entry(&d.entry);
    let dev = softrdma_device::Device::open_shared(&cfg).map_err(|e| {
        eprintln!("libibverbs (softrdma): opening {}: {e}", d.entry.name);
        e.raw_os_error().unwrap_or(libc::EIO)
    })?;
    let sh = Arc::new(DevShared {
        dev,
        reg: Mutex::new(Registry::default()),
        ctxs: Mutex::new(Vec::new()),
    });
    open.push((d.entry.name.clone(), me, Arc::downgrade(&sh)));
    Ok(sh)
}

/// Open the device `d` names (shared by every context of this process on it).
pub(crate) fn open(d: &Dev) -> Result<(&'static Dev, Arc<DevShared>), i32> {
    // Re-resolve by name: the configuration may have changed since the list was made.
    let d: &'static Dev = {
        let entries = configured();
        let mut all = lock(&DEVICES);
        match entries.iter().find(|e| e.name == d.entry.name) {
            Some(e) => dev_entry(&mut all, e),
            None => return Err(libc::ENODEV),
        }
    };
    Ok((d, open_shared(d)?))
}

// ------------------------------------------------------------------ queries

pub(crate) fn device_attr(ctx: &Ctx) -> sys::ibv_device_attr {
    let a = ctx.dev().device_attr();
    let mut o: sys::ibv_device_attr = zeroed();
    fill_cstr(&mut o.fw_ver, &a.fw_ver);
    o.node_guid = a.node_guid.to_be();
    o.sys_image_guid = a.sys_image_guid.to_be();
    o.max_mr_size = a.max_mr_size;
    o.page_size_cap = a.page_size_cap;
    o.vendor_id = a.vendor_id;
    o.vendor_part_id = a.vendor_part_id;
    o.hw_ver = a.hw_ver;
    o.max_qp = a.max_qp as c_int;
    o.max_qp_wr = a.max_qp_wr as c_int;
    o.device_cap_flags = a.device_cap_flags;
    o.max_sge = a.max_sge as c_int;
    o.max_sge_rd = a.max_sge_rd as c_int;
    o.max_cq = a.max_cq as c_int;
    o.max_cqe = a.max_cqe as c_int;
    o.max_mr = a.max_mr as c_int;
    o.max_pd = a.max_pd as c_int;
    o.max_qp_rd_atom = a.max_qp_rd_atom as c_int;
    o.max_ee_rd_atom = a.max_ee_rd_atom as c_int;
    o.max_res_rd_atom = a.max_res_rd_atom as c_int;
    o.max_qp_init_rd_atom = a.max_qp_init_rd_atom as c_int;
    o.atomic_cap = a.atomic_cap;
    o.max_mw = a.max_mw as c_int;
    o.max_ah = a.max_ah as c_int;
    o.max_srq = a.max_srq as c_int;
    o.max_srq_wr = a.max_srq_wr as c_int;
    o.max_srq_sge = a.max_srq_sge as c_int;
    o.max_pkeys = a.max_pkeys;
    o.max_mcast_grp = a.max_mcast_grp as c_int;
    o.max_mcast_qp_attach = a.max_mcast_qp_attach as c_int;
    o.max_total_mcast_qp_attach = a.max_total_mcast_qp_attach as c_int;
    o.local_ca_ack_delay = a.local_ca_ack_delay;
    o.phys_port_cnt = a.phys_port_cnt;
    o
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_device_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        let o = device_attr(ctx);
        // SAFETY: `attr` points at a caller's ibv_device_attr.
        unsafe { attr.write(o) };
        0
    })
}

/// Completion timestamps are device-clock nanoseconds: a 1 GHz clock (in kHz).
const CORE_CLOCK_KHZ: u64 = 1_000_000;

/// On-demand paging: regions need not be backed when registered, the implicit region
/// covers the whole address space, and every operation of every QP type reaches such
/// memory as any other (the device copies through fault-safe accesses in either case).
/// No XRC, so no `xrc_odp_caps`.
fn odp_caps() -> sys::ibv_odp_caps {
    let all = sys::IBV_ODP_SUPPORT_SEND | sys::IBV_ODP_SUPPORT_RECV | sys::IBV_ODP_SUPPORT_SRQ_RECV;
    let mut c: sys::ibv_odp_caps = zeroed();
    c.general_caps = u64::from(sys::IBV_ODP_SUPPORT | sys::IBV_ODP_SUPPORT_IMPLICIT);
    c.per_transport_caps.rc_odp_caps =
        all | sys::IBV_ODP_SUPPORT_WRITE | sys::IBV_ODP_SUPPORT_READ | sys::IBV_ODP_SUPPORT_ATOMIC;
    c.per_transport_caps.uc_odp_caps = all | sys::IBV_ODP_SUPPORT_WRITE;
    c.per_transport_caps.ud_odp_caps = all;
    c
}

/// `verbs_context.query_rt_values` (`ibv_query_rt_values_ex`): the device clock now, in
/// the units of `ibv_wc_read_completion_ts` (nanoseconds since the device opened; the
/// clock's rate is `hca_core_clock`), as mlx5 reports it: the count in `raw_clock.tv_nsec`
/// and `tv_sec` 0. EINVAL for a mask bit other than IBV_VALUES_MASK_RAW_CLOCK.
pub(crate) unsafe extern "C" fn query_rt_values(
    context: *mut sys::ibv_context,
    values: *mut sys::ibv_values_ex,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if values.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `values` points at the caller's ibv_values_ex.
        let v = unsafe { &mut *values };
        if v.comp_mask & !sys::IBV_VALUES_MASK_RAW_CLOCK != 0 {
            return libc::EINVAL;
        }
        let mut done = 0;
        if v.comp_mask & sys::IBV_VALUES_MASK_RAW_CLOCK != 0 {
            v.raw_clock.tv_sec = 0;
            v.raw_clock.tv_nsec = ctx.dev().now().min(i64::MAX as u64) as _;
            done |= sys::IBV_VALUES_MASK_RAW_CLOCK;
        }
        v.comp_mask = done;
        0
    })
}

/// `verbs_context.query_device_ex`.
pub(crate) unsafe extern "C" fn query_device_ex(
    context: *mut sys::ibv_context,
    input: *const sys::ibv_query_device_ex_input,
    attr: *mut sys::ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        // SAFETY: `input` is null or the caller's input struct.
        if attr.is_null() || (!input.is_null() && unsafe { (*input).comp_mask } != 0) {
            return libc::EINVAL;
        }
        if attr_size < std::mem::size_of::<sys::ibv_device_attr>() {
            return libc::EINVAL;
        }
        let mut o: sys::ibv_device_attr_ex = zeroed();
        o.orig_attr = device_attr(ctx);
        o.completion_timestamp_mask = u64::MAX;
        o.hca_core_clock = CORE_CLOCK_KHZ;
        o.max_dm_size = ctx.dev().read(|r| r.device_attr().max_dm_size);
        o.phys_port_cnt_ex = u32::from(o.orig_attr.phys_port_cnt);
        o.odp_caps = odp_caps();
        // The kernel reports every capability here, the 32 bits of `device_cap_flags`
        // among them (`ib_uverbs_ex_query_device`); softrdma has none past them.
        o.device_cap_flags_ex = u64::from(o.orig_attr.device_cap_flags);
        // SAFETY: `attr` has `attr_size` bytes (the caller's sizeof).
        unsafe { crate::copy_prefix(&o, attr, attr_size) };
        0
    })
}

fn port_attr(ctx: &Ctx, port: u8) -> Result<sys::ibv_port_attr, i32> {
    let p = ctx.dev().port_attr(port).map_err(|e| e.errno.code())?;
    let mut o: sys::ibv_port_attr = zeroed();
    o.state = p.state;
    o.max_mtu = p.max_mtu as u32;
    o.active_mtu = p.active_mtu as u32;
    o.gid_tbl_len = p.gid_tbl_len;
    o.port_cap_flags = p.port_cap_flags;
    o.max_msg_sz = p.max_msg_sz;
    o.pkey_tbl_len = p.pkey_tbl_len;
    o.lid = p.lid;
    o.sm_lid = p.sm_lid;
    o.max_vl_num = 1;
    o.active_width = p.active_width;
    o.active_speed = p.active_speed;
    o.phys_state = p.phys_state;
    o.link_layer = p.link_layer;
    Ok(o)
}

/// `verbs_context.query_port`: what the inline `ibv_query_port` calls.
pub(crate) unsafe extern "C" fn query_port_ex(
    context: *mut sys::ibv_context,
    port_num: u8,
    attr: *mut sys::ibv_port_attr,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        match port_attr(ctx, port_num) {
            Ok(o) => {
                // SAFETY: `attr` has `len` bytes (the caller's sizeof).
                unsafe { crate::copy_prefix(&o, attr, len) };
                0
            }
            Err(e) => e,
        }
    })
}

/// The exported `ibv_query_port` (old binaries, or code that bypasses the inline): the
/// compat struct is `ibv_port_attr` up to `link_layer`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    context: *mut sys::ibv_context,
    port_num: u8,
    attr: *mut sys::_compat_ibv_port_attr,
) -> c_int {
    let len = std::mem::offset_of!(sys::ibv_port_attr, flags);
    // SAFETY: forwarded; the compat struct has at least `len` bytes.
    unsafe { query_port_ex(context, port_num, attr.cast::<sys::ibv_port_attr>(), len) }
}

fn gid_of(ctx: &Ctx, port: u32, index: u32) -> Result<Gid, i32> {
    if port != 1 || index > 255 {
        return Err(libc::EINVAL);
    }
    ctx.dev().query_gid(index as u8).map_err(|e| e.errno.code())
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut sys::ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut sys::ibv_gid,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if gid.is_null() || index < 0 {
            return minus_one(libc::EINVAL);
        }
        match gid_of(ctx, port_num as u32, index as u32) {
            Ok(g) => {
                // SAFETY: `gid` points at a caller's 16-byte union.
                unsafe { (*gid).raw = g.0 };
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

fn gid_entry(ctx: &Ctx, port: u32, index: u32) -> Result<sys::ibv_gid_entry, i32> {
    let g = gid_of(ctx, port, index)?;
    let mut e: sys::ibv_gid_entry = zeroed();
    e.gid.raw = g.0;
    e.gid_index = index;
    e.port_num = port;
    e.gid_type = sys::IBV_GID_TYPE_ROCE_V2;
    // The interface holding the GID's address (`lo` for 127.0.0.x), so that programs can
    // name it with if_indextoname as they do for a kernel RoCE device; 0 (none) when no
    // interface of this host holds it.
    e.ndev_ifindex = softrdma_device::netdev::holding(g.to_ip()).map_or(0, |n| n.index);
    Ok(e)
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut sys::ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut sys::ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if entry.is_null() || flags != 0 {
            return libc::EINVAL;
        }
        match gid_entry(ctx, port_num, gid_index) {
            Ok(e) => {
                // SAFETY: `entry` has `entry_size` bytes.
                unsafe { crate::copy_prefix(&e, entry, entry_size) };
                0
            }
            Err(_) => libc::ENODATA,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut sys::ibv_context,
    entries: *mut sys::ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard(-(libc::EIO as isize), || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return -(libc::EINVAL as isize);
        };
        if flags != 0 || (entries.is_null() && max_entries > 0) || entry_size == 0 {
            return -(libc::EINVAL as isize);
        }
        let n = ctx.dev().read(|r| r.gids().len());
        if n > max_entries {
            return -(libc::EINVAL as isize);
        }
        for i in 0..n {
            if let Ok(e) = gid_entry(ctx, 1, i as u32) {
                // SAFETY: the caller's array holds `max_entries` entries of `entry_size`.
                unsafe {
                    let dst = entries.cast::<u8>().add(i * entry_size);
                    crate::copy_prefix(&e, dst.cast::<sys::ibv_gid_entry>(), entry_size);
                }
            }
        }
        n as isize
    })
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34, used by ibv_devinfo): every GID is RoCE v2.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut sys::ibv_context,
    port_num: u8,
    index: u32,
    gid_type: *mut u32,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if gid_type.is_null() {
            return minus_one(libc::EINVAL);
        }
        match gid_of(ctx, port_num as u32, index) {
            Ok(_) => {
                // SAFETY: points at the caller's enum ibv_gid_type_sysfs.
                unsafe { *gid_type = 1 }; // IBV_GID_TYPE_SYSFS_ROCE_V2
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut sys::ibv_context,
    port_num: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if pkey.is_null() || port_num != 1 || !(0..=0xFFFF).contains(&index) {
            return minus_one(libc::EINVAL);
        }
        match ctx.dev().pkey(index as u16) {
            Ok(p) => {
                // SAFETY: points at the caller's __be16.
                unsafe { *pkey = p.to_be() };
                0
            }
            Err(e) => minus_one(e.errno.code()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(
    context: *mut sys::ibv_context,
    port_num: u8,
    pkey: u16,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if port_num != 1 {
            return minus_one(libc::EINVAL);
        }
        let want = u16::from_be(pkey);
        let found = ctx.dev().read(|r| {
            (0..=u16::MAX)
                .map_while(|i| r.pkey(i).ok().map(|p| (i, p)))
                .find(|&(_, p)| p == want)
        });
        match found {
            Some((i, _)) => i as c_int,
            None => minus_one(libc::ENOENT),
        }
    })
}

// ------------------------------------------------------------------ async events

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

// ------------------------------------------------------------------ sysfs

#[no_mangle]
pub unsafe extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// Read `dir/file` into `buf` (NUL-terminated, a trailing newline removed); -1 if absent.
/// Under `softrdma run` the devices' entries (`ibdev_path`, `dev_path`) are the view it
/// mounts for the program; elsewhere they are absent and this reads only real files.
#[no_mangle]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard(-1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the caller passes NUL-terminated strings.
        let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let path = format!("{}/{}", d.to_string_lossy(), f.to_string_lossy());
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) => return minus_one(e.raw_os_error().unwrap_or(libc::ENOENT)),
        };
        let mut n = data.len().min(size - 1);
        if n > 0 && data[n - 1] == b'\n' {
            n -= 1;
        }
        // SAFETY: `buf` has `size` bytes; we write n + 1 <= size.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        n as c_int
    })
}
