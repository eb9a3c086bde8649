//! Unit tests of the verbs rules.

use crate::*;
use std::net::Ipv4Addr;

fn ctx() -> Context {
    Context::new(
        vec![
            Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 1)),
            Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1)),
        ],
        0x5EED,
    )
}

fn reg(c: &mut Context, pd: PdId, buf: &mut [u8], iova: u64, access: Access) -> MrInfo {
    // SAFETY: every test keeps `buf` alive (declared before the context) and does not touch it
    // through references while spans exist.
    unsafe { c.reg_mr(pd, buf.as_mut_ptr(), buf.len(), iova, access) }.expect("reg_mr")
}

const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::MW_BIND);

fn cq(c: &mut Context) -> CqId {
    c.create_cq(16, None, false).expect("cq").0
}

fn qp_init(pd: PdId, cq: CqId, t: QpType) -> QpInitAttr {
    QpInitAttr {
        qp_type: t,
        pd,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap {
            max_send_wr: 8,
            max_recv_wr: 4,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 16,
        },
        sq_sig_all: false,
    }
}

fn av() -> AhAttr {
    AhAttr::roce(Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 2)), 0)
}

/// Attribute values valid for every field.
fn good_attr() -> QpAttr {
    QpAttr {
        qkey: 0x1111_1111,
        rq_psn: 0x12_3456,
        sq_psn: 0x65_4321,
        dest_qp_num: 0x42,
        qp_access_flags: Access::REMOTE_WRITE | Access::REMOTE_READ,
        ah_attr: av(),
        path_mtu: Mtu::Mtu1024,
        pkey_index: 0,
        port_num: 1,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 12,
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        ..Default::default()
    }
}

fn to_state(c: &mut Context, qpn: Qpn, s: QpState) -> Result<(QpState, QpState)> {
    let mut a = good_attr();
    a.qp_state = s;
    let m = req_mask(
        c.qp(qpn).map(|q| q.init.qp_type).unwrap_or(QpType::Rc),
        c.qp(qpn).map(|q| q.state).unwrap_or_default(),
        s,
    );
    c.modify_qp(qpn, &a, m | QpAttrMask::STATE)
}

/// Bring a fresh QP to `s` (SQE is entered by the engine, through `qp_mut`).
fn drive(c: &mut Context, qpn: Qpn, s: QpState) {
    use QpState::*;
    let path: &[QpState] = match s {
        Reset => &[],
        Init => &[Init],
        Rtr => &[Init, Rtr],
        Rts => &[Init, Rtr, Rts],
        Sqd => &[Init, Rtr, Rts, Sqd],
        Sqe => &[Init, Rtr, Rts],
        Err => &[Err],
    };
    for &p in path {
        to_state(c, qpn, p).expect("drive");
    }
    if s == Sqe {
        if let Some(q) = c.qp_mut(qpn) {
            q.state = Sqe;
            q.attr.qp_state = Sqe;
        }
    }
    assert_eq!(c.qp(qpn).map(|q| q.state), Some(s));
}

// ------------------------------------------------------------------ expected table
// Written out independently of `qp_table.rs` from the kernel's qp_state_table.

use QpAttrMask as M;

fn expected(t: QpType, cur: QpState, next: QpState) -> Option<(M, M)> {
    use QpState::*;
    use QpType::*;
    let e = M::empty();
    let rtx_opt = |t| match t {
        Ud => M::CUR_STATE | M::QKEY,
        Uc => M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
        Rc => M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
    };
    match (cur, next) {
        (_, Reset) | (_, Err) => Some((e, e)),
        (Reset, Init) => Some((
            if t == Ud {
                M::PKEY_INDEX | M::PORT | M::QKEY
            } else {
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS
            },
            e,
        )),
        (Init, Init) => Some((
            e,
            if t == Ud {
                M::PKEY_INDEX | M::PORT | M::QKEY
            } else {
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS
            },
        )),
        (Init, Rtr) => Some(match t {
            Ud => (e, M::PKEY_INDEX | M::QKEY),
            Uc => (
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
            Rc => (
                M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
        }),
        (Rtr, Rts) => Some(match t {
            Ud | Uc => (M::SQ_PSN, rtx_opt(t)),
            Rc => (
                M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
                rtx_opt(t),
            ),
        }),
        (Rts, Rts) | (Sqd, Rts) => Some((e, rtx_opt(t))),
        (Rts, Sqd) => Some((e, M::EN_SQD_ASYNC_NOTIFY)),
        (Sqd, Sqd) => Some((
            e,
            match t {
                Ud => M::PKEY_INDEX | M::QKEY,
                Uc => M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
                Rc => {
                    M::PORT
                        | M::AV
                        | M::TIMEOUT
                        | M::RETRY_CNT
                        | M::RNR_RETRY
                        | M::MAX_QP_RD_ATOMIC
                        | M::MAX_DEST_RD_ATOMIC
                        | M::ALT_PATH
                        | M::ACCESS_FLAGS
                        | M::PKEY_INDEX
                        | M::MIN_RNR_TIMER
                        | M::PATH_MIG_STATE
                }
            },
        )),
        (Sqe, Rts) => Some((
            e,
            match t {
                Ud => M::CUR_STATE | M::QKEY,
                Uc => M::CUR_STATE | M::ACCESS_FLAGS,
                Rc => e,
            },
        )),
        _ => None,
    }
}

fn req_mask(t: QpType, cur: QpState, next: QpState) -> M {
    expected(t, cur, next).map_or(M::empty(), |(r, _)| r)
}

const STATES: [QpState; 7] = [
    QpState::Reset,
    QpState::Init,
    QpState::Rtr,
    QpState::Rts,
    QpState::Sqd,
    QpState::Sqe,
    QpState::Err,
];
const TYPES: [QpType; 3] = [QpType::Rc, QpType::Uc, QpType::Ud];

fn fresh_qp(c: &mut Context, pd: PdId, cq: CqId, t: QpType, s: QpState) -> Qpn {
    let q = c.create_qp(qp_init(pd, cq, t)).expect("create_qp");
    drive(c, q, s);
    q
}

#[test]
fn qp_state_table_legal_transitions_with_required_masks() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    for t in TYPES {
        for cur in STATES {
            for next in STATES {
                let q = fresh_qp(&mut c, pd, cq, t, cur);
                let mut a = good_attr();
                a.qp_state = next;
                a.cur_qp_state = cur;
                match expected(t, cur, next) {
                    Some((req, opt)) => {
                        // Required only.
                        assert_eq!(
                            c.modify_qp(q, &a, req | M::STATE).ok(),
                            Some((cur, next)),
                            "{t:?} {cur:?}->{next:?}"
                        );
                        // Required plus every optional one (CUR_STATE included).
                        let q2 = fresh_qp(&mut c, pd, cq, t, cur);
                        assert_eq!(
                            c.modify_qp(q2, &a, req | opt | M::STATE).ok(),
                            Some((cur, next)),
                            "{t:?} {cur:?}->{next:?} with optional"
                        );
                        // Each required attribute removed.
                        for bit in req.iter() {
                            let q3 = fresh_qp(&mut c, pd, cq, t, cur);
                            let e = c.modify_qp(q3, &a, (req - bit) | M::STATE).unwrap_err();
                            assert_eq!(
                                e.errno,
                                Errno::EINVAL,
                                "{t:?} {cur:?}->{next:?} w/o {bit:?}"
                            );
                            assert_eq!(c.qp(q3).unwrap().state, cur, "nothing changes");
                            c.destroy_qp(q3).unwrap();
                        }
                        // Every attribute that is neither required nor optional.
                        for bit in M::all().iter() {
                            if (req | opt | M::STATE).contains(bit) {
                                continue;
                            }
                            let q4 = fresh_qp(&mut c, pd, cq, t, cur);
                            let e = c.modify_qp(q4, &a, req | bit | M::STATE).unwrap_err();
                            assert_eq!(e.errno, Errno::EINVAL, "{t:?} {cur:?}->{next:?} + {bit:?}");
                            assert_eq!(c.qp(q4).unwrap().state, cur);
                            c.destroy_qp(q4).unwrap();
                        }
                        c.destroy_qp(q2).unwrap();
                    }
                    None => {
                        // Illegal, even with every attribute present.
                        for m in [M::STATE, M::all()] {
                            let e = c.modify_qp(q, &a, m).unwrap_err();
                            assert_eq!(e.errno, Errno::EINVAL, "{t:?} {cur:?}->{next:?}");
                            assert_eq!(c.qp(q).unwrap().state, cur);
                        }
                    }
                }
                c.destroy_qp(q).unwrap();
            }
        }
    }
}

#[test]
fn qp_modify_values_and_cur_state_are_checked() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let q = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Reset);
    let init_m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
    let mut a = good_attr();
    a.qp_state = QpState::Init;
    for bad in [
        QpAttr {
            pkey_index: 64,
            ..a
        },
        QpAttr { port_num: 2, ..a },
        QpAttr { port_num: 0, ..a },
    ] {
        assert_eq!(
            c.modify_qp(q, &bad, init_m).unwrap_err().errno,
            Errno::EINVAL
        );
    }
    c.modify_qp(q, &a, init_m).unwrap();
    let rtr_m = M::STATE | req_mask(QpType::Rc, QpState::Init, QpState::Rtr);
    a.qp_state = QpState::Rtr;
    let no_grh = AhAttr {
        is_global: false,
        ..av()
    };
    let bad_sgid = AhAttr {
        grh: GlobalRoute {
            sgid_index: 2,
            ..av().grh
        },
        ..av()
    };
    for bad in [
        QpAttr {
            min_rnr_timer: 32,
            ..a
        },
        QpAttr {
            max_dest_rd_atomic: 129,
            ..a
        },
        QpAttr {
            dest_qp_num: 1 << 24,
            ..a
        },
        QpAttr {
            ah_attr: no_grh,
            ..a
        },
        QpAttr {
            ah_attr: bad_sgid,
            ..a
        },
    ] {
        assert_eq!(
            c.modify_qp(q, &bad, rtr_m).unwrap_err().errno,
            Errno::EINVAL
        );
        assert_eq!(c.qp(q).unwrap().state, QpState::Init);
    }
    a.rq_psn = 0xFF12_3456;
    c.modify_qp(q, &a, rtr_m).unwrap();
    assert_eq!(
        c.qp(q).unwrap().attr.rq_psn,
        0x12_3456,
        "PSN masked to 24 bits"
    );
    let rts_m = M::STATE | req_mask(QpType::Rc, QpState::Rtr, QpState::Rts);
    a.qp_state = QpState::Rts;
    for bad in [
        QpAttr { timeout: 32, ..a },
        QpAttr { retry_cnt: 8, ..a },
        QpAttr { rnr_retry: 8, ..a },
        QpAttr {
            max_rd_atomic: 129,
            ..a
        },
    ] {
        assert_eq!(
            c.modify_qp(q, &bad, rts_m).unwrap_err().errno,
            Errno::EINVAL
        );
    }
    // CUR_STATE must match.
    let wrong_cur = QpAttr {
        cur_qp_state: QpState::Init,
        ..a
    };
    assert!(c.modify_qp(q, &wrong_cur, rts_m | M::CUR_STATE).is_err());
    let right_cur = QpAttr {
        cur_qp_state: QpState::Rtr,
        ..a
    };
    c.modify_qp(q, &right_cur, rts_m | M::CUR_STATE).unwrap();
    let qp = c.qp(q).unwrap();
    assert_eq!((qp.state, qp.attr.qp_state), (QpState::Rts, QpState::Rts));
    assert_eq!(qp.attr.sq_psn, 0x65_4321);
    assert_eq!(qp.attr.retry_cnt, 7);
    // CUR_STATE is refused from RESET/INIT even when it matches.
    let q2 = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Init);
    let same = QpAttr {
        qp_state: QpState::Init,
        cur_qp_state: QpState::Init,
        ..a
    };
    assert!(c.modify_qp(q2, &same, M::STATE | M::CUR_STATE).is_err());
    // No STATE in the mask: a modify within the current state.
    let mut acc = a;
    acc.qp_access_flags = Access::REMOTE_READ;
    c.modify_qp(q, &acc, M::ACCESS_FLAGS).unwrap();
    assert_eq!(c.qp(q).unwrap().attr.qp_access_flags, Access::REMOTE_READ);
    assert!(c.modify_qp(q, &acc, M::PATH_MTU).is_err());
}

#[test]
fn reset_clears_rq_and_attrs() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let q = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Rts);
    c.post_recv(
        q,
        RecvWr {
            wr_id: 1,
            sg_list: vec![],
        },
    )
    .unwrap();
    assert!(c.peek_recv(q).is_some());
    to_state(&mut c, q, QpState::Reset).unwrap();
    let qp = c.qp(q).unwrap();
    assert!(qp.rq.is_empty());
    assert_eq!(qp.attr.sq_psn, 0);
    assert_eq!(qp.attr.dest_qp_num, 0);
    assert_eq!(qp.attr.cap, qp.init.cap);
    assert_eq!(
        c.post_recv(
            q,
            RecvWr {
                wr_id: 2,
                sg_list: vec![]
            }
        )
        .unwrap_err()
        .errno,
        Errno::EINVAL
    );
}

