//! Completion queues, completion channels and the CQ events between them.

use std::collections::VecDeque;

use super::table::Table;
use super::{ebusy, einval, enomem, missing, Context};
use crate::error::{ErrorKind, Result};
use crate::types::{AsyncEvent, ChannelId, CqId, WcStatus, WorkCompletion};

/// How a CQ is armed for its next event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arm {
    /// Any next completion.
    Next,
    /// Only a completion of a received message with the solicited bit (or any error).
    Solicited,
}

#[derive(Debug)]
pub(super) struct CqObj {
    cap: u32,
    q: VecDeque<WorkCompletion>,
    overflowed: bool,
    channel: Option<ChannelId>,
    timestamps: bool,
    arm: Option<Arm>,
    /// Events handed out by `get_cq_event` and not yet acknowledged.
    unacked: u64,
}

#[derive(Debug, Default)]
pub(super) struct ChannelObj {
    events: VecDeque<CqId>,
}

/// The completion queues.
pub(super) type CqTable = Table<CqId, CqObj>;
/// The completion channels.
pub(super) type ChannelTable = Table<ChannelId, ChannelObj>;

impl CqTable {
    fn uses_channel(&self, ch: ChannelId) -> bool {
        self.values().any(|c| c.channel == Some(ch))
    }
    /// Remove the completions of QP `qpn` that `cq` holds, but for its receives when
    /// `keep_recvs` (an SRQ's: each holds a buffer taken from the SRQ); how many.
    pub(super) fn clean(&mut self, cq: CqId, qpn: crate::types::Qpn, keep_recvs: bool) -> usize {
        let Some(c) = self.get_mut(cq) else {
            return 0;
        };
        let before = c.q.len();
        c.q.retain(|wc| wc.qp_num != qpn || (keep_recvs && wc.opcode.is_recv()));
        before - c.q.len()
    }
}

