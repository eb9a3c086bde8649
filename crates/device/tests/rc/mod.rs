//! RC set-up the device tests share: a loopback device with a PD, a CQ and a registered
//! buffer ([`Host`]), a QP's creation attributes, and how it connects ([`cfg`]; the walk
//! from RESET through INIT and RTR to RTS is the test kit's).

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use softrdma_device::verbs::{
    Access, CqId, PdId, QpCap, QpInitAttr, QpType, Qpn, SendFlags, SendOp, SendWr, Sge,
    WorkCompletion,
};
use softrdma_device::{CqPoller, Device, DeviceAddr, DeviceConfig, Rnic};
pub use softrdma_testkit::{Peer, QpCfg};

/// A device on loopback (port 4791 of a 127.0.0.x of its own) that writes no statistics
/// file: tests leave nothing behind.
pub fn open(name: &str) -> Device {
    let mut cfg = DeviceConfig::new(name, DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = None;
    Device::open(&cfg).expect("open device")
}

/// A device with one PD, one CQ and one registered buffer: where every RC device test
/// starts.
pub struct Host {
    /// Declared before `mem`, so dropped first: the device may write `mem` until then.
    pub dev: Device,
    pub pd: PdId,
    pub cq: CqPoller,
    pub mem: Box<[u8]>,
    pub lkey: u32,
    pub rkey: u32,
}

impl Host {
    /// Device `name` with a CQ of `cq_depth` entries and `len` bytes of `fill`
    /// registered with `access`.
    pub fn new(name: &str, len: usize, fill: u8, cq_depth: u32, access: Access) -> Host {
        Host::on(open(name), len, fill, cq_depth, access)
    }

    /// As [`Host::new`], on a device of the caller's.
    pub fn on(dev: Device, len: usize, fill: u8, cq_depth: u32, access: Access) -> Host {
        let mut mem = vec![fill; len].into_boxed_slice();
        let ptr = mem.as_mut_ptr();
        let pd = dev.alloc_pd().unwrap();
        let (cq, _) = dev.create_cq(cq_depth, None, false).unwrap();
        // SAFETY: the boxed slice lives in the `Host` next to the device, which the `Host`
        // drops first (field order); tests read it under the engine lock
        // ([`Host::contents`]) or after the completion that says it was written.
        let mr = unsafe { dev.reg_mr(pd, ptr, len, ptr as u64, access) }.unwrap();
        let (lkey, rkey) = (mr.lkey, mr.rkey);
        Host {
            dev,
            pd,
            cq: CqPoller::new(cq),
            mem,
            lkey,
            rkey,
        }
    }

    /// A new RC QP on the host's PD and CQ, `depth` WRs deep each way ([`rc_qp`]).
    pub fn rc_qp(&self, depth: u32) -> Qpn {
        let (pd, cq) = (self.pd, self.cq.cq());
        self.dev
            .create_qp(rc_qp(pd, cq, depth))
            .expect("create QP")
            .0
    }

    /// Take QP `qpn` to RTS as `cfg` says, towards `peer`, sending from `sq_psn`.
    pub fn connect(&self, qpn: Qpn, cfg: &QpCfg, peer: &Peer, sq_psn: u32) {
        cfg.walk_to_rts(Some(peer), sq_psn, |a, m| self.dev.modify_qp(qpn, a, m));
    }

    /// `len` bytes of the buffer from offset `at`, as a scatter/gather entry.
    pub fn sge(&self, at: usize, len: usize) -> Sge {
        assert!(at + len <= self.mem.len(), "{at} + {len} past the buffer");
        Sge {
            addr: self.mem.as_ptr() as u64 + at as u64,
            length: len as u32,
            lkey: self.lkey,
        }
    }

    /// The address of offset `at` of the buffer, as a peer's WRITE names it.
    pub fn addr(&self, at: usize) -> u64 {
        self.mem.as_ptr() as u64 + at as u64
    }

    /// Post a send WR of one SGE on QP `qpn` through the posting path.
    pub fn post_send(&self, qpn: Qpn, wr_id: u64, op: SendOp, flags: SendFlags, sge: Sge) {
        let wr = SendWr {
            wr_id,
            op,
            flags,
            sg_list: vec![sge],
            inline_data: None,
            ud: None,
        };
        self.dev.post_send(qpn, wr).unwrap();
    }

    /// Poll until `n` completions arrived (more may come with the last poll), sleeping a
    /// millisecond between empty polls; the bound `within` only keeps a broken build from
    /// hanging.
    pub fn wait_wcs(&self, n: usize, within: Duration) -> Vec<WorkCompletion> {
        let until = Instant::now() + within;
        let mut out = Vec::with_capacity(n);
        let mut wc = [WorkCompletion::default(); 64];
        while out.len() < n {
            let k = self.cq.poll(&self.dev, &mut wc).unwrap();
            out.extend_from_slice(&wc[..k]);
            if k == 0 {
                assert!(
                    Instant::now() < until,
                    "{} of {n} completions on {} within {within:?}",
                    out.len(),
                    self.dev.name()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }

    /// The buffer, read under the engine lock (the device writes it under that lock).
    pub fn contents(&self) -> Vec<u8> {
        self.dev.read(|_| self.mem.to_vec())
    }
}

/// An RC QP on `pd` whose sends and receives complete on `cq`, `depth` WRs deep each way,
/// one SGE, no inline data, sends unsignaled unless asked.
pub fn rc_qp(pd: PdId, cq: CqId, depth: u32) -> QpInitAttr {
    QpInitAttr {
        qp_type: QpType::Rc,
        pd,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
    }
}

/// How an RC QP connects unless a test says otherwise, as a perftest-style program does:
/// no remote rights, no READ/atomic resources, 7 retries of each kind, path MTU 1024,
/// local ACK timeout 14 (4.096 µs × 2^14), RNR timer 1.
pub fn cfg() -> QpCfg {
    QpCfg {
        access: Access::empty(),
        max_rd_atomic: 0,
        max_dest_rd_atomic: 0,
        timeout: 14,
        ..QpCfg::rc()
    }
}

/// Take QP `qpn` of an engine of its own to RTS as `cfg` says, towards `peer`, sending
/// from `sq_psn`.
pub fn connect(r: &mut Rnic, now: u64, qpn: Qpn, cfg: &QpCfg, peer: &Peer, sq_psn: u32) {
    cfg.walk_to_rts(Some(peer), sq_psn, |a, m| r.modify_qp(now, qpn, a, m));
}
