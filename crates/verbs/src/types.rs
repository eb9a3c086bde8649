//! The vocabulary of verbs: flags, states, work requests, work completions, attributes.
//! Numeric values follow `<infiniband/verbs.h>` so the C face can convert by value.

use bitflags::bitflags;

/// Handle of a protection domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PdId(pub u32);
/// Handle of a completion queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CqId(pub u32);
/// Handle of a completion channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelId(pub u32);
/// Handle of a shared receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SrqId(pub u32);
/// Handle of an address handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AhId(pub u32);
/// Handle of a memory window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MwId(pub u32);
/// Handle of a device-memory allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DmId(pub u32);
/// A QP is named by its 24-bit number.
pub type Qpn = u32;

bitflags! {
    /// Memory access rights (`IBV_ACCESS_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        /// Local writes by the device (receives, READ responses, atomic results).
        const LOCAL_WRITE = 1;
        /// Remote RDMA WRITE.
        const REMOTE_WRITE = 1 << 1;
        /// Remote RDMA READ.
        const REMOTE_READ = 1 << 2;
        /// Remote atomics.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory windows may be bound to the region.
        const MW_BIND = 1 << 4;
        /// Addresses are offsets from 0 rather than virtual addresses.
        const ZERO_BASED = 1 << 5;
        /// On-demand paging: the memory need not be backed when it is registered; the
        /// device reaches each page as it touches it, and an access to memory the process
        /// does not map then fails as such. With a null address and a length of
        /// `usize::MAX`, the region is implicit: the whole address space.
        const ON_DEMAND = 1 << 6;
    }
}

bitflags! {
    /// Send work request flags (`IBV_SEND_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for all prior READs and atomics to complete before starting.
        const FENCE = 1;
        /// Generate a completion.
        const SIGNALED = 1 << 1;
        /// Set the solicited-event bit.
        const SOLICITED = 1 << 2;
        /// Copy the payload at post time; the SGEs' lkeys are not checked.
        const INLINE = 1 << 3;
    }
}

bitflags! {
    /// Work completion flags (`IBV_WC_*` flags).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u32 {
        /// A 40-byte GRH precedes the data (UD).
        const GRH = 1;
        /// `imm_data` is valid.
        const WITH_IMM = 1 << 1;
        /// IP checksum verified.
        const IP_CSUM_OK = 1 << 2;
        /// `imm_data` holds the invalidated rkey.
        const WITH_INV = 1 << 3;
    }
}

bitflags! {
    /// Which fields of [`QpAttr`] a modify applies (`IBV_QP_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// `qp_state`.
        const STATE = 1;
        /// `cur_qp_state`.
        const CUR_STATE = 1 << 1;
        /// `en_sqd_async_notify`.
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// `qp_access_flags`.
        const ACCESS_FLAGS = 1 << 3;
        /// `pkey_index`.
        const PKEY_INDEX = 1 << 4;
        /// `port_num`.
        const PORT = 1 << 5;
        /// `qkey`.
        const QKEY = 1 << 6;
        /// `ah_attr`.
        const AV = 1 << 7;
        /// `path_mtu`.
        const PATH_MTU = 1 << 8;
        /// `timeout`.
        const TIMEOUT = 1 << 9;
        /// `retry_cnt`.
        const RETRY_CNT = 1 << 10;
        /// `rnr_retry`.
        const RNR_RETRY = 1 << 11;
        /// `rq_psn`.
        const RQ_PSN = 1 << 12;
        /// `max_rd_atomic`.
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// `alt_ah_attr` and friends.
        const ALT_PATH = 1 << 14;
        /// `min_rnr_timer`.
        const MIN_RNR_TIMER = 1 << 15;
        /// `sq_psn`.
        const SQ_PSN = 1 << 16;
        /// `max_dest_rd_atomic`.
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// `path_mig_state`.
        const PATH_MIG_STATE = 1 << 18;
        /// `cap`.
        const CAP = 1 << 19;
        /// `dest_qp_num`.
        const DEST_QPN = 1 << 20;
    }
}

