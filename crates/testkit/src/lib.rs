//! softrdma's test support, for the tests of every crate above the transport: `Rnic`
//! devices on the `sim` network, registered buffers, connected QPs, completion polling
//! in virtual time, packet capture, and expected-completion builders. Dev-only: never a
//! dependency of a library.
//!
//! Every wait is bounded by a virtual deadline; nothing here reads a real clock.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::rc::Rc;

pub use softrdma_net::sim::{Endpoint, Faults, Network, Packet, Sim};
pub use softrdma_transport::verbs::{self, *};
pub use softrdma_transport::{Rnic, Stats};
pub use softrdma_wire as wire;

/// Nanoseconds in a microsecond / millisecond / second of virtual time.
pub const US: u64 = 1_000;
/// A millisecond.
pub const MS: u64 = 1_000_000;
/// A second.
pub const SEC: u64 = 1_000_000_000;
/// Default bound of one wait (virtual time).
pub const WAIT: u64 = 2 * SEC;

/// Address of device `i`: 10.0.0.(i+1):4791.
pub fn dev_addr(i: usize) -> SocketAddr {
    let last = u8::try_from(i + 1).expect("at most 254 devices");
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)), 4791)
}

/// Direction of a captured packet, seen from the capturing device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Sent by the device.
    Tx,
    /// Delivered to the device (as delivered: possibly corrupted).
    Rx,
}

/// A captured packet with its virtual time.
#[derive(Debug, Clone)]
pub struct Cap {
    /// Virtual time.
    pub t: u64,
    /// Direction.
    pub dir: Dir,
    /// The datagram.
    pub pkt: Packet,
}

/// A device on the sim network: the engine plus an optional packet log.
pub struct Dev {
    /// The engine.
    pub nic: Rnic,
    /// Whether to log packets.
    pub capture: bool,
    /// Logged packets, in the order the device saw them.
    pub log: Vec<Cap>,
    /// Most datagrams the engine held queued after any call the sim made.
    pub max_queued: usize,
}

impl Endpoint for Dev {
    fn addr(&self) -> SocketAddr {
        self.nic.addr()
    }
    fn handle_packet(&mut self, now: u64, pkt: Packet) {
        self.nic
            .handle_datagram_tos(now, pkt.src, pkt.dst, pkt.tos, &pkt.data);
        self.max_queued = self.max_queued.max(self.nic.queued_packets());
        if self.capture {
            self.log.push(Cap {
                t: now,
                dir: Dir::Rx,
                pkt,
            });
        }
    }
    fn poll_transmit(&mut self, now: u64) -> Option<Packet> {
        let t = self.nic.poll_transmit(now)?;
        let pkt = Packet {
            src: t.src,
            dst: t.dst,
            tos: t.tos,
            data: t.data,
        };
        if self.capture {
            self.log.push(Cap {
                t: now,
                dir: Dir::Tx,
                pkt: pkt.clone(),
            });
        }
        Some(pkt)
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.nic.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.nic.handle_timeout(now);
        self.max_queued = self.max_queued.max(self.nic.queued_packets());
    }
}

/// A heap buffer, 8-byte aligned, that the device may write while it is registered.
/// Never handed out as a reference: read and written by copying.
pub struct Mem {
    ptr: *mut u8,
    len: usize,
    words: usize,
}

impl Mem {
    /// A zeroed buffer of `len` bytes. Whoever registers it drops the engine first.
    pub fn new(len: usize) -> Mem {
        let words = len.div_ceil(8).max(1);
        let b: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        let ptr = Box::into_raw(b) as *mut u64 as *mut u8;
        Mem { ptr, len, words }
    }
    /// Start pointer.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// Start address (the iova used when registering, as on hardware).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy out `len` bytes at `off`.
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len, "read {off}+{len} past {}", self.len);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds of a live allocation; the engine runs on this thread only
        // inside calls we make, so nothing writes concurrently.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }
    /// Copy out everything.
    pub fn read_all(&self) -> Vec<u8> {
        self.read(0, self.len)
    }
    /// Copy `data` in at `off`.
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(
            off + data.len() <= self.len,
            "write {off}+{} past {}",
            data.len(),
            self.len
        );
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
    /// Set every byte.
    pub fn fill(&self, byte: u8) {
        self.write(0, &vec![byte; self.len]);
    }
    /// The u64 at `off` (host order, as atomics see it).
    pub fn read_u64(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.read(off, 8).try_into().unwrap())
    }
    /// Store a u64 at `off` (host order).
    pub fn write_u64(&self, off: usize, v: u64) {
        self.write(off, &v.to_ne_bytes());
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a `[u64]` of `words` elements in `new`.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr as *mut u64,
                self.words,
            )))
        };
    }
}

