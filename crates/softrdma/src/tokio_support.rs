//! Futures on tokio (feature `tokio`): completion queues, device async events and the
//! connection manager's events, awaited without blocking the runtime's thread.
//!
//! Every type here registers one of softrdma's descriptors with tokio's reactor through
//! [`AsyncFd`] over the object that owns it (a [`CompletionChannel`], a [`Device`], a
//! [`cm::EventChannel`](crate::cm::EventChannel)): the descriptor stays open for as long
//! as the registration, so no raw fd and no `unsafe` is involved on either side.
//!
//! - [`AsyncCompletionQueue`] ([`CompletionQueue::into_async`]): `next().await` gives
//!   the next work completion. It polls first, and only when the CQ is empty arms it
//!   (`req_notify`), polls once more and sleeps on the channel's fd, as the verbs
//!   pattern requires, so no completion is lost between a poll and the arming.
//! - [`AsyncDeviceEvents`] ([`Device::async_events`]): `next_event().await` gives the
//!   device's next [`AsyncEvent`] (a CQ error, a QP's fatal or last-WQE event, …).
//! - [`cm::AsyncEventChannel`](crate::cm::AsyncEventChannel),
//!   [`cm::AsyncListener`](crate::cm::AsyncListener) and
//!   [`cm::connect_async`](crate::cm::connect_async): the rdma_cm's events, requests
//!   and connection setup awaited.
//!
//! The methods are inherent rather than implementations of `futures::Stream`, which
//! would add a dependency for one trait. [`AsyncCompletionQueue::poll_next`] has the
//! signature of `Stream::poll_next` (its stream ends after a CQ failure), so wrapping it
//! in a stream is one line of the program's; the device's and the CM's events never end,
//! so their `poll_next_event` and `next_event` give a `Result` without the `Option`.
//!
//! The types need a runtime with I/O enabled (`enable_io`, or `#[tokio::main]`) when
//! they are made; outside one they are an error of kind
//! [`InvalidArgument`](ErrorKind::InvalidArgument), not a panic. A descriptor can be
//! registered with one runtime once at a time: a second [`AsyncCompletionQueue`] on the
//! same channel, or a second [`AsyncDeviceEvents`] of the same device, is an error of kind
//! [`Busy`](ErrorKind::Busy) while the first lives.
//!
//! Two queue pairs of one device connected to each other, a WRITE awaited on a
//! current-thread runtime:
//!
//! ```
//! use softrdma::{wr, Access, Device, QpInit, QpType};
//! # fn main() -> softrdma::Result<()> {
//! let rt = tokio::runtime::Builder::new_current_thread()
//!     .enable_all()
//!     .build()?;
//! rt.block_on(async {
//!     let dev = Device::open_default()?;
//!     let pd = dev.alloc_pd()?;
//!     let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
//!     // The awaited CQ needs a completion channel: its fd is what the runtime watches.
//!     let channel = dev.create_channel()?;
//!     let (a_cq, b_cq) = (dev.create_cq(128, Some(&channel))?, dev.create_cq(128, None)?);
//!     let a = pd.create_qp(&QpInit::new(QpType::Rc, &a_cq))?;
//!     let b = pd.create_qp(&QpInit::new(QpType::Rc, &b_cq))?;
//!     let (a_mem, b_mem) = (pd.register(4096, access)?, pd.register(4096, access)?);
//!     a.connect_to(&b.endpoint(), access)?;
//!     b.connect_to(&a.endpoint(), access)?;
//!     let mut completions = a_cq.into_async()?;
//!     a_mem.write(0, b"awaited")?;
//!     a.post_send(wr::write(1, [a_mem.sge(0..7)?], &b_mem.remote(), 0)?)?;
//!     let wc = completions.completion().await?; // the runtime runs other tasks meanwhile
//!     wc.result()?;
//!     assert_eq!(b_mem.to_vec(0, 7)?, b"awaited");
//!     Ok(())
//! })
//! # }
//! ```

