//! Grants: what a device lets its same-host peers do to its registered memory without
//! it, for one-sided operations that copy once, straight between the two processes
//! (`process_vm_writev` / `process_vm_readv`), with no thread of the target running.
//!
//! The target publishes, in a sealed memfd that its peers map, the regions its peers may
//! reach (rkey, bounds, host address, remote access rights, protection domain) and its
//! QPs (remote access rights, protection domain). A requester checks an operation there
//! exactly as the target's responder would, and copies only under a *hold*: it announces
//! the region and the grant's generation in its own slot, then reads the grant again.
//! The target revokes a grant (deregistration, invalidation) by changing its generation
//! and then waiting until no live peer's slot announces the old one. Either the
//! requester sees the revocation and copies nothing, or the target sees the hold and
//! waits for the copy: a revoked region is never written after the revocation returns
//! (the orderings are sequentially consistent, Dekker's pattern).
//!
//! The table is a peer's to scribble on (same user: it could trace us anyway); it only
//! ever tells a requester what to ask the kernel for, and the kernel checks that address
//! against the target's own memory map. Every index and length read from it is bounded
//! here, and nothing in it is ever dereferenced.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{fence, Ordering};

use super::map::{check_sealed_memfd, sealed_memfd, Mapping};

/// Peers that may each hold one copy in flight at once.
pub const PEER_SLOTS: usize = 64;
/// Regions published at most; operations on others go through the rings.
pub const REGIONS: usize = 4096;
/// QPs published at most.
pub const QPS: usize = 1024;
/// Entries a lookup tries from a key's home before giving up.
const PROBE: usize = 16;

/// A grant allows remote writes.
pub const REMOTE_WRITE: u32 = 1;
/// A grant allows remote reads.
pub const REMOTE_READ: u32 = 2;

const MAGIC: u64 = u64::from_le_bytes(*b"SRDMAG1\0");
const OFF_MAGIC: usize = 0;
const LINE: usize = 64;
const SLOTS_OFF: usize = LINE;
const REGIONS_OFF: usize = SLOTS_OFF + PEER_SLOTS * LINE;
const REGION_SIZE: usize = 64;
const QPS_OFF: usize = REGIONS_OFF + REGIONS * REGION_SIZE;
const QP_SIZE: usize = 32;
/// Size of the grants' memfd.
pub const GRANTS_BYTES: usize = (QPS_OFF + QPS * QP_SIZE).next_multiple_of(4096);

// An entry starts with its state: generation << 1 | valid. Its other words are written
// only while the state says invalid, and read between two reads of an unchanged state.
const E_STATE: usize = 0;
const R_RKEY: usize = 8;
const R_ACCESS: usize = 12;
const R_PD: usize = 16;
const R_IOVA: usize = 24;
const R_LEN: usize = 32;
const R_HOST: usize = 40;
const Q_QPN: usize = 8;
const Q_ACCESS: usize = 12;
const Q_PD: usize = 16;

fn region_off(i: usize) -> usize {
    REGIONS_OFF + (i % REGIONS) * REGION_SIZE
}

fn qp_off(i: usize) -> usize {
    QPS_OFF + (i % QPS) * QP_SIZE
}

fn region_home(rkey: u32) -> usize {
    (rkey.wrapping_mul(0x9E37_79B1) >> 20) as usize
}

fn qp_home(qpn: u32) -> usize {
    (qpn.wrapping_mul(0x9E37_79B1) >> 22) as usize
}

/// What a hold announces: the region's index (+1, so that 0 means none) and the low
/// bits of the state it was checked under.
fn hold_key(idx: usize, state: u64) -> u64 {
    ((idx as u64 + 1) << 48) | (state & ((1 << 48) - 1))
}

/// A region a device lets its peers reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionGrant {
    /// The key a peer names it by.
    pub rkey: u32,
    /// The first address a peer names (the region's I/O virtual address).
    pub iova: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Where `iova` is in the target process.
    pub host: u64,
    /// [`REMOTE_WRITE`] and [`REMOTE_READ`], as the region allows.
    pub access: u32,
    /// Its protection domain (the target's number for it).
    pub pd: u32,
}

/// A QP of a device whose peers may reach its regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpGrant {
    /// Its number.
    pub qpn: u32,
    /// [`REMOTE_WRITE`] and [`REMOTE_READ`], as the QP allows.
    pub access: u32,
    /// Its protection domain.
    pub pd: u32,
}

