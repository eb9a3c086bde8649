//! Memory windows: allocation, binding (type 1 and type 2) and invalidation.

use super::table::IdMap;
use super::{einval, enomem, missing, Context};
use crate::error::Result;
use crate::types::{Access, MwBind, MwId, PdId, Qpn, WcStatus};

/// The rkey a type-1 bind gives a window whose rkey is `rkey`: the key byte (low 8 bits)
/// advanced by one, wrapping, the index (upper 24 bits) kept, as `ibv_inc_rkey` computes it.
///
/// [`Context::bind_mw`] applies it when the bind executes; a face that tells the program
/// the new key when the bind is posted (`ibv_bind_mw` sets `mw->rkey`) computes it from the
/// key the program last saw with this same function.
pub fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xFF) | (rkey.wrapping_add(1) & 0xFF)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MwState {
    /// Type 2 not bound (or invalidated).
    Free,
    /// Bound (type 1 windows are always valid, possibly with no region).
    Valid,
}

#[derive(Debug)]
pub(super) struct MwObj {
    pd: PdId,
    mw_type: u8,
    rkey: u32,
    state: MwState,
    /// Key of the region the window is bound to.
    mr_key: Option<u32>,
    /// Window start in the region's address space.
    addr: u64,
    length: u64,
    access: Access,
    /// Type 2: the QP the window is bound to.
    qpn: Option<Qpn>,
}

impl MwObj {
    /// Where a remote access of `len` bytes at `va` through this window lands, as (region
    /// key, address in the region's space), if the window is valid for `pd`, bound to `qpn`
    /// when it is a type-2 window, grants `need`, and covers the range. The region itself is
    /// the caller's to check.
    pub(super) fn reach(
        &self,
        pd: PdId,
        qpn: Qpn,
        va: u64,
        len: u64,
        need: Access,
    ) -> Option<(u32, u64)> {
        if self.state != MwState::Valid || self.pd != pd {
            return None;
        }
        if self.mw_type == 2 && self.qpn != Some(qpn) {
            return None;
        }
        if !self.access.contains(need) {
            return None;
        }
        let mr_key = self.mr_key?;
        // Window-relative offset of va.
        let off = if self.access.contains(Access::ZERO_BASED) {
            va
        } else {
            va.checked_sub(self.addr)?
        };
        match off.checked_add(len) {
            Some(end) if end <= self.length => {}
            _ => return None,
        }
        Some((mr_key, self.addr.checked_add(off)?))
    }
    /// Back to unbound: what invalidation does to a type-2 window, and destroying its QP.
    fn free(&mut self) {
        self.state = MwState::Free;
        self.mr_key = None;
        self.qpn = None;
    }
}

/// The memory windows by id, and by rkey index (key >> 8), which they share with the
/// regions (see [`Context::alloc_key`]).
#[derive(Debug, Default)]
pub(super) struct MwTable {
    by_id: IdMap<MwId, MwObj>,
    by_index: IdMap<u32, MwId>,
}

impl MwTable {
    /// The window whose current rkey is `rkey`.
    pub(super) fn by_rkey(&self, rkey: u32) -> Option<&MwObj> {
        let id = self.by_index.get(&(rkey >> 8))?;
        self.by_id.get(id).filter(|w| w.rkey == rkey)
    }
    fn by_rkey_mut(&mut self, rkey: u32) -> Option<&mut MwObj> {
        let id = self.by_index.get(&(rkey >> 8))?;
        self.by_id.get_mut(id).filter(|w| w.rkey == rkey)
    }
    /// Whether a window holds the key index `index`.
    pub(super) fn has_index(&self, index: u32) -> bool {
        self.by_index.contains_key(&index)
    }
    pub(super) fn uses_pd(&self, pd: PdId) -> bool {
        self.by_id.values().any(|w| w.pd == pd)
    }
    /// Whether a window is bound to the region whose key is `mr_key`.
    pub(super) fn bound_to_mr(&self, mr_key: u32) -> bool {
        self.by_id
            .values()
            .any(|w| w.state == MwState::Valid && w.mr_key == Some(mr_key))
    }
    /// Free the type-2 windows bound to `qpn` (the QP is going away).
    pub(super) fn unbind_qp(&mut self, qpn: Qpn) {
        for mw in self.by_id.values_mut() {
            if mw.mw_type == 2 && mw.qpn == Some(qpn) {
                mw.free();
            }
        }
    }
}