/// Queue pair transport type (`IBV_QPT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum QpType {
    /// Reliable connected.
    Rc = 2,
    /// Unreliable connected.
    Uc = 3,
    /// Unreliable datagram.
    Ud = 4,
}

/// Queue pair state (`IBV_QPS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum QpState {
    /// Just created or reset.
    #[default]
    Reset = 0,
    /// Initialised: may post receives.
    Init = 1,
    /// Ready to receive.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Send queue drained.
    Sqd = 4,
    /// Send queue error (UC/UD).
    Sqe = 5,
    /// Error: everything flushes.
    Err = 6,
}

/// Path MTU (`IBV_MTU_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(u32)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    #[default]
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// Bytes of payload per packet.
    pub fn bytes(self) -> usize {
        128 << (self as u32)
    }
    /// From its byte count (256, 512, 1024, 2048 or 4096), as a user or a peer states
    /// it: the one parser of MTUs in bytes, so that every face accepts the same ones.
    pub fn from_bytes(n: u32) -> Option<Mtu> {
        Some(match n {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }
    /// From the `IBV_MTU_*` value.
    pub fn from_raw(v: u32) -> Option<Mtu> {
        Some(match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }
}

/// A 128-bit global identifier; for RoCEv2 an IPv6 address or an IPv4-mapped one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4-mapped GID `::ffff:a.b.c.d`.
    pub fn from_ipv4(ip: std::net::Ipv4Addr) -> Gid {
        Gid(ip.to_ipv6_mapped().octets())
    }
    /// The GID as an IP address (IPv4 if it is IPv4-mapped).
    pub fn to_ip(self) -> std::net::IpAddr {
        std::net::Ipv6Addr::from(self.0).to_canonical()
    }
    /// Whether this is a multicast GID, as the kernel's `rdma_is_multicast_addr` decides:
    /// an IPv6 multicast address (first byte 0xFF), or the IPv4-mapped form of an IPv4
    /// multicast address (224.0.0.0/4), which is what RoCEv2 uses for IPv4 groups.
    pub fn is_multicast(self) -> bool {
        self.to_ip().is_multicast()
    }
    /// The GID of an IP address.
    pub fn from_ip(ip: std::net::IpAddr) -> Gid {
        match ip {
            std::net::IpAddr::V4(v4) => Gid::from_ipv4(v4),
            std::net::IpAddr::V6(v6) => Gid(v6.octets()),
        }
    }
}

/// Global routing part of an address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GlobalRoute {
    /// Destination GID.
    pub dgid: Gid,
    /// IPv6 flow label.
    pub flow_label: u32,
    /// Index of the source GID in our GID table.
    pub sgid_index: u8,
    /// Hop limit / TTL.
    pub hop_limit: u8,
    /// Traffic class: goes into the IP DSCP/ECN byte.
    pub traffic_class: u8,
}

/// An address vector (`ibv_ah_attr`). RoCE requires `is_global`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    /// Global route (required on RoCE).
    pub grh: GlobalRoute,
    /// Destination LID (unused on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// Whether `grh` is valid.
    pub is_global: bool,
    /// Local port number (1).
    pub port_num: u8,
}

impl AhAttr {
    /// The RoCE address vector towards `dgid` from our GID at `sgid_index`, on port 1:
    /// a global route with hop limit 64, flow label and traffic class 0, and no LID.
    pub fn roce(dgid: Gid, sgid_index: u8) -> AhAttr {
        AhAttr {
            grh: GlobalRoute {
                dgid,
                sgid_index,
                hop_limit: 64,
                ..Default::default()
            },
            is_global: true,
            port_num: 1,
            ..Default::default()
        }
    }
}

/// Queue sizes (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send WR.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive WR.
    pub max_recv_sge: u32,
    /// Bytes that may be posted inline.
    pub max_inline_data: u32,
}

/// What a QP is created with (`ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInitAttr {
    /// Transport type.
    pub qp_type: QpType,
    /// Protection domain.
    pub pd: PdId,
    /// CQ for send completions.
    pub send_cq: CqId,
    /// CQ for receive completions.
    pub recv_cq: CqId,
    /// Receives come from this SRQ instead of the QP's own queue.
    pub srq: Option<SrqId>,
    /// Requested sizes; the created QP reports the actual ones.
    pub cap: QpCap,
    /// Every send WR is signaled.
    pub sq_sig_all: bool,
}