/// The target's side: the table it publishes and revokes from.
#[derive(Debug)]
pub struct Grants {
    map: Mapping,
    memfd: OwnedFd,
    /// Where each granted region and QP sits (ours only: never read from the table).
    regions: HashMap<u32, usize>,
    qps: HashMap<u32, usize>,
    /// Which entries hold a grant.
    region_used: Vec<bool>,
    qp_used: Vec<bool>,
    /// Slots given to peers.
    slots: [bool; PEER_SLOTS],
}

/// The first free entry of `used` within [`PROBE`] of `home` (wrapping), if any.
fn free_entry(used: &[bool], home: usize) -> Option<usize> {
    (0..PROBE)
        .map(|k| (home + k) % used.len())
        .find(|&i| !used[i])
}

impl Grants {
    /// An empty table in a fresh sealed memfd.
    pub fn create() -> io::Result<Grants> {
        let memfd = sealed_memfd(c"softrdma-grants", GRANTS_BYTES)?;
        let map = Mapping::map(memfd.as_fd(), GRANTS_BYTES)?;
        map.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(Grants {
            map,
            memfd,
            regions: HashMap::new(),
            qps: HashMap::new(),
            region_used: vec![false; REGIONS],
            qp_used: vec![false; QPS],
            slots: [false; PEER_SLOTS],
        })
    }

    /// The table's memfd, to pass to a peer with the slot it may use.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// A free slot for a new peer; None when every slot is taken.
    pub fn claim_slot(&mut self) -> Option<usize> {
        let s = self.slots.iter().position(|used| !used)?;
        self.slots[s] = true;
        self.map
            .u64_at(SLOTS_OFF + s * LINE)
            .store(0, Ordering::SeqCst);
        Some(s)
    }

    /// The peer of `slot` is gone: its slot is free again, and whatever it announced no
    /// longer holds a revocation up.
    pub fn release_slot(&mut self, slot: usize) {
        if let Some(used) = self.slots.get_mut(slot) {
            *used = false;
            self.map
                .u64_at(SLOTS_OFF + slot * LINE)
                .store(0, Ordering::SeqCst);
        }
    }

    /// Publish `g` (replacing a grant of the same rkey, which is revoked first, waiting
    /// for holds of it as [`Grants::revoke_region`] does). False if no entry near its
    /// home is free: the region stays reachable through the rings only.
    pub fn grant_region(&mut self, g: &RegionGrant, alive: impl Fn(usize) -> bool) -> bool {
        self.revoke_region(g.rkey, &alive);
        let Some(i) = free_entry(&self.region_used, region_home(g.rkey)) else {
            return false;
        };
        self.write_entry(region_off(i), |m, off| {
            m.u32_at(off + R_RKEY).store(g.rkey, Ordering::Relaxed);
            m.u32_at(off + R_ACCESS).store(g.access, Ordering::Relaxed);
            m.u32_at(off + R_PD).store(g.pd, Ordering::Relaxed);
            m.u64_at(off + R_IOVA).store(g.iova, Ordering::Relaxed);
            m.u64_at(off + R_LEN).store(g.len, Ordering::Relaxed);
            m.u64_at(off + R_HOST).store(g.host, Ordering::Relaxed);
        });
        self.regions.insert(g.rkey, i);
        self.region_used[i] = true;
        true
    }

    /// Withdraw the grant of `rkey` (if any), and return only once no peer whose slot
    /// `alive` says is live still holds it: after this, no peer copies into or out of
    /// the region under that grant.
    pub fn revoke_region(&mut self, rkey: u32, alive: impl Fn(usize) -> bool) {
        let Some(i) = self.regions.remove(&rkey) else {
            return;
        };
        self.region_used[i] = false;
        let old = self.invalidate_entry(region_off(i));
        let key = hold_key(i, old);
        for s in 0..PEER_SLOTS {
            if !self.slots[s] {
                continue;
            }
            let active = self.map.u64_at(SLOTS_OFF + s * LINE);
            while active.load(Ordering::SeqCst) == key && alive(s) {
                std::thread::yield_now();
            }
        }
    }

