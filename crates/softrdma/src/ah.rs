//! Address handles: where UD sends go.

use std::sync::Arc;

use softrdma_transport::verbs::{AhAttr, AhId, Gid, GlobalRoute, UdDest};

use crate::pd::{PdInner, ProtectionDomain};
use crate::Result;

impl ProtectionDomain {
    /// Create an address handle.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let pd = self.inner.id;
        let id = self.inner.dev.rt().create_ah(pd, attr)?;
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
///
/// A UD QP has no connection: it moves to RTS with no peer, and each send names its
/// destination, an address handle (the peer device's GID) with the peer's QP number and
/// Q_Key ([`AddressHandle::dest`], [`crate::wr::ud_send`]). A message fits the port's
/// MTU, and every receive buffer starts with 40 bytes where the GRH lands (the IP
/// header of the datagram, IPv4 in its last 20 bytes), counted in `byte_len`.
///
/// ```
/// use std::time::Duration;
/// use softrdma::{wr, Access, Device, QpInit, QpType, RemoteQp, WcFlags, DEFAULT_QKEY};
/// # fn main() -> softrdma::Result<()> {
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let (a_cq, b_cq) = (dev.create_cq(128, None)?, dev.create_cq(128, None)?);
/// let a = pd.create_qp(&QpInit::new(QpType::Ud, &a_cq))?;
/// let b = pd.create_qp(&QpInit::new(QpType::Ud, &b_cq))?;
/// for qp in [&a, &b] {
///     // INIT (with the Q_Key DEFAULT_QKEY), RTR, RTS: no peer to name.
///     qp.connect(&RemoteQp::default(), 0, Access::empty())?;
/// }
/// let mem = pd.register(4096, Access::LOCAL_WRITE)?;
/// b.post_recv(wr::recv(1, [mem.sge(0..40 + 1024)?]))?;
///
/// let ah = pd.create_ah_to(dev.gid())?; // b's device: here the same one
/// mem.write(2048, b"datagram")?;
/// a.post_send(wr::ud_send(2, [mem.sge(2048..2056)?], ah.dest(b.qpn(), DEFAULT_QKEY)))?;
/// a_cq.wait(Duration::from_secs(5))?.result()?;
/// let wc = b_cq.wait(Duration::from_secs(5))?;
/// wc.result()?;
/// assert!(wc.wc_flags.contains(WcFlags::GRH));
/// assert_eq!((wc.byte_len, wc.src_qp), (40 + 8, a.qpn()));
/// assert_eq!(mem.to_vec(40, 8)?, b"datagram");
/// # Ok(()) }
/// ```
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
        let _ = self.pd.dev.rt().destroy_ah(id);
    }
}