/// A registered region over (part of) a [`Mem`].
#[derive(Clone)]
pub struct Mr {
    /// The buffer.
    pub mem: Rc<Mem>,
    /// Offset of the region in the buffer.
    pub off: usize,
    /// What registration returned.
    pub info: MrInfo,
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.info.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.info.rkey
    }
    /// Address (iova) of byte `off` of the region.
    pub fn va(&self, off: usize) -> u64 {
        self.info.addr + off as u64
    }
    /// Length of the region.
    pub fn len(&self) -> usize {
        self.info.length as usize
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// SGE for `len` bytes at `off`.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.va(off),
            length: u32::try_from(len).unwrap(),
            lkey: self.lkey(),
        }
    }
    /// Copy out `len` bytes at region offset `off`.
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        self.mem.read(self.off + off, len)
    }
    /// Copy out the region.
    pub fn read_all(&self) -> Vec<u8> {
        self.read(0, self.len())
    }
    /// Copy in at region offset `off`.
    pub fn write(&self, off: usize, data: &[u8]) {
        self.mem.write(self.off + off, data)
    }
    /// u64 at region offset `off`.
    pub fn read_u64(&self, off: usize) -> u64 {
        self.mem.read_u64(self.off + off)
    }
    /// Store a u64 at region offset `off`.
    pub fn write_u64(&self, off: usize, v: u64) {
        self.mem.write_u64(self.off + off, v)
    }
}

/// Deterministic pseudo-random bytes (splitmix64 stream).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = test_rng(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// The tests' generator.
pub use wire::SplitMix64 as Rng;

/// A generator for test data from `seed`. A [`World`]'s network draws from the same
/// seed, so the stream is offset to stay independent of the network's decisions.
pub fn test_rng(seed: u64) -> Rng {
    Rng::new(seed ^ 0x5DEE_CE66_D1CE_F00D)
}

/// How a QP is created and connected.
#[derive(Debug, Clone, Copy)]
pub struct QpCfg {
    /// Transport.
    pub qp_type: QpType,
    /// Path MTU (RC/UC).
    pub mtu: Mtu,
    /// Remote access rights the QP grants.
    pub access: Access,
    /// Local ACK timeout code.
    pub timeout: u8,
    /// Retries on timeout / sequence NAK.
    pub retry_cnt: u8,
    /// Retries on RNR NAK.
    pub rnr_retry: u8,
    /// RNR timer code advertised.
    pub min_rnr_timer: u8,
    /// Outstanding READ/atomic as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding READ/atomic as target.
    pub max_dest_rd_atomic: u8,
    /// Queue sizes.
    pub cap: QpCap,
    /// Every WR signaled.
    pub sq_sig_all: bool,
    /// Q_Key (UD).
    pub qkey: u32,
}

impl QpCfg {
    /// An RC QP with every remote right, MTU 1024, timeout ~4 ms, 7 retries, RNR timer 10 µs.
    pub fn rc() -> QpCfg {
        QpCfg {
            qp_type: QpType::Rc,
            mtu: Mtu::Mtu1024,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            cap: QpCap {
                max_send_wr: 128,
                max_recv_wr: 128,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 256,
            },
            sq_sig_all: false,
            qkey: 0,
        }
    }
    /// A UC QP (REMOTE_WRITE only).
    pub fn uc() -> QpCfg {
        QpCfg {
            qp_type: QpType::Uc,
            access: Access::REMOTE_WRITE,
            ..QpCfg::rc()
        }
    }
    /// A UD QP with Q_Key 0x1111_2222.
    pub fn ud() -> QpCfg {
        QpCfg {
            qp_type: QpType::Ud,
            access: Access::empty(),
            qkey: 0x1111_2222,
            ..QpCfg::rc()
        }
    }
    /// Same, with another path MTU.
    pub fn with_mtu(self, mtu: Mtu) -> QpCfg {
        QpCfg { mtu, ..self }
    }

    /// Creation attributes of a QP of this config on `pd`.
    pub fn create_attr(
        &self,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        srq: Option<SrqId>,
    ) -> QpInitAttr {
        QpInitAttr {
            qp_type: self.qp_type,
            pd,
            send_cq,
            recv_cq,
            srq,
            cap: self.cap,
            sq_sig_all: self.sq_sig_all,
        }
    }