#[test]
fn created_qps_never_take_the_special_numbers() {
    for seed in 0..32 {
        let mut c = Context::new(vec![Gid::default()], seed);
        let pd = c.alloc_pd().unwrap();
        let cq = cq(&mut c);
        for _ in 0..32 {
            let qpn = c.create_qp(qp_init(pd, cq, QpType::Ud)).unwrap();
            assert!(
                (0x11..=0xFF_FFFF).contains(&qpn),
                "QPN {qpn:#x}, seed {seed}"
            );
        }
    }
}

#[test]
fn create_qp_caps_checked_and_rounded() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.cap.max_send_wr = c.device_attr().max_qp_wr + 1;
    assert_eq!(c.create_qp(i).unwrap_err().errno, Errno::EINVAL);
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.cap.max_recv_sge = 33;
    assert_eq!(c.create_qp(i).unwrap_err().errno, Errno::EINVAL);
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.cap.max_inline_data = 4096;
    assert_eq!(c.create_qp(i).unwrap_err().errno, Errno::EINVAL);
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.cap = QpCap {
        max_send_wr: 0,
        max_recv_wr: 0,
        max_send_sge: 0,
        max_recv_sge: 0,
        max_inline_data: 100,
    };
    let q = c.create_qp(i).unwrap();
    let cap = c.qp(q).unwrap().init.cap;
    assert!(cap.max_send_wr >= 1 && cap.max_recv_wr >= 1 && cap.max_recv_sge >= 1);
    assert!(cap.max_inline_data >= 100 && cap.max_send_sge >= 1);
    assert!((0x11..=0xFF_FFFF).contains(&q));
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.pd = PdId(9999);
    assert!(c.create_qp(i).is_err());
}

// ------------------------------------------------------------------ keys

#[test]
fn keys_are_unique_nonzero_and_not_sequential() {
    let mut bufs = vec![[0u8; 8]; 64];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let keys: Vec<u32> = bufs
        .iter_mut()
        .map(|b| reg(&mut c, pd, b, 0x1000, Access::LOCAL_WRITE).lkey)
        .collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), keys.len(), "unique");
    assert!(keys.iter().all(|&k| k != 0));
    let diffs: Vec<i64> = keys.windows(2).map(|w| w[1] as i64 - w[0] as i64).collect();
    assert!(
        diffs.windows(2).filter(|d| d[0] == d[1]).count() < 3,
        "no constant stride"
    );
    assert!(
        diffs.iter().filter(|&&d| d.unsigned_abs() <= 256).count() < 3,
        "not adjacent"
    );
    // Indexes are spread over the 24 bits, not low counters.
    assert!(keys.iter().any(|k| k >> 8 > 0x10_0000));
    // Another seed, other keys; the same seed, the same keys.
    let mut c2 = Context::new(vec![Gid::default()], 7);
    let pd2 = c2.alloc_pd().unwrap();
    let mut b2 = [0u8; 8];
    let k2 = reg(&mut c2, pd2, &mut b2, 0, Access::empty()).lkey;
    assert_ne!(k2, keys[0]);
    let mut c3 = ctx();
    let pd3 = c3.alloc_pd().unwrap();
    let mut b3 = [0u8; 8];
    assert_eq!(reg(&mut c3, pd3, &mut b3, 0, Access::empty()).lkey, keys[0]);
}

#[test]
fn reg_mr_checks() {
    let mut buf = [0u8; 64];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    for bad in [
        Access::REMOTE_WRITE,
        Access::REMOTE_ATOMIC,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    ] {
        // SAFETY: buf outlives c.
        let r = unsafe { c.reg_mr(pd, buf.as_mut_ptr(), buf.len(), 0, bad) };
        assert_eq!(r.unwrap_err().errno, Errno::EINVAL);
    }
    // SAFETY: as above.
    let r = unsafe { c.reg_mr(PdId(777), buf.as_mut_ptr(), buf.len(), 0, Access::empty()) };
    assert!(r.is_err());
    // SAFETY: as above.
    let r = unsafe {
        c.reg_mr(
            pd,
            buf.as_mut_ptr(),
            buf.len(),
            u64::MAX - 10,
            Access::empty(),
        )
    };
    assert!(r.is_err(), "iova + len overflows");
    // SAFETY: null with a length is refused before use.
    let r = unsafe { c.reg_mr(pd, std::ptr::null_mut(), 8, 0, Access::empty()) };
    assert!(r.is_err());
    let mr = reg(&mut c, pd, &mut buf, 0x1000, Access::REMOTE_READ);
    assert_eq!(
        (mr.lkey, mr.rkey, mr.addr, mr.length),
        (mr.rkey, mr.lkey, 0x1000, 64)
    );
    assert!(c.dereg_mr(mr.lkey ^ 1).is_err());
    c.dereg_mr(mr.lkey).unwrap();
    assert!(c.dereg_mr(mr.lkey).is_err());
}

#[test]
fn check_sg_list_refuses_what_local_span_would_fail() {
    let mut buf = [0u8; 64];
    let mut other = [0u8; 64];
    let mut c = ctx();
    let (pd, pd2) = (c.alloc_pd().unwrap(), c.alloc_pd().unwrap());
    let mr = reg(&mut c, pd, &mut buf, 0x1000, Access::LOCAL_WRITE);
    let mr2 = reg(&mut c, pd2, &mut other, 0x2000, ALL);
    let sge = |addr, length, lkey| Sge { addr, length, lkey };
    let kind = |r: Result<()>| r.unwrap_err().kind;
    let good = sge(0x1000, 64, mr.lkey);
    c.check_sg_list(pd, &[good], Access::LOCAL_WRITE).unwrap();
    // Every SGE is checked, not only the first; empty ones name no memory.
    let list = [good, sge(0, 0, 0xdead), sge(0x1020, 33, mr.lkey)];
    assert_eq!(
        kind(c.check_sg_list(pd, &list, Access::empty())),
        ErrorKind::OutOfBounds
    );
    let foreign = [sge(0x2000, 8, mr2.lkey)];
    assert_eq!(
        kind(c.check_sg_list(pd, &foreign, Access::empty())),
        ErrorKind::ForeignObject
    );
    let unknown = [sge(0x1000, 8, mr.lkey ^ 1)];
    assert_eq!(
        kind(c.check_sg_list(pd, &unknown, Access::empty())),
        ErrorKind::NotFound
    );
    c.dereg_mr(mr2.lkey).unwrap();
    let r = c.check_sg_list(pd2, &foreign, Access::empty());
    assert_eq!(kind(r), ErrorKind::NotFound, "deregistered");
    let mr3 = reg(&mut c, pd2, &mut other, 0x2000, Access::empty());
    let ro = [sge(0x2000, 8, mr3.lkey)];
    c.check_sg_list(pd2, &ro, Access::empty()).unwrap();
    let r = c.check_sg_list(pd2, &ro, Access::LOCAL_WRITE);
    assert_eq!(kind(r), ErrorKind::PermissionDenied);
}

// ------------------------------------------------------------------ remote_span

