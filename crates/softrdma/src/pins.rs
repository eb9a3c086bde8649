//! Work requests keep the registrations they name alive until their completion, and
//! memory windows the regions they were bound to until the window is dropped.
//!
//! An SGE is plain data (address, length, lkey), so a posted work request cannot borrow
//! its [`MemoryRegion`](crate::MemoryRegion). Instead every post looks its SGEs' lkeys up
//! in the device's registry of the registrations this face made and takes a strong
//! reference to each ("pins" it) before the device sees the request; the pins wait in the
//! work queue's [`WorkQueuePins`], in posting order, until the completion that retires
//! the request is polled from a CQ. Dropping every handle of a region while a request
//! holds it therefore only drops a reference: the registration, and the memory behind
//! it, stay until the request completes, and only then is the region deregistered.
//!
//! Why shared ownership rather than a borrow: a borrow would tie every posted request to
//! a lifetime that must end at a poll of a CQ the borrow checker cannot see (another
//! thread, an async task, a CQ shared by many QPs), which is what forces sideway's guards
//! and async-rdma's owned futures. Pinning at the post keeps `Sge` plain and the verbs
//! calls as they are, and makes "dropped while in flight" harmless instead of an error.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use softrdma_transport::verbs::{MwId, SendOp, Sge, WorkCompletion};
use softrdma_wire::idhash::IdMap;

use crate::mr::MrReg;
use crate::{Device, Error, ErrorKind, Result};

/// The registrations a device's regions have, by lkey: weak, so that the registry keeps
/// nothing alive; a registration is found (and pinned) while some handle or request has it.
pub(crate) type Registry = Mutex<IdMap<u32, Weak<MrReg>>>;

/// The registrations each memory window was bound to (see [`pin_window`]).
pub(crate) type Windows = Mutex<HashMap<MwId, Vec<Arc<MrReg>>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Enter a new registration under its lkey (replacing a dead one of a reused lkey).
pub(crate) fn enter(dev: &Device, lkey: u32, reg: &Arc<MrReg>) {
    lock(&dev.inner.mrs).insert(lkey, Arc::downgrade(reg));
}

/// Keep the region a window bind names (`SendOp::BindMw`) registered until the window is
/// dropped, as a work request keeps the regions its SGEs name until its completion.
///
/// Why: a region with a window bound to it cannot be deregistered (the verbs refuse it,
/// EBUSY, as rxe does). Without this, dropping the region's last handle while a window
/// is bound would leave the registration alive for good, outside anything the program holds:
/// peers could still write the memory (with the region's rkey or the window's) after the
/// program took it back. Pinned at the post, whether or not the bind then succeeds;
/// every region a window was ever bound to stays until the window goes, which is
/// conservative and bounded by the regions the program made.
pub(crate) fn pin_window(dev: &Device, op: &SendOp) {
    let SendOp::BindMw(b) = op else {
        return;
    };
    let Some(reg) = lock(&dev.inner.mrs).get(&b.mr_lkey).and_then(Weak::upgrade) else {
        return;
    };
    let mut w = lock(&dev.inner.windows);
    let regs = w.entry(b.mw).or_default();
    if !regs.iter().any(|r| Arc::ptr_eq(r, &reg)) {
        regs.push(reg);
    }
}

/// Window `mw` was deallocated: the regions it kept, for the caller to drop (outside the
/// lock, since dropping the last reference deregisters).
pub(crate) fn unpin_window(dev: &Device, mw: MwId) -> Vec<Arc<MrReg>> {
    lock(&dev.inner.windows).remove(&mw).unwrap_or_default()
}

/// Remove `lkey`'s entry once its registration is gone. A live entry under the same lkey
/// is a newer registration that reused it, and stays.
pub(crate) fn leave(dev: &Device, lkey: u32) {
    let mut m = lock(&dev.inner.mrs);
    if m.get(&lkey).is_some_and(|w| w.strong_count() == 0) {
        m.remove(&lkey);
    }
}

/// The registrations `sg` names, pinned. An lkey the registry does not know is left to the
/// device's own check (which refuses it, or fails the request in its completion). One
/// whose last handle is being dropped right now cannot be pinned any more: `strict` (the
/// checked posts) refuses it as the deregistered region it is about to be
/// ([`ErrorKind::NotFound`]); otherwise the request goes unpinned and the device fails it.
pub(crate) fn pin(dev: &Device, sg: &[Sge], strict: bool) -> Result<Vec<Arc<MrReg>>> {
    let mut pins = Vec::with_capacity(sg.len());
    let mut dying = false;
    {
        let m = lock(&dev.inner.mrs);
        for s in sg {
            match m.get(&s.lkey).map(Weak::upgrade) {
                Some(Some(reg)) => pins.push(reg),
                Some(None) => dying = true,
                None => {}
            }
        }
    }
    // The pins are dropped (if refused) outside the registry's lock: dropping the last
    // reference deregisters, which takes the lock again.
    if dying && strict {
        drop(pins);
        return Err(Error::invalid("SGE of a memory region being deregistered")
            .with_kind(ErrorKind::NotFound));
    }
    Ok(pins)
}

/// The pins of one work queue's outstanding requests.
pub(crate) struct WorkQueuePins {
    q: Mutex<PinQueue>,
}

