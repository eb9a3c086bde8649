//! Devices: the list, the device an open context shares with the process's other contexts
//! on it, what a context tells of its device (attributes, ports, GIDs, P_Keys), its async
//! events, and sysfs (the view `softrdma run` mounts for the program).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use softrdma_device::verbs::{self, Gid};
use softrdma_device::{config, DeviceAddr, DeviceConfig, DeviceEntry};

use crate::sys;
use crate::{guard, null_errno, set_errno, zeroed};

mod events;
mod query;
mod sysfs;

pub(crate) use query::{query_device_ex, query_port_ex, query_rt_values};

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
