//! The QPs' timer deadlines, ordered, so that finding the earliest one and the due ones
//! costs O(log QPs) instead of a scan of every QP: the device asks for the next deadline
//! after every step, and a device may carry tens of thousands of idle QPs.
//!
//! The protocol handlers keep setting `req.rto`, the round-trip timer and `req.rnr_until` on the QP;
//! [`crate::Rnic`] re-reads a QP's deadline here after every call that may have changed it.
//! That happens several times per packet, and most calls change nothing, so each QP keeps
//! the deadline it is indexed under ([`Indexed`]): an unchanged deadline costs one
//! comparison, with no hashing and no tree walk.

use std::collections::BTreeSet;

use crate::qp::QpCtx;
use crate::verbs::Qpn;

/// Each QP's earliest deadline, ordered; the QP itself keeps the deadline it is indexed
/// under ([`Indexed`]).
#[derive(Debug, Default)]
pub(crate) struct Timers {
    by_deadline: BTreeSet<(u64, Qpn)>,
}

/// The deadlines a QP is indexed under in the device's two indexes (None: not indexed).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Indexed {
    /// In [`crate::Rnic`]'s index of requests in flight ([`deadline`]).
    pub req: Option<u64>,
    /// In its keepalive index.
    pub ka: Option<u64>,
}

/// A QP's earliest deadline of those that mean requests in flight: its local ACK
/// timeout, its round-trip retransmission timer or the end of its RNR wait. (Its
/// keepalive's, which idle QPs have, is indexed apart: see [`crate::Rnic::in_flight`].)
pub(crate) fn deadline(qp: &QpCtx) -> Option<u64> {
    [qp.req.rto, qp.req.rec.rtt_deadline(), qp.req.rnr_until]
        .into_iter()
        .flatten()
        .min()
}

impl Timers {
    /// Record QP `qpn`'s earliest deadline (None: no timer), `indexed` being where the
    /// QP keeps the deadline it is indexed under here, updated to match.
    pub fn set(&mut self, qpn: Qpn, indexed: &mut Option<u64>, deadline: Option<u64>) {
        if *indexed == deadline {
            return;
        }
        if let Some(o) = indexed.take() {
            self.by_deadline.remove(&(o, qpn));
        }
        if let Some(d) = deadline {
            self.by_deadline.insert((d, qpn));
        }
        *indexed = deadline;
    }

    /// The earliest deadline of all.
    pub fn first(&self) -> Option<u64> {
        self.by_deadline.first().map(|&(d, _)| d)
    }

    /// The QPs with a deadline at or before `now`, in QP number order (the order a scan
    /// of the QP table fires them in).
    pub fn due(&self, now: u64) -> Vec<Qpn> {
        let mut v: Vec<Qpn> = self
            .by_deadline
            .range(..=(now, Qpn::MAX))
            .map(|&(_, q)| q)
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_follows_changes() {
        let mut t = Timers::default();
        // What QPs 3, 7 and 9 keep.
        let (mut q3, mut q7, mut q9) = (None, None, None);
        assert_eq!(t.first(), None);
        t.set(7, &mut q7, Some(100));
        t.set(3, &mut q3, Some(50));
        t.set(9, &mut q9, Some(50));
        assert_eq!((q3, q7, q9), (Some(50), Some(100), Some(50)));
        assert_eq!(t.first(), Some(50));
        assert_eq!(t.due(49), Vec::<Qpn>::new());
        assert_eq!(t.due(50), vec![3, 9]);
        assert_eq!(t.due(u64::MAX), vec![3, 7, 9]);
        t.set(3, &mut q3, Some(200));
        t.set(3, &mut q3, Some(200));
        t.set(9, &mut q9, None);
        t.set(9, &mut q9, None);
        assert_eq!(t.first(), Some(100));
        assert_eq!(t.due(150), vec![7]);
        assert_eq!(t.due(u64::MAX), vec![3, 7]);
        t.set(7, &mut q7, None);
        t.set(3, &mut q3, None);
        assert_eq!((q3, q7, q9), (None, None, None));
        assert_eq!(t.first(), None);
        assert!(t.by_deadline.is_empty());
    }
}
