//! Address handles and the address vector rules they share with connected QPs.

use super::table::Table;
use super::{einval, enomem, missing, Context};
use crate::error::Result;
use crate::types::{AhAttr, AhId, PdId};

/// The address handles, each with its PD and address vector.
pub(super) type AhTable = Table<AhId, (PdId, AhAttr)>;

impl AhTable {
    pub(super) fn uses_pd(&self, pd: PdId) -> bool {
        self.values().any(|a| a.0 == pd)
    }
}

impl Context {
    /// Check an address vector: RoCE needs `is_global`, a valid sgid index whose IP
    /// version is the destination's (RoCEv2 puts both in one IP header), port 1 (0 is
    /// taken as the default port 1).
    pub(super) fn check_ah_attr(&self, a: &AhAttr) -> Result<()> {
        if !a.is_global {
            return Err(einval("RoCE address vectors need a GRH (is_global)"));
        }
        let Some(sgid) = self.gids.get(a.grh.sgid_index as usize) else {
            return Err(einval("sgid index out of range"));
        };
        if sgid.to_ip().is_ipv4() != a.grh.dgid.to_ip().is_ipv4() {
            return Err(einval(
                "the source GID and the destination GID are of different IP versions",
            ));
        }
        if a.port_num > 1 {
            return Err(einval("no such port"));
        }
        Ok(())
    }
    /// Create an address handle; RoCE needs `is_global` and a valid sgid index.
    /// `port_num` must be 1 (0 is taken as port 1).
    pub fn create_ah(&mut self, pd: PdId, attr: &AhAttr) -> Result<AhId> {
        self.check_pd(pd)?;
        self.check_ah_attr(attr)?;
        if self.ahs.len() >= self.dev.max_ah as usize {
            return Err(enomem("too many AHs"));
        }
        let id = AhId(self.new_id()?);
        let mut a = *attr;
        a.port_num = 1;
        self.ahs.insert(id, (pd, a));
        Ok(id)
    }
    /// The attributes of an AH.
    pub fn ah(&self, ah: AhId) -> Result<(PdId, AhAttr)> {
        self.ahs.get(ah).copied().ok_or(missing("no such AH"))
    }
    /// Destroy an AH.
    pub fn destroy_ah(&mut self, ah: AhId) -> Result<()> {
        self.ahs.remove(ah).map(|_| ()).ok_or(missing("no such AH"))
    }
}