use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::task::{ready, Context, Poll};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::Interest;
use softrdma_transport::verbs::{AsyncEvent, WorkCompletion};

use crate::{CompletionChannel, CompletionQueue, Device, Error, ErrorKind, Result};

/// An owner whose fd stays open, and is the same fd, for as long as the owner lives: the
/// contract of [`AsyncFd::register_with_interest`], which is `unsafe` because tokio
/// cannot check it for an arbitrary [`AsRawFd`]. Only the types below, which own their
/// descriptor, make that promise, so [`register`] is safe to call.
///
/// # Safety
///
/// `as_raw_fd` must return the same open descriptor from creation to drop.
pub(crate) unsafe trait OwnedStableFd: AsRawFd {}

// SAFETY: the channel's eventfd is created with the channel and closed only by
// `ChanInner::drop` (through `remove_channel_fd`), which runs when the last clone of the
// channel (the one the AsyncFd holds among them) is gone; `as_raw_fd` returns the fd
// stored at creation.
unsafe impl OwnedStableFd for CompletionChannel {}
// SAFETY: the async-event eventfd is created with the runtime device and closed with it,
// and every clone of the `Device` (the one the AsyncFd holds among them) keeps that
// device alive; `as_raw_fd` always returns that fd.
unsafe impl OwnedStableFd for Device {}
// SAFETY: the CM channel's eventfd is an `OwnedFd` inside the `Arc` that every clone of
// the channel (the one the AsyncFd holds among them) shares, closed when the last goes.
unsafe impl OwnedStableFd for crate::cm::EventChannel {}

/// Register `inner`'s fd with the current runtime's reactor, for reading. An error, not
/// tokio's panic, when there is no runtime or it has no I/O driver: the caller made a
/// softrdma object in the wrong place, which it should be told as an error.
pub(crate) fn register<T: OwnedStableFd>(inner: T, what: &str) -> Result<AsyncFd<T>> {
    let not_here = |why: &str| {
        Error::new(libc::EINVAL, format!("{what}: {why}")).with_kind(ErrorKind::InvalidArgument)
    };
    if ::tokio::runtime::Handle::try_current().is_err() {
        return Err(not_here(
            "not inside a tokio runtime (make it from a task or under Runtime::enter)",
        ));
    }
    // tokio panics rather than return an error when the runtime has no I/O driver.
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `T: OwnedStableFd` promises what register_with_interest asks: the fd
        // is open and the same for as long as `inner` lives, and the AsyncFd owns
        // `inner` until it is dropped.
        unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
    }));
    match r {
        Ok(Ok(fd)) => Ok(fd),
        Ok(Err(e)) => {
            let e = std::io::Error::from(e);
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Err(Error::new(
                    libc::EBUSY,
                    format!(
                        "{what}: its fd is registered with the runtime already (one waiter per fd)"
                    ),
                )
                .with_kind(ErrorKind::Busy));
            }
            Err(Error::io(
                e,
                libc::EIO,
                format!("{what}: registering its fd with tokio"),
            ))
        }
        Err(_) => Err(not_here(
            "the tokio runtime has no I/O driver (build it with enable_io)",
        )),
    }
}

/// The error of a failed readiness wait.
fn io_err(e: std::io::Error, what: &'static str) -> Error {
    Error::io(e, libc::EIO, what)
}

/// Completions in a batch taken from the CQ at once.
const BATCH: usize = 16;

