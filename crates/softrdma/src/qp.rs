//! Queue pairs, their connection helpers, and shared receive queues.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use softrdma_transport::verbs::{
    Access, Gid, Mtu, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, Qpn, RecvWr, SendWr,
    SrqId,
};

use crate::ah::ah_attr;
use crate::cq::{CompletionQueue, CqCharge, CqInner};
use crate::pd::{PdInner, ProtectionDomain};
use crate::pins::{self, WorkQueuePins};
use crate::{Error, ErrorKind, Result};

/// The default Q_Key of the UD helpers.
pub const DEFAULT_QKEY: u32 = 0x1111_1111;

/// What a queue pair is created with.
#[derive(Clone, Copy)]
pub struct QpInit<'a> {
    /// Transport type.
    pub qp_type: QpType,
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions.
    pub recv_cq: &'a CompletionQueue,
    /// Take receives from this SRQ.
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Queue sizes.
    pub cap: QpCap,
    /// Signal every send WR.
    pub sq_sig_all: bool,
}

impl<'a> QpInit<'a> {
    /// A QP of `qp_type` with one CQ for both queues, 64-deep queues, 4 SGEs, 64 bytes inline.
    /// The CQ must have room for both queues' 128 completions (see
    /// [`ProtectionDomain::create_qp`]); [`QpInit::depth`] sizes the queues otherwise.
    pub fn new(qp_type: QpType, cq: &'a CompletionQueue) -> QpInit<'a> {
        QpInit {
            qp_type,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 64,
                max_recv_wr: 64,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 64,
            },
            sq_sig_all: false,
        }
    }

    /// The same, with `send` and `recv` WRs deep queues (the CQs must hold them).
    pub fn depth(mut self, send: u32, recv: u32) -> QpInit<'a> {
        self.cap.max_send_wr = send;
        self.cap.max_recv_wr = recv;
        self
    }
}

/// What one side tells the other to connect a QP: GID, QP number and first PSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteQp {
    /// The peer's GID (index 0 of its device).
    pub gid: Gid,
    /// The peer's QP number.
    pub qpn: u32,
    /// The first PSN the peer sends with (our receive side expects it).
    pub psn: u32,
}

impl RemoteQp {
    /// Wire form for exchanging over a side channel: GID, QPN, PSN big-endian (24 bytes).
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..16].copy_from_slice(&self.gid.0);
        b[16..20].copy_from_slice(&self.qpn.to_be_bytes());
        b[20..].copy_from_slice(&self.psn.to_be_bytes());
        b
    }
    /// Parse [`RemoteQp::to_bytes`].
    pub fn from_bytes(b: &[u8; 24]) -> RemoteQp {
        let mut g = [0u8; 16];
        g.copy_from_slice(&b[..16]);
        let mut q = [0u8; 4];
        q.copy_from_slice(&b[16..20]);
        let mut p = [0u8; 4];
        p.copy_from_slice(&b[20..]);
        RemoteQp {
            gid: Gid(g),
            qpn: u32::from_be_bytes(q),
            psn: u32::from_be_bytes(p),
        }
    }
}

/// Path and retry parameters of the connection helpers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathOptions {
    /// Path MTU.
    pub mtu: Mtu,
    /// IP DSCP/ECN byte of the packets.
    pub traffic_class: u8,
    /// Hop limit / TTL.
    pub hop_limit: u8,
    /// Local ACK timeout code (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Retries on timeout or sequence NAK.
    pub retry_cnt: u8,
    /// Retries on RNR NAK (7 = infinite).
    pub rnr_retry: u8,
    /// RNR NAK timer code we advertise.
    pub min_rnr_timer: u8,
    /// Outstanding READ/atomic we issue.
    pub max_rd_atomic: u8,
    /// Outstanding READ/atomic we accept.
    pub max_dest_rd_atomic: u8,
}

impl Default for PathOptions {
    fn default() -> PathOptions {
        PathOptions {
            mtu: Mtu::Mtu1024,
            traffic_class: 0,
            hop_limit: 64,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
        }
    }
}