    /// RESET → INIT: port 1, P_Key index 0, and the remote rights (RC/UC) or the Q_Key (UD).
    pub fn init_attr(&self) -> (QpAttr, QpAttrMask) {
        let mut attr = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            ..Default::default()
        };
        let mut mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
        if self.qp_type == QpType::Ud {
            attr.qkey = self.qkey;
            mask |= QpAttrMask::QKEY;
        } else {
            attr.qp_access_flags = self.access;
            mask |= QpAttrMask::ACCESS_FLAGS;
        }
        (attr, mask)
    }

    /// INIT → RTR towards `peer` (RC/UC; an RC QP also gets its responder resources and
    /// RNR timer), or plain RTR with `None` (UD).
    pub fn rtr_attr(&self, peer: Option<&Peer>) -> (QpAttr, QpAttrMask) {
        let mut attr = QpAttr {
            qp_state: QpState::Rtr,
            ..Default::default()
        };
        let mut mask = QpAttrMask::STATE;
        if let Some(p) = peer {
            attr.ah_attr = p.av;
            attr.path_mtu = self.mtu;
            attr.dest_qp_num = p.qpn;
            attr.rq_psn = p.psn;
            mask |=
                QpAttrMask::AV | QpAttrMask::PATH_MTU | QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN;
            if self.qp_type == QpType::Rc {
                attr.max_dest_rd_atomic = self.max_dest_rd_atomic;
                attr.min_rnr_timer = self.min_rnr_timer;
                mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
            }
        }
        (attr, mask)
    }

    /// RTR → RTS sending from `sq_psn` (an RC QP also gets its timeout, retries and
    /// initiator depth).
    pub fn rts_attr(&self, sq_psn: u32) -> (QpAttr, QpAttrMask) {
        let mut attr = QpAttr {
            qp_state: QpState::Rts,
            sq_psn,
            ..Default::default()
        };
        let mut mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN;
        if self.qp_type == QpType::Rc {
            attr.timeout = self.timeout;
            attr.retry_cnt = self.retry_cnt;
            attr.rnr_retry = self.rnr_retry;
            attr.max_rd_atomic = self.max_rd_atomic;
            mask |= QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC;
        }
        (attr, mask)
    }

    /// Take a QP from RESET through INIT and RTR (towards `peer`, or none for UD) to RTS
    /// sending from `sq_psn`, through `modify`: an engine's, a device's, any face's modify
    /// QP. Panics naming the step `modify` refused.
    #[track_caller]
    pub fn walk_to_rts<E: std::fmt::Display>(
        &self,
        peer: Option<&Peer>,
        sq_psn: u32,
        mut modify: impl FnMut(&QpAttr, QpAttrMask) -> std::result::Result<(), E>,
    ) {
        let steps = [
            ("INIT", self.init_attr()),
            ("RTR", self.rtr_attr(peer)),
            ("RTS", self.rts_attr(sq_psn)),
        ];
        for (name, (attr, mask)) in steps {
            if let Err(e) = modify(&attr, mask) {
                panic!("modify QP to {name}: {e}");
            }
        }
    }
}

/// What a connected QP learns of its peer at RTR: the path to it, its QPN, and the PSN
/// it sends from (this QP's receive PSN).
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// Address vector towards the peer.
    pub av: AhAttr,
    /// The peer's QP number.
    pub qpn: Qpn,
    /// The first PSN the peer sends.
    pub psn: u32,
}

impl Peer {
    /// The peer QP `qpn` at `gid` (source GID index 0), sending from `psn`.
    pub fn at(gid: Gid, qpn: Qpn, psn: u32) -> Peer {
        Peer {
            av: AhAttr::roce(gid, 0),
            qpn,
            psn,
        }
    }
}

/// One end of a connection: the device and the objects of the QP.
#[derive(Debug, Clone, Copy)]
pub struct Ep {
    /// Device index.
    pub dev: usize,
    /// PD.
    pub pd: PdId,
    /// Send CQ.
    pub scq: CqId,
    /// Receive CQ.
    pub rcq: CqId,
    /// QP number.
    pub qpn: Qpn,
    /// SRQ, if attached.
    pub srq: Option<SrqId>,
}

/// Devices on a sim network, and the buffers they may touch.
///
/// Field order matters: the devices (`sim`) are dropped before the buffers (`mems`).
pub struct World {
    /// The simulation.
    pub sim: Sim<Dev>,
    /// Seed the world was made with.
    pub seed: u64,
    mems: Vec<Rc<Mem>>,
}

impl World {
    /// `n` devices at 10.0.0.1.. on a network with `faults`, everything seeded by `seed`.
    pub fn new(n: usize, seed: u64, faults: Faults) -> World {
        let mut sim = Sim::new(Network::new(seed, faults));
        for i in 0..n {
            let nic = Rnic::new(
                dev_addr(i),
                seed.wrapping_mul(31).wrapping_add(i as u64 + 1),
            );
            sim.add(Dev {
                nic,
                capture: false,
                log: Vec::new(),
                max_queued: 0,
            });
        }
        World {
            sim,
            seed,
            mems: Vec::new(),
        }
    }
    /// Two devices on a perfect 1 µs link.
    pub fn two(seed: u64) -> World {
        World::new(2, seed, Faults::default())
    }