#[test]
fn remote_span_failures_and_success() {
    use RemoteKeyError::{Access as Denied, Misaligned};
    let mut buf = [0u8; 64];
    let mut ro = [0u8; 64];
    let mut zb = [0u8; 32];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    let rw = reg(&mut c, pd, &mut buf, 0x1000, ALL);
    let r = reg(&mut c, pd, &mut ro, 0x8000, Access::REMOTE_READ);
    let z = reg(
        &mut c,
        pd,
        &mut zb,
        0xdead_0000,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::ZERO_BASED,
    );
    assert_eq!(z.addr, 0);
    let q = 0x100;
    let rs = |c: &Context, pd, key, va, len, need| {
        c.remote_span(pd, q, key, va, len, need).map(|s| s.len())
    };
    // Success.
    assert_eq!(
        rs(&c, pd, rw.rkey, 0x1000, 64, Access::REMOTE_WRITE),
        Ok(64)
    );
    assert_eq!(rs(&c, pd, r.rkey, 0x8010, 8, Access::REMOTE_READ), Ok(8));
    assert_eq!(rs(&c, pd, z.rkey, 24, 8, Access::REMOTE_WRITE), Ok(8));
    // Unknown key, flipped key byte.
    assert_eq!(
        rs(&c, pd, 0x1234_5678, 0x1000, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, rw.rkey ^ 0x01, 0x1000, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    // Wrong PD.
    assert_eq!(
        rs(&c, pd2, rw.rkey, 0x1000, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    // Missing right.
    assert_eq!(
        rs(&c, pd, r.rkey, 0x8000, 8, Access::REMOTE_WRITE),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, r.rkey, 0x8000, 8, Access::REMOTE_ATOMIC),
        Err(Denied)
    );
    assert_eq!(rs(&c, pd, z.rkey, 0, 8, Access::REMOTE_READ), Err(Denied));
    // Bounds.
    assert_eq!(
        rs(&c, pd, rw.rkey, 0xFFF, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, rw.rkey, 0x1039, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, rw.rkey, 0x1000, 65, Access::REMOTE_READ),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, rw.rkey, u64::MAX - 3, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, rw.rkey, 0x1040, 1, Access::REMOTE_READ),
        Err(Denied)
    );
    assert_eq!(
        rs(&c, pd, z.rkey, 0xdead_0000, 8, Access::REMOTE_WRITE),
        Err(Denied),
        "zero-based"
    );
    assert_eq!(rs(&c, pd, z.rkey, 25, 8, Access::REMOTE_WRITE), Err(Denied));
    // Zero length checks no key.
    assert_eq!(rs(&c, pd2, 0xBAD, 0, 0, Access::REMOTE_WRITE), Ok(0));
    // Atomics: alignment.
    assert_eq!(
        rs(&c, pd, rw.rkey, 0x1004, 8, Access::REMOTE_ATOMIC),
        Err(Misaligned)
    );
    assert_eq!(rs(&c, pd, rw.rkey, 0x1008, 8, Access::REMOTE_ATOMIC), Ok(8));
    // Deregistered key.
    c.dereg_mr(r.lkey).unwrap();
    assert_eq!(
        rs(&c, pd, r.rkey, 0x8000, 8, Access::REMOTE_READ),
        Err(Denied)
    );
    // The span writes where it should.
    let s = c
        .remote_span(pd, q, rw.rkey, 0x1010, 4, Access::REMOTE_WRITE)
        .unwrap();
    assert!(s.write(0, &[1, 2, 3, 4]));
    let s = c
        .remote_span(pd, q, z.rkey, 30, 2, Access::REMOTE_WRITE)
        .unwrap();
    assert!(s.write(0, &[9, 9]));
    drop(c);
    assert_eq!(&buf[0x10..0x14], &[1, 2, 3, 4]);
    assert_eq!(buf[0x14], 0);
    assert_eq!(&zb[30..], &[9, 9]);
}

// ------------------------------------------------------------------ MemSpan

#[test]
fn memspan_bounds_and_atomics() {
    let mut buf = [0u64; 4];
    // SAFETY: the u64 array is 8-aligned; viewed as 32 bytes for registration only.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), 32) };
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let mr = reg(&mut c, pd, bytes, 0, ALL);
    let s = c
        .remote_span(pd, 1, mr.rkey, 0, 32, Access::REMOTE_ATOMIC)
        .unwrap();
    assert!(!s.write(30, &[0; 3]));
    assert!(!s.write(usize::MAX, &[0; 1]));
    assert!(s.write(32, &[]));
    let mut out = [0u8; 4];
    assert!(!s.read(29, &mut out));
    assert!(s.write(0, &5u64.to_ne_bytes()));
    assert_eq!(
        s.compare_swap(0, 4, 100),
        Some(5),
        "failed compare returns original"
    );
    assert_eq!(s.compare_swap(0, 5, 100), Some(5));
    assert_eq!(s.fetch_add(0, 11), Some(100));
    assert_eq!(s.fetch_add(8, u64::MAX), Some(0));
    assert_eq!(s.fetch_add(4, 1), None, "misaligned");
    assert_eq!(s.compare_swap(32, 0, 1), None, "out of bounds");
    assert_eq!(s.fetch_add(usize::MAX - 3, 1), None);
    let mut out8 = [0u8; 8];
    assert!(s.read(0, &mut out8));
    assert_eq!(u64::from_ne_bytes(out8), 111);
    drop(c);
    assert_eq!(buf[0], 111);
    assert_eq!(buf[1], u64::MAX);
}

// ------------------------------------------------------------------ scatter / gather

#[test]
fn scatter_gather_multi_sge() {
    // Each failed check gives its own detail, for the completion's vendor_err.
    let prot = |d| WcError::new(WcStatus::LocProtErr, d);
    let too_long = WcError::new(WcStatus::LocLenErr, WcDetail::MessageTooLong);
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    let mut rdonly = [7u8; 8];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    let ma = reg(&mut c, pd, &mut a, 0x100, Access::LOCAL_WRITE);
    let mb = reg(&mut c, pd, &mut b, 0x200, Access::LOCAL_WRITE);
    let mr = reg(&mut c, pd, &mut rdonly, 0x300, Access::empty());
    let sgl = [
        Sge {
            addr: 0x102,
            length: 4,
            lkey: ma.lkey,
        },
        Sge {
            addr: 0,
            length: 0,
            lkey: 0xBAD,
        }, // zero-length: not checked
        Sge {
            addr: 0x200,
            length: 8,
            lkey: mb.lkey,
        },
    ];
    let data: Vec<u8> = (1..=12).collect();
    c.scatter(pd, &sgl, 0, &data[..6]).unwrap();
    c.scatter(pd, &sgl, 6, &data[6..]).unwrap();
    assert_eq!(c.scatter(pd, &sgl, 10, &[0; 3]), Err(too_long));
    assert_eq!(c.scatter(pd, &sgl, usize::MAX, &[0; 3]), Err(too_long));
    assert_eq!(c.scatter(pd, &sgl, 12, &[]), Ok(()));
    assert_eq!(
        c.scatter(pd2, &sgl, 0, &[1]),
        Err(prot(WcDetail::WrongPd)),
        "other PD"
    );
    let mut out = [0u8; 12];
    c.gather(pd, &sgl, 0, &mut out).unwrap();
    assert_eq!(out.to_vec(), data);
    let mut out5 = [0u8; 5];
    c.gather(pd, &sgl, 3, &mut out5).unwrap();
    assert_eq!(out5, [4, 5, 6, 7, 8]);
    assert_eq!(c.gather(pd, &sgl, 8, &mut out5), Err(too_long));
    // Local write needed to scatter; reading needs none.
    let ro = [Sge {
        addr: 0x300,
        length: 8,
        lkey: mr.lkey,
    }];
    assert_eq!(
        c.scatter(pd, &ro, 0, &[1]),
        Err(prot(WcDetail::LocalAccess))
    );
    let mut o = [0u8; 8];
    c.gather(pd, &ro, 0, &mut o).unwrap();
    assert_eq!(o, [7; 8]);
    // An SGE out of the MR's bounds, and a bad key in a later SGE.
    let oob = [Sge {
        addr: 0x104,
        length: 8,
        lkey: ma.lkey,
    }];
    assert_eq!(
        c.gather(pd, &oob, 0, &mut o),
        Err(prot(WcDetail::SgeOutOfBounds))
    );
    let bad2 = [
        Sge {
            addr: 0x100,
            length: 4,
            lkey: ma.lkey,
        },
        Sge {
            addr: 0x200,
            length: 4,
            lkey: mb.lkey ^ 0x80,
        },
    ];
    assert_eq!(
        c.gather(pd, &bad2, 0, &mut o),
        Err(prot(WcDetail::UnknownLkey))
    );
    assert_eq!(
        c.gather(pd, &bad2, 0, &mut o[..4]),
        Ok(()),
        "second SGE untouched"
    );
    drop(c);
    assert_eq!(a, [0, 0, 1, 2, 3, 4, 0, 0]);
    assert_eq!(b, [5, 6, 7, 8, 9, 10, 11, 12]);
}

// ------------------------------------------------------------------ CQ and channels

fn wc(id: u64, status: WcStatus) -> WorkCompletion {
    WorkCompletion {
        wr_id: id,
        status,
        ..Default::default()
    }
}

#[test]
fn cq_overflow_is_an_error_and_an_event() {
    let mut c = ctx();
    let (cq, cap) = c.create_cq(2, None, false).unwrap();
    assert_eq!(cap, 2);
    assert!(c.create_cq(0, None, false).is_err());
    assert!(c
        .create_cq(c.device_attr().max_cqe + 1, None, false)
        .is_err());
    // Sizes middleware asks for (libfabric's RxM: about 200k) are allowed, and cost
    // nothing until completions arrive.
    let (big, cap) = c.create_cq(c.device_attr().max_cqe, None, false).unwrap();
    assert_eq!(cap, c.device_attr().max_cqe);
    assert!(cap >= 1 << 20);
    c.destroy_cq(big).unwrap();
    assert!(c.push_completion(cq, wc(1, WcStatus::Success), false, 0));
    assert!(c.push_completion(cq, wc(2, WcStatus::Success), false, 0));
    assert_eq!(c.next_event(), None);
    assert!(!c.push_completion(cq, wc(3, WcStatus::Success), false, 0));
    assert_eq!(c.next_event(), Some(AsyncEvent::CqErr(cq)));
    assert!(!c.push_completion(cq, wc(4, WcStatus::Success), false, 0));
    assert_eq!(c.next_event(), None, "one event");
    let mut out = [WorkCompletion::default(); 4];
    assert!(c.poll_cq(cq, &mut out).is_err());
}

#[test]
fn cq_poll_resize_and_timestamps() {
    let mut c = ctx();
    let (cq, _) = c.create_cq(4, None, true).unwrap();
    let (cq2, _) = c.create_cq(4, None, false).unwrap();
    for i in 0..3 {
        assert!(c.push_completion(cq, wc(i, WcStatus::Success), false, 1000 + i));
    }
    c.push_completion(cq2, wc(9, WcStatus::Success), false, 5);
    assert_eq!(c.cq_len(cq), Ok(3));
    assert_eq!(c.resize_cq(cq, 2).unwrap_err().errno, Errno::EINVAL);
    assert_eq!(c.resize_cq(cq, 8), Ok(8));
    let mut out = [WorkCompletion::default(); 2];
    assert_eq!(c.poll_cq(cq, &mut out), Ok(2));
    assert_eq!((out[0].wr_id, out[0].timestamp), (0, Some(1000)));
    assert_eq!((out[1].wr_id, out[1].timestamp), (1, Some(1001)));
    assert_eq!(c.poll_cq(cq, &mut out), Ok(1));
    assert_eq!(c.poll_cq(cq, &mut out), Ok(0));
    assert_eq!(c.poll_cq(cq2, &mut out), Ok(1));
    assert_eq!(out[0].timestamp, None);
}

#[test]
fn channel_arming_next_solicited_and_acks() {
    let mut c = ctx();
    let ch = c.create_channel().unwrap();
    let (cq, _) = c.create_cq(64, Some(ch), false).unwrap();
    // Unarmed: no event.
    c.push_completion(cq, wc(0, WcStatus::Success), true, 0);
    assert_eq!(c.channel_pending(ch), 0);
    // Next: fires once, then disarmed.
    c.req_notify_cq(cq, Arm::Next).unwrap();
    c.push_completion(cq, wc(1, WcStatus::Success), false, 0);
    c.push_completion(cq, wc(2, WcStatus::Success), false, 0);
    assert_eq!(c.channel_pending(ch), 1);
    // Solicited: ignores unsolicited successes; fires on a solicited one.
    c.req_notify_cq(cq, Arm::Solicited).unwrap();
    c.push_completion(cq, wc(3, WcStatus::Success), false, 0);
    assert_eq!(c.channel_pending(ch), 1);
    c.push_completion(cq, wc(4, WcStatus::Success), true, 0);
    assert_eq!(c.channel_pending(ch), 2);
    c.push_completion(cq, wc(5, WcStatus::Success), true, 0);
    assert_eq!(c.channel_pending(ch), 2, "disarmed");
    // Solicited fires on an error.
    c.req_notify_cq(cq, Arm::Solicited).unwrap();
    c.push_completion(cq, wc(6, WcStatus::RemAccessErr), false, 0);
    assert_eq!(c.channel_pending(ch), 3);
    // Next is not narrowed by a later Solicited.
    c.req_notify_cq(cq, Arm::Next).unwrap();
    c.req_notify_cq(cq, Arm::Solicited).unwrap();
    c.push_completion(cq, wc(7, WcStatus::Success), false, 0);
    assert_eq!(c.channel_pending(ch), 4);
    // Events and acks.
    assert_eq!(c.get_cq_event(ch), Some(cq));
    assert_eq!(c.get_cq_event(ch), Some(cq));
    assert_eq!(c.channel_pending(ch), 2);
    assert_eq!(c.ack_cq_events(cq, 3).unwrap_err().errno, Errno::EINVAL);
    c.ack_cq_events(cq, 1).unwrap();
    assert_eq!(
        c.destroy_cq(cq).unwrap_err().errno,
        Errno::EBUSY,
        "one unacked"
    );
    assert_eq!(c.destroy_channel(ch).unwrap_err().errno, Errno::EBUSY);
    c.ack_cq_events(cq, 1).unwrap();
    // Pending (never fetched) events do not block; they go with the CQ.
    c.destroy_cq(cq).unwrap();
    assert_eq!(c.channel_pending(ch), 0);
    assert_eq!(c.get_cq_event(ch), None);
    c.destroy_channel(ch).unwrap();
    assert!(c.create_cq(4, Some(ch), false).is_err(), "channel gone");
}

// ------------------------------------------------------------------ destroy rules

#[test]
fn destroy_ebusy_cases() {
    let mut buf = [0u8; 64];
    let mut c = ctx();
    let busy = |r: Result<()>| assert_eq!(r.unwrap_err().errno, Errno::EBUSY);
    let pd = c.alloc_pd().unwrap();
    // MR
    let mr = reg(
        &mut c,
        pd,
        &mut buf,
        0,
        Access::LOCAL_WRITE | Access::MW_BIND,
    );
    busy(c.dealloc_pd(pd));
    c.dereg_mr(mr.lkey).unwrap();
    // AH
    let ah = c.create_ah(pd, &av()).unwrap();
    busy(c.dealloc_pd(pd));
    c.destroy_ah(ah).unwrap();
    // SRQ
    let srq = c.create_srq(pd, 4, 1, 0).unwrap();
    busy(c.dealloc_pd(pd));
    // MW
    let mw = c.alloc_mw(pd, 1).unwrap();
    busy(c.dealloc_pd(pd));
    c.dealloc_mw(mw).unwrap();
    // QP using a CQ and the SRQ
    let cq = cq(&mut c);
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.srq = Some(srq);
    let q = c.create_qp(i).unwrap();
    busy(c.dealloc_pd(pd));
    busy(c.destroy_cq(cq));
    busy(c.destroy_srq(srq));
    c.destroy_qp(q).unwrap();
    c.destroy_srq(srq).unwrap();
    c.destroy_cq(cq).unwrap();
    c.dealloc_pd(pd).unwrap();
    assert_eq!(c.dealloc_pd(pd).unwrap_err().errno, Errno::EINVAL);
    assert!(c.destroy_qp(q).is_err());
}

// ------------------------------------------------------------------ multicast

fn mgid(a: u8, b: u8, c: u8, d: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(a, b, c, d))
}

#[test]
fn multicast_gids_are_ipv6_multicast_or_mapped_ipv4_multicast() {
    assert!(mgid(239, 1, 2, 3).is_multicast());
    assert!(mgid(224, 0, 0, 1).is_multicast());
    assert!(!mgid(127, 0, 0, 1).is_multicast());
    assert!(!mgid(240, 0, 0, 1).is_multicast());
    let v6: std::net::Ipv6Addr = "ff0e::1:2:3".parse().unwrap();
    assert!(Gid(v6.octets()).is_multicast());
    let v6: std::net::Ipv6Addr = "fd00::1".parse().unwrap();
    assert!(!Gid(v6.octets()).is_multicast());
    // 0xff0e:: with an IPv4 multicast tail is the IB form rdma_cm uses on IB; it is
    // multicast by its first byte.
    let mut ib = mgid(239, 1, 2, 3).0;
    ib[0] = 0xFF;
    ib[1] = 0x0E;
    assert!(Gid(ib).is_multicast());
}

#[test]
fn attach_follows_the_kernel_rules() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let ud = c.create_qp(qp_init(pd, cq, QpType::Ud)).unwrap();
    let ud2 = c.create_qp(qp_init(pd, cq, QpType::Ud)).unwrap();
    let rc = c.create_qp(qp_init(pd, cq, QpType::Rc)).unwrap();
    let g = mgid(239, 1, 2, 3);
    let inval = |r: Result<bool>| assert_eq!(r.unwrap_err().errno, Errno::EINVAL);
    // Only UD QPs, only multicast GIDs, only existing QPs.
    inval(c.attach_mcast(rc, g, 0));
    inval(c.attach_mcast(ud, mgid(10, 0, 0, 1), 0));
    inval(c.attach_mcast(0xABCDE, g, 0));
    assert_eq!(c.mcast_groups().count(), 0);
    // The first attachment makes the group; a second one of the same QP changes nothing.
    assert!(c.attach_mcast(ud, g, 0).unwrap());
    assert!(!c.attach_mcast(ud, g, 0).unwrap());
    assert!(
        !c.attach_mcast(ud, g, 0xC001).unwrap(),
        "the MLID is ignored"
    );
    assert!(!c.attach_mcast(ud2, g, 0).unwrap());
    assert_eq!(c.mcast_members(&g), &[ud, ud2]);
    assert_eq!(c.mcast_groups().collect::<Vec<_>>(), vec![g]);
    // Attached QPs cannot be destroyed (uverbs: EBUSY until detached).
    assert_eq!(c.destroy_qp(ud).unwrap_err().errno, Errno::EBUSY);
    // Detach: EINVAL when not attached; the group goes with its last QP.
    inval(c.detach_mcast(ud, mgid(239, 9, 9, 9), 0));
    inval(c.detach_mcast(rc, g, 0));
    assert!(!c.detach_mcast(ud, g, 0).unwrap());
    inval(c.detach_mcast(ud, g, 0));
    assert_eq!(c.mcast_members(&g), &[ud2]);
    assert!(c.detach_mcast(ud2, g, 0).unwrap());
    assert!(c.mcast_members(&g).is_empty());
    assert_eq!(c.mcast_groups().count(), 0);
    c.destroy_qp(ud).unwrap();
    c.destroy_qp(ud2).unwrap();
}