/// QP attributes (`ibv_qp_attr`); which ones apply is given by a [`QpAttrMask`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// Target state.
    pub qp_state: QpState,
    /// Assumed current state.
    pub cur_qp_state: QpState,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Expected PSN of the next incoming request.
    pub rq_psn: u32,
    /// PSN of the next outgoing request.
    pub sq_psn: u32,
    /// Remote QP number (RC/UC).
    pub dest_qp_num: u32,
    /// Remote access rights granted by this QP.
    pub qp_access_flags: Access,
    /// Queue sizes.
    pub cap: QpCap,
    /// Primary path.
    pub ah_attr: AhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Async event when the SQ has drained.
    pub en_sqd_async_notify: bool,
    /// Whether the SQ is draining (query only).
    pub sq_draining: bool,
    /// Outstanding READ/atomic requests this QP may issue.
    pub max_rd_atomic: u8,
    /// Outstanding READ/atomic requests this QP accepts.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (5 bits) this QP advertises.
    pub min_rnr_timer: u8,
    /// Port number.
    pub port_num: u8,
    /// Local ACK timeout code: 4.096 µs × 2^timeout, 0 = infinite.
    pub timeout: u8,
    /// Retries on timeout or sequence NAK (0..=7).
    pub retry_cnt: u8,
    /// Retries on RNR NAK (0..=7; 7 = infinite).
    pub rnr_retry: u8,
}

/// One scatter/gather element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address in the MR's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the MR.
    pub lkey: u32,
}

/// Destination of a UD send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    /// Address handle.
    pub ah: AhId,
    /// Remote QP number.
    pub remote_qpn: u32,
    /// Remote Q_Key (if the high bit is set, the QP's own Q_Key is used).
    pub remote_qkey: u32,
}

/// Binding of a memory window (`ibv_mw_bind_info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MwBind {
    /// The window.
    pub mw: MwId,
    /// New rkey for a type-2 window (its low 8 bits are the key the consumer chose).
    pub rkey: u32,
    /// Region the window sits in (by lkey).
    pub mr_lkey: u32,
    /// Start address.
    pub addr: u64,
    /// Length.
    pub length: u64,
    /// Remote rights the window grants.
    pub access: Access,
}

/// The operation of a send work request, with its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendWithImm {
        /// Immediate data (host order; big-endian on the wire).
        imm: u32,
    },
    /// SEND that invalidates a remote rkey.
    SendWithInv {
        /// Rkey to invalidate at the responder.
        invalidate_rkey: u32,
    },
    /// RDMA WRITE.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE with immediate data (consumes a receive WR).
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// RDMA READ.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// 64-bit compare and swap.
    CompareSwap {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Compare value.
        compare: u64,
        /// Swap value.
        swap: u64,
    },
    /// 64-bit fetch and add.
    FetchAdd {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Value to add.
        add: u64,
    },
    /// Invalidate a local key.
    LocalInv {
        /// The key.
        rkey: u32,
    },
    /// Bind a type-2 memory window.
    BindMw(MwBind),
}

/// `IBV_WR_*` opcode numbers.
impl SendOp {
    /// The `ibv_wr_opcode` value.
    pub fn raw_opcode(&self) -> u32 {
        match self {
            SendOp::Write { .. } => 0,
            SendOp::WriteWithImm { .. } => 1,
            SendOp::Send => 2,
            SendOp::SendWithImm { .. } => 3,
            SendOp::Read { .. } => 4,
            SendOp::CompareSwap { .. } => 5,
            SendOp::FetchAdd { .. } => 6,
            SendOp::LocalInv { .. } => 7,
            SendOp::BindMw(_) => 8,
            SendOp::SendWithInv { .. } => 9,
        }
    }
    /// The completion opcode this WR completes with.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => {
                WcOpcode::Send
            }
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::LocalInv { .. } => WcOpcode::LocalInv,
            SendOp::BindMw(_) => WcOpcode::BindMw,
        }
    }
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Consumer cookie, returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Flags.
    pub flags: SendFlags,
    /// Local buffers (gather for sends/writes, scatter for READ and atomics' result).
    /// With `inline_data`, the gather list the bytes were taken from: its lengths must add
    /// up to the data's, and its addresses and keys are never read.
    pub sg_list: Vec<Sge>,
    /// The payload of an inline send or write, given by value (implies `SendFlags::INLINE`).
    ///
    /// A face that receives inline data as raw pointers (the C ABI) copies it here, so the
    /// engine only ever reads registered memory. Without it, an INLINE work request is
    /// gathered from registered memory through `sg_list`'s lkeys at post time.
    pub inline_data: Option<Vec<u8>>,
    /// UD destination.
    pub ud: Option<UdDest>,
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Consumer cookie.
    pub wr_id: u64,
    /// Scatter list.
    pub sg_list: Vec<Sge>,
}