    /// The engine of device `d`.
    pub fn nic(&mut self, d: usize) -> &mut Rnic {
        &mut self.sim.endpoints[d].nic
    }
    /// Virtual time.
    pub fn now(&self) -> u64 {
        self.sim.now
    }
    /// Counters of device `d`.
    pub fn stats(&self, d: usize) -> Stats {
        self.sim.endpoints[d].nic.stats().clone()
    }
    /// Start logging packets at device `d`.
    pub fn capture(&mut self, d: usize) {
        self.sim.endpoints[d].capture = true;
    }
    /// Take the packet log of device `d`.
    pub fn take_log(&mut self, d: usize) -> Vec<Cap> {
        std::mem::take(&mut self.sim.endpoints[d].log)
    }
    /// Drain the async events of device `d`.
    pub fn events(&mut self, d: usize) -> Vec<AsyncEvent> {
        let mut v = Vec::new();
        for _ in 0..10_000 {
            match self.nic(d).next_event() {
                Some(e) => v.push(e),
                None => break,
            }
        }
        v
    }

    // ---- objects

    /// New PD.
    pub fn pd(&mut self, d: usize) -> PdId {
        self.nic(d).alloc_pd().expect("alloc_pd")
    }
    /// New CQ of at least `cqe` entries, no channel, no timestamps.
    pub fn cq(&mut self, d: usize, cqe: u32) -> CqId {
        self.nic(d)
            .create_cq(cqe, None, false)
            .expect("create_cq")
            .0
    }
    /// A fresh zeroed buffer kept alive as long as the world.
    pub fn mem(&mut self, len: usize) -> Rc<Mem> {
        let m = Rc::new(Mem::new(len));
        self.mems.push(m.clone());
        m
    }
    /// Register `len` bytes at `off` of `mem` on device `d`.
    pub fn try_reg(
        &mut self,
        d: usize,
        pd: PdId,
        mem: &Rc<Mem>,
        off: usize,
        len: usize,
        access: Access,
    ) -> verbs::Result<Mr> {
        assert!(off + len <= mem.len());
        // SAFETY: `mem` is kept alive by `self.mems` until after the devices are dropped,
        // and only ever accessed by copying, never through references.
        let info = unsafe {
            let p = mem.ptr().add(off);
            self.nic(d).reg_mr(pd, p, len, p as u64, access)
        }?;
        Ok(Mr {
            mem: mem.clone(),
            off,
            info,
        })
    }
    /// Register (panics on error).
    pub fn reg(
        &mut self,
        d: usize,
        pd: PdId,
        mem: &Rc<Mem>,
        off: usize,
        len: usize,
        access: Access,
    ) -> Mr {
        self.try_reg(d, pd, mem, off, len, access)
            .unwrap_or_else(|e| panic!("reg_mr on dev {d}: {e}"))
    }
    /// A fresh buffer of `len` bytes filled with `fill`, registered whole.
    pub fn mr(&mut self, d: usize, pd: PdId, len: usize, access: Access, fill: u8) -> Mr {
        let m = self.mem(len);
        m.fill(fill);
        self.reg(d, pd, &m, 0, len, access)
    }

    /// Create a QP (in RESET).
    pub fn create_qp(
        &mut self,
        d: usize,
        pd: PdId,
        scq: CqId,
        rcq: CqId,
        srq: Option<SrqId>,
        cfg: &QpCfg,
    ) -> Ep {
        let qpn = self
            .nic(d)
            .create_qp(cfg.create_attr(pd, scq, rcq, srq))
            .unwrap_or_else(|e| panic!("create_qp on dev {d}: {e}"));
        Ep {
            dev: d,
            pd,
            scq,
            rcq,
            qpn,
            srq,
        }
    }
    /// A QP on device `d` with its own PD and two 512-entry CQs (send, receive).
    pub fn new_ep(&mut self, d: usize, cfg: &QpCfg) -> Ep {
        let pd = self.pd(d);
        let scq = self.cq(d, 512);
        let rcq = self.cq(d, 512);
        self.create_qp(d, pd, scq, rcq, None, cfg)
    }

    /// The address vector towards device `to`.
    pub fn av(&self, to: usize) -> AhAttr {
        AhAttr::roce(Gid::from_ip(dev_addr(to).ip()), 0)
    }
    /// Address handle on `from` (in `pd`) towards device `to`.
    pub fn ah(&mut self, from: usize, pd: PdId, to: usize) -> AhId {
        let av = self.av(to);
        self.nic(from).create_ah(pd, &av).expect("create_ah")
    }

