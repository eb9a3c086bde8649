//! Protection domains.

use super::table::Table;
use super::{ebusy, enomem, missing, Context};
use crate::error::Result;
use crate::types::PdId;

/// The protection domains; a PD has no state of its own, only the objects that name it.
pub(super) type PdTable = Table<PdId, ()>;

impl Context {
    pub(super) fn check_pd(&self, pd: PdId) -> Result<()> {
        if self.pds.contains(pd) {
            Ok(())
        } else {
            Err(missing("no such PD"))
        }
    }
    /// Whether `pd` is a live protection domain (for importing it by handle).
    pub fn pd_exists(&self, pd: PdId) -> bool {
        self.pds.contains(pd)
    }
    /// Allocate a protection domain.
    pub fn alloc_pd(&mut self) -> Result<PdId> {
        if self.pds.len() >= self.dev.max_pd as usize {
            return Err(enomem("too many PDs"));
        }
        let pd = PdId(self.new_id()?);
        self.pds.insert(pd, ());
        Ok(pd)
    }
    /// Free a PD; EBUSY while objects use it.
    pub fn dealloc_pd(&mut self, pd: PdId) -> Result<()> {
        self.check_pd(pd)?;
        let busy = self.mrs.uses_pd(pd)
            || self.mws.uses_pd(pd)
            || self.qps.uses_pd(pd)
            || self.ahs.uses_pd(pd)
            || self.srqs.uses_pd(pd);
        if busy {
            return Err(ebusy("PD in use"));
        }
        self.pds.remove(pd);
        Ok(())
    }
}