    /// Publish QP `g` (replacing what was published for its number). False if no entry
    /// near its home is free.
    pub fn grant_qp(&mut self, g: &QpGrant) -> bool {
        self.revoke_qp(g.qpn);
        let Some(i) = free_entry(&self.qp_used, qp_home(g.qpn)) else {
            return false;
        };
        self.write_entry(qp_off(i), |m, off| {
            m.u32_at(off + Q_QPN).store(g.qpn, Ordering::Relaxed);
            m.u32_at(off + Q_ACCESS).store(g.access, Ordering::Relaxed);
            m.u32_at(off + Q_PD).store(g.pd, Ordering::Relaxed);
        });
        self.qps.insert(g.qpn, i);
        self.qp_used[i] = true;
        true
    }

    /// Withdraw QP `qpn`: later checks through it fail. (A copy already checked through
    /// it may still finish, as a NIC's DMA may as the QP leaves RTS; the regions'
    /// revocations are what fence memory.)
    pub fn revoke_qp(&mut self, qpn: u32) {
        if let Some(i) = self.qps.remove(&qpn) {
            self.qp_used[i] = false;
            self.invalidate_entry(qp_off(i));
        }
    }

    /// Rewrite the entry at `off` with `fill` (given the mapping and `off`): its state goes
    /// to a new generation, invalid, while the fields change, then valid, so a reader that
    /// reads the state around the fields sees either the old entry invalid or the new one
    /// whole.
    fn write_entry(&self, off: usize, fill: impl FnOnce(&Mapping, usize)) {
        let state = self.map.u64_at(off + E_STATE);
        let gen = state.load(Ordering::Relaxed) >> 1;
        state.store((gen + 1) << 1, Ordering::SeqCst);
        fill(&self.map, off);
        state.store(((gen + 2) << 1) | 1, Ordering::Release);
    }

    /// Mark the entry at `off` invalid in a new generation; its state before.
    fn invalidate_entry(&self, off: usize) -> u64 {
        let state = self.map.u64_at(off + E_STATE);
        let old = state.load(Ordering::Relaxed);
        state.store(((old >> 1) + 1) << 1, Ordering::SeqCst);
        old
    }
}

/// A device's grants as its link shares them with the device: the table, and whether
/// the peer given a slot is still connected (a revocation waits for its holds only then).
#[derive(Clone)]
pub struct Shared {
    /// The table.
    pub grants: std::sync::Arc<std::sync::Mutex<Grants>>,
    /// Whether slot `s`'s peer is connected.
    pub alive: std::sync::Arc<dyn Fn(usize) -> bool + Send + Sync>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

/// Why a requester may not copy on its own (it then sends the operation's packets, and
/// the target's responder answers as it would any other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The QP is not published (not ready, not ours to reach, or the table is full).
    NoQp,
    /// The QP does not allow the access.
    QpAccess,
    /// No region of that rkey is published.
    NoRegion,
    /// The region does not allow the access.
    RegionAccess,
    /// The region belongs to another protection domain than the QP.
    ForeignPd,
    /// The bytes named are not all inside the region.
    OutOfBounds,
    /// The grant changed while it was being read or held.
    Changed,
}

/// One operation as a requester asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// The target QP.
    pub qpn: u32,
    /// The region's key.
    pub rkey: u32,
    /// The first address named.
    pub va: u64,
    /// How many bytes.
    pub len: u64,
    /// [`REMOTE_WRITE`] or [`REMOTE_READ`].
    pub access: u32,
}

/// A requester's view of one target's grants, with the slot it announces holds in.
#[derive(Debug)]
pub struct PeerGrants {
    map: Mapping,
    slot: usize,
}