impl Context {
    /// Create a completion channel.
    pub fn create_channel(&mut self) -> Result<ChannelId> {
        let ch = ChannelId(self.new_id()?);
        self.channels.insert(ch, ChannelObj::default());
        Ok(ch)
    }
    /// Destroy a channel; EBUSY while CQs use it.
    pub fn destroy_channel(&mut self, ch: ChannelId) -> Result<()> {
        if !self.channels.contains(ch) {
            return Err(missing("no such channel"));
        }
        if self.cqs.uses_channel(ch) {
            return Err(ebusy("CQs use the channel"));
        }
        self.channels.remove(ch);
        Ok(())
    }
    fn check_cqe(&self, cqe: u32) -> Result<()> {
        if cqe == 0 || cqe > self.dev.max_cqe {
            return Err(einval("CQ size out of range"));
        }
        Ok(())
    }
    /// Create a CQ of at least `cqe` entries; returns its id and actual capacity.
    pub fn create_cq(
        &mut self,
        cqe: u32,
        channel: Option<ChannelId>,
        timestamps: bool,
    ) -> Result<(CqId, u32)> {
        self.check_cqe(cqe)?;
        if let Some(ch) = channel {
            if !self.channels.contains(ch) {
                return Err(missing("no such channel"));
            }
        }
        if self.cqs.len() >= self.dev.max_cq as usize {
            return Err(enomem("too many CQs"));
        }
        let id = CqId(self.new_id()?);
        self.cqs.insert(
            id,
            CqObj {
                cap: cqe,
                q: VecDeque::new(),
                overflowed: false,
                channel,
                timestamps,
                arm: None,
                unacked: 0,
            },
        );
        Ok((id, cqe))
    }
    /// Resize a CQ; EINVAL if smaller than its current contents.
    pub fn resize_cq(&mut self, cq: CqId, cqe: u32) -> Result<u32> {
        self.check_cqe(cqe)?;
        let c = self.cqs.get_mut(cq).ok_or(missing("no such CQ"))?;
        if (cqe as usize) < c.q.len() {
            return Err(einval("CQ holds more completions than the new size"));
        }
        c.cap = cqe;
        Ok(cqe)
    }
    /// Destroy a CQ; EBUSY while QPs use it or events are unacknowledged.
    pub fn destroy_cq(&mut self, cq: CqId) -> Result<()> {
        let c = self.cqs.get(cq).ok_or(missing("no such CQ"))?;
        if c.unacked > 0 {
            return Err(ebusy("CQ events not acknowledged"));
        }
        if self.qps.uses_cq(cq) {
            return Err(ebusy("QPs use the CQ"));
        }
        if let Some(ch) = c.channel.and_then(|ch| self.channels.get_mut(ch)) {
            ch.events.retain(|&e| e != cq);
        }
        self.cqs.remove(cq);
        Ok(())
    }
    /// Append a completion at time `now_ns`. If the CQ is full it overflows: the completion
    /// is lost, the CQ enters error and a `CqErr` async event is queued (the spec's behaviour).
    /// If armed (and for `Solicited` only when `solicited` or the status is an error), an
    /// event is queued on its channel and the arm is consumed. Returns false on overflow.
    pub fn push_completion(
        &mut self,
        cq: CqId,
        wc: WorkCompletion,
        solicited: bool,
        now_ns: u64,
    ) -> bool {
        let Some(c) = self.cqs.get_mut(cq) else {
            return false;
        };
        if c.overflowed {
            return false;
        }
        if c.q.len() >= c.cap as usize {
            c.overflowed = true;
            self.events.push_back(AsyncEvent::CqErr(cq));
            return false;
        }
        let mut wc = wc;
        wc.timestamp = c.timestamps.then_some(now_ns);
        let status_err = wc.status != WcStatus::Success;
        c.q.push_back(wc);
        let fire = match c.arm {
            Some(Arm::Next) => true,
            Some(Arm::Solicited) => solicited || status_err,
            None => false,
        };
        if fire {
            c.arm = None;
            if let Some(ch) = c.channel.and_then(|ch| self.channels.get_mut(ch)) {
                ch.events.push_back(cq);
            }
        }
        true
    }
    /// Poll up to `out.len()` completions, oldest first. EIO-like error (EINVAL) if overflowed.
    pub fn poll_cq(&mut self, cq: CqId, out: &mut [WorkCompletion]) -> Result<usize> {
        let c = self.cqs.get_mut(cq).ok_or(missing("no such CQ"))?;
        if c.overflowed {
            return Err(einval("CQ overflowed").with_kind(ErrorKind::CqOverflow));
        }
        let mut n = 0;
        for slot in out.iter_mut() {
            match c.q.pop_front() {
                Some(wc) => {
                    *slot = wc;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }
    /// Number of completions waiting.
    pub fn cq_len(&self, cq: CqId) -> Result<usize> {
        self.cqs
            .get(cq)
            .map(|c| c.q.len())
            .ok_or(missing("no such CQ"))
    }
    /// Arm the CQ for one event.
    pub fn req_notify_cq(&mut self, cq: CqId, arm: Arm) -> Result<()> {
        let c = self.cqs.get_mut(cq).ok_or(missing("no such CQ"))?;
        // Next is the wider request: it is not narrowed by a later Solicited.
        if c.arm != Some(Arm::Next) {
            c.arm = Some(arm);
        }
        Ok(())
    }
    /// Take the next CQ event from a channel, if any.
    pub fn get_cq_event(&mut self, ch: ChannelId) -> Option<CqId> {
        let chan = self.channels.get_mut(ch)?;
        let cq = chan.events.pop_front()?;
        if let Some(c) = self.cqs.get_mut(cq) {
            c.unacked += 1;
        }
        Some(cq)
    }
    /// Number of events waiting on a channel.
    pub fn channel_pending(&self, ch: ChannelId) -> usize {
        self.channels.get(ch).map_or(0, |c| c.events.len())
    }
    /// Acknowledge `n` events of a CQ. EINVAL if more than were taken with `get_cq_event`.
    pub fn ack_cq_events(&mut self, cq: CqId, n: u32) -> Result<()> {
        let c = self.cqs.get_mut(cq).ok_or(missing("no such CQ"))?;
        if n as u64 > c.unacked {
            return Err(einval("more events acknowledged than received"));
        }
        c.unacked -= n as u64;
        Ok(())
    }
}