/// A completion queue whose completions are awaited: made by
/// [`CompletionQueue::into_async`] from a CQ created with a [`CompletionChannel`].
///
/// [`AsyncCompletionQueue::next`] returns a completion at once when one is queued; only
/// when the CQ is empty does it arm the CQ for one event, poll once more (a completion
/// that came between the poll and the arming raises no event) and sleep on the channel's
/// fd; woken, it takes and acknowledges the event and polls again. The progress thread
/// of the device handles the network meanwhile, so the task's thread is free.
///
/// The channel must serve this CQ alone: events of other CQs on it are acknowledged and
/// dropped here, so their own waiters would never see them.
///
/// Cancel-safe: the state lives in the value, so dropping a pending `next()` (in a
/// `select!`, a timeout) loses no completion.
pub struct AsyncCompletionQueue {
    cq: CompletionQueue,
    chan: AsyncFd<CompletionChannel>,
    buf: [WorkCompletion; BATCH],
    at: usize,
    n: usize,
    /// Armed for an event not yet taken from the channel: arming again is not needed.
    armed: bool,
    /// The error that ended the stream (a CQ overflow), repeated by `completion()`.
    failed: Option<Error>,
}

impl std::fmt::Debug for AsyncCompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCompletionQueue")
            .field("cq", &self.cq.id())
            .field("channel", &self.chan.get_ref().id())
            .field("buffered", &(self.n - self.at))
            .field("armed", &self.armed)
            .field("failed", &self.failed)
            .finish()
    }
}

impl CompletionQueue {
    /// This CQ with its completions awaited on tokio ([`AsyncCompletionQueue`]). The CQ
    /// must have been created with a completion channel (InvalidArgument otherwise), and
    /// this must be called inside a tokio runtime with I/O enabled. The CQ itself stays
    /// usable through [`AsyncCompletionQueue::cq`] (to post, to check its length).
    pub fn into_async(self) -> Result<AsyncCompletionQueue> {
        AsyncCompletionQueue::new(self)
    }
}

impl AsyncCompletionQueue {
    /// See [`CompletionQueue::into_async`].
    pub fn new(cq: CompletionQueue) -> Result<AsyncCompletionQueue> {
        let Some(chan) = cq.inner._chan.as_ref() else {
            return Err(Error::invalid(
                "an async CQ needs a completion channel: create the CQ with Some(&channel)",
            )
            .with_kind(ErrorKind::InvalidArgument));
        };
        let chan = CompletionChannel {
            inner: std::sync::Arc::clone(chan),
        };
        let chan = register(chan, "completion channel")?;
        Ok(AsyncCompletionQueue {
            cq,
            chan,
            buf: [WorkCompletion::default(); BATCH],
            at: 0,
            n: 0,
            armed: false,
            failed: None,
        })
    }

    /// The completion queue.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The completion queue back, with the completions taken from it but not yet
    /// returned (their order is kept: these come before anything still in the CQ). An
    /// event still pending on the channel is acknowledged when the CQ is destroyed.
    pub fn into_inner(self) -> (CompletionQueue, Vec<WorkCompletion>) {
        let rest = self.buf[self.at..self.n].to_vec();
        (self.cq, rest)
    }