#[test]
fn attach_limits_are_rxes() {
    let mut c = ctx();
    let a = c.device_attr().clone();
    assert_eq!(
        (
            a.max_mcast_grp,
            a.max_mcast_qp_attach,
            a.max_total_mcast_qp_attach
        ),
        (8192, 56, 0x70000)
    );
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let g = mgid(239, 0, 0, 1);
    let qps: Vec<Qpn> = (0..=a.max_mcast_qp_attach)
        .map(|_| c.create_qp(qp_init(pd, cq, QpType::Ud)).unwrap())
        .collect();
    for &q in &qps[..a.max_mcast_qp_attach as usize] {
        c.attach_mcast(q, g, 0).unwrap();
    }
    let last = qps[a.max_mcast_qp_attach as usize];
    assert_eq!(c.attach_mcast(last, g, 0).unwrap_err().errno, Errno::ENOMEM);
    // One QP may be in many groups, up to the device's group count.
    for i in 1..a.max_mcast_grp {
        let g = mgid(239, 1, (i >> 8) as u8, i as u8);
        assert!(c.attach_mcast(last, g, 0).unwrap(), "group {i}");
    }
    assert_eq!(c.mcast_groups().count(), a.max_mcast_grp as usize);
    let over = mgid(239, 200, 0, 0);
    assert_eq!(
        c.attach_mcast(last, over, 0).unwrap_err().errno,
        Errno::ENOMEM
    );
}

// ------------------------------------------------------------------ SRQ

#[test]
fn srq_limit_event_fires_once() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let srq = c.create_srq(pd, 8, 2, 0).unwrap();
    assert!(c.create_srq(pd, 4, 1, 5).is_err(), "limit above max_wr");
    assert!(c.create_srq(pd, 4, 28, 0).is_err(), "too many SGEs");
    assert_eq!(
        c.modify_srq(srq, None, Some(9)).unwrap_err().errno,
        Errno::EINVAL
    );
    assert!(c.modify_srq(srq, Some(4), None).is_err(), "grow only");
    let cq = cq(&mut c);
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.srq = Some(srq);
    let q = c.create_qp(i).unwrap();
    assert_eq!(c.qp(q).unwrap().init.cap.max_recv_wr, 0);
    drive(&mut c, q, QpState::Rtr);
    for id in 0..8 {
        c.post_srq_recv(
            srq,
            RecvWr {
                wr_id: id,
                sg_list: vec![],
            },
        )
        .unwrap();
    }
    assert_eq!(
        c.post_srq_recv(
            srq,
            RecvWr {
                wr_id: 9,
                sg_list: vec![]
            }
        )
        .unwrap_err()
        .errno,
        Errno::ENOMEM
    );
    assert_eq!(
        c.post_srq_recv(
            srq,
            RecvWr {
                wr_id: 9,
                sg_list: vec![Sge::default(); 3]
            }
        )
        .unwrap_err()
        .errno,
        Errno::EINVAL
    );
    assert_eq!(
        c.post_recv(
            q,
            RecvWr {
                wr_id: 9,
                sg_list: vec![]
            }
        )
        .unwrap_err()
        .errno,
        Errno::EINVAL
    );
    c.modify_srq(srq, None, Some(6)).unwrap();
    assert_eq!(c.query_srq(srq), Ok((8, 2, 6)));
    assert_eq!(c.peek_recv(q).map(|w| w.wr_id), Some(0));
    assert_eq!(c.take_recv(q).map(|w| w.wr_id), Some(0)); // 7 left
    assert_eq!(c.take_recv(q).map(|w| w.wr_id), Some(1)); // 6 left: not below
    assert_eq!(c.next_event(), None);
    assert_eq!(c.take_recv(q).map(|w| w.wr_id), Some(2)); // 5 < 6
    assert_eq!(c.next_event(), Some(AsyncEvent::SrqLimitReached(srq)));
    assert_eq!(c.query_srq(srq), Ok((8, 2, 0)), "disarmed");
    c.take_recv(q);
    assert_eq!(c.next_event(), None, "fires once");
    c.modify_srq(srq, Some(16), None).unwrap();
    assert_eq!(c.query_srq(srq).unwrap().0, 16);
}

// ------------------------------------------------------------------ MW

#[test]
fn mw_type1_bind_and_rules() {
    let mut buf = [0u8; 256];
    let mut nolw = [0u8; 64];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    let mr = reg(&mut c, pd, &mut buf, 0x1000, ALL);
    let plain = reg(&mut c, pd, &mut nolw, 0x9000, Access::REMOTE_READ);
    let nlw = {
        c.dereg_mr(plain.lkey).unwrap();
        reg(
            &mut c,
            pd,
            &mut nolw,
            0x9000,
            Access::REMOTE_READ | Access::MW_BIND,
        )
    };
    assert!(c.alloc_mw(pd, 3).is_err());
    let mw = c.alloc_mw(pd, 1).unwrap();
    let k0 = c.mw_rkey(mw).unwrap();
    let q = 0x77;
    let bind = MwBind {
        mw,
        rkey: 0,
        mr_lkey: mr.lkey,
        addr: 0x1010,
        length: 32,
        access: Access::REMOTE_WRITE | Access::REMOTE_READ,
    };
    let k1 = c.bind_mw(pd, q, &bind).unwrap();
    assert_eq!(k1 >> 8, k0 >> 8);
    assert_eq!(k1 & 0xFF, (k0 + 1) & 0xFF, "key byte bumped");
    assert_eq!(k1, inc_rkey(k0), "the rule a face computes at post");
    assert_eq!(c.mw_rkey(mw), Ok(k1));
    // Access via the window: inside only, new key only, any QP of the PD.
    assert!(c
        .remote_span(pd, 5, k1, 0x1010, 32, Access::REMOTE_WRITE)
        .is_ok());
    assert!(c
        .remote_span(pd, 5, k1, 0x1008, 8, Access::REMOTE_WRITE)
        .is_err());
    assert!(c
        .remote_span(pd, 5, k1, 0x1028, 9, Access::REMOTE_WRITE)
        .is_err());
    assert!(
        c.remote_span(pd, 5, k1, 0x1010, 8, Access::REMOTE_ATOMIC)
            .is_err(),
        "not granted"
    );
    assert!(
        c.remote_span(pd, 5, k0, 0x1010, 8, Access::REMOTE_READ)
            .is_err(),
        "old key"
    );
    assert!(c
        .remote_span(pd2, 5, k1, 0x1010, 8, Access::REMOTE_READ)
        .is_err());
    // Bind failures.
    let e = Err(WcStatus::MwBindErr);
    assert_eq!(
        c.bind_mw(
            pd,
            q,
            &MwBind {
                addr: 0x10F0,
                ..bind
            }
        ),
        e,
        "past the MR"
    );
    assert_eq!(
        c.bind_mw(
            pd,
            q,
            &MwBind {
                addr: 0x0FF0,
                ..bind
            }
        ),
        e,
        "before the MR"
    );
    assert_eq!(c.bind_mw(pd2, q, &bind), e, "other PD");
    assert_eq!(
        c.bind_mw(
            pd,
            q,
            &MwBind {
                mr_lkey: nlw.lkey,
                addr: 0x9000,
                ..bind
            }
        ),
        e,
        "write needs MR LOCAL_WRITE"
    );
    assert!(c
        .bind_mw(
            pd,
            q,
            &MwBind {
                mr_lkey: nlw.lkey,
                addr: 0x9000,
                access: Access::REMOTE_READ,
                ..bind
            }
        )
        .is_ok());
    assert_eq!(
        c.bind_mw(
            pd,
            q,
            &MwBind {
                access: Access::REMOTE_READ | Access::ZERO_BASED,
                ..bind
            }
        ),
        e
    );
    // An MR without MW_BIND.
    let mut nb = [0u8; 16];
    let mnb = reg(&mut c, pd, &mut nb, 0x5000, Access::LOCAL_WRITE);
    assert_eq!(
        c.bind_mw(
            pd,
            q,
            &MwBind {
                mr_lkey: mnb.lkey,
                addr: 0x5000,
                length: 8,
                ..bind
            }
        ),
        e
    );
    // Bound window keeps its MR; dereg EBUSY.
    assert_eq!(c.dereg_mr(nlw.lkey).unwrap_err().errno, Errno::EBUSY);
    // Type 1 cannot be invalidated; zero length unbinds.
    let k = c.mw_rkey(mw).unwrap();
    assert_eq!(c.invalidate_rkey(pd, k), Err(WcStatus::MwBindErr));
    let k2 = c.bind_mw(pd, q, &MwBind { length: 0, ..bind }).unwrap();
    assert!(c
        .remote_span(pd, 5, k2, 0x9000, 1, Access::REMOTE_READ)
        .is_err());
    c.dereg_mr(nlw.lkey).unwrap();
    // The MR's own key cannot be invalidated (no fast-reg MRs).
    assert_eq!(c.invalidate_rkey(pd, mr.rkey), Err(WcStatus::MwBindErr));
    assert!(c
        .remote_span(pd, 5, mr.rkey, 0x1000, 8, Access::REMOTE_READ)
        .is_ok());
    c.dealloc_mw(mw).unwrap();
    assert!(c.mw_rkey(mw).is_err());
}

#[test]
fn mw_type2_bind_qp_and_invalidate() {
    let mut buf = [0u8; 128];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let qa = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Rts);
    let qb = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Rts);
    let mr = reg(&mut c, pd, &mut buf, 0x4000, ALL);
    let mw = c.alloc_mw(pd, 2).unwrap();
    let k0 = c.mw_rkey(mw).unwrap();
    // Free type 2 windows grant nothing.
    assert!(c
        .remote_span(pd, qa, k0, 0x4000, 8, Access::REMOTE_READ)
        .is_err());
    let newk = (k0 & !0xFF) | ((k0 + 7) & 0xFF);
    let bind = MwBind {
        mw,
        rkey: newk,
        mr_lkey: mr.lkey,
        addr: 0x4040,
        length: 64,
        access: Access::REMOTE_READ | Access::REMOTE_ATOMIC | Access::ZERO_BASED,
    };
    let e = Err(WcStatus::MwBindErr);
    assert_eq!(
        c.bind_mw(
            pd,
            qa,
            &MwBind {
                rkey: newk ^ 0x100,
                ..bind
            }
        ),
        e,
        "index must stay"
    );
    assert_eq!(c.bind_mw(pd, 0xFF_FFF0, &bind), e, "no such QP");
    assert_eq!(c.bind_mw(pd, qa, &bind), Ok(newk));
    assert_eq!(c.bind_mw(pd, qa, &bind), e, "already bound");
    // Zero-based window: va is an offset into the window.
    assert!(c
        .remote_span(pd, qa, newk, 0, 64, Access::REMOTE_READ)
        .is_ok());
    assert!(c
        .remote_span(pd, qa, newk, 8, 8, Access::REMOTE_ATOMIC)
        .is_ok());
    assert_eq!(
        c.remote_span(pd, qa, newk, 4, 8, Access::REMOTE_ATOMIC)
            .err(),
        Some(RemoteKeyError::Misaligned)
    );
    assert!(c
        .remote_span(pd, qa, newk, 0x4040, 8, Access::REMOTE_READ)
        .is_err());
    assert!(c
        .remote_span(pd, qa, newk, 60, 8, Access::REMOTE_READ)
        .is_err());
    assert!(
        c.remote_span(pd, qb, newk, 0, 8, Access::REMOTE_READ)
            .is_err(),
        "other QP"
    );
    assert!(c
        .remote_span(pd, qa, newk, 0, 8, Access::REMOTE_WRITE)
        .is_err());
    // Invalidate: wrong key, other PD, then right.
    let pd2 = c.alloc_pd().unwrap();
    assert_eq!(c.invalidate_rkey(pd, newk ^ 1), Err(WcStatus::MwBindErr));
    assert_eq!(c.invalidate_rkey(pd2, newk), Err(WcStatus::MwBindErr));
    c.invalidate_rkey(pd, newk).unwrap();
    assert!(
        c.remote_span(pd, qa, newk, 0, 8, Access::REMOTE_READ)
            .is_err(),
        "invalidated"
    );
    assert_eq!(
        c.invalidate_rkey(pd, newk),
        Err(WcStatus::MwBindErr),
        "twice"
    );
    // Rebind after invalidation, then destroying the QP frees the window.
    let k2 = (newk & !0xFF) | ((newk + 1) & 0xFF);
    c.bind_mw(pd, qb, &MwBind { rkey: k2, ..bind }).unwrap();
    assert!(c.remote_span(pd, qb, k2, 0, 8, Access::REMOTE_READ).is_ok());
    assert_eq!(c.dereg_mr(mr.lkey).unwrap_err().errno, Errno::EBUSY);
    c.destroy_qp(qb).unwrap();
    assert!(c
        .remote_span(pd, qb, k2, 0, 8, Access::REMOTE_READ)
        .is_err());
    c.dereg_mr(mr.lkey).unwrap();
}

