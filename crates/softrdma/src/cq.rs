//! Completion queues and completion channels.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use softrdma_device::CqPoller;
use softrdma_transport::verbs::{Arm, ChannelId, CqId, SrqId, WorkCompletion};

use crate::pins::CqQueues;
use crate::{Device, Error, ErrorKind, Result};

pub(crate) struct ChanInner {
    pub(crate) dev: Device,
    pub(crate) id: ChannelId,
    pub(crate) fd: RawFd,
}

impl Drop for ChanInner {
    fn drop(&mut self) {
        // CQs using the channel hold an Arc of it, so none is left when this runs.
        self.dev.inner.dev.remove_channel_fd(self.id);
        let id = self.id;
        let _ = self.dev.rt().destroy_channel(id);
    }
}

/// A completion channel (`ibv_comp_channel`): its fd is readable while CQ events are
/// pending, so it works with poll/epoll/async runtimes.
///
/// A CQ created with a channel ([`Device::create_cq`]) and armed with
/// [`CompletionQueue::req_notify`] puts one event on the channel when its next
/// completion arrives, then is disarmed. The usual loop: arm, wait for the event
/// ([`CompletionChannel::wait`], or the fd becoming readable and
/// [`CompletionChannel::try_get`]), acknowledge it, arm again, then poll the CQ empty
/// (arming before polling, so that a completion arriving in between is not missed).
/// Events not acknowledged are acknowledged when the CQ is dropped.
///
/// ```
/// use std::time::Duration;
/// use softrdma::{wr, Access, Device, QpInit, QpType};
/// # fn main() -> softrdma::Result<()> {
/// let t = Some(Duration::from_secs(5));
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let ch = dev.create_channel()?;
/// let cq = dev.create_cq(128, Some(&ch))?; // b's completions, with events
/// let a_cq = dev.create_cq(128, None)?;
/// let a = pd.create_qp(&QpInit::new(QpType::Rc, &a_cq))?;
/// let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
/// a.connect(&b.local(0), 0, Access::empty())?;
/// b.connect(&a.local(0), 0, Access::empty())?;
/// let mem = pd.register(4096, Access::LOCAL_WRITE)?;
///
/// cq.req_notify(false)?; // the next completion makes an event
/// b.post_recv(wr::recv(1, [mem.sge(0..64)?]))?;
/// a.post_send(wr::send(2, [mem.sge(100..110)?]))?;
///
/// // Block until the event (poll(2), epoll or an async runtime can watch
/// // `ch.as_fd()` instead, then take the event with `try_get`).
/// let which = ch.wait(t)?;
/// assert_eq!(which, cq.id());
/// ch.ack(&cq, 1)?;
/// cq.req_notify(false)?; // arm again before polling
/// let wc = cq.poll_one()?.expect("the event said a completion is there");
/// assert_eq!((wc.wr_id, wc.byte_len), (1, 10));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChanInner>,
}

impl CompletionChannel {
    /// The verbs handle.
    pub fn id(&self) -> ChannelId {
        self.inner.id
    }
    /// Take the next CQ event without blocking (`ibv_get_cq_event` on a non-blocking fd).
    /// Acknowledge it later with [`CompletionChannel::ack`].
    pub fn try_get(&self) -> Result<Option<CqId>> {
        let id = self.inner.id;
        Ok(self.inner.dev.rt().get_cq_event(id))
    }
    /// Wait for the next CQ event (`None` waits forever); ETIMEDOUT on timeout. Returns the
    /// CQ that has the event (compare with [`CompletionQueue::id`]). The calling thread
    /// drives the device's progress while it waits (see [`CompletionQueue::wait`]).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<CqId> {
        let mut err = None;
        let r = self
            .inner
            .dev
            .rt()
            .wait_for(timeout, || match self.try_get() {
                Ok(Some(cq)) => Some(cq),
                Ok(None) => None,
                Err(e) => {
                    err = Some(e);
                    Some(CqId(0))
                }
            });
        match (err, r) {
            (Some(e), _) => Err(e),
            (None, Some(cq)) => Ok(cq),
            (None, None) => Err(Error::timed_out("no completion event")),
        }
    }
    /// Acknowledge `n` events of `cq` (`ibv_ack_cq_events`).
    pub fn ack(&self, cq: &CompletionQueue, n: u32) -> Result<()> {
        cq.ack_events(n)
    }
}

