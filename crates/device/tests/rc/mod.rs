//! RC QP set-up the device tests share: a QP's creation attributes and its walk from
//! RESET through INIT and RTR to RTS towards a peer (by default path MTU 1024, local ACK
//! timeout 14, RNR timer 1, as a perftest-style program connects).

use softrdma_device::verbs::{
    Access, AhAttr, CqId, Gid, Mtu, PdId, QpAttr, QpAttrMask as M, QpCap, QpInitAttr, QpState,
    QpType, Qpn,
};
use softrdma_device::Rnic;

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

/// Take QP `qpn` from RESET to RTS as `c` says.
pub fn connect(r: &mut Rnic, now: u64, qpn: Qpn, c: &Connect) {
    let mut a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: c.access,
        ..Default::default()
    };
    let m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
    r.modify_qp(now, qpn, &a, m).unwrap();
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
    r.modify_qp(now, qpn, &a, m).unwrap();
    a.qp_state = QpState::Rts;
    a.sq_psn = c.sq_psn;
    a.timeout = c.timeout;
    a.retry_cnt = c.retry_cnt;
    a.rnr_retry = c.rnr_retry;
    a.max_rd_atomic = c.max_rd_atomic;
    let m = M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC;
    r.modify_qp(now, qpn, &a, m).unwrap();
}