/// Completion status (`IBV_WC_*` status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum WcStatus {
    /// Success.
    #[default]
    Success = 0,
    /// Local length error: a message did not fit the receive buffer, or SGEs exceed limits.
    LocLenErr = 1,
    /// Local QP operation error.
    LocQpOpErr = 2,
    /// Local EEC operation error.
    LocEecOpErr = 3,
    /// Local protection error: bad lkey, bounds or access.
    LocProtErr = 4,
    /// Flushed because the QP is in the error state.
    WrFlushErr = 5,
    /// Memory window bind error.
    MwBindErr = 6,
    /// Bad response.
    BadRespErr = 7,
    /// Local access error.
    LocAccessErr = 8,
    /// Remote invalid request.
    RemInvReqErr = 9,
    /// Remote access error.
    RemAccessErr = 10,
    /// Remote operation error.
    RemOpErr = 11,
    /// Transport retry counter exceeded.
    RetryExcErr = 12,
    /// RNR retry counter exceeded.
    RnrRetryExcErr = 13,
    /// Local RDD violation.
    LocRddViolErr = 14,
    /// Remote invalid RD request.
    RemInvRdReqErr = 15,
    /// Remote aborted.
    RemAbortErr = 16,
    /// Invalid EEC number.
    InvEecnErr = 17,
    /// Invalid EEC state.
    InvEecStateErr = 18,
    /// Fatal error.
    FatalErr = 19,
    /// Response timeout.
    RespTimeoutErr = 20,
    /// General error.
    GeneralErr = 21,
}

impl WcStatus {
    /// The text `ibv_wc_status_str` gives.
    pub fn as_str(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocEecOpErr => "local EE context operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::MwBindErr => "memory management operation error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::LocRddViolErr => "local RDD violation error",
            WcStatus::RemInvRdReqErr => "remote invalid RD request",
            WcStatus::RemAbortErr => "operation aborted",
            WcStatus::InvEecnErr => "invalid EE context number",
            WcStatus::InvEecStateErr => "invalid EE context state",
            WcStatus::FatalErr => "fatal error",
            WcStatus::RespTimeoutErr => "response timeout error",
            WcStatus::GeneralErr => "general error",
        }
    }
}

impl core::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::error::Error for WcStatus {}