    /// Apply a modify (now = virtual time).
    pub fn modify(&mut self, ep: &Ep, attr: &QpAttr, mask: QpAttrMask) -> verbs::Result<()> {
        let now = self.now();
        self.nic(ep.dev).modify_qp(now, ep.qpn, attr, mask)
    }
    /// RESET → INIT.
    pub fn modify_to_init(&mut self, ep: &Ep, cfg: &QpCfg) {
        let (attr, mask) = cfg.init_attr();
        self.modify(ep, &attr, mask)
            .unwrap_or_else(|e| panic!("INIT qp {:#x}: {e}", ep.qpn));
    }
    /// INIT → RTR towards `remote` (RC/UC), or plain RTR (UD).
    pub fn modify_to_rtr(&mut self, ep: &Ep, cfg: &QpCfg, remote: Option<&Ep>, rq_psn: u32) {
        let peer = remote.map(|r| Peer {
            av: self.av(r.dev),
            qpn: r.qpn,
            psn: rq_psn,
        });
        let (attr, mask) = cfg.rtr_attr(peer.as_ref());
        self.modify(ep, &attr, mask)
            .unwrap_or_else(|e| panic!("RTR qp {:#x}: {e}", ep.qpn));
    }
    /// RTR → RTS.
    pub fn modify_to_rts(&mut self, ep: &Ep, cfg: &QpCfg, sq_psn: u32) {
        let (attr, mask) = cfg.rts_attr(sq_psn);
        self.modify(ep, &attr, mask)
            .unwrap_or_else(|e| panic!("RTS qp {:#x}: {e}", ep.qpn));
    }
    /// Connect `a` and `b` (RC/UC): `a` sends from `a_psn`, `b` from `b_psn`.
    pub fn connect(&mut self, a: &Ep, acfg: &QpCfg, a_psn: u32, b: &Ep, bcfg: &QpCfg, b_psn: u32) {
        self.modify_to_init(a, acfg);
        self.modify_to_init(b, bcfg);
        self.modify_to_rtr(a, acfg, Some(b), b_psn);
        self.modify_to_rtr(b, bcfg, Some(a), a_psn);
        self.modify_to_rts(a, acfg, a_psn);
        self.modify_to_rts(b, bcfg, b_psn);
    }
    /// A connected pair, `a` on device 0 and `b` on device 1, same config both sides,
    /// send PSNs 0x1000 (a) and 0x2000 (b).
    pub fn pair(&mut self, cfg: &QpCfg) -> (Ep, Ep) {
        self.pair_psn(cfg, cfg, 0x1000, 0x2000)
    }
    /// A connected pair with per-side configs and PSNs.
    pub fn pair_psn(&mut self, acfg: &QpCfg, bcfg: &QpCfg, a_psn: u32, b_psn: u32) -> (Ep, Ep) {
        let a = self.new_ep(0, acfg);
        let b = self.new_ep(1, bcfg);
        self.connect(&a, acfg, a_psn, &b, bcfg, b_psn);
        (a, b)
    }
    /// A UD QP in RTS.
    pub fn ud_ready(&mut self, ep: &Ep, cfg: &QpCfg, sq_psn: u32) {
        self.modify_to_init(ep, cfg);
        self.modify_to_rtr(ep, cfg, None, 0);
        self.modify_to_rts(ep, cfg, sq_psn);
    }
    /// QP state.
    pub fn qp_state(&mut self, ep: &Ep) -> QpState {
        self.nic(ep.dev)
            .query_qp(ep.qpn)
            .unwrap_or_else(|e| panic!("query_qp {:#x}: {e}", ep.qpn))
            .qp_state
    }

    // ---- work requests

    /// Post a send WR (panics if refused).
    pub fn post_send(&mut self, ep: &Ep, wr: SendWr) {
        let now = self.now();
        let id = wr.wr_id;
        self.nic(ep.dev)
            .post_send(now, ep.qpn, wr)
            .unwrap_or_else(|e| panic!("post_send wr {id} on qp {:#x}: {e}", ep.qpn));
    }
    /// Post a send WR.
    pub fn try_post_send(&mut self, ep: &Ep, wr: SendWr) -> verbs::Result<()> {
        let now = self.now();
        self.nic(ep.dev).post_send(now, ep.qpn, wr)
    }
    /// Post a receive WR (panics if refused).
    pub fn post_recv(&mut self, ep: &Ep, wr: RecvWr) {
        let now = self.now();
        let id = wr.wr_id;
        self.nic(ep.dev)
            .post_recv(now, ep.qpn, wr)
            .unwrap_or_else(|e| panic!("post_recv wr {id} on qp {:#x}: {e}", ep.qpn));
    }
    /// Post to an SRQ (panics if refused).
    pub fn post_srq_recv(&mut self, d: usize, srq: SrqId, wr: RecvWr) {
        let now = self.now();
        let id = wr.wr_id;
        self.nic(d)
            .post_srq_recv(now, srq, wr)
            .unwrap_or_else(|e| panic!("post_srq_recv wr {id}: {e}"));
    }