impl AsFd for CompletionChannel {
    /// The channel's eventfd, for poll/epoll or an async runtime's `AsyncFd`.
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the device keeps the channel's eventfd open until `ChanInner::drop`
        // removes it, and `self` holds an `Arc` of that `ChanInner`, so the fd outlives
        // the borrow of `self` the returned value is tied to.
        unsafe { BorrowedFd::borrow_raw(self.inner.fd) }
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd
    }
}

pub(crate) struct CqInner {
    pub(crate) dev: Device,
    pub(crate) id: CqId,
    pub(crate) cap: u32,
    pub(crate) _chan: Option<Arc<ChanInner>>,
    pub(crate) poller: CqPoller,
    /// The completions the queues reporting here may hold at once.
    pub(crate) load: Mutex<CqLoad>,
    /// The queues reporting here, whose requests' pins a polled completion releases.
    pub(crate) queues: CqQueues,
}

/// What the work queues reporting into a CQ may have outstanding: each one can complete
/// that many WRs before the program polls, so together they must fit the CQ, or an
/// overflow loses completions and breaks the CQ for good.
#[derive(Debug, Default)]
pub(crate) struct CqLoad {
    /// The `max_send_wr` and `max_recv_wr` of the QP queues reporting here.
    wrs: u64,
    /// SRQs whose QPs report receives here: (how many such QPs, the SRQ's `max_wr`). An
    /// SRQ holds `max_wr` receives however many QPs take from it, so it counts once.
    srqs: HashMap<SrqId, (u32, u32)>,
}

impl CqLoad {
    fn total(&self) -> u64 {
        self.wrs + self.srqs.values().map(|&(_, w)| u64::from(w)).sum::<u64>()
    }
}

/// A QP's share of a CQ's capacity, given back when the QP is destroyed.
pub(crate) struct CqCharge {
    cq: Arc<CqInner>,
    wrs: u64,
    srq: Option<SrqId>,
}

/// The CQ-too-small error of `create_qp` and `SharedReceiveQueue::modify`.
fn too_small(cap: u32, load: u64, more: u64) -> Error {
    Error::invalid(format!(
        "a CQ of {cap} entries cannot hold the completions of its work queues \
         ({load} already reserved, {more} more asked): make it larger or the queues smaller"
    ))
    .with_kind(ErrorKind::InvalidArgument)
}

impl CqInner {
    fn load(&self) -> std::sync::MutexGuard<'_, CqLoad> {
        self.load.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserve `wrs` entries, and an SRQ of `max_wr` receives if it is new here.
    pub(crate) fn charge(
        self: &Arc<Self>,
        wrs: u64,
        srq: Option<(SrqId, u32)>,
    ) -> Result<CqCharge> {
        let mut l = self.load();
        let srq_more = match srq {
            Some((id, max_wr)) if !l.srqs.contains_key(&id) => u64::from(max_wr),
            _ => 0,
        };
        let total = l.total();
        if total + wrs + srq_more > u64::from(self.cap) {
            return Err(too_small(self.cap, total, wrs + srq_more));
        }
        l.wrs += wrs;
        if let Some((id, max_wr)) = srq {
            l.srqs.entry(id).or_insert((0, max_wr)).0 += 1;
        }
        Ok(CqCharge {
            cq: Arc::clone(self),
            wrs,
            srq: srq.map(|(id, _)| id),
        })
    }

    /// The SRQ `srq` now holds `max_wr` receives: refused if the CQ would not hold them.
    /// Returns the previous `max_wr`, or None if no QP of the SRQ reports here.
    pub(crate) fn resize_srq(&self, srq: SrqId, max_wr: u32) -> Result<Option<u32>> {
        let mut l = self.load();
        let total = l.total();
        let Some(e) = l.srqs.get_mut(&srq) else {
            return Ok(None);
        };
        let old = e.1;
        let more = u64::from(max_wr.saturating_sub(old));
        if total + more > u64::from(self.cap) {
            return Err(too_small(self.cap, total, more));
        }
        e.1 = max_wr;
        Ok(Some(old))
    }
}

impl Drop for CqCharge {
    fn drop(&mut self) {
        let mut l = self.cq.load();
        l.wrs -= self.wrs;
        if let Some(id) = self.srq {
            if let Some(e) = l.srqs.get_mut(&id) {
                e.0 -= 1;
                if e.0 == 0 {
                    l.srqs.remove(&id);
                }
            }
        }
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.dev.rt().objects(|ctx| {
            // Unacknowledged events would make destroy EBUSY; nobody can ack them after
            // the handle is gone, so ack them here (the count is bounded by events taken).
            for _ in 0..(1u32 << 20) {
                if ctx.ack_cq_events(id, 1).is_err() {
                    break;
                }
            }
            ctx.destroy_cq(id)
        });
    }
}

