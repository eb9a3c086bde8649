//! RC set-up the device tests share: a loopback device with a PD, a CQ and a registered
//! buffer ([`Host`]), a QP's creation attributes, and its walk from RESET through INIT and
//! RTR to RTS towards a peer (by default path MTU 1024, local ACK timeout 14, RNR timer 1,
//! as a perftest-style program connects).

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use softrdma_device::verbs::{
    Access, AhAttr, CqId, Gid, Mtu, PdId, QpAttr, QpAttrMask as M, QpCap, QpInitAttr, QpState,
    QpType, Qpn, SendFlags, SendOp, SendWr, Sge, WorkCompletion,
};
use softrdma_device::{CqPoller, Device, DeviceAddr, DeviceConfig, Rnic};

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

    /// Take QP `qpn` to RTS as `c` says ([`connect`]).
    pub fn connect(&self, qpn: Qpn, c: &Connect) {
        connect_with(|a, m| self.dev.modify_qp(qpn, a, m), c);
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

/// Where and how an RC QP connects.
pub struct Connect {
    pub peer_gid: Gid,
    pub peer_qpn: Qpn,
    /// The remote rights it grants.
    pub access: Access,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub max_rd_atomic: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub path_mtu: Mtu,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
}

impl Connect {
    /// To QP `peer_qpn` at `peer_gid`: no remote rights, PSNs 0, no READ/atomic
    /// resources, 7 retries of each kind, path MTU 1024, ACK timeout 14.
    pub fn to(peer_gid: Gid, peer_qpn: Qpn) -> Connect {
        Connect {
            peer_gid,
            peer_qpn,
            access: Access::empty(),
            rq_psn: 0,
            sq_psn: 0,
            max_dest_rd_atomic: 0,
            max_rd_atomic: 0,
            retry_cnt: 7,
            rnr_retry: 7,
            path_mtu: Mtu::Mtu1024,
            timeout: 14,
        }
    }
}

/// Take QP `qpn` from RESET to RTS as `c` says, on an engine of its own.
pub fn connect(r: &mut Rnic, now: u64, qpn: Qpn, c: &Connect) {
    connect_with(|a, m| r.modify_qp(now, qpn, a, m), c);
}

/// Take a QP from RESET to RTS as `c` says, through `modify`.
pub fn connect_with(
    mut modify: impl FnMut(&QpAttr, M) -> softrdma_device::verbs::Result<()>,
    c: &Connect,
) {
    let mut a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: c.access,
        ..Default::default()
    };
    let m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
    modify(&a, m).unwrap();
    a.qp_state = QpState::Rtr;
    a.ah_attr = AhAttr::roce(c.peer_gid, 0);
    a.path_mtu = c.path_mtu;
    a.dest_qp_num = c.peer_qpn;
    a.rq_psn = c.rq_psn;
    a.max_dest_rd_atomic = c.max_dest_rd_atomic;
    a.min_rnr_timer = 1;
    let m = M::STATE
        | M::AV
        | M::PATH_MTU
        | M::DEST_QPN
        | M::RQ_PSN
        | M::MAX_DEST_RD_ATOMIC
        | M::MIN_RNR_TIMER;
    modify(&a, m).unwrap();
    a.qp_state = QpState::Rts;
    a.sq_psn = c.sq_psn;
    a.timeout = c.timeout;
    a.retry_cnt = c.retry_cnt;
    a.rnr_retry = c.rnr_retry;
    a.max_rd_atomic = c.max_rd_atomic;
    let m = M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC;
    modify(&a, m).unwrap();
}
