//! Devices: listing, opening, queries, async events.

use softrdma_device::CqPoller;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use softrdma_device as dev;
use softrdma_transport::verbs::{AsyncEvent, DeviceAttr, Gid, Mtu, PortAttr};

use crate::cq::{ChanInner, CompletionChannel, CompletionQueue, CqInner};
use crate::mr::{DeviceMemory, DmInner};
use crate::pd::{PdInner, ProtectionDomain};
use crate::{Error, Result};

pub use dev::{
    DeviceAddr, DeviceConfig, DeviceEntry, DeviceStats, DriverStats, EngineStats, LinkStats,
};

/// A configured device, as listed by [`devices`] without opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Its address. For an automatic loopback device, the address it would take now.
    pub addr: SocketAddr,
    /// Whether the address is chosen automatically when the device opens.
    pub auto: bool,
    /// GID index 0.
    pub gid: Gid,
}

/// The configured devices, the default one first (see the README for `SOFTRDMA_ADDR`,
/// `SOFTRDMA_CONFIG` and `/etc/softrdma.conf`).
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Ok(dev::devices()?
        .into_iter()
        .map(|e| {
            let (addr, auto) = match e.addr {
                DeviceAddr::Fixed(a) => (a, false),
                DeviceAddr::AutoLoopback(p) => (dev::config::probe_auto_loopback(p), true),
            };
            DeviceInfo {
                name: e.name,
                addr,
                auto,
                gid: Gid::from_ip(addr.ip()),
            }
        })
        .collect())
}

pub(crate) struct DevInner {
    /// Shared with the device's connection manager, which sends and receives on it.
    pub(crate) dev: Arc<dev::Device>,
    /// The device's rdma_cm, started by the first CM object made on the device.
    pub(crate) cm: Mutex<Option<Arc<softrdma_cm::agent::Agent>>>,
    /// The memory regions registered through this face, by lkey, for posts to pin.
    pub(crate) mrs: crate::pins::Registry,
    /// The regions each memory window was bound to, kept registered until the window
    /// goes (see `pins::pin_window`).
    pub(crate) windows: crate::pins::Windows,
}

/// This face's state of each device open in the process (its CM, its pins), found by the
/// runtime device it wraps: opening a device a second time returns the same handle.
static FACES: Mutex<Vec<std::sync::Weak<DevInner>>> = Mutex::new(Vec::new());

/// An open RDMA device: one UDP endpoint with its own protocol engine and progress thread.
/// Cheap to clone (shared); every object made from it keeps it open.
///
/// [`Device::open_default`] opens the first configured device ([`devices`]); with no
/// configuration that is `softrdma0` at the first free 127.0.0.x, UDP port 4791, so that
/// the processes of one host each get an address of their own. Opening a device a second
/// time in one process gives the same device, as `ibv_open_device` does
/// ([`softrdma_device::Device::open_shared`]); devices of other names are NICs of their
/// own, so one process may open several, for example both ends of a connection in a test.
/// Everything else is made from a device: protection domains ([`Device::alloc_pd`]),
/// completion queues and channels, device memory.
///
/// ```
/// use softrdma::{Device, DeviceAddr, DeviceConfig, Mtu};
/// # fn main() -> softrdma::Result<()> {
/// let dev = Device::open_default()?;
/// println!("{} at {}, GID {:?}", dev.name(), dev.addr(), dev.gid().to_ip());
/// let port = dev.query_port(1)?;
/// assert_eq!(port.max_mtu, Mtu::Mtu4096);
///
/// // A second device in the same process, at another loopback address.
/// let other = Device::open_with(&DeviceConfig::new("peer", DeviceAddr::AutoLoopback(4791)))?;
/// assert_ne!(other.addr(), dev.addr());
/// // Opened again, a device is the same one.
/// assert_eq!(Device::open_default()?.addr(), dev.addr());
///
/// // Async events (a CQ overflow, a QP's fatal error, ...) queue up on the device: take
/// // them here, or watch `dev.as_fd()` in an event loop.
/// assert!(dev.next_async_event().is_none());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DevInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("addr", &self.addr())
            .finish()
    }
}

impl Device {
    /// Open the default device (the first one [`devices`] lists).
    pub fn open_default() -> Result<Device> {
        let list = dev::devices()?;
        let e = list
            .first()
            .ok_or_else(|| Error::new(libc::ENODEV, "no device configured"))?;
        Device::open_with(&DeviceConfig::from_entry(e))
    }