#[test]
fn inc_rkey_bumps_the_key_byte_only() {
    assert_eq!(inc_rkey(0x1234_5600), 0x1234_5601);
    assert_eq!(inc_rkey(0x1234_56FF), 0x1234_5600, "wraps within the byte");
    assert_eq!(inc_rkey(0xFFFF_FFFF), 0xFFFF_FF00);
}

// ------------------------------------------------------------------ DM

#[test]
fn objects_are_found_by_handle_for_import() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    assert!(c.pd_exists(pd));
    assert!(!c.pd_exists(PdId(pd.0 ^ 0x55aa)));
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives the region (deregistered below) and is not otherwise used.
    let mr = unsafe {
        c.reg_mr(
            pd,
            buf.as_mut_ptr(),
            buf.len(),
            0x1000,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
        )
    }
    .unwrap();
    assert_eq!(c.query_mr(mr.lkey).unwrap(), (pd, mr));
    assert_eq!(c.query_mr(mr.lkey ^ 1).unwrap_err().errno, Errno::EINVAL);
    let mw = c.alloc_mw(pd, 2).unwrap();
    let mw_key = c.mw_rkey(mw).unwrap();
    assert!(c.query_mr(mw_key).is_err(), "a window is not an MR");
    let dm = c.alloc_dm(1000).unwrap();
    assert_eq!(c.dm_len(dm).unwrap(), 1000);
    c.dealloc_mw(mw).unwrap();
    c.dereg_mr(mr.lkey).unwrap();
    assert!(c.query_mr(mr.lkey).is_err());
    c.free_dm(dm).unwrap();
    assert_eq!(c.dm_len(dm).unwrap_err().errno, Errno::EINVAL);
    c.dealloc_pd(pd).unwrap();
    assert!(!c.pd_exists(pd));
    assert!(c.pd_exists(pd2));
}

#[test]
fn device_memory_copy_and_registration() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    assert_eq!(c.alloc_dm(256 * 1024 + 1).unwrap_err().errno, Errno::ENOMEM);
    assert!(c.alloc_dm(0).is_err());
    let dm = c.alloc_dm(128 * 1024).unwrap();
    let dm2 = c.alloc_dm(128 * 1024).unwrap();
    assert_eq!(
        c.alloc_dm(1).unwrap_err().errno,
        Errno::ENOMEM,
        "total reached"
    );
    c.free_dm(dm2).unwrap();
    let dm3 = c.alloc_dm(64).unwrap();
    c.dm_copy_to(dm3, 60, &[1, 2, 3, 4]).unwrap();
    assert_eq!(
        c.dm_copy_to(dm3, 61, &[1, 2, 3, 4]).unwrap_err().errno,
        Errno::EINVAL
    );
    assert!(c.dm_copy_to(dm3, u64::MAX, &[1]).is_err());
    let mut out = [0u8; 4];
    c.dm_copy_from(dm3, 60, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4]);
    assert!(c.dm_copy_from(dm3, 64, &mut out).is_err());
    // Copies are in 32-bit words, as on the devices that have device memory.
    for (off, len) in [(1, 4), (2, 4), (3, 4), (4, 1), (4, 3), (4, 6)] {
        let data = vec![7u8; len];
        let e = c.dm_copy_to(dm3, off, &data).unwrap_err();
        assert_eq!(e.errno, Errno::EINVAL, "copy to at {off}+{len}");
        let mut o = vec![0u8; len];
        let e = c.dm_copy_from(dm3, off, &mut o).unwrap_err();
        assert_eq!(e.errno, Errno::EINVAL, "copy from at {off}+{len}");
    }
    c.dm_copy_from(dm3, 60, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4], "a refused copy changes nothing");
    c.dm_copy_to(dm3, 0, &[]).unwrap();
    assert!(
        c.reg_dm_mr(pd, dm3, 32, 40, Access::LOCAL_WRITE).is_err(),
        "past the end"
    );
    let mr = c
        .reg_dm_mr(
            pd,
            dm3,
            32,
            32,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    assert_eq!(mr.addr, 0);
    {
        let s = c
            .remote_span(pd, 1, mr.rkey, 28, 4, Access::REMOTE_READ)
            .unwrap();
        let mut o = [0u8; 4];
        assert!(s.read(0, &mut o));
        assert_eq!(o, [1, 2, 3, 4]);
        assert!(s.write(0, &[9, 9, 9, 9]));
    }
    assert!(c
        .remote_span(pd, 1, mr.rkey, 29, 4, Access::REMOTE_READ)
        .is_err());
    c.dm_copy_from(dm3, 60, &mut out).unwrap();
    assert_eq!(out, [9; 4]);
    let sge = [Sge {
        addr: 0,
        length: 4,
        lkey: mr.lkey,
    }];
    c.scatter(pd, &sge, 0, &[5; 4]).unwrap();
    c.dm_copy_from(dm3, 32, &mut out).unwrap();
    assert_eq!(out, [5; 4]);
    assert_eq!(c.free_dm(dm3).unwrap_err().errno, Errno::EBUSY);
    c.dereg_mr(mr.lkey).unwrap();
    c.free_dm(dm3).unwrap();
    c.free_dm(dm).unwrap();
    assert!(c.free_dm(dm).is_err());
}

// ------------------------------------------------------------------ posting

#[test]
fn post_recv_errors() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let q = c.create_qp(qp_init(pd, cq, QpType::Rc)).unwrap();
    let wr = |n| RecvWr {
        wr_id: 1,
        sg_list: vec![Sge::default(); n],
    };
    assert_eq!(
        c.post_recv(q, wr(1)).unwrap_err().errno,
        Errno::EINVAL,
        "RESET"
    );
    drive(&mut c, q, QpState::Init);
    assert_eq!(
        c.post_recv(q, wr(3)).unwrap_err().errno,
        Errno::EINVAL,
        "SGEs"
    );
    for _ in 0..4 {
        c.post_recv(q, wr(2)).unwrap();
    }
    assert_eq!(c.post_recv(q, wr(0)).unwrap_err().errno, Errno::ENOMEM);
    assert!(c.take_recv(q).is_some());
    c.set_qp_error(q);
    assert_eq!(c.qp(q).unwrap().state, QpState::Err);
    c.post_recv(q, wr(0)).unwrap();
    assert_eq!(
        c.post_recv(q, wr(3)).unwrap_err().errno,
        Errno::EINVAL,
        "SGEs in ERR"
    );
    assert!(c.post_recv(0x999_999, wr(0)).is_err());
}

#[test]
fn check_send_wr_errors() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let ah = c.create_ah(pd, &av()).unwrap();
    let ah_other = c.create_ah(pd2, &av()).unwrap();
    let rc = c.create_qp(qp_init(pd, cq, QpType::Rc)).unwrap();
    let uc = fresh_qp(&mut c, pd, cq, QpType::Uc, QpState::Rts);
    let ud = fresh_qp(&mut c, pd, cq, QpType::Ud, QpState::Rts);
    let sge8 = Sge {
        addr: 0,
        length: 8,
        lkey: 1,
    };
    let w = |op, n: usize| SendWr {
        wr_id: 1,
        op,
        flags: SendFlags::empty(),
        sg_list: vec![sge8; n],
        inline_data: None,
        ud: None,
    };
    let inval = |r: Result<()>| assert_eq!(r.unwrap_err().errno, Errno::EINVAL);
    let read = SendOp::Read {
        remote_addr: 0,
        rkey: 1,
    };
    let cas = SendOp::CompareSwap {
        remote_addr: 0,
        rkey: 1,
        compare: 0,
        swap: 1,
    };
    let write = SendOp::Write {
        remote_addr: 0,
        rkey: 1,
    };
    // State.
    for s in [QpState::Reset, QpState::Init, QpState::Rtr] {
        if s != QpState::Reset {
            to_state(&mut c, rc, s).unwrap();
        }
        inval(c.check_send_wr(rc, &w(SendOp::Send, 1)));
    }
    to_state(&mut c, rc, QpState::Rts).unwrap();
    c.check_send_wr(rc, &w(SendOp::Send, 1)).unwrap();
    c.check_send_wr(rc, &w(read, 2)).unwrap();
    c.check_send_wr(rc, &w(cas, 1)).unwrap();
    c.check_send_wr(rc, &w(SendOp::SendWithInv { invalidate_rkey: 5 }, 0))
        .unwrap();
    // SGE count and atomics' buffer.
    inval(c.check_send_wr(rc, &w(SendOp::Send, 3)));
    inval(c.check_send_wr(rc, &w(cas, 0)));
    let mut short = w(
        SendOp::FetchAdd {
            remote_addr: 0,
            rkey: 1,
            add: 1,
        },
        1,
    );
    short.sg_list[0].length = 4;
    inval(c.check_send_wr(rc, &short));
    // Inline.
    let cap = c.qp(rc).unwrap().init.cap;
    let mut inl = w(write, 1);
    inl.flags = SendFlags::INLINE;
    inl.sg_list[0].length = cap.max_inline_data;
    c.check_send_wr(rc, &inl).unwrap();
    inl.sg_list[0].length += 1;
    inval(c.check_send_wr(rc, &inl));
    let mut rinl = w(read, 1);
    rinl.flags = SendFlags::INLINE;
    inval(c.check_send_wr(rc, &rinl));
    // UC opcodes.
    c.check_send_wr(uc, &w(write, 1)).unwrap();
    c.check_send_wr(uc, &w(SendOp::LocalInv { rkey: 1 }, 0))
        .unwrap();
    inval(c.check_send_wr(uc, &w(read, 1)));
    inval(c.check_send_wr(uc, &w(cas, 1)));
    inval(c.check_send_wr(uc, &w(SendOp::SendWithInv { invalidate_rkey: 1 }, 1)));
    // UD: destination and opcodes.
    inval(c.check_send_wr(ud, &w(SendOp::Send, 1)));
    let mut uds = w(SendOp::SendWithImm { imm: 3 }, 1);
    uds.ud = Some(UdDest {
        ah,
        remote_qpn: 0x22,
        remote_qkey: 0x1111_1111,
    });
    c.check_send_wr(ud, &uds).unwrap();
    uds.ud = Some(UdDest {
        ah: ah_other,
        remote_qpn: 0x22,
        remote_qkey: 0,
    });
    inval(c.check_send_wr(ud, &uds));
    uds.ud = Some(UdDest {
        ah: AhId(424242),
        remote_qpn: 0x22,
        remote_qkey: 0,
    });
    inval(c.check_send_wr(ud, &uds));
    let mut udw = w(write, 1);
    udw.ud = Some(UdDest {
        ah,
        remote_qpn: 0x22,
        remote_qkey: 0,
    });
    inval(c.check_send_wr(ud, &udw));
    // ERR: too many SGEs is still EINVAL; everything else is accepted, to be flushed.
    c.set_qp_error(rc);
    inval(c.check_send_wr(rc, &w(SendOp::Send, 3)));
    c.check_send_wr(rc, &w(SendOp::Send, 2)).unwrap();
    c.check_send_wr(rc, &w(cas, 0)).unwrap();
    c.check_send_wr(rc, &rinl).unwrap();
    // RESET, INIT, RTR: too many SGEs is EINVAL there too (as is any post).
    let fresh = c.create_qp(qp_init(pd, cq, QpType::Rc)).unwrap();
    inval(c.check_send_wr(fresh, &w(SendOp::Send, 3)));
}

#[test]
fn ah_and_device_attrs() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    assert!(c
        .create_ah(
            pd,
            &AhAttr {
                is_global: false,
                ..av()
            }
        )
        .is_err());
    assert!(c
        .create_ah(
            pd,
            &AhAttr {
                grh: GlobalRoute {
                    sgid_index: 2,
                    ..av().grh
                },
                ..av()
            }
        )
        .is_err());
    assert!(c.create_ah(PdId(31337), &av()).is_err());
    let ah = c
        .create_ah(
            pd,
            &AhAttr {
                port_num: 0,
                ..av()
            },
        )
        .unwrap();
    assert_eq!(c.ah(ah).unwrap().1.port_num, 1);
    c.destroy_ah(ah).unwrap();
    assert!(c.ah(ah).is_err());
    let d = c.device_attr();
    assert_eq!(
        (d.vendor_id, d.max_sge, d.phys_port_cnt, d.atomic_cap),
        (0xFF_FFFF, 32, 1, 1)
    );
    assert_eq!(d.max_mr_size, u64::MAX);
    let p = c.port_attr(1).unwrap();
    assert_eq!(
        (p.state, p.link_layer, p.phys_state, p.pkey_tbl_len),
        (4, 2, 5, 64)
    );
    assert_eq!(
        (p.max_mtu, p.active_mtu, p.gid_tbl_len),
        (Mtu::Mtu4096, Mtu::Mtu1024, 2)
    );
    assert!(c.port_attr(2).is_err());
    assert_eq!(c.pkey(0), Ok(0xFFFF));
    assert!(c.pkey(64).is_err());
    assert_eq!(c.gid(1), Ok(Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1))));
    assert!(c.gid(2).is_err());
    assert_eq!(c.gids().len(), 2);
    c.set_active_mtu(Mtu::Mtu4096).unwrap();
    assert_eq!(c.port_attr(1).unwrap().active_mtu, Mtu::Mtu4096);
    c.push_event(AsyncEvent::PortActive(1));
    assert_eq!(c.next_event(), Some(AsyncEvent::PortActive(1)));
    assert_eq!(c.next_event(), None);
}