impl ProtectionDomain {
    /// Create a queue pair (in RESET).
    ///
    /// Its CQs must have room for what its queues can complete before the program polls:
    /// the `max_send_wr` of every QP reporting sends into a CQ plus the `max_recv_wr` of
    /// every QP reporting receives into it (for QPs taking receives from an SRQ, the SRQ's
    /// `max_wr`, once per CQ) must not exceed the CQ's capacity. A QP that would overcommit
    /// a CQ is refused with [`ErrorKind::InvalidArgument`]: the C face, like hardware,
    /// accepts it, and the overflow later loses completions and breaks the CQ. The rule
    /// bounds what completes between polls of a program that polls before reposting; one
    /// that keeps posting without polling can still overflow a CQ.
    ///
    /// ```
    /// use softrdma::{Device, ErrorKind, QpInit, QpType};
    /// # fn main() -> softrdma::Result<()> {
    /// let dev = Device::open_default()?;
    /// let pd = dev.alloc_pd()?;
    /// let cq = dev.create_cq(32, None)?;
    /// // 64 send and 64 receive WRs by default: more than the CQ holds.
    /// # assert!(cq.capacity() < 128);
    /// let e = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap_err();
    /// assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    /// // Queues of 8 and 8 fit, twice.
    /// let qp1 = pd.create_qp(&QpInit::new(QpType::Rc, &cq).depth(8, 8))?;
    /// let qp2 = pd.create_qp(&QpInit::new(QpType::Rc, &cq).depth(8, 8))?;
    /// # Ok(()) }
    /// ```
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<QueuePair> {
        QueuePair::create(self, init)
    }

    /// Create a shared receive queue.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        SharedReceiveQueue::create(self, max_wr, max_sge)
    }
}