impl PeerGrants {
    /// Map a target's grants (refused unless it is a sealed memfd of
    /// [`GRANTS_BYTES`] with the table's mark), announcing holds in `slot`.
    pub fn open(memfd: BorrowedFd<'_>, slot: usize) -> io::Result<PeerGrants> {
        check_sealed_memfd(memfd, GRANTS_BYTES, "grants")?;
        if slot >= PEER_SLOTS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "grants slot out of range",
            ));
        }
        let map = Mapping::map(memfd, GRANTS_BYTES)?;
        if map.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a grants table",
            ));
        }
        Ok(PeerGrants { map, slot })
    }

    /// Check `a` as the target's responder would and hold the region: until the returned
    /// hold is dropped, the target's revocation of it waits. The hold says where the
    /// bytes are in the target.
    pub fn hold(&mut self, a: &Ask) -> Result<Hold<'_>, Refusal> {
        let qp_pd = self.find_qp(a)?;
        let (i, state, g) = self.find_region(a.rkey)?;
        if g.access & a.access != a.access {
            return Err(Refusal::RegionAccess);
        }
        if g.pd != qp_pd {
            return Err(Refusal::ForeignPd);
        }
        let end = a.va.checked_add(a.len).ok_or(Refusal::OutOfBounds)?;
        let region_end = g.iova.checked_add(g.len).ok_or(Refusal::OutOfBounds)?;
        if a.va < g.iova || end > region_end {
            return Err(Refusal::OutOfBounds);
        }
        let host = g
            .host
            .checked_add(a.va - g.iova)
            .ok_or(Refusal::OutOfBounds)?;
        let active = self.map.u64_at(SLOTS_OFF + self.slot * LINE);
        active.store(hold_key(i, state), Ordering::SeqCst);
        if self
            .map
            .u64_at(region_off(i) + E_STATE)
            .load(Ordering::SeqCst)
            != state
        {
            active.store(0, Ordering::SeqCst);
            return Err(Refusal::Changed);
        }
        Ok(Hold { grants: self, host })
    }

    /// The protection domain of the QP `a` names, if it is published and allows `a`.
    fn find_qp(&self, a: &Ask) -> Result<u32, Refusal> {
        let home = qp_home(a.qpn);
        for k in 0..PROBE {
            let off = qp_off(home + k);
            let state = self.map.u64_at(off + E_STATE);
            let s1 = state.load(Ordering::Acquire);
            if s1 & 1 == 0 || self.map.u32_at(off + Q_QPN).load(Ordering::Relaxed) != a.qpn {
                continue;
            }
            let access = self.map.u32_at(off + Q_ACCESS).load(Ordering::Relaxed);
            let pd = self.map.u32_at(off + Q_PD).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if state.load(Ordering::Relaxed) != s1 {
                return Err(Refusal::Changed);
            }
            if access & a.access != a.access {
                return Err(Refusal::QpAccess);
            }
            return Ok(pd);
        }
        Err(Refusal::NoQp)
    }

    /// The region of `rkey`: its index, the state it was read under, and its grant.
    fn find_region(&self, rkey: u32) -> Result<(usize, u64, RegionGrant), Refusal> {
        let home = region_home(rkey);
        for k in 0..PROBE {
            let i = (home + k) % REGIONS;
            let off = region_off(i);
            let state = self.map.u64_at(off + E_STATE);
            let s1 = state.load(Ordering::Acquire);
            if s1 & 1 == 0 || self.map.u32_at(off + R_RKEY).load(Ordering::Relaxed) != rkey {
                continue;
            }
            let g = RegionGrant {
                rkey,
                access: self.map.u32_at(off + R_ACCESS).load(Ordering::Relaxed),
                pd: self.map.u32_at(off + R_PD).load(Ordering::Relaxed),
                iova: self.map.u64_at(off + R_IOVA).load(Ordering::Relaxed),
                len: self.map.u64_at(off + R_LEN).load(Ordering::Relaxed),
                host: self.map.u64_at(off + R_HOST).load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            if state.load(Ordering::Relaxed) != s1 {
                return Err(Refusal::Changed);
            }
            return Ok((i, s1, g));
        }
        Err(Refusal::NoRegion)
    }
}

/// A region held against revocation while a requester copies (see
/// [`PeerGrants::hold`]); dropping it ends the hold.
#[derive(Debug)]
pub struct Hold<'a> {
    grants: &'a PeerGrants,
    host: u64,
}