// ------------------------------------------------------------------ property test

mod prop {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        AllocPd,
        DeallocPd(u8),
        RegMr(u8, u8, u8, u8),
        DeregMr(u8),
        Remote(u8, u8, u64, u16, u8),
        Local(u8, u8, u64, u16, u8),
        CreateCq(u16, bool),
        Push(u8, u8, bool),
        Poll(u8, u8),
        Arm(u8, bool),
        Channel,
        GetEv(u8),
        Ack(u8, u8),
        DestroyCq(u8),
        CreateQp(u8, u8, u8, u8),
        Modify(u8, u8, u32, u32),
        DestroyQp(u8),
        PostRecv(u8, u8),
        Take(u8),
        CheckSend(u8, u8, u8),
        CreateSrq(u8, u8, u8),
        ModSrq(u8, Option<u8>, Option<u8>),
        AllocMw(u8, u8),
        Bind(u8, u8, u8, u64, u64, u8, u32),
        Inval(u8, u8),
        AllocDm(u32),
        DmCopy(u8, u64, u8),
        RegDm(u8, u8, u64, u16, u8),
        FreeDm(u8),
        CreateAh(u8, u8, bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::AllocPd),
            any::<u8>().prop_map(Op::DeallocPd),
            (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>())
                .prop_map(|(a, b, c, d)| Op::RegMr(a, b, c, d)),
            any::<u8>().prop_map(Op::DeregMr),
            (
                any::<u8>(),
                any::<u8>(),
                any::<u64>(),
                any::<u16>(),
                any::<u8>()
            )
                .prop_map(|(a, b, c, d, e)| Op::Remote(a, b, c, d, e)),
            (
                any::<u8>(),
                any::<u8>(),
                any::<u64>(),
                any::<u16>(),
                any::<u8>()
            )
                .prop_map(|(a, b, c, d, e)| Op::Local(a, b, c, d, e)),
            (any::<u16>(), any::<bool>()).prop_map(|(a, b)| Op::CreateCq(a, b)),
            (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, c)| Op::Push(a, b, c)),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::Poll(a, b)),
            (any::<u8>(), any::<bool>()).prop_map(|(a, b)| Op::Arm(a, b)),
            Just(Op::Channel),
            any::<u8>().prop_map(Op::GetEv),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::Ack(a, b)),
            any::<u8>().prop_map(Op::DestroyCq),
            (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>())
                .prop_map(|(a, b, c, d)| Op::CreateQp(a, b, c, d)),
            (any::<u8>(), any::<u8>(), any::<u32>(), any::<u32>())
                .prop_map(|(a, b, c, d)| Op::Modify(a, b, c, d)),
            any::<u8>().prop_map(Op::DestroyQp),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::PostRecv(a, b)),
            any::<u8>().prop_map(Op::Take),
            (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(a, b, c)| Op::CheckSend(a, b, c)),
            (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(a, b, c)| Op::CreateSrq(a, b, c)),
            (any::<u8>(), any::<Option<u8>>(), any::<Option<u8>>())
                .prop_map(|(a, b, c)| Op::ModSrq(a, b, c)),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::AllocMw(a, b)),
            (
                any::<u8>(),
                any::<u8>(),
                any::<u8>(),
                any::<u64>(),
                any::<u64>(),
                any::<u8>(),
                any::<u32>()
            )
                .prop_map(|(a, b, c, d, e, f, g)| Op::Bind(a, b, c, d, e, f, g)),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::Inval(a, b)),
            (0u32..300_000).prop_map(Op::AllocDm),
            (any::<u8>(), any::<u64>(), any::<u8>()).prop_map(|(a, b, c)| Op::DmCopy(a, b, c)),
            (
                any::<u8>(),
                any::<u8>(),
                any::<u64>(),
                any::<u16>(),
                any::<u8>()
            )
                .prop_map(|(a, b, c, d, e)| Op::RegDm(a, b, c, d, e)),
            any::<u8>().prop_map(Op::FreeDm),
            (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, c)| Op::CreateAh(a, b, c)),
        ]
    }

    fn pick<T: Copy>(v: &[T], i: u8) -> Option<T> {
        if v.is_empty() {
            None
        } else {
            Some(v[i as usize % v.len()])
        }
    }

    const STATES: [QpState; 7] = super::STATES;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]
        #[test]
        fn random_verbs_sequences_never_panic(ops in proptest::collection::vec(op(), 1..80), seed in any::<u64>()) {
            let mut bufs = vec![[0u8; 256]; 8];
            let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
            let mut c = Context::new(vec![Gid::default()], seed);
            let (mut pds, mut keys, mut cqs, mut chs, mut qps, mut srqs, mut mws, mut dms, mut ahs) =
                (vec![], vec![0x1234u32], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
            for op in ops {
                match op {
                    Op::AllocPd => { if let Ok(p) = c.alloc_pd() { pds.push(p) } }
                    Op::DeallocPd(i) => { if let Some(p) = pick(&pds, i) { let _ = c.dealloc_pd(p); } }
                    Op::RegMr(p, b, off, acc) => {
                        if let (Some(pd), Some(ptr)) = (pick(&pds, p), pick(&ptrs, b)) {
                            let off = (off as usize) % 256;
                            // SAFETY: the buffers outlive `c` and stay within their 256 bytes.
                            let r = unsafe { c.reg_mr(pd, ptr.wrapping_add(off), 256 - off, (off as u64) << 4, Access::from_bits_truncate(acc as u32)) };
                            if let Ok(m) = r { keys.push(m.lkey) }
                        }
                    }
                    Op::DeregMr(k) => { if let Some(k) = pick(&keys, k) { let _ = c.dereg_mr(k); } }
                    Op::Remote(p, k, va, len, need) => {
                        if let (Some(pd), Some(k)) = (pick(&pds, p), pick(&keys, k)) {
                            let q = pick(&qps, p).unwrap_or(0);
                            if let Ok(s) = c.remote_span(pd, q, k, va % 8192, len as usize, Access::from_bits_truncate(need as u32)) {
                                let data = vec![0xAB; s.len()];
                                prop_assert!(s.write(0, &data));
                                let _ = s.fetch_add(0, 1);
                                let _ = s.compare_swap(len as usize % 16, 0, 1);
                            }
                        }
                    }
                    Op::Local(p, k, addr, len, off) => {
                        if let (Some(pd), Some(k)) = (pick(&pds, p), pick(&keys, k)) {
                            let sgl = [Sge { addr: addr % 8192, length: len as u32 % 300, lkey: k }, Sge { addr: 0, length: 16, lkey: k }];
                            let data = [7u8; 40];
                            let _ = c.scatter(pd, &sgl, off as usize, &data);
                            let mut out = [0u8; 40];
                            let _ = c.gather(pd, &sgl, off as usize, &mut out);
                        }
                    }
                    Op::CreateCq(n, ts) => {
                        let ch = if ts { pick(&chs, n as u8) } else { None };
                        if let Ok((id, _)) = c.create_cq(n as u32 % 8, ch, ts) { cqs.push(id) }
                    }
                    Op::Push(i, st, sol) => {
                        if let Some(cq) = pick(&cqs, i) {
                            let status = if st % 3 == 0 { WcStatus::GeneralErr } else { WcStatus::Success };
                            let _ = c.push_completion(cq, WorkCompletion { status, ..Default::default() }, sol, st as u64);
                        }
                    }
                    Op::Poll(i, n) => {
                        if let Some(cq) = pick(&cqs, i) {
                            let mut out = vec![WorkCompletion::default(); n as usize % 5];
                            let _ = c.poll_cq(cq, &mut out);
                            let _ = c.resize_cq(cq, n as u32);
                        }
                    }
                    Op::Arm(i, s) => { if let Some(cq) = pick(&cqs, i) { let _ = c.req_notify_cq(cq, if s { Arm::Solicited } else { Arm::Next }); } }
                    Op::Channel => { if let Ok(ch) = c.create_channel() { chs.push(ch) } }
                    Op::GetEv(i) => { if let Some(ch) = pick(&chs, i) { let _ = c.get_cq_event(ch); let _ = c.channel_pending(ch); let _ = c.destroy_channel(ch); } }
                    Op::Ack(i, n) => { if let Some(cq) = pick(&cqs, i) { let _ = c.ack_cq_events(cq, n as u32 % 3); } }
                    Op::DestroyCq(i) => { if let Some(cq) = pick(&cqs, i) { let _ = c.destroy_cq(cq); } }
                    Op::CreateQp(p, q, t, caps) => {
                        if let (Some(pd), Some(cq)) = (pick(&pds, p), pick(&cqs, q)) {
                            let qp_type = [QpType::Rc, QpType::Uc, QpType::Ud][t as usize % 3];
                            let srq = if caps & 1 == 1 { pick(&srqs, caps) } else { None };
                            let cap = QpCap { max_send_wr: caps as u32, max_recv_wr: caps as u32 % 5, max_send_sge: caps as u32 % 40, max_recv_sge: caps as u32 % 4, max_inline_data: caps as u32 * 3 };
                            if let Ok(qpn) = c.create_qp(QpInitAttr { qp_type, pd, send_cq: cq, recv_cq: cq, srq, cap, sq_sig_all: false }) { qps.push(qpn) }
                        }
                    }
                    Op::Modify(q, s, mask, vals) => {
                        if let Some(qpn) = pick(&qps, q) {
                            let mut a = good_attr();
                            a.qp_state = STATES[s as usize % 7];
                            a.cur_qp_state = STATES[(s / 7) as usize % 7];
                            a.timeout = (vals & 63) as u8;
                            a.retry_cnt = ((vals >> 6) & 15) as u8;
                            a.pkey_index = ((vals >> 10) & 127) as u16;
                            a.sq_psn = vals;
                            let r = c.modify_qp(qpn, &a, QpAttrMask::from_bits_truncate(mask));
                            if let (Ok((_, new)), Some(qp)) = (r, c.qp(qpn)) { prop_assert_eq!(qp.state, new); }
                            // Also the table-driven happy path, so QPs reach every state.
                            let cur = c.qp(qpn).map(|q| q.state).unwrap_or_default();
                            let t = c.qp(qpn).map(|q| q.init.qp_type).unwrap_or(QpType::Rc);
                            let next = STATES[vals as usize % 7];
                            let mut a = good_attr();
                            a.qp_state = next;
                            let _ = c.modify_qp(qpn, &a, req_mask(t, cur, next) | QpAttrMask::STATE);
                        }
                    }
                    Op::DestroyQp(q) => { if let Some(qpn) = pick(&qps, q) { let _ = c.destroy_qp(qpn); } }
                    Op::PostRecv(q, n) => {
                        if let Some(qpn) = pick(&qps, q) {
                            let _ = c.post_recv(qpn, RecvWr { wr_id: 1, sg_list: vec![Sge::default(); n as usize % 4] });
                        }
                        if let Some(srq) = pick(&srqs, n) {
                            let _ = c.post_srq_recv(srq, RecvWr { wr_id: 2, sg_list: vec![Sge::default(); n as usize % 4] });
                        }
                    }
                    Op::Take(q) => { if let Some(qpn) = pick(&qps, q) { let _ = c.peek_recv(qpn); let _ = c.take_recv(qpn); } }
                    Op::CheckSend(q, o, n) => {
                        if let Some(qpn) = pick(&qps, q) {
                            let ops = [SendOp::Send, SendOp::Read { remote_addr: 0, rkey: 0 }, SendOp::FetchAdd { remote_addr: 0, rkey: 0, add: 1 }, SendOp::LocalInv { rkey: 0 }, SendOp::SendWithInv { invalidate_rkey: 1 }];
                            let ud = pick(&ahs, n).map(|ah| UdDest { ah, remote_qpn: n as u32, remote_qkey: 0 });
                            let wr = SendWr { wr_id: 0, op: ops[o as usize % ops.len()], flags: SendFlags::from_bits_truncate(n as u32), sg_list: vec![Sge { addr: 0, length: n as u32 * 7, lkey: 0 }; n as usize % 4], inline_data: None, ud };
                            let _ = c.check_send_wr(qpn, &wr);
                        }
                    }
                    Op::CreateSrq(p, w, l) => { if let Some(pd) = pick(&pds, p) { if let Ok(s) = c.create_srq(pd, w as u32 % 10, l as u32 % 30, l as u32 % 5) { srqs.push(s) } } }
                    Op::ModSrq(i, w, l) => {
                        if let Some(s) = pick(&srqs, i) {
                            let _ = c.modify_srq(s, w.map(u32::from), l.map(|x| x as u32 % 12));
                            let _ = c.query_srq(s);
                            let _ = c.destroy_srq(s);
                        }
                    }
                    Op::AllocMw(p, t) => { if let Some(pd) = pick(&pds, p) { if let Ok(m) = c.alloc_mw(pd, t % 4) { mws.push(m); if let Ok(k) = c.mw_rkey(m) { keys.push(k) } } } }
                    Op::Bind(m, p, k, addr, len, acc, rk) => {
                        if let (Some(mw), Some(pd), Some(mk)) = (pick(&mws, m), pick(&pds, p), pick(&keys, k)) {
                            let q = pick(&qps, k).unwrap_or(0);
                            let base = c.mw_rkey(mw).unwrap_or(0);
                            let rkey = if rk & 1 == 0 { (base & !0xFF) | (rk >> 8 & 0xFF) } else { rk };
                            let b = MwBind { mw, rkey, mr_lkey: mk, addr: addr % 8192, length: len % 512, access: Access::from_bits_truncate(acc as u32) };
                            if let Ok(nk) = c.bind_mw(pd, q, &b) { keys.push(nk) }
                            if rk % 7 == 0 { let _ = c.dealloc_mw(mw); }
                        }
                    }
                    Op::Inval(p, k) => { if let (Some(pd), Some(k)) = (pick(&pds, p), pick(&keys, k)) { let _ = c.invalidate_rkey(pd, k); } }
                    Op::AllocDm(n) => { if let Ok(d) = c.alloc_dm(n as usize) { dms.push(d) } }
                    Op::DmCopy(d, off, n) => {
                        if let Some(dm) = pick(&dms, d) {
                            let data = vec![1u8; n as usize];
                            let _ = c.dm_copy_to(dm, off % 300_000, &data);
                            let mut out = vec![0u8; n as usize];
                            let _ = c.dm_copy_from(dm, off % 300_000, &mut out);
                        }
                    }
                    Op::RegDm(p, d, off, len, acc) => {
                        if let (Some(pd), Some(dm)) = (pick(&pds, p), pick(&dms, d)) {
                            if let Ok(m) = c.reg_dm_mr(pd, dm, off % 300_000, len as usize, Access::from_bits_truncate(acc as u32)) { keys.push(m.lkey) }
                        }
                    }
                    Op::FreeDm(d) => { if let Some(dm) = pick(&dms, d) { let _ = c.free_dm(dm); } }
                    Op::CreateAh(p, s, g) => {
                        if let Some(pd) = pick(&pds, p) {
                            let a = AhAttr { is_global: g, grh: GlobalRoute { sgid_index: s % 3, ..Default::default() }, ..Default::default() };
                            if let Ok(ah) = c.create_ah(pd, &a) { ahs.push(ah); if s & 8 != 0 { let _ = c.destroy_ah(ah); } }
                        }
                    }
                }
                while c.next_event().is_some() {}
            }
            drop(c);
            drop(bufs);
        }
    }
}

