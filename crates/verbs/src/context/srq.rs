//! Shared receive queues and their limit event.

use std::collections::VecDeque;

use super::table::Table;
use super::{ebusy, einval, enomem, missing, Context};
use crate::error::{ErrorKind, Result};
use crate::types::{AsyncEvent, PdId, RecvWr, SrqId};

#[derive(Debug)]
pub(super) struct SrqObj {
    pd: PdId,
    max_wr: u32,
    max_sge: u32,
    limit: u32,
    q: VecDeque<RecvWr>,
}

/// The shared receive queues.
pub(super) type SrqTable = Table<SrqId, SrqObj>;

impl SrqTable {
    pub(super) fn uses_pd(&self, pd: PdId) -> bool {
        self.values().any(|s| s.pd == pd)
    }
}

impl Context {
    /// Create an SRQ with `max_wr`, `max_sge` and a limit (0 = disarmed).
    /// `max_wr` and `max_sge` of 0 are rounded up to 1; EINVAL above the device limits or for
    /// a limit above `max_wr`.
    pub fn create_srq(&mut self, pd: PdId, max_wr: u32, max_sge: u32, limit: u32) -> Result<SrqId> {
        self.check_pd(pd)?;
        if max_wr > self.dev.max_srq_wr || max_sge > self.dev.max_srq_sge {
            return Err(einval("SRQ size above device limits"));
        }
        let max_wr = max_wr.max(1);
        let max_sge = max_sge.max(1);
        if limit > max_wr {
            return Err(einval("SRQ limit above max_wr"));
        }
        if self.srqs.len() >= self.dev.max_srq as usize {
            return Err(enomem("too many SRQs"));
        }
        let id = SrqId(self.new_id()?);
        self.srqs.insert(
            id,
            SrqObj {
                pd,
                max_wr,
                max_sge,
                limit,
                q: VecDeque::new(),
            },
        );
        Ok(id)
    }
    /// Change max_wr (grow only) and/or arm the limit. EINVAL for a limit above max_wr.
    pub fn modify_srq(
        &mut self,
        srq: SrqId,
        max_wr: Option<u32>,
        limit: Option<u32>,
    ) -> Result<()> {
        let dev_max = self.dev.max_srq_wr;
        let s = self.srqs.get_mut(srq).ok_or(missing("no such SRQ"))?;
        let new_max = max_wr.unwrap_or(s.max_wr);
        if new_max < s.max_wr || new_max > dev_max {
            return Err(einval("SRQ max_wr may only grow, up to the device limit"));
        }
        let new_limit = limit.unwrap_or(s.limit);
        if new_limit > new_max {
            return Err(einval("SRQ limit above max_wr"));
        }
        s.max_wr = new_max;
        s.limit = new_limit;
        Ok(())
    }
    /// (max_wr, max_sge, limit).
    pub fn query_srq(&self, srq: SrqId) -> Result<(u32, u32, u32)> {
        self.srqs
            .get(srq)
            .map(|s| (s.max_wr, s.max_sge, s.limit))
            .ok_or(missing("no such SRQ"))
    }
    /// The PD an SRQ was created in, whose regions its receive SGEs must name.
    pub fn srq_pd(&self, srq: SrqId) -> Result<PdId> {
        self.srqs
            .get(srq)
            .map(|s| s.pd)
            .ok_or(missing("no such SRQ"))
    }
    /// Destroy an SRQ; EBUSY while QPs use it.
    pub fn destroy_srq(&mut self, srq: SrqId) -> Result<()> {
        if !self.srqs.contains(srq) {
            return Err(missing("no such SRQ"));
        }
        if self.qps.uses_srq(srq) {
            return Err(ebusy("QPs use the SRQ"));
        }
        self.srqs.remove(srq);
        Ok(())
    }
    /// Post a receive WR to an SRQ (ENOMEM when full, EINVAL for too many SGEs).
    pub fn post_srq_recv(&mut self, srq: SrqId, wr: RecvWr) -> Result<()> {
        let s = self.srqs.get_mut(srq).ok_or(missing("no such SRQ"))?;
        if wr.sg_list.len() > s.max_sge as usize {
            return Err(einval("too many SGEs"));
        }
        if s.q.len() >= s.max_wr as usize {
            return Err(enomem("SRQ full").with_kind(ErrorKind::QueueFull));
        }
        s.q.push_back(wr);
        Ok(())
    }
    /// Number of receive WRs posted to an SRQ.
    pub fn srq_len(&self, srq: SrqId) -> Result<usize> {
        self.srqs
            .get(srq)
            .map(|s| s.q.len())
            .ok_or(missing("no such SRQ"))
    }
    /// Take the SRQ's next receive WR, firing the limit event when the SRQ drops below its
    /// armed limit (which disarms it).
    pub(super) fn take_srq_recv(&mut self, srq: SrqId) -> Option<RecvWr> {
        let s = self.srqs.get_mut(srq)?;
        let wr = s.q.pop_front()?;
        if s.limit > 0 && (s.q.len() as u64) < s.limit as u64 {
            s.limit = 0;
            self.events.push_back(AsyncEvent::SrqLimitReached(srq));
        }
        Some(wr)
    }
    /// The SRQ's next receive WR, left in place.
    pub(super) fn peek_srq_recv(&self, srq: SrqId) -> Option<&RecvWr> {
        self.srqs.get(srq)?.q.front()
    }
}