    /// Poll for the next completion, with the signature of `Stream::poll_next`:
    /// `Ready(Some(Ok(wc)))` for a completion (of any status: see
    /// [`WorkCompletion::result`]), `Ready(Some(Err(e)))` once when the CQ failed (an
    /// overflow lost completions: kind [`CqOverflow`](ErrorKind::CqOverflow)), and
    /// `Ready(None)` after that, as the CQ gives nothing more. `Pending` registers the
    /// task's waker with the channel's fd.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<WorkCompletion>>> {
        if self.failed.is_some() {
            return Poll::Ready(None);
        }
        // A CQ that always has a completion would otherwise keep the task running and
        // starve the others on its thread: spend tokio's cooperative budget per item.
        let coop = ready!(::tokio::task::coop::poll_proceed(cx));
        loop {
            if self.at < self.n {
                let wc = self.buf[self.at];
                self.at += 1;
                coop.made_progress();
                return Poll::Ready(Some(Ok(wc)));
            }
            match self.step(cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => {
                    self.failed = Some(e.clone());
                    coop.made_progress();
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// One step towards a completion with the buffer empty: poll, else arm, else wait
    /// for and take the channel's event. Ready(Ok) means "look again".
    fn step(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let n = self.cq.poll(&mut self.buf)?;
        if n > 0 {
            self.at = 0;
            self.n = n;
            return Poll::Ready(Ok(()));
        }
        if !self.armed {
            self.cq.req_notify(false)?;
            self.armed = true;
            // Poll once more before sleeping: a completion that arrived between the
            // empty poll and the arming raises no event.
            return Poll::Ready(Ok(()));
        }
        let mut guard = ready!(self.chan.poll_read_ready(cx))
            .map_err(|e| io_err(e, "waiting on the completion channel"))?;
        match self.chan.get_ref().try_get()? {
            Some(id) if id == self.cq.id() => {
                self.cq.ack_events(1)?;
                // The event consumed the arming: the next sleep arms again.
                self.armed = false;
            }
            Some(other) => {
                // Another CQ shares the channel (see the type's documentation): its
                // event is acknowledged so that CQ can still be destroyed.
                let dev = &self.cq.inner.dev;
                dev.rt().ack_cq_events(other, 1)?;
            }
            None => {
                // Nothing pending: forget the readiness. tokio keeps it if the fd
                // became readable again since `poll_read_ready`, so an event that came
                // in between is not lost, and the next poll registers the waker.
                guard.clear_ready();
            }
        }
        Poll::Ready(Ok(()))
    }

    /// The next completion, waiting for it without blocking the thread; `None` after
    /// the CQ failed (the error was returned once before). Cancel-safe.
    pub async fn next(&mut self) -> Option<Result<WorkCompletion>> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// The next completion, as [`AsyncCompletionQueue::next`] but with the CQ's failure
    /// as the error every time, for `?` in code that awaits one completion at a time.
    pub async fn completion(&mut self) -> Result<WorkCompletion> {
        match self.next().await {
            Some(r) => r,
            None => Err(self
                .failed
                .clone()
                .unwrap_or_else(|| Error::invalid("the CQ gives no more completions"))),
        }
    }

    /// The next `n` completions, in order. Stops at the CQ's failure with its error.
    pub async fn completions(&mut self, n: usize) -> Result<Vec<WorkCompletion>> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            out.push(self.completion().await?);
        }
        Ok(out)
    }
}

/// A device's async events awaited on tokio: made by [`Device::async_events`].
///
/// The methods take `&self`, so tasks may share it (in an `Arc`); each event goes to one
/// of them.
pub struct AsyncDeviceEvents {
    fd: AsyncFd<Device>,
}

impl std::fmt::Debug for AsyncDeviceEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDeviceEvents")
            .field("device", self.fd.get_ref())
            .finish()
    }
}

impl Device {
    /// The device's async events, awaited on tokio ([`AsyncDeviceEvents`]). Call it
    /// inside a tokio runtime with I/O enabled; one at a time per device (Busy while
    /// another lives, since a descriptor is registered with a runtime once).
    pub fn async_events(&self) -> Result<AsyncDeviceEvents> {
        Ok(AsyncDeviceEvents {
            fd: register(self.clone(), "device async events")?,
        })
    }
}

impl AsyncDeviceEvents {
    /// The device.
    pub fn device(&self) -> &Device {
        self.fd.get_ref()
    }

    /// Poll for the next event: `Ready(Ok(event))`, or `Pending` with the task's waker
    /// registered with the device's async-event fd. The events of a device never end,
    /// so there is no `None`; an error is one of the runtime's reactor.
    pub fn poll_next_event(&self, cx: &mut Context<'_>) -> Poll<Result<AsyncEvent>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))
                .map_err(|e| io_err(e, "waiting for a device async event"))?;
            if let Some(ev) = self.fd.get_ref().next_async_event() {
                return Poll::Ready(Ok(ev));
            }
            // Empty: readiness goes unless the fd was set again since it was reported.
            guard.clear_ready();
        }
    }

    /// The next async event, waiting for it without blocking the thread. Cancel-safe.
    pub async fn next_event(&self) -> Result<AsyncEvent> {
        std::future::poll_fn(|cx| self.poll_next_event(cx)).await
    }
}