// ------------------------------------------------------------------ backing memory

/// `len` bytes of fresh anonymous memory with `prot`.
fn map(len: usize, prot: i32) -> *mut u8 {
    // SAFETY: a new private anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

#[test]
fn reg_mr_needs_backing_memory() {
    const PAGE: usize = 4096;
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let rw = map(4 * PAGE, libc::PROT_READ | libc::PROT_WRITE);
    let ro = map(PAGE, libc::PROT_READ);
    let reg_err = |c: &mut Context, p: *mut u8, len: usize, a: Access| {
        // SAFETY: only mappings of this test, which outlive `c`'s use of them; a refused
        // registration keeps nothing.
        unsafe { c.reg_mr(pd, p, len, p as u64, a) }
            .map(|_| ())
            .map_err(|e| e.errno)
    };
    // Far past the mapping (1 TiB over 16 KiB): EFAULT, as pinning it fails.
    assert_eq!(reg_err(&mut c, rw, 1 << 40, ALL), Err(Errno::EFAULT));
    assert_eq!(
        reg_err(&mut c, rw, 1 << 40, Access::REMOTE_READ),
        Err(Errno::EFAULT)
    );
    // A hole in the middle.
    // SAFETY: unmaps one page of this test's own mapping, used by nothing else.
    assert_eq!(unsafe { libc::munmap(rw.add(PAGE).cast(), PAGE) }, 0);
    assert_eq!(
        reg_err(&mut c, rw, 3 * PAGE, Access::empty()),
        Err(Errno::EFAULT)
    );
    assert_eq!(reg_err(&mut c, rw, PAGE, ALL), Ok(()));
    // Read-only memory: any access letting the device write is EFAULT (the kernel pins with
    // FOLL_WRITE for LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC and MW_BIND).
    for a in [
        Access::LOCAL_WRITE,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
        Access::MW_BIND,
    ] {
        assert_eq!(reg_err(&mut c, ro, PAGE, a), Err(Errno::EFAULT), "{a:?}");
    }
    assert_eq!(reg_err(&mut c, ro, PAGE, Access::REMOTE_READ), Ok(()));
    // Length 0: no page at a page boundary (EINVAL), the page holding it otherwise.
    assert_eq!(reg_err(&mut c, rw, 0, ALL), Err(Errno::EINVAL));
    assert_eq!(reg_err(&mut c, rw.wrapping_add(8), 0, ALL), Ok(()));
    assert_eq!(
        reg_err(&mut c, rw.wrapping_add(PAGE + 8), 0, Access::empty()),
        Err(Errno::EFAULT)
    );
    assert_eq!(
        reg_err(&mut c, ro.wrapping_add(8), 0, ALL),
        Err(Errno::EFAULT)
    );
    drop(c);
    // SAFETY: this test's own mappings; the context is dropped first.
    unsafe {
        libc::munmap(rw.cast(), 4 * PAGE);
        libc::munmap(ro.cast(), PAGE);
    }
}

#[test]
fn spans_over_memory_gone_since_registration_fail() {
    const PAGE: usize = 4096;
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let q = 0x100;
    let p = map(2 * PAGE, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: this test's own mapping; spans over it are used only after checks below.
    let mr = unsafe { c.reg_mr(pd, p, 2 * PAGE, p as u64, ALL) }.unwrap();
    let va = p as u64;
    // Page 0 write-protected, page 1 unmapped.
    // SAFETY: this test's own mapping, reached only through the device's fault-safe copies.
    unsafe {
        assert_eq!(libc::mprotect(p.cast(), PAGE, libc::PROT_READ), 0);
        assert_eq!(libc::munmap(p.add(PAGE).cast(), PAGE), 0);
    }
    let span = |len, need| c.remote_span(pd, q, mr.rkey, va, len, need).unwrap();
    let mut out = vec![0u8; 2 * PAGE];
    // Reads: the readable page works, across into the unmapped one fails.
    assert!(span(PAGE, Access::REMOTE_READ).read(0, &mut out[..PAGE]));
    assert!(!span(2 * PAGE, Access::REMOTE_READ).read(0, &mut out));
    // Writes into the read-only page fail, and change nothing.
    assert!(!span(64, Access::REMOTE_WRITE).write(0, &[9; 64]));
    // SAFETY: the page is mapped readable.
    assert_eq!(unsafe { *p }, 0);
    // Atomics on either page fail without a signal.
    let s = span(2 * PAGE, Access::REMOTE_ATOMIC);
    assert_eq!(s.fetch_add(0, 1), None);
    assert_eq!(s.compare_swap(0, 0, 1), None);
    assert_eq!(s.fetch_add(PAGE, 1), None);
    assert_eq!(s.compare_swap(PAGE + 8, 0, 1), None);
    // Local gathers and scatters too: LocProtErr.
    let sge = Sge {
        addr: va + PAGE as u64 - 16,
        length: 32,
        lkey: mr.lkey,
    };
    assert_eq!(
        c.gather(pd, std::slice::from_ref(&sge), 0, &mut [0u8; 32]),
        Err(WcError::new(WcStatus::LocProtErr, WcDetail::MemoryFault))
    );
    assert_eq!(
        c.scatter(pd, std::slice::from_ref(&sge), 0, &[1u8; 32]),
        Err(WcError::new(WcStatus::LocProtErr, WcDetail::MemoryFault))
    );
    drop(c);
    // SAFETY: what is left of this test's mapping.
    unsafe { libc::munmap(p.cast(), PAGE) };
}

#[test]
fn overlapping_device_copies_move_as_memmove() {
    let mut buf = [0u8; 64];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    for (i, b) in buf.iter_mut().enumerate() {
        *b = i as u8;
    }
    let mr = reg(&mut c, pd, &mut buf, 0, ALL);
    let s = c.remote_span(pd, 0x100, mr.rkey, 0, 64, ALL).unwrap();
    let mut out = [0u8; 64];
    assert!(s.read(0, &mut out));
    assert_eq!(out[63], 63);
    // The spans' own copies never overlap their source here; the fault-safe copy still
    // moves overlapping ranges in both directions as memmove does.
    let mut v: Vec<u8> = (0..64).collect();
    let p = v.as_mut_ptr();
    // SAFETY: both ranges lie in `v`, an exclusive local buffer.
    unsafe {
        crate::context::fault_copy_for_tests(p.add(8), p, 32).unwrap();
    }
    assert_eq!(&v[8..40], &(0..32).collect::<Vec<u8>>()[..]);
    let mut v: Vec<u8> = (0..64).collect();
    let p = v.as_mut_ptr();
    // SAFETY: as above.
    unsafe {
        crate::context::fault_copy_for_tests(p, p.add(8), 32).unwrap();
    }
    assert_eq!(&v[..32], &(8..40).collect::<Vec<u8>>()[..]);
}

#[test]
fn wc_detail_codes_round_trip_and_result_reports_them() {
    let all = [
        WcDetail::Unspecified,
        WcDetail::UnknownLkey,
        WcDetail::WrongPd,
        WcDetail::SgeOutOfBounds,
        WcDetail::LocalAccess,
        WcDetail::MemoryFault,
        WcDetail::MessageTooLong,
        WcDetail::RemoteInvalidRequest,
        WcDetail::RemoteAccess,
        WcDetail::RemoteOperational,
        WcDetail::RemoteInvalidRdRequest,
        WcDetail::RetryExceeded,
        WcDetail::RnrRetryExceeded,
    ];
    for d in all {
        assert_eq!(WcDetail::from_code(d.code()), Some(d));
    }
    assert_eq!(WcDetail::from_code(7), None);
    let mut wc = WorkCompletion::default();
    assert_eq!(wc.result(), Ok(()));
    wc.status = WcStatus::LocProtErr;
    wc.vendor_err = WcDetail::WrongPd.code();
    let e = wc.result().unwrap_err();
    assert_eq!(e, WcError::new(WcStatus::LocProtErr, WcDetail::WrongPd));
    assert_eq!(
        e.to_string(),
        "local protection error (memory region of another protection domain)"
    );
    wc.vendor_err = 0xdead;
    assert_eq!(
        wc.detail(),
        WcDetail::Unspecified,
        "unknown codes have no detail"
    );
    assert_eq!(
        WcError::from(WcStatus::RetryExcErr).to_string(),
        "transport retry counter exceeded"
    );
}

#[test]
fn rereg_mr_changes_pd_access_and_memory_in_place() {
    use RemoteKeyError::Access as Denied;
    let mut old = [1u8; 64];
    let mut new = [2u8; 128];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    let q = 0x100;
    let oa = old.as_ptr() as u64;
    let mr = reg(&mut c, pd, &mut old, oa, Access::LOCAL_WRITE);
    let rs = |c: &Context, pd, va: u64, len, need| {
        c.remote_span(pd, q, mr.rkey, va, len, need)
            .map(|s| s.len())
    };
    assert_eq!(rs(&c, pd, oa, 8, Access::REMOTE_WRITE), Err(Denied));
    // SAFETY (every rereg below): the memory is this test's arrays, alive until its end.
    let rereg = |c: &mut Context, pd, mem: Option<(*mut u8, usize, u64)>, a| unsafe {
        c.rereg_mr(mr.lkey, pd, mem, a)
    };
    // Access: the rkey now admits remote writes; the keys stay.
    let info = rereg(&mut c, None, None, Some(ALL)).unwrap();
    assert_eq!((info.lkey, info.rkey, info.length), (mr.lkey, mr.rkey, 64));
    assert_eq!(rs(&c, pd, oa, 8, Access::REMOTE_WRITE), Ok(8));
    // PD: the region answers to the new PD only.
    rereg(&mut c, Some(pd2), None, None).unwrap();
    assert_eq!(rs(&c, pd, oa, 8, Access::REMOTE_WRITE), Err(Denied));
    assert_eq!(rs(&c, pd2, oa, 8, Access::REMOTE_WRITE), Ok(8));
    // Memory: the same keys reach the new array, at its own address, and not the old one.
    let na = new.as_mut_ptr();
    let info = rereg(&mut c, None, Some((na, new.len(), na as u64)), None).unwrap();
    assert_eq!((info.addr, info.length), (na as u64, 128));
    assert_eq!(rs(&c, pd2, oa, 8, Access::REMOTE_WRITE), Err(Denied));
    assert_eq!(rs(&c, pd2, na as u64 + 120, 8, Access::REMOTE_READ), Ok(8));
    let sge = Sge {
        addr: na as u64 + 4,
        length: 4,
        lkey: mr.lkey,
    };
    assert_eq!(
        c.local_span(pd2, &sge, Access::LOCAL_WRITE)
            .map(|s| s.len()),
        Ok(4)
    );
    // Refused, and the region stays as it was: nothing to change, a PD that does not
    // exist, remote write without local write, an unknown key.
    let e = |r: Result<MrInfo>| r.map(|_| ()).map_err(|e| e.errno);
    assert_eq!(e(rereg(&mut c, None, None, None)), Err(Errno::EINVAL));
    assert!(e(rereg(&mut c, Some(PdId(0xdead)), None, None)).is_err());
    assert_eq!(
        e(rereg(&mut c, None, None, Some(Access::REMOTE_WRITE))),
        Err(Errno::EINVAL)
    );
    // SAFETY: no memory given.
    assert!(unsafe { c.rereg_mr(mr.lkey ^ 0x100, None, None, Some(ALL)) }.is_err());
    assert_eq!(rs(&c, pd2, na as u64, 8, Access::REMOTE_WRITE), Ok(8));
    // Memory the process does not back: EFAULT, as at registration.
    assert_eq!(
        e(rereg(&mut c, None, Some((na, 1 << 40, na as u64)), None)),
        Err(Errno::EFAULT)
    );
    assert_eq!(rs(&c, pd2, na as u64 + 120, 8, Access::REMOTE_READ), Ok(8));
    // A bound window was checked against the region as it was: EBUSY until it goes.
    let mw = c.alloc_mw(pd2, 1).unwrap();
    let bind = MwBind {
        mw,
        rkey: 0,
        mr_lkey: mr.lkey,
        addr: na as u64,
        length: 32,
        access: Access::REMOTE_READ,
    };
    c.bind_mw(pd2, q, &bind).unwrap();
    assert_eq!(e(rereg(&mut c, None, None, Some(ALL))), Err(Errno::EBUSY));
    c.dealloc_mw(mw).unwrap();
    assert!(rereg(&mut c, Some(pd), None, None).is_ok());
    assert_eq!(old, [1u8; 64]);
}

#[test]
fn discard_completions_takes_one_qps_out_of_its_cqs() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let a = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Rts);
    let b = fresh_qp(&mut c, pd, cq, QpType::Rc, QpState::Rts);
    let of = |qpn, id| WorkCompletion {
        qp_num: qpn,
        ..wc(id, WcStatus::WrFlushErr)
    };
    for (qpn, id) in [(a, 1), (b, 2), (a, 3), (b, 4)] {
        assert!(c.push_completion(cq, of(qpn, id), false, 0));
    }
    // The context's reset alone keeps them: the device cleans them on the way to RESET.
    to_state(&mut c, a, QpState::Err).unwrap();
    to_state(&mut c, a, QpState::Reset).unwrap();
    assert_eq!(c.cq_len(cq), Ok(4));
    assert_eq!(c.discard_completions(a), Ok(2));
    assert!(c.discard_completions(0xFF_FFF0).is_err());
    let mut out = [WorkCompletion::default(); 8];
    let n = c.poll_cq(cq, &mut out).unwrap();
    let left: Vec<(Qpn, u64)> = out[..n].iter().map(|w| (w.qp_num, w.wr_id)).collect();
    assert_eq!(left, vec![(b, 2), (b, 4)], "only the other QP's, in order");
}