impl Context {
    /// Invalidate an rkey (SEND_WITH_INV at the responder, LOCAL_INV at the requester):
    /// MRs with MW_BIND-capable type-2 windows and fast-reg style keys.
    /// Returns the error status to report on failure.
    ///
    /// Only bound type-2 windows of `pd` can be invalidated here: this layer has no
    /// fast-registration MRs, and, as in rxe, an ordinary MR's key cannot be invalidated.
    /// Any failure (unknown key, an MR key, a type-1 window, another PD, an unbound window)
    /// returns `MwBindErr` ("memory management operation error", the requester's status for
    /// a failed LOCAL_INV); a responder handling SEND_WITH_INV reports its invalid request
    /// error (`RemInvReqErr`) instead.
    pub fn invalidate_rkey(&mut self, pd: PdId, rkey: u32) -> core::result::Result<(), WcStatus> {
        let mw = self.mws.by_rkey_mut(rkey).ok_or(WcStatus::MwBindErr)?;
        if mw.mw_type != 2 || mw.pd != pd || mw.state != MwState::Valid {
            return Err(WcStatus::MwBindErr);
        }
        mw.free();
        Ok(())
    }

    /// Allocate a memory window of type 1 or 2.
    pub fn alloc_mw(&mut self, pd: PdId, mw_type: u8) -> Result<MwId> {
        self.check_pd(pd)?;
        if mw_type != 1 && mw_type != 2 {
            return Err(einval("memory window type must be 1 or 2"));
        }
        if self.mws.by_id.len() >= self.dev.max_mw as usize {
            return Err(enomem("too many memory windows"));
        }
        let rkey = self.alloc_key()?;
        let id = MwId(self.new_id()?);
        self.mws.by_id.insert(
            id,
            MwObj {
                pd,
                mw_type,
                rkey,
                state: if mw_type == 1 {
                    MwState::Valid
                } else {
                    MwState::Free
                },
                mr_key: None,
                addr: 0,
                length: 0,
                access: Access::empty(),
                qpn: None,
            },
        );
        self.mws.by_index.insert(rkey >> 8, id);
        Ok(id)
    }
    /// Free a window.
    pub fn dealloc_mw(&mut self, mw: MwId) -> Result<()> {
        let obj = self
            .mws
            .by_id
            .remove(&mw)
            .ok_or(missing("no such memory window"))?;
        self.mws.by_index.remove(&(obj.rkey >> 8));
        Ok(())
    }
    /// Current rkey of a window.
    pub fn mw_rkey(&self, mw: MwId) -> Result<u32> {
        self.mws
            .by_id
            .get(&mw)
            .map(|w| w.rkey)
            .ok_or(missing("no such memory window"))
    }
    /// Bind (executed in send-queue order by the transport). For type 1 the key byte is
    /// bumped ([`inc_rkey`]) and the new rkey returned; for type 2 `bind.rkey` becomes the key and the window
    /// is tied to `qpn`. MwBindErr on failure (MR without MW_BIND, bounds, PD, wrong type).
    ///
    /// Type 2: the window must be free (unbound or invalidated), `bind.rkey` must keep the
    /// window's index (upper 24 bits, as `ibv_inc_rkey` does) and `qpn` must exist. Type 1:
    /// ZERO_BASED is not allowed; a zero length unbinds. Remote write or atomic rights need
    /// LOCAL_WRITE on the region.
    pub fn bind_mw(
        &mut self,
        pd: PdId,
        qpn: Qpn,
        bind: &MwBind,
    ) -> core::result::Result<u32, WcStatus> {
        const E: WcStatus = WcStatus::MwBindErr;
        let mw = self.mws.by_id.get(&bind.mw).ok_or(E)?;
        if mw.pd != pd {
            return Err(E);
        }
        let t = mw.mw_type;
        let new_rkey = if t == 1 {
            if bind.access.contains(Access::ZERO_BASED) {
                return Err(E);
            }
            inc_rkey(mw.rkey)
        } else {
            if mw.state != MwState::Free
                || (bind.rkey & !0xFF) != (mw.rkey & !0xFF)
                || !self.qps.contains(qpn)
            {
                return Err(E);
            }
            bind.rkey
        };
        let unbind = t == 1 && bind.length == 0;
        if !unbind {
            let mr = self.mrs.by_key(bind.mr_lkey).ok_or(E)?;
            if mr.pd != pd
                || !mr.access.contains(Access::MW_BIND)
                || !mr.contains(bind.addr, bind.length)
            {
                return Err(E);
            }
            if bind
                .access
                .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
                && !mr.access.contains(Access::LOCAL_WRITE)
            {
                return Err(E);
            }
        }
        let Some(mw) = self.mws.by_id.get_mut(&bind.mw) else {
            return Err(E);
        };
        mw.rkey = new_rkey;
        mw.state = MwState::Valid;
        if unbind {
            mw.mr_key = None;
            mw.addr = 0;
            mw.length = 0;
            mw.access = Access::empty();
        } else {
            mw.mr_key = Some(bind.mr_lkey);
            mw.addr = bind.addr;
            mw.length = bind.length;
            mw.access = bind.access;
        }
        mw.qpn = if t == 2 { Some(qpn) } else { None };
        Ok(new_rkey)
    }
}
