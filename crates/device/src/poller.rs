//! Polling a completion queue from an application thread: one policy for every face (the
//! Rust API, the C ABI, and any later one).
//!
//! An empty CQ is recognised without the engine lock (nothing happened on the device since
//! it was last found empty). When a poll finds nothing, the calling thread drives the
//! device's progress once (receives and handles what arrived, fires due timers) and looks
//! again: a thread polling in a loop is the one that moves the device, with no cross-thread
//! wake-up, and the progress thread stays out of its way.

use std::sync::atomic::{AtomicU64, Ordering};

use softrdma_transport::verbs::{self, CqId, WorkCompletion};

use crate::Device;

/// Completions taken per engine lock by [`CqPoller::poll_each`]: a face that converts
/// completions into its own buffer keeps a small stack buffer (C programs call
/// `ibv_poll_cq` in tight loops, and filling a large one costs them).
const CHUNK: usize = 16;

/// The polling state of one CQ.
#[derive(Debug)]
pub struct CqPoller {
    cq: CqId,
    /// The device generation at which the CQ was last found empty.
    empty_at: AtomicU64,
}

impl CqPoller {
    /// A poller for `cq`.
    pub fn new(cq: CqId) -> CqPoller {
        CqPoller {
            cq,
            empty_at: AtomicU64::new(u64::MAX),
        }
    }

    /// The CQ.
    pub fn cq(&self) -> CqId {
        self.cq
    }

    /// Whether the CQ is known to be empty: the device's generation has not moved since it
    /// was last found empty.
    pub fn known_empty(&self, dev: &Device) -> bool {
        self.empty_at.load(Ordering::Relaxed) == dev.generation()
    }

    /// Take up to `out.len()` completions, oldest first, without driving progress; no lock
    /// while the CQ is known empty.
    pub fn take(&self, dev: &Device, out: &mut [WorkCompletion]) -> verbs::Result<usize> {
        let g = dev.generation();
        if self.empty_at.load(Ordering::Relaxed) == g {
            return Ok(0);
        }
        let cq = self.cq;
        let n = dev.inspect(|r| r.poll_cq(cq, out))?;
        if n == 0 {
            // `g` was read before the lock: a completion added after our look bumps the
            // generation past it.
            self.empty_at.store(g, Ordering::Relaxed);
        }
        Ok(n)
    }

    /// Poll up to `out.len()` completions: [`CqPoller::take`], and when that finds
    /// nothing, drive the device's progress once and take again.
    pub fn poll(&self, dev: &Device, out: &mut [WorkCompletion]) -> verbs::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        self.with_progress(dev, || self.take(dev, out))
    }

    /// Like [`CqPoller::poll`] for up to `want` completions handed to `sink` one by one
    /// with their index, taken in small chunks. A CQ known to be empty returns before any
    /// buffer is touched.
    pub fn poll_each(
        &self,
        dev: &Device,
        want: usize,
        mut sink: impl FnMut(usize, &WorkCompletion),
    ) -> verbs::Result<usize> {
        self.with_progress(dev, || {
            if self.known_empty(dev) {
                return Ok(0);
            }
            let mut buf = [WorkCompletion::default(); CHUNK];
            let mut got = 0;
            while got < want {
                let k = (want - got).min(CHUNK);
                let n = self.take(dev, &mut buf[..k])?;
                for (i, w) in buf[..n].iter().enumerate() {
                    sink(got + i, w);
                }
                got += n;
                if n < k {
                    break;
                }
            }
            Ok(got)
        })
    }

    /// Run `take`; when it finds nothing, drive progress once from this thread and run it
    /// again. A take that finds completions tells the device an application thread polls.
    fn with_progress(
        &self,
        dev: &Device,
        mut take: impl FnMut() -> verbs::Result<usize>,
    ) -> verbs::Result<usize> {
        let n = take()?;
        if n > 0 {
            dev.note_poll();
            Ok(n)
        } else if dev.progress() {
            take()
        } else {
            Ok(0)
        }
    }
}