/// A queue pair. Dropping it destroys it; posted WRs vanish without completions.
///
/// A QP is created in RESET and connected by moving it INIT → RTR → RTS, in one call
/// ([`QueuePair::connect`]) or step by step ([`QueuePair::to_init`],
/// [`QueuePair::to_rtr`], [`QueuePair::to_rts`]). What it accepts in each state:
///
/// | state | [`post_recv`](QueuePair::post_recv) | [`post_send`](QueuePair::post_send) |
/// |---|---|---|
/// | RESET | refused, [`ErrorKind::QpState`] | refused, [`ErrorKind::QpState`] |
/// | INIT, RTR | queued (messages arrive from RTR on) | refused, [`ErrorKind::QpState`] |
/// | RTS | queued | queued and started at once |
/// | SQD, SQE | queued | queued, started back in RTS |
/// | ERR | accepted, completes at once with WR_FLUSH_ERR | the same |
///
/// A full queue is [`ErrorKind::QueueFull`] in every state. Receives can be posted from
/// INIT on, so a program can have them in place before the peer sends; one posted after
/// [`QueuePair::connect`] works too, since a SEND that finds no receive is retried
/// (RNR, forever with the default [`PathOptions`]).
///
/// ```
/// use std::time::Duration;
/// use softrdma::{wr, Access, Device, ErrorKind, QpInit, QpState, QpType};
/// # fn main() -> softrdma::Result<()> {
/// let t = Duration::from_secs(5);
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let (a_cq, b_cq) = (dev.create_cq(128, None)?, dev.create_cq(128, None)?);
/// let a = pd.create_qp(&QpInit::new(QpType::Rc, &a_cq))?;
/// let b = pd.create_qp(&QpInit::new(QpType::Rc, &b_cq))?;
/// let mem = pd.register(4096, Access::LOCAL_WRITE)?;
/// assert_eq!(b.state()?, QpState::Reset);
/// let refused = b.post_recv(wr::recv(1, [mem.sge(0..64)?])).unwrap_err();
/// assert_eq!(refused.kind(), ErrorKind::QpState);
///
/// // b step by step, with a receive posted in INIT; a in one call.
/// b.to_init(Access::empty())?;
/// b.post_recv(wr::recv(1, [mem.sge(0..64)?]))?;
/// b.to_rtr(&a.local(7))?; // a sends from PSN 7
/// b.to_rts(9)?; // b sends from PSN 9
/// a.connect(&b.local(9), 7, Access::empty())?;
///
/// mem.write(100, b"ping")?;
/// a.post_send(wr::send(2, [mem.sge(100..104)?]))?;
/// a_cq.wait(t)?.result()?;
/// assert_eq!(b_cq.wait(t)?.byte_len, 4);
///
/// // A QP in ERROR (or any state) is reset and connected again, both sides, new PSNs.
/// a.to_error()?;
/// a.reset()?;
/// b.reset()?;
/// a.connect(&b.local(500), 300, Access::empty())?;
/// b.connect(&a.local(300), 500, Access::empty())?;
/// b.post_recv(wr::recv(3, [mem.sge(0..64)?]))?;
/// a.post_send(wr::send(4, [mem.sge(100..104)?]))?;
/// a_cq.wait(t)?.result()?;
/// assert_eq!(b_cq.wait(t)?.wr_id, 3);
/// # Ok(()) }
/// ```
pub struct QueuePair {
    pd: Arc<PdInner>,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    _srq: Option<Arc<SrqInner>>,
    /// Its reservations in its CQs, released once the QP is destroyed.
    charges: Vec<CqCharge>,
    qpn: Qpn,
    qp_type: QpType,
    cap: QpCap,
    /// The first PSN this QP sends with, chosen with the QP (and again on reset) so that
    /// [`QueuePair::endpoint`] and [`QueuePair::connect_to`] cannot disagree.
    psn: AtomicU32,
    /// The memory regions its outstanding send requests name, kept registered until
    /// their completions are polled (see `crate::pins`).
    sq_pins: Arc<WorkQueuePins>,
    /// The same for its own receive queue (unused with an SRQ, which has its own).
    rq_pins: Arc<WorkQueuePins>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn)
            .field("qp_type", &self.qp_type)
            .finish()
    }
}

impl QueuePair {
    pub(crate) fn create(pd: &ProtectionDomain, init: &QpInit<'_>) -> Result<QueuePair> {
        let dev = &pd.inner.dev;
        for cq in [init.send_cq, init.recv_cq] {
            if !Arc::ptr_eq(&cq.inner.dev.inner, &dev.inner) {
                return Err(
                    Error::invalid("CQ of another device").with_kind(ErrorKind::ForeignObject)
                );
            }
        }
        if let Some(s) = init.srq {
            if !Arc::ptr_eq(&s.pd.dev.inner, &dev.inner) {
                return Err(
                    Error::invalid("SRQ of another device").with_kind(ErrorKind::ForeignObject)
                );
            }
        }
        let attr = QpInitAttr {
            qp_type: init.qp_type,
            pd: pd.inner.id,
            send_cq: init.send_cq.inner.id,
            recv_cq: init.recv_cq.inner.id,
            srq: init.srq.map(|s| s.id),
            cap: init.cap,
            sq_sig_all: init.sq_sig_all,
        };
        let (qpn, cap) = dev.rt().create_qp(attr)?;
        let psn = dev.rt().random_psn();
        let charges = match Self::charge_cqs(init, &cap) {
            Ok(c) => c,
            Err(e) => {
                let _ = dev.rt().destroy_qp(qpn);
                return Err(e);
            }
        };
        let sq_pins = WorkQueuePins::new(true);
        let rq_pins = WorkQueuePins::new(true);
        init.send_cq.inner.queues.link(qpn, false, &sq_pins);
        let recv_pins = init.srq.map_or(&rq_pins, |s| &s.inner.pins);
        init.recv_cq.inner.queues.link(qpn, true, recv_pins);
        Ok(QueuePair {
            sq_pins,
            rq_pins,
            pd: Arc::clone(&pd.inner),
            _send_cq: Arc::clone(&init.send_cq.inner),
            _recv_cq: Arc::clone(&init.recv_cq.inner),
            _srq: init.srq.map(|s| Arc::clone(&s.inner_arc())),
            charges,
            qpn,
            qp_type: init.qp_type,
            cap,
            psn: AtomicU32::new(psn),
        })
    }