struct PinQueue {
    /// (wr_id, pins) per posted request, oldest first.
    posted: VecDeque<(u64, Vec<Arc<MrReg>>)>,
    /// A send queue or a QP's own receive queue completes in posting order; an SRQ does
    /// not (QPs finish the messages they took receives for in any order).
    in_order: bool,
    /// SRQ only: completions seen per wr_id whose requests are not all released yet.
    done: HashMap<u64, usize>,
}

/// Pins released by a completion; dropped by the caller once no lock is held, since the
/// last reference deregisters under the engine's lock.
pub(crate) type Released = Vec<Vec<Arc<MrReg>>>;

impl WorkQueuePins {
    /// The pins of a send queue or a QP's receive queue (`in_order`), or of an SRQ.
    pub(crate) fn new(in_order: bool) -> Arc<WorkQueuePins> {
        Arc::new(WorkQueuePins {
            q: Mutex::new(PinQueue {
                posted: VecDeque::new(),
                in_order,
                done: HashMap::new(),
            }),
        })
    }

    /// Post through `f` and keep `pins` for request `wr_id` if it was accepted. The
    /// queue's lock is held across `f`, so that requests enter it in the device's order
    /// and a completion polled at once on another thread finds its entry.
    pub(crate) fn post<R>(
        &self,
        wr_id: u64,
        pins: Vec<Arc<MrReg>>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let mut q = lock(&self.q);
        match f() {
            Ok(r) => {
                q.posted.push_back((wr_id, pins));
                Ok(r)
            }
            Err(e) => {
                drop(q);
                drop(pins);
                Err(e)
            }
        }
    }

    /// The queue was emptied without completions to poll (its QP went to RESET, which
    /// takes its outstanding requests and cleans their completions out of the CQs):
    /// every pin goes. The caller drops what is returned once no lock is held.
    pub(crate) fn clear(&self) -> Released {
        let mut q = lock(&self.q);
        q.done.clear();
        q.posted.drain(..).map(|(_, p)| p).collect()
    }

    /// A completion of request `wr_id` was polled: release what it retires. In order, that
    /// is every request up to the oldest posted with that wr_id (a send queue completes in
    /// order, so unsignaled requests before it are done too; with wr_ids repeated, the
    /// oldest is at or before the one that completed, so nothing is released early). On
    /// an SRQ, requests sharing a wr_id are released together once as many completions
    /// with it were seen as there are such requests.
    fn retire(&self, wr_id: u64, out: &mut Released) {
        let mut q = lock(&self.q);
        if q.in_order {
            if let Some(at) = q.posted.iter().position(|(id, _)| *id == wr_id) {
                out.extend(q.posted.drain(..=at).map(|(_, p)| p));
            }
            return;
        }
        let waiting = q.posted.iter().filter(|(id, _)| *id == wr_id).count();
        if waiting == 0 {
            return;
        }
        let seen = q.done.entry(wr_id).or_insert(0);
        *seen += 1;
        if *seen >= waiting {
            q.done.remove(&wr_id);
            let mut keep = VecDeque::with_capacity(q.posted.len());
            for (id, p) in q.posted.drain(..) {
                if id == wr_id {
                    out.push(p);
                } else {
                    keep.push_back((id, p));
                }
            }
            q.posted = keep;
        }
    }
}

/// The work queues reporting into one CQ, by QP number: where a polled completion's pins
/// wait (the QP's send queue, its receive queue or its SRQ). Weak: a CQ keeps no queue alive.
#[derive(Default)]
pub(crate) struct CqQueues {
    by_qpn: Mutex<IdMap<u32, Links>>,
}

#[derive(Default)]
struct Links {
    send: Option<Weak<WorkQueuePins>>,
    recv: Option<Weak<WorkQueuePins>>,
}

impl CqQueues {
    /// QP `qpn` reports sends (`recv` false) or receives into this CQ, pinned in `pins`.
    pub(crate) fn link(&self, qpn: u32, recv: bool, pins: &Arc<WorkQueuePins>) {
        let mut m = lock(&self.by_qpn);
        let l = m.entry(qpn).or_default();
        let w = Some(Arc::downgrade(pins));
        if recv {
            l.recv = w;
        } else {
            l.send = w;
        }
    }

    /// QP `qpn` is going: forget its queues (unless a newer QP reuses the number).
    pub(crate) fn unlink(&self, qpn: u32, send: &Arc<WorkQueuePins>) {
        let mut m = lock(&self.by_qpn);
        let mine = |l: &Links| {
            [&l.send, &l.recv]
                .into_iter()
                .flatten()
                .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(send)) || w.strong_count() == 0)
        };
        if m.get(&qpn).is_some_and(mine) {
            m.remove(&qpn);
        }
    }

    /// Release what the polled completions `wcs` retire. Call with no lock held.
    pub(crate) fn retire(&self, wcs: &[WorkCompletion]) {
        if wcs.is_empty() {
            return;
        }
        let mut found = Vec::with_capacity(wcs.len());
        {
            let m = lock(&self.by_qpn);
            for wc in wcs {
                let Some(l) = m.get(&wc.qp_num) else { continue };
                let recv = wc.opcode.is_recv();
                let w = if recv { &l.recv } else { &l.send };
                if let Some(q) = w.as_ref().and_then(Weak::upgrade) {
                    found.push((q, wc.wr_id));
                }
            }
        }
        let mut released = Released::new();
        for (q, wr_id) in &found {
            q.retire(*wr_id, &mut released);
        }
        // Only now, with every lock released: the last pin of a dropped region
        // deregisters it.
        drop(released);
    }
}