/// A completion queue. Cheap to clone (shared).
///
/// Every receive ends in one [`WorkCompletion`] here, and so does every send posted
/// SIGNALED (all those [`crate::wr`] builds are) or on a QP created with `sq_sig_all`;
/// an unsignaled send completes only if it fails. [`WorkCompletion::result`] turns a
/// failed completion into an error with its status and detail. Take them oldest first, without
/// waiting ([`CompletionQueue::poll`], [`CompletionQueue::poll_one`],
/// [`CompletionQueue::poll_iter`]) or waiting ([`CompletionQueue::wait`],
/// [`CompletionQueue::wait_n`]); to sleep on a file descriptor instead, give the CQ a
/// [`CompletionChannel`].
///
/// # Overflow
///
/// A CQ holds [`CompletionQueue::capacity`] completions. One more arriving before the
/// program polls overflows it, as on a NIC: that completion is lost, the CQ is in error
/// for good (every later poll and wait, and the last item of
/// [`CompletionQueue::poll_iter`], is an error of kind [`ErrorKind::CqOverflow`]) and the
/// device queues an [`AsyncEvent::CqErr`](crate::AsyncEvent::CqErr). Size a CQ for the
/// queues reporting into it: [`ProtectionDomain::create_qp`](crate::ProtectionDomain::create_qp)
/// refuses a QP whose queues it could not hold.
///
/// ```
/// use std::time::Duration;
/// use softrdma::{wr, Access, Device, QpInit, QpType, WcStatus};
/// # fn main() -> softrdma::Result<()> {
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let cq = dev.create_cq(16, None)?;
/// let mem = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
/// // Two QPs connected to each other, both reporting here (4 + 4 WRs each).
/// let init = QpInit::new(QpType::Rc, &cq).depth(4, 4);
/// let (a, b) = (pd.create_qp(&init)?, pd.create_qp(&init)?);
/// a.connect(&b.local(1), 1, Access::REMOTE_WRITE)?;
/// b.connect(&a.local(1), 1, Access::REMOTE_WRITE)?;
///
/// for i in 0..4 {
///     a.post_send(wr::write(i, [mem.sge(0..64)?], &mem.remote(), 1024 + 64 * i)?)?;
/// }
/// // Wait for all four, or poll in a loop of the program's own.
/// let wcs = cq.wait_n(4, Duration::from_secs(5))?;
/// assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success && wc.qp_num == a.qpn()));
/// // Nothing more: poll and poll_iter return at once.
/// assert!(cq.poll_one()?.is_none());
/// for wc in cq.poll_iter() {
///     wc?.result()?; // an Err item means the CQ overflowed
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl CompletionQueue {
    /// The verbs handle.
    pub fn id(&self) -> CqId {
        self.inner.id
    }
    /// Capacity.
    pub fn capacity(&self) -> u32 {
        self.inner.cap
    }
    /// Poll up to `out.len()` completions, oldest first; returns how many were written.
    ///
    /// An empty CQ is recognised without the engine lock (nothing happened on the device
    /// since it was last found empty), and then the calling thread drives the device's
    /// progress once (receives and handles what arrived, fires due timers) and looks
    /// again: a thread polling in a loop is the one that makes progress, and the device's
    /// progress thread stays out of its way.
    ///
    /// Polling a completion releases the memory regions its work request (and, for a
    /// send, the unsignaled ones before it) kept registered: see
    /// [`MemoryRegion`](crate::MemoryRegion#dropping).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.inner.poller.poll(self.inner.dev.rt(), out)?;
        self.inner.queues.retire(&out[..n.min(out.len())]);
        Ok(n)
    }
    /// Poll without driving progress; skips the engine lock while the CQ is known empty.
    fn poll_quick(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.inner.poller.take(self.inner.dev.rt(), out)?;
        self.inner.queues.retire(&out[..n.min(out.len())]);
        Ok(n)
    }
    /// One completion, if any.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        let mut wc = [WorkCompletion::default()];
        Ok((self.poll(&mut wc)? == 1).then_some(wc[0]))
    }
    /// The completions available now, as an iterator: it ends at the first empty poll,
    /// and an error of the poll (a CQ overflow: completions were lost) is its last item,
    /// so that a loop over it cannot mistake a broken CQ for an idle one.
    pub fn poll_iter(&self) -> PollIter<'_> {
        PollIter {
            cq: self,
            buf: [WorkCompletion::default(); 16],
            at: 0,
            n: 0,
            done: false,
        }
    }
    /// Wait for one completion; ETIMEDOUT after `timeout`. The calling thread drives the
    /// device's progress while it waits: it spins briefly receiving and handling datagrams
    /// itself (no cross-thread wake-up), then blocks on the device socket (busy-poll
    /// devices never block).
    pub fn wait(&self, timeout: Duration) -> Result<WorkCompletion> {
        let mut wc = [WorkCompletion::default()];
        self.wait_into(&mut wc, timeout)?;
        Ok(wc[0])
    }
    /// Wait for at least one completion and return up to `out.len()` (at least 1).
    fn wait_into(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        self.wait_or(out, timeout, || false)
    }
    /// Wait as [`CompletionQueue::wait`] does for completions (up to `out.len()`, at least
    /// one, returned as a count) or until `ready` returns true (0 then), whichever comes
    /// first; ETIMEDOUT after `timeout`. `ready` runs whenever the device may have changed
    /// (a datagram handled, a completion made): a program that watches its own memory for
    /// a peer's RDMA WRITE, which completes nothing on this side, waits with the device's
    /// policy instead of a poll loop of its own.
    pub fn wait_or(
        &self,
        out: &mut [WorkCompletion],
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<usize> {
        if out.is_empty() {
            return Err(Error::invalid("no room for a completion"));
        }
        let mut err = None;
        let r = self.inner.dev.rt().wait_for(Some(timeout), || {
            if ready() {
                return Some(0);
            }
            match self.poll_quick(out) {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(e) => {
                    err = Some(e);
                    Some(0)
                }
            }
        });
        match (err, r) {
            (Some(e), _) => Err(e),
            (None, Some(n)) => Ok(n),
            (None, None) => Err(Error::timed_out("no completion")),
        }
    }
    /// Wait for `n` completions (all returned, in order); ETIMEDOUT after `timeout`.
    pub fn wait_n(&self, n: usize, timeout: Duration) -> Result<Vec<WorkCompletion>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(n);
        let mut buf = [WorkCompletion::default(); 16];
        while out.len() < n {
            let want = (n - out.len()).min(buf.len());
            let left = deadline.saturating_duration_since(Instant::now());
            match self.wait_into(&mut buf[..want], left) {
                Ok(got) => out.extend_from_slice(&buf[..got]),
                Err(e) if e.is_timeout() => {
                    return Err(Error::timed_out("not all completions arrived"))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
    /// Arm the CQ for one event on its channel (`ibv_req_notify_cq`).
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let id = self.inner.id;
        let arm = if solicited_only {
            Arm::Solicited
        } else {
            Arm::Next
        };
        let r = self
            .inner
            .dev
            .rt()
            .req_notify_cq(id, arm)
            .map_err(Error::from);
        // The caller may now block on the channel's fd, out of the device's sight.
        self.inner.dev.rt().flush();
        r
    }
    /// Acknowledge `n` events taken from its channel.
    pub fn ack_events(&self, n: u32) -> Result<()> {
        let id = self.inner.id;
        Ok(self.inner.dev.rt().ack_cq_events(id, n)?)
    }
    /// Completions waiting.
    pub fn len(&self) -> Result<usize> {
        let id = self.inner.id;
        Ok(self.inner.dev.rt().cq_len(id)?)
    }
    /// Whether no completion is waiting.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

/// Iterator over the completions available now ([`CompletionQueue::poll_iter`]).
pub struct PollIter<'a> {
    cq: &'a CompletionQueue,
    buf: [WorkCompletion; 16],
    at: usize,
    n: usize,
    done: bool,
}

impl Iterator for PollIter<'_> {
    type Item = Result<WorkCompletion>;
    fn next(&mut self) -> Option<Result<WorkCompletion>> {
        if self.at == self.n {
            if self.done {
                return None;
            }
            self.at = 0;
            self.n = 0;
            match self.cq.poll(&mut self.buf) {
                Ok(n) => self.n = n,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
            if self.n < self.buf.len() {
                self.done = true;
            }
            if self.n == 0 {
                return None;
            }
        }
        let wc = self.buf[self.at];
        self.at += 1;
        Some(Ok(wc))
    }
}

impl std::iter::FusedIterator for PollIter<'_> {}