impl Hold<'_> {
    /// Where the operation's first byte is in the target process.
    pub fn host(&self) -> u64 {
        self.host
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.grants
            .map
            .u64_at(SLOTS_OFF + self.grants.slot * LINE)
            .store(0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;

    const ALIVE: fn(usize) -> bool = |_| true;

    fn region(rkey: u32) -> RegionGrant {
        RegionGrant {
            rkey,
            iova: 0x1000,
            len: 0x2000,
            host: 0x7f00_0000_0000,
            access: REMOTE_WRITE | REMOTE_READ,
            pd: 3,
        }
    }

    fn ask(rkey: u32, va: u64, len: u64, access: u32) -> Ask {
        Ask {
            qpn: 0x11,
            rkey,
            va,
            len,
            access,
        }
    }

    fn pair() -> (Grants, PeerGrants) {
        let mut g = Grants::create().unwrap();
        let slot = g.claim_slot().unwrap();
        let p = PeerGrants::open(g.memfd(), slot).unwrap();
        assert!(g.grant_qp(&QpGrant {
            qpn: 0x11,
            access: REMOTE_WRITE | REMOTE_READ,
            pd: 3
        }));
        (g, p)
    }

    #[test]
    fn checks_are_the_responders() {
        let (mut g, mut p) = pair();
        assert!(g.grant_region(&region(0x500), ALIVE));
        let h = p.hold(&ask(0x500, 0x1800, 16, REMOTE_WRITE)).unwrap();
        assert_eq!(h.host(), 0x7f00_0000_0800);
        drop(h);
        // The last byte of the region, and one past it.
        assert!(p.hold(&ask(0x500, 0x2fff, 1, REMOTE_READ)).is_ok());
        assert_eq!(
            p.hold(&ask(0x500, 0x2fff, 2, REMOTE_READ)).unwrap_err(),
            Refusal::OutOfBounds
        );
        assert_eq!(
            p.hold(&ask(0x500, 0xfff, 1, REMOTE_READ)).unwrap_err(),
            Refusal::OutOfBounds
        );
        assert_eq!(
            p.hold(&ask(0x500, u64::MAX, 2, REMOTE_READ)).unwrap_err(),
            Refusal::OutOfBounds
        );
        assert_eq!(
            p.hold(&ask(0x501, 0x1800, 1, REMOTE_READ)).unwrap_err(),
            Refusal::NoRegion
        );
        let mut a = ask(0x500, 0x1800, 1, REMOTE_READ);
        a.qpn = 0x12;
        assert_eq!(p.hold(&a).unwrap_err(), Refusal::NoQp);
        // A read-only region, another PD, a QP that allows reads only.
        assert!(g.grant_region(
            &RegionGrant {
                access: REMOTE_READ,
                ..region(0x600)
            },
            ALIVE
        ));
        assert_eq!(
            p.hold(&ask(0x600, 0x1800, 1, REMOTE_WRITE)).unwrap_err(),
            Refusal::RegionAccess
        );
        assert!(g.grant_region(
            &RegionGrant {
                pd: 4,
                ..region(0x700)
            },
            ALIVE
        ));
        assert_eq!(
            p.hold(&ask(0x700, 0x1800, 1, REMOTE_READ)).unwrap_err(),
            Refusal::ForeignPd
        );
        assert!(g.grant_qp(&QpGrant {
            qpn: 0x11,
            access: REMOTE_READ,
            pd: 3
        }));
        assert_eq!(
            p.hold(&ask(0x500, 0x1800, 1, REMOTE_WRITE)).unwrap_err(),
            Refusal::QpAccess
        );
        g.revoke_qp(0x11);
        assert_eq!(
            p.hold(&ask(0x500, 0x1800, 1, REMOTE_READ)).unwrap_err(),
            Refusal::NoQp
        );
    }

    #[test]
    fn a_revoked_region_is_refused_and_a_new_grant_of_its_key_is_found() {
        let (mut g, mut p) = pair();
        assert!(g.grant_region(&region(0x500), ALIVE));
        g.revoke_region(0x500, ALIVE);
        assert_eq!(
            p.hold(&ask(0x500, 0x1800, 1, REMOTE_READ)).unwrap_err(),
            Refusal::NoRegion
        );
        assert!(g.grant_region(
            &RegionGrant {
                host: 0x10_0000,
                ..region(0x500)
            },
            ALIVE
        ));
        assert_eq!(
            p.hold(&ask(0x500, 0x1000, 1, REMOTE_READ)).unwrap().host(),
            0x10_0000
        );
    }

    #[test]
    fn keys_sharing_a_home_each_find_their_region_until_the_probe_runs_out() {
        let (mut g, mut p) = pair();
        // Keys with one home: multiples of 2^20 times the inverse of the hash multiplier
        // would do; simpler, search for them.
        let home = region_home(1);
        let same: Vec<u32> = (1..u32::MAX)
            .filter(|&k| region_home(k) == home)
            .take(PROBE + 1)
            .collect();
        for (n, &k) in same.iter().enumerate() {
            assert_eq!(g.grant_region(&region(k), ALIVE), n < PROBE, "key {n}");
        }
        for &k in &same[..PROBE] {
            assert!(p.hold(&ask(k, 0x1000, 1, REMOTE_READ)).is_ok());
        }
        assert_eq!(
            p.hold(&ask(same[PROBE], 0x1000, 1, REMOTE_READ))
                .unwrap_err(),
            Refusal::NoRegion
        );
    }

    #[test]
    fn revocation_waits_for_the_copy_under_a_hold() {
        // The peer copies under holds in a loop; the target revokes, then marks the
        // region freed. No copy may start after the mark (each copy checks it twice:
        // before and after the time it takes).
        let (mut g, mut p) = pair();
        assert!(g.grant_region(&region(0x500), ALIVE));
        let freed = Arc::new(AtomicBool::new(false));
        let copies = Arc::new(AtomicU64::new(0));
        let (f, c) = (Arc::clone(&freed), Arc::clone(&copies));
        let peer = std::thread::spawn(move || {
            let mut late = 0;
            for _ in 0..200_000 {
                if let Ok(h) = p.hold(&ask(0x500, 0x1000, 8, REMOTE_WRITE)) {
                    if f.load(Ordering::SeqCst) {
                        late += 1;
                    }
                    std::hint::spin_loop();
                    if f.load(Ordering::SeqCst) {
                        late += 1;
                    }
                    c.fetch_add(1, Ordering::Relaxed);
                    drop(h);
                }
            }
            late
        });
        while copies.load(Ordering::Relaxed) < 1000 {
            std::thread::yield_now();
        }
        g.revoke_region(0x500, ALIVE);
        freed.store(true, Ordering::SeqCst);
        assert_eq!(peer.join().unwrap(), 0, "a copy ran after the revocation");
    }

    #[test]
    fn a_dead_peers_hold_does_not_stop_a_revocation() {
        let (mut g, mut p) = pair();
        assert!(g.grant_region(&region(0x500), ALIVE));
        let h = p.hold(&ask(0x500, 0x1000, 8, REMOTE_WRITE)).unwrap();
        // Killed mid-copy: its slot still announces the hold.
        std::mem::forget(h);
        g.revoke_region(0x500, |_| false);
        g.release_slot(0);
        assert!(g.claim_slot().is_some());
    }

    #[test]
    fn open_refuses_what_is_not_a_grants_table() {
        let ring = sealed_memfd(c"t", GRANTS_BYTES).unwrap();
        assert!(PeerGrants::open(ring.as_fd(), 0).is_err(), "no mark");
        let small = sealed_memfd(c"t", 4096).unwrap();
        assert!(PeerGrants::open(small.as_fd(), 0).is_err(), "size");
        let g = Grants::create().unwrap();
        assert!(PeerGrants::open(g.memfd(), PEER_SLOTS).is_err(), "slot");
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever a peer writes into the table, a requester's check neither panics
            /// nor grants an access outside the bounds it read, and the owner still
            /// grants and revokes.
            #[test]
            fn scribbled_tables_are_survived(
                writes in proptest::collection::vec((0..GRANTS_BYTES / 8, any::<u64>()), 0..400),
                rkey in any::<u32>(),
                va in any::<u64>(),
                len in 0u64..1 << 20,
            ) {
                let (mut g, mut p) = pair();
                prop_assert!(g.grant_region(&region(0x500), ALIVE));
                for (w, v) in &writes {
                    g.map.u64_at(w * 8).store(*v, Ordering::Relaxed);
                }
                if let Ok(h) = p.hold(&ask(rkey, va, len, REMOTE_WRITE)) {
                    // Whatever was read, the hold's address is inside it.
                    let (_, _, r) = p_find(&h, rkey);
                    let end = va.checked_add(len).unwrap();
                    prop_assert!(va >= r.iova && end <= r.iova.checked_add(r.len).unwrap());
                }
                g.revoke_region(0x500, |_| false);
                let _ = g.grant_region(&region(0x501), |_| false);
            }
        }

        /// The grant a hold was taken under (read again: the test holds the only writer).
        fn p_find(h: &Hold<'_>, rkey: u32) -> (usize, u64, RegionGrant) {
            h.grants.find_region(rkey).unwrap()
        }
    }
}