    /// Open a configured device by name.
    pub fn open(name: &str) -> Result<Device> {
        let list = dev::devices()?;
        let e = list
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| Error::new(libc::ENODEV, format!("no device named {name:?}")))?;
        Device::open_with(&DeviceConfig::from_entry(e))
    }

    /// Open a device from an explicit configuration: the device of that name this
    /// process has open already (whose configuration holds), else a new one
    /// ([`softrdma_device::Device::open_shared`]).
    pub fn open_with(cfg: &DeviceConfig) -> Result<Device> {
        dev::log::init_from_env();
        // Held across the open, so two threads opening one name make one handle.
        let mut faces = FACES.lock().unwrap_or_else(|p| p.into_inner());
        let d = dev::Device::open_shared(cfg).map_err(|e| {
            // The address says which socket failed; an OS error's text is added by
            // `Error`'s Display, so only a message of the error's own is kept here.
            let at = match cfg.addr {
                dev::DeviceAddr::Fixed(a) => a.to_string(),
                dev::DeviceAddr::AutoLoopback(port) => format!("127.0.0.x:{port}"),
            };
            let (errno, detail) = match e.raw_os_error() {
                Some(n) => (n, String::new()),
                None if e.kind() == std::io::ErrorKind::AddrInUse => {
                    (libc::EADDRINUSE, format!(": {e}"))
                }
                None => (libc::EIO, format!(": {e}")),
            };
            let msg = format!("opening {} at UDP {at}{detail}", cfg.name);
            Error::io(e, errno, msg)
        })?;
        faces.retain(|w| w.strong_count() > 0);
        if let Some(inner) = faces
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .find(|i| Arc::ptr_eq(&i.dev, &d))
        {
            return Ok(Device { inner });
        }
        let inner = Arc::new(DevInner {
            dev: d,
            cm: Mutex::new(None),
            mrs: Default::default(),
            windows: Default::default(),
        });
        faces.push(Arc::downgrade(&inner));
        Ok(Device { inner })
    }

    /// The runtime device.
    pub(crate) fn rt(&self) -> &dev::Device {
        &self.inner.dev
    }

    /// Device name.
    pub fn name(&self) -> &str {
        self.inner.dev.name()
    }
    /// The UDP address the device is bound to.
    pub fn addr(&self) -> SocketAddr {
        self.inner.dev.addr()
    }
    /// GID index 0 (the IPv4-mapped form of the address, or the IPv6 address).
    pub fn gid(&self) -> Gid {
        self.inner.dev.gid()
    }
    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> DeviceAttr {
        self.inner.dev.device_attr()
    }
    /// Port attributes (`ibv_query_port`); port 1 only.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        Ok(self.inner.dev.port_attr(port)?)
    }
    /// Set port 1's active MTU: the largest UD message this device sends (RC and UC
    /// messages are split by each QP's path MTU instead). EINVAL above the port's
    /// `max_mtu` (4096). Peers are not told: a UD receiver takes any message that fits
    /// its receive buffers.
    pub fn set_port_mtu(&self, mtu: Mtu) -> Result<()> {
        Ok(self.inner.dev.set_active_mtu(mtu)?)
    }
    /// GID at `index` (`ibv_query_gid`).
    pub fn query_gid(&self, index: u8) -> Result<Gid> {
        Ok(self.inner.dev.query_gid(index)?)
    }
    /// Engine and runtime counters.
    pub fn stats(&self) -> DeviceStats {
        self.inner.dev.stats()
    }

    /// Allocate a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let id = self.inner.dev.alloc_pd()?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                dev: self.clone(),
                id,
            }),
        })
    }

    /// Create a completion channel (its fd is readable while CQ events are pending).
    pub fn create_channel(&self) -> Result<CompletionChannel> {
        let id = self.inner.dev.create_channel()?;
        let fd = match self.inner.dev.add_channel_fd(id) {
            Ok(fd) => fd,
            Err(e) => {
                let _ = self.inner.dev.destroy_channel(id);
                return Err(e.into());
            }
        };
        Ok(CompletionChannel {
            inner: Arc::new(ChanInner {
                dev: self.clone(),
                id,
                fd,
            }),
        })
    }

    /// Create a completion queue of at least `cqe` entries, optionally reporting events
    /// to `channel`. Size it for the work queues that will report into it: QPs that
    /// could overflow it are refused ([`ProtectionDomain::create_qp`]), and what an
    /// overflow does is on [`CompletionQueue`].
    pub fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let ch = channel.map(|c| c.inner.id);
        let (id, cap) = self.inner.dev.create_cq(cqe, ch, false)?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                dev: self.clone(),
                id,
                cap,
                _chan: channel.map(|c| Arc::clone(&c.inner)),
                poller: CqPoller::new(id),
                load: Default::default(),
                queues: Default::default(),
            }),
        })
    }

    /// Allocate `len` bytes of device memory (`ibv_alloc_dm`).
    pub fn alloc_dm(&self, len: usize) -> Result<DeviceMemory> {
        let id = self.inner.dev.alloc_dm(len)?;
        Ok(DeviceMemory {
            inner: Arc::new(DmInner {
                dev: self.clone(),
                id,
                len,
            }),
        })
    }

    /// The async-event fd, readable while async events are pending (take them with
    /// [`Device::next_async_event`]). Borrowed from the device, so it cannot outlive it;
    /// the same fd is the device's [`AsFd`].
    pub fn async_event_fd(&self) -> BorrowedFd<'_> {
        self.inner.dev.async_event_borrowed_fd()
    }
    /// The next async event, if one is pending.
    pub fn next_async_event(&self) -> Option<AsyncEvent> {
        self.inner.dev.next_async_event()
    }
    /// Wait for the next async event; `None` waits forever. ETIMEDOUT on timeout.
    pub fn wait_async_event(&self, timeout: Option<Duration>) -> Result<AsyncEvent> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(ev) = self.next_async_event() {
                return Ok(ev);
            }
            let left = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::timed_out("no async event"));
                    }
                    Some(d - now)
                }
                None => None,
            };
            self.inner.dev.wait_async_event(left)?;
        }
    }
}

impl AsFd for Device {
    /// The async-event fd ([`Device::async_event_fd`]).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.async_event_fd()
    }
}

impl AsRawFd for Device {
    /// The async-event fd.
    fn as_raw_fd(&self) -> RawFd {
        self.async_event_fd().as_raw_fd()
    }
}