/// Why a work request failed, beyond its status: the `vendor_err` of its completion (the C
/// face's `ibv_wc.vendor_err` carries the same number, as a hardware syndrome would).
///
/// The codes are stable. Local causes (below 0x100) are known exactly, from the check that
/// failed here. Remote causes (0x100 and up) are what the peer answered: the wire carries a
/// NAK code, not which of the peer's checks failed, so a remote access error stays one
/// code whether the rkey was unknown, of another PD, lacking a right or out of bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
#[repr(u32)]
pub enum WcDetail {
    /// No detail: a success, a flushed request, or a cause with nothing to add to its
    /// status.
    #[default]
    Unspecified = 0,
    /// An SGE's lkey names no memory region: never registered, or deregistered since
    /// (the region was dropped while the request was outstanding).
    UnknownLkey = 1,
    /// An SGE's memory region belongs to another protection domain than the QP's.
    WrongPd = 2,
    /// An SGE reaches outside its memory region's bounds.
    SgeOutOfBounds = 3,
    /// An SGE's memory region lacks the access the device needs (LOCAL_WRITE to place a
    /// received message, a READ's data or an atomic's result).
    LocalAccess = 4,
    /// The memory behind a region was unmapped or protected after registration: the copy
    /// stopped at the fault instead of crashing the program.
    MemoryFault = 5,
    /// The message is longer than the scatter list of the receive (or its data longer
    /// than the request's SGEs).
    MessageTooLong = 6,
    /// The peer NAKed the request as invalid (an opcode it does not take, a SEND longer
    /// than its receive buffer, a malformed packet).
    RemoteInvalidRequest = 0x101,
    /// The peer NAKed the request's remote access: its rkey check failed (unknown or
    /// invalidated rkey, another PD, a missing right, out of bounds, a misaligned
    /// atomic), or its QP does not allow the operation.
    RemoteAccess = 0x102,
    /// The peer NAKed the request as failed on its side (for example its receive WQE's
    /// memory failed a local check).
    RemoteOperational = 0x103,
    /// The peer NAKed a READ or atomic as exceeding what it accepts outstanding.
    RemoteInvalidRdRequest = 0x104,
    /// The peer did not answer within the transport retries (timeout or lost packets).
    RetryExceeded = 0x105,
    /// The peer kept answering "receiver not ready" (no receive posted) past the RNR
    /// retries.
    RnrRetryExceeded = 0x106,
}

impl WcDetail {
    /// The numeric code, as `vendor_err` carries it.
    pub const fn code(self) -> u32 {
        self as u32
    }
    /// The detail a `vendor_err` code stands for; None for a code this version does not
    /// know.
    pub const fn from_code(code: u32) -> Option<WcDetail> {
        Some(match code {
            0 => WcDetail::Unspecified,
            1 => WcDetail::UnknownLkey,
            2 => WcDetail::WrongPd,
            3 => WcDetail::SgeOutOfBounds,
            4 => WcDetail::LocalAccess,
            5 => WcDetail::MemoryFault,
            6 => WcDetail::MessageTooLong,
            0x101 => WcDetail::RemoteInvalidRequest,
            0x102 => WcDetail::RemoteAccess,
            0x103 => WcDetail::RemoteOperational,
            0x104 => WcDetail::RemoteInvalidRdRequest,
            0x105 => WcDetail::RetryExceeded,
            0x106 => WcDetail::RnrRetryExceeded,
            _ => return None,
        })
    }
    /// What it means, in words.
    pub const fn as_str(self) -> &'static str {
        match self {
            WcDetail::Unspecified => "no detail",
            WcDetail::UnknownLkey => "lkey of no registered memory region",
            WcDetail::WrongPd => "memory region of another protection domain",
            WcDetail::SgeOutOfBounds => "SGE outside its memory region",
            WcDetail::LocalAccess => "memory region lacks the access needed",
            WcDetail::MemoryFault => "memory unmapped or protected since registration",
            WcDetail::MessageTooLong => "message longer than the scatter list",
            WcDetail::RemoteInvalidRequest => "the peer NAKed an invalid request",
            WcDetail::RemoteAccess => "the peer NAKed a remote access",
            WcDetail::RemoteOperational => "the peer NAKed an operational error",
            WcDetail::RemoteInvalidRdRequest => "the peer NAKed an invalid READ/atomic",
            WcDetail::RetryExceeded => "the peer did not answer within the retries",
            WcDetail::RnrRetryExceeded => "the peer had no receive posted within the retries",
        }
    }
}

impl core::fmt::Display for WcDetail {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A work request that failed: its completion's status and detail
/// ([`WorkCompletion::result`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcError {
    /// The completion status (never `Success`).
    pub status: WcStatus,
    /// Why, where known.
    pub detail: WcDetail,
}

impl WcError {
    /// A failure of `status` for the reason `detail`.
    pub const fn new(status: WcStatus, detail: WcDetail) -> WcError {
        WcError { status, detail }
    }
}

impl core::fmt::Display for WcError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.detail {
            WcDetail::Unspecified => write!(f, "{}", self.status),
            d => write!(f, "{} ({d})", self.status),
        }
    }
}

