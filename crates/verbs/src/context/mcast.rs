//! Multicast attachments (`ibv_attach_mcast`): which UD QPs get a copy of the datagrams
//! sent to a multicast GID, with the rules of the kernel's `ib_attach_mcast` /
//! `ib_uverbs_attach_mcast` and of rxe (`rxe_mcast.c`).

use std::collections::HashMap;

use super::{einval, enomem, missing, Context};
use crate::error::Result;
use crate::types::{Gid, QpType, Qpn};

/// The attached QPs of every group that has any.
#[derive(Debug, Default)]
pub(super) struct McastTable {
    /// Attached QPs per group, in the order they attached.
    groups: HashMap<Gid, Vec<Qpn>>,
    /// Attachments in all.
    total: usize,
}

impl McastTable {
    /// Whether the QP is attached to any group (it cannot be destroyed then).
    pub(super) fn has_qp(&self, qpn: Qpn) -> bool {
        self.groups.values().any(|m| m.contains(&qpn))
    }
}

impl Context {
    /// The checks attach and detach share (`ib_attach_mcast`): the QP exists and is UD,
    /// and `mgid` is a multicast GID. All EINVAL.
    fn check_mcast(&self, qpn: Qpn, mgid: Gid) -> Result<()> {
        let q = self.qps.get(qpn).ok_or(missing("no such QP"))?;
        if q.init.qp_type != QpType::Ud {
            return Err(einval("only UD QPs join multicast groups"));
        }
        if !mgid.is_multicast() {
            return Err(einval("not a multicast GID"));
        }
        Ok(())
    }

    /// Attach UD QP `qpn` to the multicast group `mgid`: from now on it receives a copy of
    /// every UD SEND to the group (destination QP 0xFFFFFF, destination IP the group's),
    /// Q_Key checked as for unicast. `mlid` is ignored, as the RoCE annex says (RoCE has
    /// no LIDs). Attaching a QP that is already attached succeeds and changes nothing
    /// (rxe, and uverbs before it, answer 0). ENOMEM past the device's `max_mcast_grp`
    /// groups, `max_mcast_qp_attach` QPs in a group or `max_total_mcast_qp_attach`
    /// attachments, as rxe. Returns whether the group is new on this device (a runtime
    /// starts receiving its datagrams then).
    pub fn attach_mcast(&mut self, qpn: Qpn, mgid: Gid, _mlid: u16) -> Result<bool> {
        self.check_mcast(qpn, mgid)?;
        let t = &mut self.mcast;
        let new = match t.groups.get(&mgid) {
            Some(m) if m.contains(&qpn) => return Ok(false),
            Some(m) if m.len() >= self.dev.max_mcast_qp_attach as usize => {
                return Err(enomem("the group has the most QPs a group may have"))
            }
            Some(_) => false,
            None if t.groups.len() >= self.dev.max_mcast_grp as usize => {
                return Err(enomem("the device has the most groups it may have"))
            }
            None => true,
        };
        if t.total >= self.dev.max_total_mcast_qp_attach as usize {
            return Err(enomem("the device has the most attachments it may have"));
        }
        t.groups.entry(mgid).or_default().push(qpn);
        t.total += 1;
        Ok(new)
    }

    /// Detach UD QP `qpn` from the multicast group `mgid` (`mlid` ignored, as for attach).
    /// EINVAL when it is not attached (uverbs checks its own list of the QP's attachments
    /// first), or for the reasons attach gives. Returns whether the group has no QP left
    /// (a runtime stops receiving its datagrams then).
    pub fn detach_mcast(&mut self, qpn: Qpn, mgid: Gid, _mlid: u16) -> Result<bool> {
        self.check_mcast(qpn, mgid)?;
        let t = &mut self.mcast;
        let Some(members) = t.groups.get_mut(&mgid) else {
            return Err(missing("the QP is not attached to that group"));
        };
        let Some(at) = members.iter().position(|&q| q == qpn) else {
            return Err(missing("the QP is not attached to that group"));
        };
        members.remove(at);
        t.total -= 1;
        let empty = members.is_empty();
        if empty {
            t.groups.remove(&mgid);
        }
        Ok(empty)
    }

    /// The QPs attached to group `mgid`, in the order they attached (none: not a group
    /// of this device).
    pub fn mcast_members(&self, mgid: &Gid) -> &[Qpn] {
        self.mcast.groups.get(mgid).map_or(&[], Vec::as_slice)
    }

    /// The groups with at least one QP attached, in no particular order.
    pub fn mcast_groups(&self) -> impl Iterator<Item = Gid> + '_ {
        self.mcast.groups.keys().copied()
    }
}