    /// Reserve the QP's queues (actual sizes `cap`) in its CQs; see
    /// [`ProtectionDomain::create_qp`].
    fn charge_cqs(init: &QpInit<'_>, cap: &QpCap) -> Result<Vec<CqCharge>> {
        let (send, recv) = (&init.send_cq.inner, &init.recv_cq.inner);
        let srq = match init.srq {
            Some(s) => {
                let (max_wr, _, _) = s.query()?;
                s.inner.note_cq(recv);
                Some((s.id, max_wr))
            }
            None => None,
        };
        let recv_wrs = if srq.is_some() {
            0
        } else {
            u64::from(cap.max_recv_wr)
        };
        let send_wrs = u64::from(cap.max_send_wr);
        if Arc::ptr_eq(send, recv) {
            return Ok(vec![send.charge(send_wrs + recv_wrs, srq)?]);
        }
        // A refusal of the second drops the first charge, which gives it back.
        let s = send.charge(send_wrs, None)?;
        let r = recv.charge(recv_wrs, srq)?;
        Ok(vec![s, r])
    }

    /// QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }
    /// Transport type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }
    /// Actual queue sizes.
    pub fn cap(&self) -> QpCap {
        self.cap
    }
    /// The first PSN this QP sends with (see [`QueuePair::endpoint`]).
    pub(crate) fn psn(&self) -> u32 {
        self.psn.load(Ordering::Relaxed)
    }
    /// The device of the QP.
    pub(crate) fn device(&self) -> &crate::Device {
        &self.pd.dev
    }
    /// What the peer needs to connect to this QP, given the PSN we will send with: the
    /// same `psn` this side then passes to [`QueuePair::connect`] (or
    /// [`QueuePair::to_rts`]) as its own. A mismatch is not detected at either call: the
    /// peer takes none of our packets, and our requests end in RETRY_EXC_ERR once the
    /// retries run out, which is why [`QueuePair::endpoint`] and
    /// [`QueuePair::connect_to`] carry the PSN the QP chose instead.
    #[deprecated(
        note = "use QueuePair::endpoint, which carries the PSN the QP chose, and connect_to"
    )]
    pub fn local(&self, psn: u32) -> RemoteQp {
        RemoteQp {
            gid: self.pd.dev.gid(),
            qpn: self.qpn,
            psn,
        }
    }

    /// Post a send work request. The requester runs now, in this thread.
    ///
    /// The QP must be in RTS (or SQD/SQE, where the request waits): before, it is
    /// [`ErrorKind::QpState`]; in ERR the request is accepted and completes at once with
    /// WR_FLUSH_ERR (see the table on [`QueuePair`]).
    ///
    /// Before anything is queued, every SGE must lie inside a live region of this QP's
    /// PD that grants the access the operation needs (LOCAL_WRITE where the device writes
    /// it: READ and atomic results): an lkey of no region (never registered, or dropped) is
    /// [`ErrorKind::NotFound`], a region of another PD [`ErrorKind::ForeignObject`], a
    /// range outside its region [`ErrorKind::OutOfBounds`], a missing right
    /// [`ErrorKind::PermissionDenied`]. The QP stays as it was. A NIC (and the C face)
    /// accepts such a WR and fails it in its completion with LOC_PROT_ERR, which moves the
    /// QP to ERROR; [`QueuePair::post_send_unvalidated`] does that here.
    ///
    /// With `SendFlags::INLINE`, the payload is copied at once from the SGEs, or taken from
    /// `wr.inline_data`.
    ///
    /// The request keeps every memory region its SGEs name registered until the
    /// completion that retires it is polled, so dropping the regions' handles meanwhile
    /// does not break it (see [`MemoryRegion`](crate::MemoryRegion#sharing-and-dropping)).
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        let qpn = self.qpn;
        let pins = pins::pin(&self.pd.dev, &wr.sg_list, true)?;
        pins::pin_window(&self.pd.dev, &wr.op);
        self.sq_pins.post(wr.wr_id, pins, || {
            Ok(self.pd.dev.rt().post_send_checked(qpn, wr)?)
        })
    }
    /// Post a send work request that only the device checks, when it executes it, as a NIC
    /// does: a bad SGE then completes with LOC_PROT_ERR (its [`WcDetail`](crate::WcDetail)
    /// says which check failed) and moves the QP to ERROR. For programs and tests that
    /// want the verbs behaviour; [`QueuePair::post_send`] refuses such a WR at the call.
    /// Memory stays safe either way: the device reaches only registered memory. The
    /// regions of this face its SGEs name are kept registered until its completion, as
    /// by [`QueuePair::post_send`]; an lkey of no such region (one dropped already, or
    /// made up) is the caller's to answer for, and fails in the completion.
    pub fn post_send_unvalidated(&self, wr: SendWr) -> Result<()> {
        let qpn = self.qpn;
        let pins = pins::pin(&self.pd.dev, &wr.sg_list, false)?;
        pins::pin_window(&self.pd.dev, &wr.op);
        self.sq_pins.post(wr.wr_id, pins, || {
            Ok(self.pd.dev.rt().post_send(qpn, wr)?)
        })
    }
    /// Post several send work requests in order; stops at the first error.
    pub fn post_send_all(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<()> {
        for wr in wrs {
            self.post_send(wr)?;
        }
        Ok(())
    }
    /// Post a receive work request, its SGEs checked as [`QueuePair::post_send`] checks
    /// them (the device writes them: LOCAL_WRITE), and the regions they name kept
    /// registered until its completion is polled, as there.
    ///
    /// Accepted in every state but RESET ([`ErrorKind::QpState`]): from INIT on, so that
    /// receives are in place before the peer sends; in ERR it completes at once with
    /// WR_FLUSH_ERR. A QP created with an SRQ takes its receives from there instead,
    /// and posting here is refused.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let qpn = self.qpn;
        let pins = pins::pin(&self.pd.dev, &wr.sg_list, true)?;
        self.rq_pins.post(wr.wr_id, pins, || {
            Ok(self.pd.dev.rt().post_recv_checked(qpn, wr)?)
        })
    }
    /// Post a receive work request that only the device checks, when a message arrives
    /// for it (see [`QueuePair::post_send_unvalidated`]).
    pub fn post_recv_unvalidated(&self, wr: RecvWr) -> Result<()> {
        let qpn = self.qpn;
        let pins = pins::pin(&self.pd.dev, &wr.sg_list, false)?;
        self.rq_pins.post(wr.wr_id, pins, || {
            Ok(self.pd.dev.rt().post_recv(qpn, wr)?)
        })
    }
    /// Modify attributes (`ibv_modify_qp`). To RESET, the QP's outstanding requests and
    /// its completions not yet polled go (see [`QueuePair::reset`]), and with them what
    /// they kept registered.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let qpn = self.qpn;
        self.pd.dev.rt().modify_qp(qpn, attr, mask)?;
        if mask.contains(QpAttrMask::STATE) && attr.qp_state == QpState::Reset {
            // An SRQ's receives are not the QP's: they stay, as do their completions.
            let released = (self.sq_pins.clear(), self.rq_pins.clear());
            drop(released);
        }
        Ok(())
    }
    /// Current attributes (`ibv_query_qp`).
    pub fn query(&self) -> Result<QpAttr> {
        let qpn = self.qpn;
        self.pd.dev.rt().query_qp(qpn).map_err(Error::from)
    }
    /// Current state.
    pub fn state(&self) -> Result<QpState> {
        Ok(self.query()?.qp_state)
    }

    /// RESET → INIT granting `access` to the peer (RC/UC), or with `qkey` (UD; `access` unused).
    pub fn to_init(&self, access: Access) -> Result<()> {
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            pkey_index: 0,
            qp_access_flags: access,
            qkey: DEFAULT_QKEY,
            ..Default::default()
        };
        let mut mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
        match self.qp_type {
            QpType::Ud => mask |= QpAttrMask::QKEY,
            _ => mask |= QpAttrMask::ACCESS_FLAGS,
        }
        a.cur_qp_state = QpState::Reset;
        self.modify(&a, mask)
    }
    /// INIT → RTR towards `remote` with default path options.
    pub fn to_rtr(&self, remote: &RemoteQp) -> Result<()> {
        self.to_rtr_with(remote, &PathOptions::default())
    }
    /// INIT → RTR towards `remote` (for UD `remote` is ignored).
    pub fn to_rtr_with(&self, remote: &RemoteQp, o: &PathOptions) -> Result<()> {
        let mut a = QpAttr {
            qp_state: QpState::Rtr,
            ..Default::default()
        };
        let mut mask = QpAttrMask::STATE;
        if self.qp_type != QpType::Ud {
            a.path_mtu = o.mtu;
            a.dest_qp_num = remote.qpn;
            a.rq_psn = remote.psn;
            a.ah_attr = ah_attr(remote.gid, o.traffic_class);
            a.ah_attr.grh.hop_limit = o.hop_limit;
            mask |=
                QpAttrMask::AV | QpAttrMask::PATH_MTU | QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN;
            if self.qp_type == QpType::Rc {
                a.max_dest_rd_atomic = o.max_dest_rd_atomic;
                a.min_rnr_timer = o.min_rnr_timer;
                mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
            }
        }
        self.modify(&a, mask)
    }
    /// RTR → RTS sending from `psn` with default options.
    pub fn to_rts(&self, psn: u32) -> Result<()> {
        self.to_rts_with(psn, &PathOptions::default())
    }
    /// RTR → RTS sending from `psn`.
    pub fn to_rts_with(&self, psn: u32, o: &PathOptions) -> Result<()> {
        let a = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: psn,
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
            max_rd_atomic: o.max_rd_atomic,
            ..Default::default()
        };
        let mut mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN;
        if self.qp_type == QpType::Rc {
            mask |= QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC;
        }
        self.modify(&a, mask)
    }
    /// RESET → INIT → RTR → RTS to `remote`, sending from `local_psn`, granting `access`.
    /// A QP that was connected before (or went to ERROR) is [`QueuePair::reset`] first.
    /// For a peer that sent its own PSN in a format of its own; with [`Endpoint`]s,
    /// [`QueuePair::connect_to`] sends from the PSN the QP gave the peer.
    ///
    /// [`Endpoint`]: crate::Endpoint
    pub fn connect(&self, remote: &RemoteQp, local_psn: u32, access: Access) -> Result<()> {
        self.connect_with(remote, local_psn, access, &PathOptions::default())
    }
    /// [`QueuePair::connect`] with path options.
    pub fn connect_with(
        &self,
        remote: &RemoteQp,
        local_psn: u32,
        access: Access,
        o: &PathOptions,
    ) -> Result<()> {
        self.to_init(access)?;
        self.to_rtr_with(remote, o)?;
        self.to_rts_with(local_psn, o)
    }
    /// Move to ERR: every outstanding WR completes with a flush error.
    pub fn to_error(&self) -> Result<()> {
        let a = QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        };
        self.modify(&a, QpAttrMask::STATE)
    }
    /// Bring the QP back to RESET, from ERROR or any other state, so that it can be
    /// connected again ([`QueuePair::connect`]) instead of replaced. A QP not yet in
    /// ERROR or RESET goes through ERROR first, which flushes its outstanding work
    /// requests; its completions not yet polled, the flushed ones included, are then
    /// cleaned out of its CQs, as a NIC cleans them on the way to RESET: to see the
    /// flushed work requests, call [`to_error`](QueuePair::to_error) first and poll them. The peer's QP must
    /// be reset and connected again too, with new PSNs, as after any reconnection.
    pub fn reset(&self) -> Result<()> {
        match self.state()? {
            QpState::Reset => return Ok(()),
            QpState::Err => {}
            _ => self.to_error()?,
        }
        let a = QpAttr {
            qp_state: QpState::Reset,
            ..Default::default()
        };
        self.modify(&a, QpAttrMask::STATE)?;
        // A new connection, a new first PSN: packets of the old one still in flight
        // must not fall in the new one's window.
        let psn = self.device().rt().random_psn();
        self.psn.store(psn, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let qpn = self.qpn;
        // Completions of this QP still in its CQs release nothing once it is gone; its
        // pins go with it, below.
        self._send_cq.queues.unlink(qpn, &self.sq_pins);
        self._recv_cq.queues.unlink(qpn, &self.sq_pins);
        let _ = self.pd.dev.rt().destroy_qp(qpn);
        // Only now can the queues no longer complete anything into the CQs.
        self.charges.clear();
        // The device no longer reaches what the QP's requests named: their pins are
        // released as the fields drop, after this and outside any lock.
    }
}

