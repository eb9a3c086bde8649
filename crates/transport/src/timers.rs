//! The QPs' timer deadlines, ordered, so that finding the earliest one and the due ones
//! costs O(log QPs) instead of a scan of every QP: the device asks for the next deadline
//! after every step, and a device may carry tens of thousands of idle QPs.
//!
//! The protocol handlers keep setting `req.rto`, the round-trip timer and `req.rnr_until` on the QP;
//! [`crate::Rnic`] re-reads a QP's deadline here after every call that may have changed it.

use std::collections::{BTreeSet, HashMap};

use crate::qp::QpCtx;
use crate::verbs::Qpn;

/// Each QP's earliest deadline, indexed both ways.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    by_deadline: BTreeSet<(u64, Qpn)>,
    of: HashMap<Qpn, u64>,
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
    /// Record QP `qpn`'s earliest deadline (None: no timer, or no such QP).
    pub fn set(&mut self, qpn: Qpn, deadline: Option<u64>) {
        let old = match deadline {
            Some(d) => self.of.insert(qpn, d),
            None => self.of.remove(&qpn),
        };
        if old == deadline {
            return;
        }
        if let Some(o) = old {
            self.by_deadline.remove(&(o, qpn));
        }
        if let Some(d) = deadline {
            self.by_deadline.insert((d, qpn));
        }
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
        assert_eq!(t.first(), None);
        t.set(7, Some(100));
        t.set(3, Some(50));
        t.set(9, Some(50));
        assert_eq!(t.first(), Some(50));
        assert_eq!(t.due(49), Vec::<Qpn>::new());
        assert_eq!(t.due(50), vec![3, 9]);
        assert_eq!(t.due(u64::MAX), vec![3, 7, 9]);
        t.set(3, Some(200));
        t.set(9, None);
        t.set(9, None);
        assert_eq!(t.first(), Some(100));
        assert_eq!(t.due(150), vec![7]);
        t.set(7, None);
        t.set(3, None);
        assert_eq!(t.first(), None);
        assert!(t.of.is_empty() && t.by_deadline.is_empty());
    }
}