/// A QP on an SRQ, its sends and receives reporting to one CQ: its send completions go
/// on the way to RESET, its receives stay (each holds a buffer taken from the SRQ).
#[test]
fn discard_completions_keeps_an_srqs_receives() {
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = cq(&mut c);
    let srq = c.create_srq(pd, 4, 1, 0).unwrap();
    let mut i = qp_init(pd, cq, QpType::Rc);
    i.srq = Some(srq);
    let q = c.create_qp(i).unwrap();
    let of = |id, opcode| WorkCompletion {
        qp_num: q,
        opcode,
        ..wc(id, WcStatus::Success)
    };
    for (id, op) in [
        (1, WcOpcode::Send),
        (2, WcOpcode::Recv),
        (3, WcOpcode::RdmaWrite),
        (4, WcOpcode::RecvRdmaWithImm),
    ] {
        assert!(c.push_completion(cq, of(id, op), false, 0));
    }
    assert_eq!(c.discard_completions(q), Ok(2));
    let mut out = [WorkCompletion::default(); 8];
    let n = c.poll_cq(cq, &mut out).unwrap();
    let left: Vec<u64> = out[..n].iter().map(|w| w.wr_id).collect();
    assert_eq!(left, vec![2, 4]);
}

// ------------------------------------------------------------------ on-demand paging

#[test]
fn on_demand_regions_need_no_backing_and_fail_cleanly_where_nothing_is_mapped() {
    const PAGE: usize = 4096;
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let q = 0x100;
    let odp = ALL | Access::ON_DEMAND;
    // Two pages reserved but not accessible yet, as a program maps memory it fills later.
    let p = map(2 * PAGE, libc::PROT_NONE);
    // SAFETY: this test's own mapping, reached only through the device's fault-safe copies.
    let reg_at = |c: &mut Context, a: Access| unsafe { c.reg_mr(pd, p, 2 * PAGE, p as u64, a) };
    assert_eq!(
        reg_at(&mut c, ALL).map_err(|e| e.errno).err(),
        Some(Errno::EFAULT),
        "pinned: refused"
    );
    let mr = reg_at(&mut c, odp).expect("on demand: accepted");
    let va = p as u64;
    // Not mapped yet: an access fails without a signal, as after an munmap.
    let span = |len, need| c.remote_span(pd, q, mr.rkey, va, len, need).unwrap();
    assert!(!span(64, Access::REMOTE_WRITE).write(0, &[7; 64]));
    // The program makes the first page writable: the device reaches it now.
    // SAFETY: this test's own mapping.
    assert_eq!(
        unsafe { libc::mprotect(p.cast(), PAGE, libc::PROT_READ | libc::PROT_WRITE) },
        0
    );
    assert!(span(64, Access::REMOTE_WRITE).write(0, &[7; 64]));
    // SAFETY: the page is mapped readable now.
    assert_eq!(unsafe { std::slice::from_raw_parts(p, 64) }, &[7u8; 64][..]);
    // The second still is not.
    assert!(!span(2 * PAGE, Access::REMOTE_READ).read(0, &mut vec![0u8; 2 * PAGE]));
    // Bounds and keys are checked as for any region.
    assert!(c
        .remote_span(
            pd,
            q,
            mr.rkey,
            va + PAGE as u64,
            2 * PAGE,
            Access::REMOTE_READ
        )
        .is_err());
    drop(c);
    // SAFETY: this test's own mapping; the context is dropped first.
    unsafe { libc::munmap(p.cast(), 2 * PAGE) };
}

#[test]
fn the_implicit_on_demand_region_reaches_any_address_of_the_process() {
    let mut a = vec![0u8; 256];
    let b: Vec<u8> = (0..=255).collect();
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let other = c.alloc_pd().unwrap();
    let q = 0x100;
    let implicit = ALL | Access::ON_DEMAND;
    // SAFETY: the implicit region names no memory of its own; this test reaches only its
    // own buffers through it.
    let reg = |c: &mut Context, ptr: *mut u8, len: usize, iova: u64, acc: Access| unsafe {
        c.reg_mr(pd, ptr, len, iova, acc).map_err(|e| e.errno)
    };
    // Only with ON_DEMAND (else the range wraps, EINVAL as the kernel's), at iova 0, not
    // zero-based.
    let null = std::ptr::null_mut();
    assert_eq!(reg(&mut c, null, usize::MAX, 0, ALL), Err(Errno::EINVAL));
    assert_eq!(
        reg(&mut c, null, usize::MAX, 4096, implicit),
        Err(Errno::EINVAL)
    );
    assert_eq!(
        reg(&mut c, null, usize::MAX, 0, implicit | Access::ZERO_BASED),
        Err(Errno::EINVAL)
    );
    let mr = reg(&mut c, null, usize::MAX, 0, implicit).unwrap();
    assert_eq!((mr.addr, mr.length), (0, u64::MAX));
    // A local gather from one buffer and a remote write into another, through one key.
    let sge = Sge {
        addr: b.as_ptr() as u64,
        length: 256,
        lkey: mr.lkey,
    };
    let mut out = [0u8; 256];
    c.gather(pd, std::slice::from_ref(&sge), 0, &mut out)
        .unwrap();
    assert_eq!(&out[..], &b[..]);
    let s = c
        .remote_span(
            pd,
            q,
            mr.rkey,
            a.as_mut_ptr() as u64 + 16,
            32,
            Access::REMOTE_WRITE,
        )
        .unwrap();
    assert!(s.write(0, &out[..32]));
    assert_eq!(&a[16..48], &b[..32]);
    assert!(a[..16].iter().chain(&a[48..]).all(|&x| x == 0));
    // Another PD's QP cannot use it; address 0 faults cleanly.
    assert!(c
        .remote_span(other, q, mr.rkey, a.as_ptr() as u64, 8, Access::REMOTE_READ)
        .is_err());
    let s = c
        .remote_span(pd, q, mr.rkey, 0, 8, Access::REMOTE_READ)
        .unwrap();
    assert!(!s.read(0, &mut [0u8; 8]));
    // It cannot be re-registered; a plain region cannot become one.
    // SAFETY: changes nothing (refused).
    let r = unsafe { c.rereg_mr(mr.lkey, Some(other), None, None) };
    assert_eq!(r.map_err(|e| e.errno), Err(Errno::EOPNOTSUPP));
    let plain = reg(&mut c, a.as_mut_ptr(), 256, a.as_ptr() as u64, ALL).unwrap();
    // SAFETY: refused, changes nothing.
    let r = unsafe {
        c.rereg_mr(
            plain.lkey,
            None,
            Some((null, usize::MAX, 0)),
            Some(implicit),
        )
    };
    assert_eq!(r.map_err(|e| e.errno), Err(Errno::EOPNOTSUPP));
    c.dereg_mr(mr.lkey).unwrap();
    drop(c);
    drop(a);
}

#[test]
fn advise_mr_checks_its_ranges_and_faults_pages_in() {
    const PAGE: usize = 4096;
    let mut plain_buf = [0u8; 64];
    let mut c = ctx();
    let pd = c.alloc_pd().unwrap();
    let other = c.alloc_pd().unwrap();
    let p = map(2 * PAGE, libc::PROT_READ | libc::PROT_WRITE);
    let ro = map(PAGE, libc::PROT_READ);
    // SAFETY: this test's own mappings and buffer, which outlive the context's use.
    let (odp, odp_ro, plain) = unsafe {
        (
            c.reg_mr(pd, p, 2 * PAGE, p as u64, ALL | Access::ON_DEMAND)
                .unwrap(),
            c.reg_mr(
                pd,
                ro,
                PAGE,
                ro as u64,
                Access::REMOTE_READ | Access::ON_DEMAND,
            )
            .unwrap(),
            c.reg_mr(pd, plain_buf.as_mut_ptr(), 64, 0, ALL | Access::ZERO_BASED)
                .unwrap(),
        )
    };
    let sge = |addr: *mut u8, length: usize, lkey| Sge {
        addr: addr as u64,
        length: length as u32,
        lkey,
    };
    let advise = |c: &Context, pd, advice, sges: &[Sge]| {
        c.advise_mr(pd, advice, sges)
            .and_then(|f| f.run())
            .map_err(|e| e.errno)
    };
    let whole = [sge(p, 2 * PAGE, odp.lkey)];
    for a in [
        Advice::Prefetch,
        Advice::PrefetchWrite,
        Advice::PrefetchNoFault,
    ] {
        assert_eq!(advise(&c, pd, a, &whole), Ok(()), "{a:?}");
    }
    // Faulting in writes nothing.
    // SAFETY: mapped readable.
    assert!(unsafe { std::slice::from_raw_parts(p, 2 * PAGE) }
        .iter()
        .all(|&x| x == 0));
    let efault = Err(Errno::EFAULT);
    assert_eq!(advise(&c, pd, Advice::Prefetch, &[]), Err(Errno::EINVAL));
    assert_eq!(
        advise(&c, other, Advice::Prefetch, &whole),
        efault,
        "other PD"
    );
    let past = [sge(p, 2 * PAGE + 1, odp.lkey)];
    assert_eq!(
        advise(&c, pd, Advice::Prefetch, &past),
        efault,
        "past the end"
    );
    let bad_key = [sge(p, 8, odp.lkey ^ 0x100)];
    assert_eq!(
        advise(&c, pd, Advice::Prefetch, &bad_key),
        efault,
        "no such key"
    );
    let pinned = [Sge {
        addr: 0,
        length: 8,
        lkey: plain.lkey,
    }];
    assert_eq!(
        advise(&c, pd, Advice::Prefetch, &pinned),
        efault,
        "not on demand"
    );
    let ro_sge = [sge(ro, PAGE, odp_ro.lkey)];
    assert_eq!(advise(&c, pd, Advice::Prefetch, &ro_sge), Ok(()));
    assert_eq!(
        advise(&c, pd, Advice::PrefetchWrite, &ro_sge),
        efault,
        "write without LOCAL_WRITE"
    );
    // A page gone since: reading it in fails; not faulting needs nothing of it.
    // SAFETY: this test's own mapping, reached only through the device's fault-safe copies.
    assert_eq!(unsafe { libc::munmap(p.add(PAGE).cast(), PAGE) }, 0);
    assert_eq!(advise(&c, pd, Advice::Prefetch, &whole), efault);
    assert_eq!(advise(&c, pd, Advice::PrefetchNoFault, &whole), Ok(()));
    drop(c);
    // SAFETY: this test's own mappings; the context is dropped first.
    unsafe {
        libc::munmap(p.cast(), PAGE);
        libc::munmap(ro.cast(), PAGE);
    }
}
