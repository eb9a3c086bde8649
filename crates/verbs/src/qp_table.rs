//! The QP state transition table: which transitions are legal and which attributes each
//! requires or allows, per QP type. Transcribed (as facts) from the table Linux applies in
//! `ib_modify_qp_is_ok` (drivers/infiniband/core/verbs.c) for RC, UC and UD.

use crate::types::{QpAttrMask as M, QpState, QpType};

/// (required, optional) attribute masks of the transition `cur → next` for `t`, or None if
/// the transition is not legal. `STATE` is always allowed on top of these.
pub(crate) fn transition(cur: QpState, next: QpState, t: QpType) -> Option<(M, M)> {
    use QpState::*;
    use QpType::*;
    let none = M::empty();
    Some(match (cur, next) {
        (_, Reset) | (_, Err) => (none, none),
        (Reset, Init) => match t {
            Ud => (M::PKEY_INDEX | M::PORT | M::QKEY, none),
            Uc | Rc => (M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none),
        },
        (Init, Init) => match t {
            Ud => (none, M::PKEY_INDEX | M::PORT | M::QKEY),
            Uc | Rc => (none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
        },
        (Init, Rtr) => match t {
            Ud => (none, M::PKEY_INDEX | M::QKEY),
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
        },
        (Rtr, Rts) => match t {
            Ud => (M::SQ_PSN, M::CUR_STATE | M::QKEY),
            Uc => (
                M::SQ_PSN,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
            ),
            Rc => (
                M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
            ),
        },
        (Rts, Rts) | (Sqd, Rts) => match t {
            Ud => (none, M::CUR_STATE | M::QKEY),
            Uc => (
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
            ),
            Rc => (
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
            ),
        },
        (Rts, Sqd) => (none, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => match t {
            Ud => (none, M::PKEY_INDEX | M::QKEY),
            Uc => (
                none,
                M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
            ),
            Rc => (
                none,
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
                    | M::PATH_MIG_STATE,
            ),
        },
        // Legal for every type in the kernel's table; RC lists no attributes (an RC QP
        // never enters SQE through a modify).
        (Sqe, Rts) => match t {
            Ud => (none, M::CUR_STATE | M::QKEY),
            Uc => (none, M::CUR_STATE | M::ACCESS_FLAGS),
            Rc => (none, none),
        },
        _ => return None,
    })
}
