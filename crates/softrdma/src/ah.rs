//! Address handles: where UD sends go.

use std::sync::Arc;

use softrdma_transport::verbs::{AhAttr, AhId, Gid, GlobalRoute, UdDest};

use crate::pd::{PdInner, ProtectionDomain};
use crate::Result;

impl ProtectionDomain {
    /// Create an address handle.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let pd = self.inner.id;
        let id = self.inner.dev.call(|r, _| r.create_ah(pd, attr))?;
        Ok(AddressHandle {
            pd: Arc::clone(&self.inner),
            id,
            attr: *attr,
        })
    }

    /// Create an address handle to `gid` with default routing (hop limit 64, traffic
    /// class 0, source GID index 0).
    pub fn create_ah_to(&self, gid: Gid) -> Result<AddressHandle> {
        self.create_ah(&ah_attr(gid, 0))
    }
}

/// An address vector to `gid` on port 1 with the given traffic class (IP DSCP/ECN byte)
/// and hop limit 64.
pub fn ah_attr(gid: Gid, traffic_class: u8) -> AhAttr {
    AhAttr {
        grh: GlobalRoute {
            dgid: gid,
            flow_label: 0,
            sgid_index: 0,
            hop_limit: 64,
            traffic_class,
        },
        is_global: true,
        port_num: 1,
        ..Default::default()
    }
}

/// An address handle: where UD sends go.
pub struct AddressHandle {
    pd: Arc<PdInner>,
    id: AhId,
    attr: AhAttr,
}

impl AddressHandle {
    /// The verbs handle.
    pub fn id(&self) -> AhId {
        self.id
    }
    /// Its address vector.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }
    /// A UD destination through this handle.
    pub fn dest(&self, remote_qpn: u32, remote_qkey: u32) -> UdDest {
        UdDest {
            ah: self.id,
            remote_qpn,
            remote_qkey,
        }
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.pd.dev.call(|r, _| r.destroy_ah(id));
    }
}