impl std::error::Error for WcError {}

/// A status with nothing to add to it.
impl From<WcStatus> for WcError {
    fn from(status: WcStatus) -> WcError {
        WcError::new(status, WcDetail::Unspecified)
    }
}

/// Completion opcode (`IBV_WC_*` opcode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum WcOpcode {
    /// SEND (any variant).
    #[default]
    Send = 0,
    /// RDMA WRITE.
    RdmaWrite = 1,
    /// RDMA READ.
    RdmaRead = 2,
    /// Compare and swap.
    CompSwap = 3,
    /// Fetch and add.
    FetchAdd = 4,
    /// Memory window bind.
    BindMw = 5,
    /// Local invalidate.
    LocalInv = 6,
    /// A received SEND.
    Recv = 128,
    /// A received RDMA WRITE with immediate.
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// A receive's completion (`IBV_WC_RECV` and above, the receive flag set).
    pub fn is_recv(self) -> bool {
        matches!(self, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
    }
}

/// A work completion with every field of `ibv_wc`, plus the `ibv_cq_ex` timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkCompletion {
    /// The WR's cookie.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode (valid on success; on error it may be the WR's).
    pub opcode: WcOpcode,
    /// Vendor syndrome: for errors, a [`WcDetail`] code saying why (0 when there is
    /// nothing to add to the status).
    pub vendor_err: u32,
    /// Bytes received (receive side) or transferred.
    pub byte_len: u32,
    /// Immediate data (host order) or the invalidated rkey.
    pub imm_data: u32,
    /// Local QP number.
    pub qp_num: u32,
    /// Remote QP number (UD).
    pub src_qp: u32,
    /// Flags.
    pub wc_flags: WcFlags,
    /// P_Key index (UD).
    pub pkey_index: u16,
    /// Source LID (0 on RoCE).
    pub slid: u16,
    /// Service level.
    pub sl: u8,
    /// Destination LID path bits.
    pub dlid_path_bits: u8,
    /// Completion timestamp in device clock nanoseconds, if the CQ asked for it.
    pub timestamp: Option<u64>,
}

impl WorkCompletion {
    /// Ok for a successful completion, otherwise its status and detail as an error, for
    /// `?` and `match`.
    pub fn result(&self) -> Result<(), WcError> {
        match self.status {
            WcStatus::Success => Ok(()),
            status => Err(WcError::new(status, self.detail())),
        }
    }
    /// The detail of `vendor_err` ([`WcDetail::Unspecified`] for a code this version
    /// does not know).
    pub fn detail(&self) -> WcDetail {
        WcDetail::from_code(self.vendor_err).unwrap_or_default()
    }
}

/// Asynchronous events (`IBV_EVENT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncEvent {
    /// A CQ overflowed: completions were lost, the CQ is in error.
    CqErr(CqId),
    /// A QP hit a fatal error.
    QpFatal(Qpn),
    /// Invalid request on a QP.
    QpReqErr(Qpn),
    /// Access violation on a QP.
    QpAccessErr(Qpn),
    /// Communication established (first packet in RTR).
    CommEst(Qpn),
    /// The send queue drained (SQD).
    SqDrained(Qpn),
    /// Last WQE reached on a QP attached to an SRQ.
    QpLastWqeReached(Qpn),
    /// An SRQ fell below its limit.
    SrqLimitReached(SrqId),
    /// Port became active.
    PortActive(u8),
    /// The device failed.
    DeviceFatal,
}

#[cfg(test)]
mod tests {
    use super::Mtu;

    #[test]
    fn mtus_parse_from_their_byte_counts_and_nothing_else() {
        for m in [
            Mtu::Mtu256,
            Mtu::Mtu512,
            Mtu::Mtu1024,
            Mtu::Mtu2048,
            Mtu::Mtu4096,
        ] {
            assert_eq!(Mtu::from_bytes(m.bytes() as u32), Some(m));
        }
        for n in [0, 1, 5, 128, 1000, 1500, 8192, u32::MAX] {
            assert_eq!(Mtu::from_bytes(n), None, "{n}");
        }
    }
}
