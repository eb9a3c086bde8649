//! The engine's grants ([`softrdma_transport::GrantSink`]) kept in the same-host path's
//! shared table ([`softrdma_net::shm::grants`]), which the device's peers on this host
//! check one-sided operations against.

use std::net::SocketAddr;

use softrdma_net::shm::grants::{self, Ask, QpGrant, RegionGrant, Shared};
use softrdma_net::shm::Placer;
use softrdma_transport::verbs::{Access, PdId, Qpn, RemoteView};
use softrdma_transport::{GrantSink, Placement};

/// The engine's [`Placement`] through the link's [`Placer`].
#[derive(Debug)]
pub(crate) struct ShmPlacement(pub(crate) Placer);

impl Placement for ShmPlacement {
    fn write(
        &mut self,
        dst: SocketAddr,
        dqpn: Qpn,
        rkey: u32,
        va: u64,
        src: &[(u64, usize)],
    ) -> bool {
        let len: usize = src.iter().map(|p| p.1).sum();
        let ask = Ask {
            qpn: dqpn,
            rkey,
            va,
            len: len as u64,
            access: grants::REMOTE_WRITE,
        };
        // SAFETY: the engine gives the pieces of a registered region (checked by
        // `local_iovecs` under the engine lock, which the region cannot be deregistered
        // without) or of the WR's own inline copy: memory of this process it may read.
        unsafe { self.0.write(dst, &ask, src) }
    }

    fn reachable(
        &mut self,
        dst: SocketAddr,
        dqpn: Qpn,
        rkey: u32,
        va: u64,
        len: usize,
        write: bool,
    ) -> bool {
        let ask = Ask {
            qpn: dqpn,
            rkey,
            va,
            len: len as u64,
            access: if write {
                grants::REMOTE_WRITE
            } else {
                grants::REMOTE_READ
            },
        };
        self.0.check(dst, &ask)
    }

    fn peer_polls(&mut self, dst: SocketAddr) -> bool {
        self.0.peer_polls(dst)
    }

    fn peer_wrote(&mut self, dst: SocketAddr) -> u64 {
        self.0.peer_wrote(dst)
    }

    fn read(
        &mut self,
        dst: SocketAddr,
        dqpn: Qpn,
        rkey: u32,
        va: u64,
        dst_pieces: &[(u64, usize)],
    ) -> bool {
        let len: usize = dst_pieces.iter().map(|p| p.1).sum();
        let ask = Ask {
            qpn: dqpn,
            rkey,
            va,
            len: len as u64,
            access: grants::REMOTE_READ,
        };
        // SAFETY: the engine gives the pieces of a region registered for local writes
        // (checked by `local_iovecs` under the engine lock, which the region cannot be
        // deregistered without), the READ's destination, which nothing else of the device
        // touches while the READ is not finished.
        unsafe { self.0.read(dst, &ask, dst_pieces) }
    }
}

/// A [`GrantSink`] over the link's shared table.
#[derive(Debug)]
pub(crate) struct ShmGrants(pub(crate) Shared);

fn bits(a: Access) -> u32 {
    let mut b = 0;
    if a.contains(Access::REMOTE_WRITE) {
        b |= grants::REMOTE_WRITE;
    }
    if a.contains(Access::REMOTE_READ) {
        b |= grants::REMOTE_READ;
    }
    b
}

impl ShmGrants {
    fn table(&self) -> std::sync::MutexGuard<'_, grants::Grants> {
        self.0.grants.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GrantSink for ShmGrants {
    fn region(&mut self, r: &RemoteView) {
        let g = RegionGrant {
            rkey: r.rkey,
            iova: r.iova,
            len: r.len,
            host: r.host,
            access: bits(r.access),
            pd: r.pd.0,
        };
        let alive = std::sync::Arc::clone(&self.0.alive);
        if !self.table().grant_region(&g, |s| alive(s)) {
            tracing::debug!(
                rkey = format_args!("{:#x}", r.rkey),
                "region not in the grants table (its entries near the key are taken): \
                 same-host peers reach it through the rings"
            );
        }
    }

    fn revoke_region(&mut self, rkey: u32) {
        let alive = std::sync::Arc::clone(&self.0.alive);
        self.table().revoke_region(rkey, |s| alive(s));
    }

    fn qp(&mut self, qpn: Qpn, ready: Option<(Access, PdId)>) {
        let mut t = self.table();
        match ready {
            Some((access, pd)) => {
                t.grant_qp(&QpGrant {
                    qpn,
                    access: bits(access),
                    pd: pd.0,
                });
            }
            None => t.revoke_qp(qpn),
        }
    }
}