    // ---- running

    /// Let `ns` of virtual time pass (events processed as they come).
    pub fn run_for(&mut self, ns: u64) {
        let deadline = self.now() + ns;
        self.sim.run_until(deadline, |_| false);
        if self.sim.now < deadline {
            // Idle before the deadline: time still passes.
            self.sim.now = deadline;
        }
    }
    /// Run until nothing is pending (bounded by [`WAIT`]); returns whether idle.
    pub fn settle(&mut self) -> bool {
        let deadline = self.now() + WAIT;
        self.sim.run_to_idle(deadline)
    }
    /// Run until `cond` holds or `within` of virtual time passed (or nothing is pending);
    /// returns `cond`. `cond` is checked between sim steps.
    pub fn run_until(&mut self, within: u64, mut cond: impl FnMut(&mut World) -> bool) -> bool {
        let deadline = self.now() + within;
        for _ in 0..5_000_000u64 {
            if cond(self) {
                return true;
            }
            if self.sim.now > deadline || !self.sim.step() {
                return cond(self);
            }
        }
        cond(self)
    }
    /// Poll up to `n` completions from `cq` of device `d`, running the sim until there are
    /// `n` or `within` of virtual time passed. Returns what was collected (at most `n`).
    pub fn poll_within(
        &mut self,
        d: usize,
        cq: CqId,
        n: usize,
        within: u64,
    ) -> Vec<WorkCompletion> {
        let mut got: Vec<WorkCompletion> = Vec::new();
        let mut buf = [WorkCompletion::default(); 32];
        let deadline = self.now() + within;
        self.sim.run_until(deadline, |sim| {
            while got.len() < n {
                let want = (n - got.len()).min(buf.len());
                let k = sim.endpoints[d]
                    .nic
                    .poll_cq(cq, &mut buf[..want])
                    .unwrap_or_else(|e| panic!("poll_cq dev {d} {cq:?}: {e}"));
                if k == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..k]);
            }
            got.len() >= n
        });
        got
    }
    /// Exactly `n` completions within [`WAIT`] (panics with what came otherwise).
    pub fn expect_wcs(&mut self, d: usize, cq: CqId, n: usize) -> Vec<WorkCompletion> {
        let got = self.poll_within(d, cq, n, WAIT);
        assert_eq!(
            got.len(),
            n,
            "dev {d} {cq:?}: expected {n} completions within {} ms of virtual time, got {got:#?}",
            WAIT / MS
        );
        got
    }
    /// One completion.
    pub fn expect_wc(&mut self, d: usize, cq: CqId) -> WorkCompletion {
        self.expect_wcs(d, cq, 1)[0]
    }
    /// Completions already in the CQ, without running.
    pub fn drain(&mut self, d: usize, cq: CqId) -> Vec<WorkCompletion> {
        let mut got = Vec::new();
        let mut buf = [WorkCompletion::default(); 32];
        for _ in 0..10_000 {
            let k = self
                .nic(d)
                .poll_cq(cq, &mut buf)
                .unwrap_or_else(|e| panic!("poll_cq dev {d} {cq:?}: {e}"));
            if k == 0 {
                break;
            }
            got.extend_from_slice(&buf[..k]);
        }
        got
    }
    /// Settle, then assert the CQ is empty.
    pub fn expect_no_wc(&mut self, d: usize, cq: CqId, what: &str) {
        self.settle();
        let got = self.drain(d, cq);
        assert!(
            got.is_empty(),
            "{what}: dev {d} {cq:?} expected no completion, got {got:#?}"
        );
    }
}

// ---- work request builders

/// A signaled send WR.
pub fn wr(wr_id: u64, op: SendOp, sg_list: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list,
        inline_data: None,
        ud: None,
    }
}
/// A send WR with explicit flags.
pub fn wr_flags(wr_id: u64, op: SendOp, flags: SendFlags, sg_list: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        flags,
        sg_list,
        inline_data: None,
        ud: None,
    }
}
/// A receive WR.
pub fn rwr(wr_id: u64, sg_list: Vec<Sge>) -> RecvWr {
    RecvWr { wr_id, sg_list }
}
/// SGE list of one element, or none for a zero-length message.
pub fn sgl(mr: &Mr, off: usize, len: usize) -> Vec<Sge> {
    if len == 0 {
        Vec::new()
    } else {
        vec![mr.sge(off, len)]
    }
}

// ---- expected completions

/// A successful send-side completion, every field as it must be (no timestamp).
pub fn send_wc(ep: &Ep, wr_id: u64, opcode: WcOpcode, byte_len: usize) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status: WcStatus::Success,
        opcode,
        vendor_err: 0,
        byte_len: u32::try_from(byte_len).unwrap(),
        imm_data: 0,
        qp_num: ep.qpn,
        src_qp: 0,
        wc_flags: WcFlags::empty(),
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
        timestamp: None,
    }
}

