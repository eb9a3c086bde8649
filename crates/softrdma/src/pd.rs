//! Protection domains. The objects that live in one are created through it; each family's
//! module adds its constructors (`register*` and `alloc_mw` in `mr`, `create_qp` and
//! `create_srq` in `qp`, `create_ah*` in `ah`), so every module depends on this one and
//! none on another through it.

use std::sync::Arc;

use softrdma_transport::verbs::PdId;

use crate::cq::CompletionQueue;
use crate::{Device, Result};

pub(crate) struct PdInner {
    pub(crate) dev: Device,
    pub(crate) id: PdId,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // Children hold an Arc of this PD, so none is left when this runs.
        let id = self.id;
        let _ = self.dev.rt().dealloc_pd(id);
    }
}

/// A protection domain. Cheap to clone (shared); objects made in it keep it alive.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl ProtectionDomain {
    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.dev
    }
    /// The verbs handle.
    pub fn id(&self) -> PdId {
        self.inner.id
    }

    /// A CQ on this PD's device (a shortcut for `pd.device().create_cq(cqe, None)`).
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue> {
        self.inner.dev.create_cq(cqe, None)
    }
}