pub(crate) struct SrqInner {
    pd: Arc<PdInner>,
    id: SrqId,
    /// The CQs its QPs report receives into, to check them when `max_wr` grows. Weak:
    /// a CQ no QP of the SRQ uses any more must stay free to go.
    cqs: Mutex<Vec<Weak<CqInner>>>,
    /// The memory regions its posted receives name, until their completions are polled.
    pins: Arc<WorkQueuePins>,
}

impl SrqInner {
    fn cqs(&self) -> std::sync::MutexGuard<'_, Vec<Weak<CqInner>>> {
        self.cqs.lock().unwrap_or_else(PoisonError::into_inner)
    }
    /// Remember that a QP of the SRQ reports receives into `cq`.
    fn note_cq(&self, cq: &Arc<CqInner>) {
        let mut v = self.cqs();
        v.retain(|w| w.strong_count() > 0);
        if !v.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(cq))) {
            v.push(Arc::downgrade(cq));
        }
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.pd.dev.rt().destroy_srq(id);
    }
}

/// A shared receive queue. Cheap to clone (shared); QPs using it keep it alive.
///
/// QPs created with it ([`QpInit::srq`]) take their receives from it, in the order
/// posted, instead of from queues of their own (their own [`QueuePair::post_recv`] is
/// refused), so a server with many connections keeps one pool of receive buffers.
///
/// ```
/// use std::time::Duration;
/// use softrdma::{wr, Access, Device, QpInit, QpType};
/// # fn main() -> softrdma::Result<()> {
/// let dev = Device::open_default()?;
/// let pd = dev.alloc_pd()?;
/// let srq = pd.create_srq(16, 1)?;
/// // The server's CQ holds the SRQ's 16 receives (counted once) and 1 send per QP.
/// let server_cq = dev.create_cq(18, None)?;
/// let server_init = QpInit {
///     srq: Some(&srq),
///     ..QpInit::new(QpType::Rc, &server_cq).depth(1, 1)
/// };
/// let client_cq = dev.create_cq(16, None)?;
/// let client_init = QpInit::new(QpType::Rc, &client_cq).depth(4, 1);
/// let mem = pd.register(4096, Access::LOCAL_WRITE)?;
/// for i in 0..2u64 {
///     let at = 64 * i as usize;
///     srq.post_recv(wr::recv(i, [mem.sge(at..at + 64)?]))?;
/// }
/// let mut pairs = Vec::new();
/// for _ in 0..2 {
///     let (s, c) = (pd.create_qp(&server_init)?, pd.create_qp(&client_init)?);
///     s.connect(&c.local(0), 0, Access::empty())?;
///     c.connect(&s.local(0), 0, Access::empty())?;
///     pairs.push((s, c));
/// }
/// for (_, c) in &pairs {
///     c.post_send(wr::send(9, [mem.sge(1024..1032)?]))?;
/// }
/// let wcs = server_cq.wait_n(2, Duration::from_secs(5))?;
/// assert_ne!(wcs[0].qp_num, wcs[1].qp_num); // one receive from the pool each
/// assert!(srq.is_empty()?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
    pd: Arc<PdInner>,
    id: SrqId,
}