/// A successful receive completion on a connected QP (RC/UC).
pub fn recv_wc(
    ep: &Ep,
    wr_id: u64,
    opcode: WcOpcode,
    byte_len: usize,
    imm: Option<u32>,
    inv: Option<u32>,
) -> WorkCompletion {
    let mut flags = WcFlags::empty();
    let mut imm_data = 0;
    if let Some(i) = imm {
        flags |= WcFlags::WITH_IMM;
        imm_data = i;
    }
    if let Some(k) = inv {
        flags |= WcFlags::WITH_INV;
        imm_data = k;
    }
    WorkCompletion {
        wr_id,
        status: WcStatus::Success,
        opcode,
        vendor_err: 0,
        byte_len: u32::try_from(byte_len).unwrap(),
        imm_data,
        qp_num: ep.qpn,
        src_qp: 0,
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
        timestamp: None,
    }
}

/// Compare a send-side completion with the expected one, every field.
#[track_caller]
pub fn check_send_wc(got: &WorkCompletion, exp: &WorkCompletion, ctx: &str) {
    assert_eq!(got, exp, "{ctx}: send completion");
}

/// Compare a receive completion on a connected QP, every field. Two fields are
/// specified by verbs for UD only, and are checked within what connected QPs may
/// report: `src_qp` is 0 or the peer's QPN (rxe: 0), and the GRH flag may be set
/// (rxe sets it on every receive) — it means nothing on RC/UC, since no GRH is placed
/// in the buffer, which the tests check byte for byte.
#[track_caller]
pub fn check_recv_wc(got: &WorkCompletion, exp: &WorkCompletion, peer_qpn: Qpn, ctx: &str) {
    assert!(
        got.src_qp == 0 || got.src_qp == peer_qpn,
        "{ctx}: src_qp {:#x} is neither 0 nor the peer {peer_qpn:#x}: {got:#?}",
        got.src_qp
    );
    let mut norm = *got;
    norm.src_qp = 0;
    norm.wc_flags.remove(WcFlags::GRH);
    assert_eq!(
        &norm, exp,
        "{ctx}: receive completion (GRH flag and src_qp normalized)"
    );
}

/// Check an error completion: the fields verbs defines for errors (wr_id, status, qp_num).
#[track_caller]
pub fn check_err_wc(got: &WorkCompletion, wr_id: u64, status: WcStatus, qpn: Qpn, ctx: &str) {
    assert_eq!(
        (got.wr_id, got.status, got.qp_num),
        (wr_id, status, qpn),
        "{ctx}: error completion (wr_id, status, qp_num); whole: {got:#?}"
    );
}

/// Parse a captured RoCE packet (panics on a malformed one).
#[track_caller]
pub fn parse(pkt: &Packet) -> (wire::Headers, Vec<u8>) {
    let (h, p) = wire::Headers::parse(&pkt.data)
        .unwrap_or_else(|e| panic!("unparseable packet {} -> {}: {e}", pkt.src, pkt.dst));
    (h, p.to_vec())
}

/// Opcode of a captured packet, if it parses.
pub fn opcode_of(pkt: &Packet) -> Option<wire::Opcode> {
    wire::Headers::parse(&pkt.data)
        .ok()
        .map(|(h, _)| h.bth.opcode)
}

/// Compare byte vectors, reporting the first difference instead of dumping both.
#[track_caller]
pub fn assert_bytes(got: &[u8], exp: &[u8], ctx: &str) {
    assert_eq!(got.len(), exp.len(), "{ctx}: length");
    if let Some(i) = got.iter().zip(exp).position(|(g, e)| g != e) {
        let diffs = got.iter().zip(exp).filter(|(g, e)| g != e).count();
        panic!(
            "{ctx}: {diffs} of {} bytes differ, first at {i}: got {:#04x} expected {:#04x}",
            exp.len(),
            got[i],
            exp[i]
        );
    }
}

/// Assert every byte of `got` is `byte`.
#[track_caller]
pub fn assert_all(got: &[u8], byte: u8, ctx: &str) {
    if let Some(i) = got.iter().position(|&g| g != byte) {
        panic!(
            "{ctx}: byte {i} of {} is {:#04x}, expected untouched {byte:#04x}",
            got.len(),
            got[i]
        );
    }
}

/// CM messages as the tests send them.
pub mod cm {
    use std::net::IpAddr;

    use softrdma_wire::cm::{private_len, CmPath, CmaHeader, Rep, Req};

