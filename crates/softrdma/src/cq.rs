//! Completion queues and completion channels.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma_transport::verbs::{Arm, ChannelId, CqId, WorkCompletion};

use crate::{Device, Error, Result};

/// How long a waiting call spins before it starts yielding the CPU, and then sleeping.
const SPIN: Duration = Duration::from_micros(50);
const YIELD: Duration = Duration::from_millis(2);

/// Wait until `fd` is readable or `timeout` passes (None: forever).
pub(crate) fn poll_fd(fd: RawFd, timeout: Option<Duration>) -> Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = match timeout {
        None => -1,
        Some(t) => {
            t.as_millis().min(i32::MAX as u128) as i32
                + i32::from(t.subsec_nanos() % 1_000_000 != 0)
        }
    };
    // SAFETY: `p` is one live pollfd; poll reads and writes only it.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e.into());
    }
    Ok(r > 0)
}

/// Escalating back-off for waits: spin, then yield, then short sleeps.
pub(crate) struct Backoff {
    start: Instant,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff {
            start: Instant::now(),
        }
    }
    pub(crate) fn snooze(&self) {
        let e = self.start.elapsed();
        if e < SPIN {
            std::hint::spin_loop();
        } else if e < YIELD {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

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
        let _ = self.dev.with(|r, _| r.ctx_mut().destroy_channel(id));
    }
}

/// A completion channel (`ibv_comp_channel`): its fd is readable while CQ events are
/// pending, so it works with poll/epoll/async runtimes.
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
        self.inner.dev.with(|r, _| Ok(r.ctx_mut().get_cq_event(id)))
    }
    /// Wait for the next CQ event (`None` waits forever); ETIMEDOUT on timeout. Returns the
    /// CQ that has the event (compare with [`CompletionQueue::id`]).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<CqId> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let spin_until = Instant::now() + SPIN;
        loop {
            if let Some(cq) = self.try_get()? {
                return Ok(cq);
            }
            let now = Instant::now();
            if now < spin_until {
                // A cross-core wake-up costs more than a short spin: look again first.
                std::hint::spin_loop();
                continue;
            }
            let left = match deadline {
                Some(d) if now >= d => return Err(Error::timed_out("no completion event")),
                Some(d) => Some(d - now),
                None => None,
            };
            poll_fd(self.inner.fd, left)?;
        }
    }
    /// Acknowledge `n` events of `cq` (`ibv_ack_cq_events`).
    pub fn ack(&self, cq: &CompletionQueue, n: u32) -> Result<()> {
        cq.ack_events(n)
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
}

impl Drop for CqInner {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.dev.with(|r, _| {
            let ctx = r.ctx_mut();
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
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let id = self.inner.id;
        self.inner.dev.with(|r, _| r.poll_cq(id, out))
    }
    /// One completion, if any.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        let mut wc = [WorkCompletion::default()];
        Ok((self.poll(&mut wc)? == 1).then_some(wc[0]))
    }
    /// The completions available now, as an iterator (stops at the first empty poll or error).
    pub fn poll_iter(&self) -> PollIter<'_> {
        PollIter {
            cq: self,
            buf: [WorkCompletion::default(); 16],
            at: 0,
            n: 0,
            done: false,
        }
    }
    /// Wait for one completion, spinning briefly and then backing off; ETIMEDOUT after
    /// `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<WorkCompletion> {
        let deadline = Instant::now() + timeout;
        let b = Backoff::new();
        loop {
            if let Some(wc) = self.poll_one()? {
                return Ok(wc);
            }
            if Instant::now() >= deadline {
                return Err(Error::timed_out("no completion"));
            }
            b.snooze();
        }
    }
    /// Wait for `n` completions (all returned, in order); ETIMEDOUT after `timeout`.
    pub fn wait_n(&self, n: usize, timeout: Duration) -> Result<Vec<WorkCompletion>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(n);
        let mut b = Backoff::new();
        let mut buf = [WorkCompletion::default(); 16];
        while out.len() < n {
            let want = (n - out.len()).min(buf.len());
            let got = self.poll(&mut buf[..want])?;
            if got > 0 {
                out.extend_from_slice(&buf[..got]);
                b = Backoff::new();
                continue;
            }
            if Instant::now() >= deadline {
                return Err(Error::timed_out("not all completions arrived"));
            }
            b.snooze();
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
        self.inner
            .dev
            .with(|r, _| r.ctx_mut().req_notify_cq(id, arm))
    }
    /// Acknowledge `n` events taken from its channel.
    pub fn ack_events(&self, n: u32) -> Result<()> {
        let id = self.inner.id;
        self.inner.dev.with(|r, _| r.ctx_mut().ack_cq_events(id, n))
    }
    /// Completions waiting.
    pub fn len(&self) -> Result<usize> {
        let id = self.inner.id;
        self.inner.dev.with(|r, _| r.ctx().cq_len(id))
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
    type Item = WorkCompletion;
    fn next(&mut self) -> Option<WorkCompletion> {
        if self.at == self.n {
            if self.done {
                return None;
            }
            self.at = 0;
            self.n = self.cq.poll(&mut self.buf).unwrap_or(0);
            if self.n < self.buf.len() {
                self.done = true;
            }
            if self.n == 0 {
                return None;
            }
        }
        let wc = self.buf[self.at];
        self.at += 1;
        Some(wc)
    }
}