impl SharedReceiveQueue {
    pub(crate) fn create(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<Self> {
        let p = pd.inner.id;
        let id = pd.inner.dev.rt().create_srq(p, max_wr, max_sge, 0)?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                pd: Arc::clone(&pd.inner),
                id,
                cqs: Mutex::new(Vec::new()),
                pins: WorkQueuePins::new(false),
            }),
            pd: Arc::clone(&pd.inner),
            id,
        })
    }
    fn inner_arc(&self) -> Arc<SrqInner> {
        Arc::clone(&self.inner)
    }
    /// The verbs handle.
    pub fn id(&self) -> SrqId {
        self.id
    }
    /// Post a receive work request, its SGEs checked against the SRQ's PD as
    /// [`QueuePair::post_recv`] checks them, and the regions they name kept registered
    /// until the completion of the receive is polled (or the SRQ is dropped).
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let id = self.id;
        let pins = pins::pin(&self.pd.dev, &wr.sg_list, true)?;
        self.inner.pins.post(wr.wr_id, pins, || {
            Ok(self.pd.dev.rt().post_srq_recv_checked(id, wr)?)
        })
    }
    /// Post a receive work request that only the device checks, when a message arrives
    /// for it (see [`QueuePair::post_send_unvalidated`]).
    pub fn post_recv_unvalidated(&self, wr: RecvWr) -> Result<()> {
        let id = self.id;
        let pins = pins::pin(&self.pd.dev, &wr.sg_list, false)?;
        self.inner.pins.post(wr.wr_id, pins, || {
            Ok(self.pd.dev.rt().post_srq_recv(id, wr)?)
        })
    }
    /// Grow `max_wr` and/or arm the limit event (`ibv_modify_srq`). A larger `max_wr`
    /// must still fit the CQs its QPs report receives into (see
    /// [`ProtectionDomain::create_qp`]): [`ErrorKind::InvalidArgument`] otherwise.
    pub fn modify(&self, max_wr: Option<u32>, limit: Option<u32>) -> Result<()> {
        let id = self.id;
        let cqs: Vec<Arc<CqInner>> = self.inner.cqs().iter().filter_map(Weak::upgrade).collect();
        let mut grown = Vec::new();
        let undo = |grown: &[(&Arc<CqInner>, u32)]| {
            for (cq, old) in grown {
                let _ = cq.resize_srq(id, *old);
            }
        };
        if let Some(n) = max_wr {
            for cq in &cqs {
                match cq.resize_srq(id, n) {
                    Ok(Some(old)) => grown.push((cq, old)),
                    Ok(None) => {}
                    Err(e) => {
                        undo(&grown);
                        return Err(e);
                    }
                }
            }
        }
        let r = self
            .pd
            .dev
            .rt()
            .modify_srq(id, max_wr, limit)
            .map_err(Error::from);
        if r.is_err() {
            undo(&grown);
        }
        r
    }
    /// (max_wr, max_sge, limit).
    pub fn query(&self) -> Result<(u32, u32, u32)> {
        let id = self.id;
        self.pd.dev.rt().query_srq(id).map_err(Error::from)
    }
    /// Receive WRs currently posted.
    pub fn len(&self) -> Result<usize> {
        let id = self.id;
        self.pd.dev.rt().srq_len(id).map_err(Error::from)
    }
    /// Whether no receive WR is posted.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}