    /// A REQ for an RC QP `qpn` starting at `psn`, as rdma_cm sends one: one responder
    /// resource and initiator depth, path MTU 1024, 7 retries of each kind, 15 CM retries,
    /// CM response timeouts 20, no private data. Comm ID and CA GUID are 0: the sender's
    /// CM fills them in (a forged one sets them itself).
    pub fn req(service_id: u64, qpn: u32, psn: u32) -> Req {
        Req {
            local_comm_id: 0,
            service_id,
            local_ca_guid: 0,
            local_qkey: 0,
            local_qpn: qpn,
            responder_resources: 1,
            local_eecn: 0,
            initiator_depth: 1,
            remote_eecn: 0,
            remote_cm_response_timeout: 20,
            transport_service_type: 0,
            e2e_flow_control: false,
            starting_psn: psn,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xFFFF,
            path_mtu: 3,
            rdc_exists: false,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            extended_transport_type: 0,
            primary: CmPath::default(),
            alternate: CmPath::default(),
            sap_supported: false,
            private_data: [0; private_len::REQ],
        }
    }

    /// [`req`] with the rdma_cm header in its private data, naming `src` (port 40000)
    /// and `dst`.
    pub fn cma_req(service_id: u64, qpn: u32, psn: u32, src: IpAddr, dst: IpAddr) -> Req {
        let mut r = req(service_id, qpn, psn);
        CmaHeader {
            src_port: 40000,
            src,
            dst,
        }
        .emit(&mut r.private_data)
        .expect("an rdma_cm header fits a REQ's private data");
        r
    }

    /// A REP for QP `qpn` starting at `psn`, with no private data.
    pub fn rep(qpn: u32, psn: u32) -> Rep {
        Rep {
            local_comm_id: 0,
            remote_comm_id: 0,
            local_qkey: 0,
            local_qpn: qpn,
            local_eecn: 0,
            starting_psn: psn,
            responder_resources: 1,
            initiator_depth: 1,
            target_ack_delay: 0,
            failover_accepted: 0,
            e2e_flow_control: false,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: 0,
            private_data: [0; private_len::REP],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk leaves each kind of QP in RTS with what its config and its peer say.
    #[test]
    fn the_walk_takes_each_kind_of_qp_to_rts_as_its_config_says() {
        let mut w = World::two(1);
        let rc = QpCfg {
            timeout: 12,
            retry_cnt: 3,
            max_rd_atomic: 2,
            max_dest_rd_atomic: 5,
            ..QpCfg::rc()
        }
        .with_mtu(Mtu::Mtu2048);
        for cfg in [rc, QpCfg::uc(), QpCfg::ud()] {
            let a = w.new_ep(0, &cfg);
            let peer = Peer {
                av: w.av(1),
                qpn: 0x77,
                psn: 0x1234,
            };
            let connected = cfg.qp_type != QpType::Ud;
            let now = w.now();
            cfg.walk_to_rts(connected.then_some(&peer), 0x4321, |attr, mask| {
                w.nic(0).modify_qp(now, a.qpn, attr, mask)
            });
            let got = w.nic(0).query_qp(a.qpn).expect("query_qp");
            let ctx = format!("{:?}", cfg.qp_type);
            assert_eq!(got.qp_state, QpState::Rts, "{ctx}");
            assert_eq!(got.sq_psn, 0x4321, "{ctx}");
            if connected {
                assert_eq!(
                    (
                        got.dest_qp_num,
                        got.rq_psn,
                        got.path_mtu,
                        got.qp_access_flags
                    ),
                    (0x77, 0x1234, cfg.mtu, cfg.access),
                    "{ctx}"
                );
            } else {
                assert_eq!(got.qkey, cfg.qkey, "{ctx}");
            }
            if cfg.qp_type == QpType::Rc {
                assert_eq!(
                    (
                        got.timeout,
                        got.retry_cnt,
                        got.max_rd_atomic,
                        got.max_dest_rd_atomic
                    ),
                    (12, 3, 2, 5)
                );
            }
        }
    }

    /// A step the QP refuses is named in the panic.
    #[test]
    fn a_refused_step_is_named() {
        let mut w = World::two(2);
        let cfg = QpCfg::rc();
        let a = w.new_ep(0, &cfg);
        // Source GID index 1: the device has one address, so RTR is refused.
        let peer = Peer {
            av: AhAttr::roce(Gid::from_ip(dev_addr(1).ip()), 1),
            qpn: 0x77,
            psn: 0,
        };
        let now = w.now();
        let nic = w.nic(0);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cfg.walk_to_rts(Some(&peer), 0, |attr, mask| {
                nic.modify_qp(now, a.qpn, attr, mask)
            })
        }))
        .expect_err("RTR with a GID index the device lacks");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.starts_with("modify QP to RTR: "), "{msg}");
        assert_eq!(w.qp_state(&a), QpState::Init);
    }
}
