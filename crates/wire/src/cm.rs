//! IB Communication Management MADs (IBTA vol. 1 ch. 12, management class 0x07, class
//! version 2), as rdma_cm sends them over RoCEv2: UD SENDs to QP1 (the GSI) with Q_Key
//! 0x80010000, one 256-byte MAD each. The IP addresses and ports of an rdma_cm
//! connection ride in a 36-byte header ([`CmaHeader`]) at the start of the REQ's
//! private data.
//!
//! Field positions are the IBTA tables': a field starts `bit` bits below the most
//! significant bit of byte `at` of the message data (after the 24-byte MAD header) and
//! runs `width` bits down, big-endian. The sub-word ones are written here once, as data,
//! in the `req_at`, `rep_at` and `other_at` tables and the path layout, and every message
//! is parsed and emitted through them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{Error, Result};

/// Bytes of a MAD.
pub const MAD_LEN: usize = 256;
/// Bytes of the common MAD header.
pub const MAD_HEADER_LEN: usize = 24;
/// Bytes of a CM message after the MAD header.
pub const CM_DATA_LEN: usize = MAD_LEN - MAD_HEADER_LEN;
/// Management class of the communication manager.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// CM class version (IBTA 1.2).
pub const CM_CLASS_VERSION: u8 = 2;
/// MAD base version.
pub const MAD_BASE_VERSION: u8 = 1;
/// MAD method Send: every CM message is one.
pub const METHOD_SEND: u8 = 0x03;
/// The GSI's QP number.
pub const GSI_QPN: u32 = 1;
/// The Q_Key of QP1.
pub const GSI_QKEY: u32 = 0x8001_0000;

/// An rdma_cm port space: ports are only shared within one, as in the kernel's per-space
/// tables, and its value is the upper half of a service ID ([`service_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortSpace {
    /// `RDMA_PS_TCP` (0x0106): reliable connections.
    Tcp,
    /// `RDMA_PS_UDP` (0x0111): unreliable datagrams.
    Udp,
    /// `RDMA_PS_IB` (0x013F): any QP type.
    Ib,
    /// `RDMA_PS_IPOIB` (0x0002).
    IpoIb,
}

impl PortSpace {
    /// The `enum rdma_port_space` value, as the C API and the service ID carry it.
    pub const fn raw(self) -> u32 {
        match self {
            PortSpace::Tcp => 0x0106,
            PortSpace::Udp => 0x0111,
            PortSpace::Ib => 0x013F,
            PortSpace::IpoIb => 0x0002,
        }
    }

    /// The port space of a C value; None for values the kernel refuses with
    /// `EPROTONOSUPPORT` (`cma_select_inet_ps`).
    pub const fn from_raw(v: u32) -> Option<PortSpace> {
        match v {
            0x0106 => Some(PortSpace::Tcp),
            0x0111 => Some(PortSpace::Udp),
            0x013F => Some(PortSpace::Ib),
            0x0002 => Some(PortSpace::IpoIb),
            _ => None,
        }
    }
}

/// The [`PortSpace`] values as the 16 bits a service ID carries them in.
pub mod port_space {
    use super::PortSpace;

    /// `RDMA_PS_IPOIB`.
    pub const IPOIB: u16 = PortSpace::IpoIb.raw() as u16;
    /// `RDMA_PS_IB`.
    pub const IB: u16 = PortSpace::Ib.raw() as u16;
    /// `RDMA_PS_TCP`.
    pub const TCP: u16 = PortSpace::Tcp.raw() as u16;
    /// `RDMA_PS_UDP`.
    pub const UDP: u16 = PortSpace::Udp.raw() as u16;
}

/// The service ID rdma_cm gives a port in a port space: `ps << 16 | port`.
pub fn service_id(port_space: u16, port: u16) -> u64 {
    (u64::from(port_space) << 16) | u64::from(port)
}

/// The port space and port of an rdma_cm service ID, if it is one.
pub fn split_service_id(sid: u64) -> Option<(u16, u16)> {
    (sid >> 32 == 0 && (sid >> 24) & 0xFF == 0x01).then_some(((sid >> 16) as u16, sid as u16))
}

/// CM attribute IDs (the MAD's attribute ID says which message it carries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum CmAttr {
    /// Request for communication.
    Req = 0x0010,
    /// Message receipt acknowledgement.
    Mra = 0x0011,
    /// Reject.
    Rej = 0x0012,
    /// Reply to request.
    Rep = 0x0013,
    /// Ready to use.
    Rtu = 0x0014,
    /// Disconnect request.
    Dreq = 0x0015,
    /// Disconnect reply.
    Drep = 0x0016,
    /// Service ID resolution request.
    SidrReq = 0x0017,
    /// Service ID resolution reply.
    SidrRep = 0x0018,
}

impl CmAttr {
    /// The attribute with ID `id`, if the CM messages here include it.
    pub fn from_id(id: u16) -> Option<CmAttr> {
        use CmAttr::*;
        [Req, Mra, Rej, Rep, Rtu, Dreq, Drep, SidrReq, SidrRep]
            .into_iter()
            .find(|a| *a as u16 == id)
    }
}

/// The common MAD header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MadHeader {
    /// Base version (1).
    pub base_version: u8,
    /// Management class.
    pub mgmt_class: u8,
    /// Class version.
    pub class_version: u8,
    /// Method.
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class-specific field.
    pub class_specific: u16,
    /// Transaction ID.
    pub tid: u64,
    /// Attribute ID.
    pub attr_id: u16,
    /// Attribute modifier.
    pub attr_mod: u32,
}

impl MadHeader {
    /// The header of a CM Send of `attr` with transaction ID `tid`.
    pub fn cm(attr: CmAttr, tid: u64) -> MadHeader {
        MadHeader {
            base_version: MAD_BASE_VERSION,
            mgmt_class: MGMT_CLASS_CM,
            class_version: CM_CLASS_VERSION,
            method: METHOD_SEND,
            status: 0,
            class_specific: 0,
            tid,
            attr_id: attr as u16,
            attr_mod: 0,
        }
    }

    /// Parse the first 24 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<MadHeader> {
        if b.len() < MAD_HEADER_LEN {
            return Err(Error::Truncated);
        }
        Ok(MadHeader {
            base_version: b[0],
            mgmt_class: b[1],
            class_version: b[2],
            method: b[3],
            status: be(b, 4, 2) as u16,
            class_specific: be(b, 6, 2) as u16,
            tid: be(b, 8, 8),
            attr_id: be(b, 16, 2) as u16,
            attr_mod: be(b, 20, 4) as u32,
        })
    }

    /// Write into the first 24 bytes of `b` (reserved bytes zero).
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        if b.len() < MAD_HEADER_LEN {
            return Err(Error::Truncated);
        }
        b[..MAD_HEADER_LEN].fill(0);
        b[0] = self.base_version;
        b[1] = self.mgmt_class;
        b[2] = self.class_version;
        b[3] = self.method;
        put_be(b, 4, 2, self.status.into());
        put_be(b, 6, 2, self.class_specific.into());
        put_be(b, 8, 8, self.tid);
        put_be(b, 16, 2, self.attr_id.into());
        put_be(b, 20, 4, self.attr_mod.into());
        Ok(())
    }
}

fn be(b: &[u8], at: usize, n: usize) -> u64 {
    b[at..at + n]
        .iter()
        .fold(0u64, |v, &x| (v << 8) | u64::from(x))
}

fn put_be(b: &mut [u8], at: usize, n: usize, v: u64) {
    for i in 0..n {
        b[at + i] = (v >> (8 * (n - 1 - i))) as u8;
    }
}

/// A field of a CM message: `width` bits from `bit` bits below the top of byte `at` of
/// the message data (IBTA table order; at most 57 bits, or a whole byte-aligned u64).
#[derive(Debug, Clone, Copy)]
struct Field {
    at: usize,
    bit: u32,
    width: u32,
}

const fn f(at: usize, bit: u32, width: u32) -> Field {
    Field { at, bit, width }
}

impl Field {
    fn bytes(&self) -> usize {
        (self.bit + self.width).div_ceil(8) as usize
    }
    fn get(&self, d: &[u8]) -> u64 {
        let n = self.bytes();
        let raw = be(d, self.at, n);
        let shift = n as u32 * 8 - self.bit - self.width;
        (raw >> shift) & mask(self.width)
    }
    fn put(&self, d: &mut [u8], v: u64) {
        let n = self.bytes();
        let shift = n as u32 * 8 - self.bit - self.width;
        let m = mask(self.width) << shift;
        let raw = be(d, self.at, n);
        put_be(d, self.at, n, (raw & !m) | ((v << shift) & m));
    }
}

fn mask(width: u32) -> u64 {
    if width >= 64 {
        u64::MAX
    } else {
        (1u64 << width) - 1
    }
}

/// A path as a REQ carries it (IBTA table 106, primary at byte 52, alternate at 96).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CmPath {
    /// Local port LID (0xFFFF, "permissive", on RoCE).
    pub local_lid: u16,
    /// Remote port LID.
    pub remote_lid: u16,
    /// Local port GID.
    pub local_gid: [u8; 16],
    /// Remote port GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local.
    pub subnet_local: bool,
    /// Local ACK timeout (5 bits).
    pub local_ack_timeout: u8,
}

impl CmPath {
    fn parse(d: &[u8], at: usize) -> CmPath {
        let g = |off: usize| -> [u8; 16] {
            let mut x = [0u8; 16];
            x.copy_from_slice(&d[at + off..at + off + 16]);
            x
        };
        CmPath {
            local_lid: be(d, at, 2) as u16,
            remote_lid: be(d, at + 2, 2) as u16,
            local_gid: g(4),
            remote_gid: g(20),
            flow_label: f(at + 36, 0, 20).get(d) as u32,
            packet_rate: f(at + 39, 2, 6).get(d) as u8,
            traffic_class: d[at + 40],
            hop_limit: d[at + 41],
            sl: f(at + 42, 0, 4).get(d) as u8,
            subnet_local: f(at + 42, 4, 1).get(d) != 0,
            local_ack_timeout: f(at + 43, 0, 5).get(d) as u8,
        }
    }
    fn emit(&self, d: &mut [u8], at: usize) {
        put_be(d, at, 2, self.local_lid.into());
        put_be(d, at + 2, 2, self.remote_lid.into());
        d[at + 4..at + 20].copy_from_slice(&self.local_gid);
        d[at + 20..at + 36].copy_from_slice(&self.remote_gid);
        f(at + 36, 0, 20).put(d, self.flow_label.into());
        f(at + 39, 2, 6).put(d, self.packet_rate.into());
        d[at + 40] = self.traffic_class;
        d[at + 41] = self.hop_limit;
        f(at + 42, 0, 4).put(d, self.sl.into());
        f(at + 42, 4, 1).put(d, self.subnet_local.into());
        f(at + 43, 0, 5).put(d, self.local_ack_timeout.into());
    }
}

/// Bytes of private data each message carries (IBTA tables 106-120).
pub mod private_len {
    /// REQ.
    pub const REQ: usize = 92;
    /// MRA.
    pub const MRA: usize = 222;
    /// REJ.
    pub const REJ: usize = 148;
    /// REP.
    pub const REP: usize = 196;
    /// RTU.
    pub const RTU: usize = 224;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// DREP.
    pub const DREP: usize = 224;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// Where each message's private data starts in the message data.
const REQ_PRIVATE: usize = 140;
const MRA_PRIVATE: usize = 10;
const REJ_PRIVATE: usize = 84;
const REP_PRIVATE: usize = 36;
const RTU_PRIVATE: usize = 8;
const DREQ_PRIVATE: usize = 12;
const DREP_PRIVATE: usize = 8;
const SIDR_REQ_PRIVATE: usize = 16;
const SIDR_REP_PRIVATE: usize = 96;
/// Length of the REJ's and SIDR_REP's additional information.
const INFO_LEN: usize = 72;

/// REQ (IBTA table 106).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Req {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Service ID.
    pub service_id: u64,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Local EECN (24 bits).
    pub local_eecn: u32,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Remote EECN (24 bits).
    pub remote_eecn: u32,
    /// Remote CM response timeout (5 bits).
    pub remote_cm_response_timeout: u8,
    /// Transport service type (2 bits: 0 RC, 1 UC).
    pub transport_service_type: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Local CM response timeout (5 bits).
    pub local_cm_response_timeout: u8,
    /// Retry count (3 bits).
    pub retry_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Path packet payload MTU (4-bit code: 1 = 256 … 5 = 4096).
    pub path_mtu: u8,
    /// RDC exists.
    pub rdc_exists: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// SRQ.
    pub srq: bool,
    /// Extended transport type (3 bits).
    pub extended_transport_type: u8,
    /// Primary path.
    pub primary: CmPath,
    /// Alternate path (all zero: none).
    pub alternate: CmPath,
    /// SAP supported.
    pub sap_supported: bool,
    /// Private data.
    pub private_data: [u8; private_len::REQ],
}

/// Positions of the REQ's fields (IBTA table 106; the 64-bit IDs are read whole and the
/// paths are laid out by [`CmPath`]).
mod req_at {
    use super::{f, Field};
    pub const LOCAL_COMM_ID: Field = f(0, 0, 32);
    pub const LOCAL_QKEY: Field = f(28, 0, 32);
    pub const LOCAL_QPN: Field = f(32, 0, 24);
    pub const RESPONDER_RESOURCES: Field = f(35, 0, 8);
    pub const LOCAL_EECN: Field = f(36, 0, 24);
    pub const INITIATOR_DEPTH: Field = f(39, 0, 8);
    pub const REMOTE_EECN: Field = f(40, 0, 24);
    pub const REMOTE_CM_RESPONSE_TIMEOUT: Field = f(43, 0, 5);
    pub const TRANSPORT_SERVICE_TYPE: Field = f(43, 5, 2);
    pub const E2E_FLOW_CONTROL: Field = f(43, 7, 1);
    pub const STARTING_PSN: Field = f(44, 0, 24);
    pub const LOCAL_CM_RESPONSE_TIMEOUT: Field = f(47, 0, 5);
    pub const RETRY_COUNT: Field = f(47, 5, 3);
    pub const PKEY: Field = f(48, 0, 16);
    pub const PATH_MTU: Field = f(50, 0, 4);
    pub const RDC_EXISTS: Field = f(50, 4, 1);
    pub const RNR_RETRY_COUNT: Field = f(50, 5, 3);
    pub const MAX_CM_RETRIES: Field = f(51, 0, 4);
    pub const SRQ: Field = f(51, 4, 1);
    pub const EXTENDED_TRANSPORT_TYPE: Field = f(51, 5, 3);
    pub const SAP_SUPPORTED: Field = f(139, 5, 1);
}

impl Req {
    fn parse(d: &[u8]) -> Req {
        use req_at::*;
        let mut private_data = [0u8; private_len::REQ];
        private_data.copy_from_slice(&d[REQ_PRIVATE..REQ_PRIVATE + private_len::REQ]);
        Req {
            local_comm_id: LOCAL_COMM_ID.get(d) as u32,
            service_id: be(d, 8, 8),
            local_ca_guid: be(d, 16, 8),
            local_qkey: LOCAL_QKEY.get(d) as u32,
            local_qpn: LOCAL_QPN.get(d) as u32,
            responder_resources: RESPONDER_RESOURCES.get(d) as u8,
            local_eecn: LOCAL_EECN.get(d) as u32,
            initiator_depth: INITIATOR_DEPTH.get(d) as u8,
            remote_eecn: REMOTE_EECN.get(d) as u32,
            remote_cm_response_timeout: REMOTE_CM_RESPONSE_TIMEOUT.get(d) as u8,
            transport_service_type: TRANSPORT_SERVICE_TYPE.get(d) as u8,
            e2e_flow_control: E2E_FLOW_CONTROL.get(d) != 0,
            starting_psn: STARTING_PSN.get(d) as u32,
            local_cm_response_timeout: LOCAL_CM_RESPONSE_TIMEOUT.get(d) as u8,
            retry_count: RETRY_COUNT.get(d) as u8,
            pkey: PKEY.get(d) as u16,
            path_mtu: PATH_MTU.get(d) as u8,
            rdc_exists: RDC_EXISTS.get(d) != 0,
            rnr_retry_count: RNR_RETRY_COUNT.get(d) as u8,
            max_cm_retries: MAX_CM_RETRIES.get(d) as u8,
            srq: SRQ.get(d) != 0,
            extended_transport_type: EXTENDED_TRANSPORT_TYPE.get(d) as u8,
            primary: CmPath::parse(d, 52),
            alternate: CmPath::parse(d, 96),
            sap_supported: SAP_SUPPORTED.get(d) != 0,
            private_data,
        }
    }
    fn emit(&self, d: &mut [u8]) {
        use req_at::*;
        LOCAL_COMM_ID.put(d, self.local_comm_id.into());
        put_be(d, 8, 8, self.service_id);
        put_be(d, 16, 8, self.local_ca_guid);
        LOCAL_QKEY.put(d, self.local_qkey.into());
        LOCAL_QPN.put(d, self.local_qpn.into());
        RESPONDER_RESOURCES.put(d, self.responder_resources.into());
        LOCAL_EECN.put(d, self.local_eecn.into());
        INITIATOR_DEPTH.put(d, self.initiator_depth.into());
        REMOTE_EECN.put(d, self.remote_eecn.into());
        REMOTE_CM_RESPONSE_TIMEOUT.put(d, self.remote_cm_response_timeout.into());
        TRANSPORT_SERVICE_TYPE.put(d, self.transport_service_type.into());
        E2E_FLOW_CONTROL.put(d, self.e2e_flow_control.into());
        STARTING_PSN.put(d, self.starting_psn.into());
        LOCAL_CM_RESPONSE_TIMEOUT.put(d, self.local_cm_response_timeout.into());
        RETRY_COUNT.put(d, self.retry_count.into());
        PKEY.put(d, self.pkey.into());
        PATH_MTU.put(d, self.path_mtu.into());
        RDC_EXISTS.put(d, self.rdc_exists.into());
        RNR_RETRY_COUNT.put(d, self.rnr_retry_count.into());
        MAX_CM_RETRIES.put(d, self.max_cm_retries.into());
        SRQ.put(d, self.srq.into());
        EXTENDED_TRANSPORT_TYPE.put(d, self.extended_transport_type.into());
        self.primary.emit(d, 52);
        self.alternate.emit(d, 96);
        // After the alternate path, which shares its byte.
        SAP_SUPPORTED.put(d, self.sap_supported.into());
        d[REQ_PRIVATE..REQ_PRIVATE + private_len::REQ].copy_from_slice(&self.private_data);
    }
}

/// REP (IBTA table 110).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rep {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID (the REQ's local one).
    pub remote_comm_id: u32,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Local EE context number (24 bits).
    pub local_eecn: u32,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// SRQ.
    pub srq: bool,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Private data.
    pub private_data: [u8; private_len::REP],
}

/// Positions of the REP's fields (IBTA table 110; the CA GUID is read whole).
mod rep_at {
    use super::{f, Field};
    pub const LOCAL_COMM_ID: Field = f(0, 0, 32);
    pub const REMOTE_COMM_ID: Field = f(4, 0, 32);
    pub const LOCAL_QKEY: Field = f(8, 0, 32);
    pub const LOCAL_QPN: Field = f(12, 0, 24);
    pub const LOCAL_EECN: Field = f(16, 0, 24);
    pub const STARTING_PSN: Field = f(20, 0, 24);
    pub const RESPONDER_RESOURCES: Field = f(24, 0, 8);
    pub const INITIATOR_DEPTH: Field = f(25, 0, 8);
    pub const TARGET_ACK_DELAY: Field = f(26, 0, 5);
    pub const FAILOVER_ACCEPTED: Field = f(26, 5, 2);
    pub const E2E_FLOW_CONTROL: Field = f(26, 7, 1);
    pub const RNR_RETRY_COUNT: Field = f(27, 0, 3);
    pub const SRQ: Field = f(27, 3, 1);
}

impl Rep {
    fn parse(d: &[u8]) -> Rep {
        use rep_at::*;
        let mut private_data = [0u8; private_len::REP];
        private_data.copy_from_slice(&d[REP_PRIVATE..REP_PRIVATE + private_len::REP]);
        Rep {
            local_comm_id: LOCAL_COMM_ID.get(d) as u32,
            remote_comm_id: REMOTE_COMM_ID.get(d) as u32,
            local_qkey: LOCAL_QKEY.get(d) as u32,
            local_qpn: LOCAL_QPN.get(d) as u32,
            local_eecn: LOCAL_EECN.get(d) as u32,
            starting_psn: STARTING_PSN.get(d) as u32,
            responder_resources: RESPONDER_RESOURCES.get(d) as u8,
            initiator_depth: INITIATOR_DEPTH.get(d) as u8,
            target_ack_delay: TARGET_ACK_DELAY.get(d) as u8,
            failover_accepted: FAILOVER_ACCEPTED.get(d) as u8,
            e2e_flow_control: E2E_FLOW_CONTROL.get(d) != 0,
            rnr_retry_count: RNR_RETRY_COUNT.get(d) as u8,
            srq: SRQ.get(d) != 0,
            local_ca_guid: be(d, 28, 8),
            private_data,
        }
    }
    fn emit(&self, d: &mut [u8]) {
        use rep_at::*;
        LOCAL_COMM_ID.put(d, self.local_comm_id.into());
        REMOTE_COMM_ID.put(d, self.remote_comm_id.into());
        LOCAL_QKEY.put(d, self.local_qkey.into());
        LOCAL_QPN.put(d, self.local_qpn.into());
        LOCAL_EECN.put(d, self.local_eecn.into());
        STARTING_PSN.put(d, self.starting_psn.into());
        RESPONDER_RESOURCES.put(d, self.responder_resources.into());
        INITIATOR_DEPTH.put(d, self.initiator_depth.into());
        TARGET_ACK_DELAY.put(d, self.target_ack_delay.into());
        FAILOVER_ACCEPTED.put(d, self.failover_accepted.into());
        E2E_FLOW_CONTROL.put(d, self.e2e_flow_control.into());
        RNR_RETRY_COUNT.put(d, self.rnr_retry_count.into());
        SRQ.put(d, self.srq.into());
        put_be(d, 28, 8, self.local_ca_guid);
        d[REP_PRIVATE..REP_PRIVATE + private_len::REP].copy_from_slice(&self.private_data);
    }
}

/// Positions of the sub-word fields of the other messages (IBTA tables 107, 108, 112
/// and 120; their whole-word fields are read and written as big-endian words).
mod other_at {
    use super::{f, Field};
    pub const MRA_MESSAGE_MRAED: Field = f(8, 0, 2);
    pub const MRA_SERVICE_TIMEOUT: Field = f(9, 0, 5);
    pub const REJ_MESSAGE_REJECTED: Field = f(8, 0, 2);
    pub const REJ_INFO_LENGTH: Field = f(9, 0, 7);
    pub const DREQ_REMOTE_QPN: Field = f(8, 0, 24);
    pub const SIDR_REP_QPN: Field = f(8, 0, 24);
}

/// REJ (IBTA table 108).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Which message is rejected (2 bits: 0 REQ, 1 REP, 2 other).
    pub message_rejected: u8,
    /// Length of the valid additional rejection information (7 bits).
    pub rejected_info_length: u8,
    /// Reason (IBTA table 109; 28 = consumer reject, 8 = invalid service ID).
    pub reason: u16,
    /// Additional rejection information.
    pub ari: [u8; INFO_LEN],
    /// Private data.
    pub private_data: [u8; private_len::REJ],
}

/// REJ reasons rdma_cm meets most.
pub mod rej_reason {
    /// No QP available.
    pub const NO_QP: u16 = 1;
    /// Timeout.
    pub const TIMEOUT: u16 = 4;
    /// Invalid service ID (nothing listens).
    pub const INVALID_SERVICE_ID: u16 = 8;
    /// Stale connection.
    pub const STALE_CONN: u16 = 10;
    /// Consumer reject (`rdma_reject`).
    pub const CONSUMER_REJECT: u16 = 28;
    /// The requested vendor options (ECE) are not supported (`rdma_reject_ece`).
    pub const VENDOR_OPTION_NOT_SUPPORTED: u16 = 35;
}

/// Which message an MRA or REJ refers to (IBTA "message MRAed" / "message rejected").
pub mod msg_response {
    /// The REQ.
    pub const REQ: u8 = 0;
    /// The REP.
    pub const REP: u8 = 1;
    /// Another message.
    pub const OTHER: u8 = 2;
}

/// SIDR_REP status values (IBTA table 120).
pub mod sidr_status {
    /// The QP was found: the REP carries its number and Q_Key.
    pub const SUCCESS: u8 = 0;
    /// The service ID is not supported here (nobody listens).
    pub const UNSUPPORTED: u8 = 1;
    /// The request was rejected.
    pub const REJECT: u8 = 2;
}

/// `data` at the start of an `N`-byte field, the rest zero (longer data is cut): how a
/// message's fixed-size private data is made from a program's shorter buffer.
pub fn zero_padded<const N: usize>(data: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    let n = data.len().min(N);
    a[..n].copy_from_slice(&data[..n]);
    a
}

impl Rej {
    /// A REJ from communication ID `local` to `remote` of message `rejected`
    /// ([`msg_response`]) with `reason`, additional information `ari` (at most 72 bytes
    /// count) and `private` data (cut to the REJ's 148 bytes).
    pub fn new(
        local: u32,
        remote: u32,
        rejected: u8,
        reason: u16,
        ari: &[u8],
        private: &[u8],
    ) -> Rej {
        let info = ari.len().min(INFO_LEN);
        Rej {
            local_comm_id: local,
            remote_comm_id: remote,
            message_rejected: rejected,
            rejected_info_length: info as u8,
            reason,
            ari: zero_padded(&ari[..info]),
            private_data: zero_padded(private),
        }
    }

    fn parse(d: &[u8]) -> Rej {
        let mut ari = [0u8; INFO_LEN];
        ari.copy_from_slice(&d[12..12 + INFO_LEN]);
        let mut private_data = [0u8; private_len::REJ];
        private_data.copy_from_slice(&d[REJ_PRIVATE..REJ_PRIVATE + private_len::REJ]);
        Rej {
            local_comm_id: be(d, 0, 4) as u32,
            remote_comm_id: be(d, 4, 4) as u32,
            message_rejected: other_at::REJ_MESSAGE_REJECTED.get(d) as u8,
            rejected_info_length: other_at::REJ_INFO_LENGTH.get(d) as u8,
            reason: be(d, 10, 2) as u16,
            ari,
            private_data,
        }
    }
    fn emit(&self, d: &mut [u8]) {
        put_be(d, 0, 4, self.local_comm_id.into());
        put_be(d, 4, 4, self.remote_comm_id.into());
        other_at::REJ_MESSAGE_REJECTED.put(d, self.message_rejected.into());
        other_at::REJ_INFO_LENGTH.put(d, self.rejected_info_length.into());
        put_be(d, 10, 2, self.reason.into());
        d[12..12 + INFO_LEN].copy_from_slice(&self.ari);
        d[REJ_PRIVATE..REJ_PRIVATE + private_len::REJ].copy_from_slice(&self.private_data);
    }
}

/// The two communication IDs every message between connected ends starts with, and the
/// private data at a fixed offset: RTU, DREP (and, with one more field, DREQ and MRA).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids<const N: usize> {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Private data.
    pub private_data: [u8; N],
}

impl<const N: usize> Ids<N> {
    fn parse(d: &[u8], private_at: usize) -> Ids<N> {
        let mut private_data = [0u8; N];
        private_data.copy_from_slice(&d[private_at..private_at + N]);
        Ids {
            local_comm_id: be(d, 0, 4) as u32,
            remote_comm_id: be(d, 4, 4) as u32,
            private_data,
        }
    }
    fn emit(&self, d: &mut [u8], private_at: usize) {
        put_be(d, 0, 4, self.local_comm_id.into());
        put_be(d, 4, 4, self.remote_comm_id.into());
        d[private_at..private_at + N].copy_from_slice(&self.private_data);
    }
}

/// RTU (IBTA table 111).
pub type Rtu = Ids<{ private_len::RTU }>;
/// DREP (IBTA table 113).
pub type Drep = Ids<{ private_len::DREP }>;

/// DREQ (IBTA table 112).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dreq {
    /// The communication IDs and private data.
    pub ids: Ids<{ private_len::DREQ }>,
    /// The receiver's QPN (24 bits).
    pub remote_qpn: u32,
}

/// MRA (IBTA table 107).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mra {
    /// The communication IDs and private data.
    pub ids: Ids<{ private_len::MRA }>,
    /// Which message is acknowledged (2 bits: 0 REQ, 1 REP, 2 LAP).
    pub message_mraed: u8,
    /// Service timeout (5 bits).
    pub service_timeout: u8,
}

/// SIDR_REQ (IBTA table 119).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrReq {
    /// Request ID.
    pub request_id: u32,
    /// Partition key.
    pub pkey: u16,
    /// Service ID.
    pub service_id: u64,
    /// Private data.
    pub private_data: [u8; private_len::SIDR_REQ],
}

/// SIDR_REP (IBTA table 120).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrRep {
    /// Request ID (the SIDR_REQ's).
    pub request_id: u32,
    /// Status (0: the QP is valid).
    pub status: u8,
    /// Length of the additional information.
    pub additional_info_length: u8,
    /// QPN (24 bits).
    pub qpn: u32,
    /// Service ID.
    pub service_id: u64,
    /// Q_Key.
    pub qkey: u32,
    /// Additional information.
    pub additional_info: [u8; INFO_LEN],
    /// Private data.
    pub private_data: [u8; private_len::SIDR_REP],
}

impl SidrRep {
    /// A SIDR_REP answering with `status` ([`sidr_status`]), naming QP `qpn` and Q_Key
    /// `qkey` (0 unless the status is [`sidr_status::SUCCESS`]), with `private` data; the
    /// request and service IDs are the caller's to fill in.
    pub fn new(status: u8, qpn: u32, qkey: u32, private: &[u8]) -> SidrRep {
        SidrRep {
            request_id: 0,
            status,
            additional_info_length: 0,
            qpn,
            service_id: 0,
            qkey,
            additional_info: [0; INFO_LEN],
            private_data: zero_padded(private),
        }
    }
}

impl SidrRep {
    /// The SIDR_REP "unsupported" (nobody serves the service ID) answering `req`.
    pub fn unsupported(req: &SidrReq) -> SidrRep {
        let mut rep = SidrRep::new(sidr_status::UNSUPPORTED, 0, 0, &[]);
        rep.request_id = req.request_id;
        rep.service_id = req.service_id;
        rep
    }
}

impl Dreq {
    /// The DREP answering this DREQ (its communication IDs swapped, no private data).
    pub fn drep(&self) -> Drep {
        Ids {
            local_comm_id: self.ids.remote_comm_id,
            remote_comm_id: self.ids.local_comm_id,
            private_data: [0; private_len::DREP],
        }
    }
}

/// A CM message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmMsg {
    /// REQ.
    Req(Box<Req>),
    /// MRA.
    Mra(Box<Mra>),
    /// REJ.
    Rej(Box<Rej>),
    /// REP.
    Rep(Box<Rep>),
    /// RTU.
    Rtu(Box<Rtu>),
    /// DREQ.
    Dreq(Box<Dreq>),
    /// DREP.
    Drep(Box<Drep>),
    /// SIDR_REQ.
    SidrReq(Box<SidrReq>),
    /// SIDR_REP.
    SidrRep(Box<SidrRep>),
}

impl CmMsg {
    /// The attribute that carries it.
    pub fn attr(&self) -> CmAttr {
        match self {
            CmMsg::Req(_) => CmAttr::Req,
            CmMsg::Mra(_) => CmAttr::Mra,
            CmMsg::Rej(_) => CmAttr::Rej,
            CmMsg::Rep(_) => CmAttr::Rep,
            CmMsg::Rtu(_) => CmAttr::Rtu,
            CmMsg::Dreq(_) => CmAttr::Dreq,
            CmMsg::Drep(_) => CmAttr::Drep,
            CmMsg::SidrReq(_) => CmAttr::SidrReq,
            CmMsg::SidrRep(_) => CmAttr::SidrRep,
        }
    }

    /// Parse a whole MAD: its header and the CM message it carries. Errors: shorter than a
    /// MAD ([`Error::Truncated`]); not a CM Send of class version 2, or an attribute that
    /// is not one of these messages ([`Error::NotCm`]).
    pub fn parse(mad: &[u8]) -> Result<(MadHeader, CmMsg)> {
        if mad.len() < MAD_LEN {
            return Err(Error::Truncated);
        }
        let h = MadHeader::parse(mad)?;
        if h.base_version != MAD_BASE_VERSION
            || h.mgmt_class != MGMT_CLASS_CM
            || h.class_version != CM_CLASS_VERSION
            || h.method != METHOD_SEND
        {
            return Err(Error::NotCm);
        }
        let d = &mad[MAD_HEADER_LEN..MAD_LEN];
        let m = match CmAttr::from_id(h.attr_id).ok_or(Error::NotCm)? {
            CmAttr::Req => CmMsg::Req(Box::new(Req::parse(d))),
            CmAttr::Rep => CmMsg::Rep(Box::new(Rep::parse(d))),
            CmAttr::Rej => CmMsg::Rej(Box::new(Rej::parse(d))),
            CmAttr::Rtu => CmMsg::Rtu(Box::new(Ids::parse(d, RTU_PRIVATE))),
            CmAttr::Drep => CmMsg::Drep(Box::new(Ids::parse(d, DREP_PRIVATE))),
            CmAttr::Dreq => CmMsg::Dreq(Box::new(Dreq {
                ids: Ids::parse(d, DREQ_PRIVATE),
                remote_qpn: other_at::DREQ_REMOTE_QPN.get(d) as u32,
            })),
            CmAttr::Mra => CmMsg::Mra(Box::new(Mra {
                ids: Ids::parse(d, MRA_PRIVATE),
                message_mraed: other_at::MRA_MESSAGE_MRAED.get(d) as u8,
                service_timeout: other_at::MRA_SERVICE_TIMEOUT.get(d) as u8,
            })),
            CmAttr::SidrReq => {
                let mut private_data = [0u8; private_len::SIDR_REQ];
                private_data.copy_from_slice(&d[SIDR_REQ_PRIVATE..][..private_len::SIDR_REQ]);
                CmMsg::SidrReq(Box::new(SidrReq {
                    request_id: be(d, 0, 4) as u32,
                    pkey: be(d, 4, 2) as u16,
                    service_id: be(d, 8, 8),
                    private_data,
                }))
            }
            CmAttr::SidrRep => {
                let mut additional_info = [0u8; INFO_LEN];
                additional_info.copy_from_slice(&d[24..24 + INFO_LEN]);
                let mut private_data = [0u8; private_len::SIDR_REP];
                private_data.copy_from_slice(&d[SIDR_REP_PRIVATE..][..private_len::SIDR_REP]);
                CmMsg::SidrRep(Box::new(SidrRep {
                    request_id: be(d, 0, 4) as u32,
                    status: d[4],
                    additional_info_length: d[5],
                    qpn: other_at::SIDR_REP_QPN.get(d) as u32,
                    service_id: be(d, 12, 8),
                    qkey: be(d, 20, 4) as u32,
                    additional_info,
                    private_data,
                }))
            }
        };
        Ok((h, m))
    }

    /// The whole MAD: a CM Send header with transaction ID `tid`, then the message;
    /// reserved bits are zero. Values wider than their field are masked.
    pub fn emit(&self, tid: u64) -> [u8; MAD_LEN] {
        let mut mad = [0u8; MAD_LEN];
        // The buffer is MAD_LEN bytes: the header always fits.
        let _ = MadHeader::cm(self.attr(), tid).emit(&mut mad);
        let d = &mut mad[MAD_HEADER_LEN..];
        match self {
            CmMsg::Req(m) => m.emit(d),
            CmMsg::Rep(m) => m.emit(d),
            CmMsg::Rej(m) => m.emit(d),
            CmMsg::Rtu(m) => m.emit(d, RTU_PRIVATE),
            CmMsg::Drep(m) => m.emit(d, DREP_PRIVATE),
            CmMsg::Dreq(m) => {
                m.ids.emit(d, DREQ_PRIVATE);
                other_at::DREQ_REMOTE_QPN.put(d, m.remote_qpn.into());
            }
            CmMsg::Mra(m) => {
                m.ids.emit(d, MRA_PRIVATE);
                other_at::MRA_MESSAGE_MRAED.put(d, m.message_mraed.into());
                other_at::MRA_SERVICE_TIMEOUT.put(d, m.service_timeout.into());
            }
            CmMsg::SidrReq(m) => {
                put_be(d, 0, 4, m.request_id.into());
                put_be(d, 4, 2, m.pkey.into());
                put_be(d, 8, 8, m.service_id);
                d[SIDR_REQ_PRIVATE..][..private_len::SIDR_REQ].copy_from_slice(&m.private_data);
            }
            CmMsg::SidrRep(m) => {
                put_be(d, 0, 4, m.request_id.into());
                d[4] = m.status;
                d[5] = m.additional_info_length;
                other_at::SIDR_REP_QPN.put(d, m.qpn.into());
                put_be(d, 12, 8, m.service_id);
                put_be(d, 20, 4, m.qkey.into());
                d[24..24 + INFO_LEN].copy_from_slice(&m.additional_info);
                d[SIDR_REP_PRIVATE..][..private_len::SIDR_REP].copy_from_slice(&m.private_data);
            }
        }
        mad
    }
}

/// Bytes of the rdma_cm header at the start of a REQ's (or SIDR_REQ's) private data.
pub const CMA_HEADER_LEN: usize = 36;

/// The rdma_cm header: the IP version, the active side's source port and both IP
/// addresses of the connection. (An IPv4 address sits in the last 4 bytes of its
/// 16-byte slot, after 12 zero bytes.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmaHeader {
    /// The active side's port.
    pub src_port: u16,
    /// The active side's address.
    pub src: IpAddr,
    /// The passive side's address.
    pub dst: IpAddr,
}

impl CmaHeader {
    /// Parse the first 36 bytes of `p`. Errors: too short, a CMA version other than 0, an
    /// IP version other than 4 or 6, or addresses of different families.
    pub fn parse(p: &[u8]) -> Result<CmaHeader> {
        if p.len() < CMA_HEADER_LEN {
            return Err(Error::Truncated);
        }
        let addr = |at: usize, v4: bool| -> IpAddr {
            if v4 {
                IpAddr::V4(Ipv4Addr::new(
                    p[at + 12],
                    p[at + 13],
                    p[at + 14],
                    p[at + 15],
                ))
            } else {
                let mut o = [0u8; 16];
                o.copy_from_slice(&p[at..at + 16]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
        };
        if p[0] != 0 {
            return Err(Error::NotCm);
        }
        let v4 = match p[1] >> 4 {
            4 => true,
            6 => false,
            _ => return Err(Error::NotCm),
        };
        Ok(CmaHeader {
            src_port: be(p, 2, 2) as u16,
            src: addr(4, v4),
            dst: addr(20, v4),
        })
    }

    /// Write into the first 36 bytes of `p`. Errors: too short, or addresses of different
    /// families.
    pub fn emit(&self, p: &mut [u8]) -> Result<()> {
        if p.len() < CMA_HEADER_LEN {
            return Err(Error::Truncated);
        }
        let v4 = match (self.src, self.dst) {
            (IpAddr::V4(_), IpAddr::V4(_)) => true,
            (IpAddr::V6(_), IpAddr::V6(_)) => false,
            _ => return Err(Error::NotCm),
        };
        p[..CMA_HEADER_LEN].fill(0);
        p[1] = if v4 { 0x40 } else { 0x60 };
        put_be(p, 2, 2, self.src_port.into());
        for (at, ip) in [(4, self.src), (20, self.dst)] {
            match ip {
                IpAddr::V4(a) => p[at + 12..at + 16].copy_from_slice(&a.octets()),
                IpAddr::V6(a) => p[at..at + 16].copy_from_slice(&a.octets()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Req {
        let mut private_data = [0u8; private_len::REQ];
        for (i, b) in private_data.iter_mut().enumerate() {
            *b = i as u8 ^ 0x5A;
        }
        Req {
            local_comm_id: 0xA1B2_C3D4,
            service_id: service_id(port_space::TCP, 7174),
            local_ca_guid: 0x0011_2233_4455_6677,
            local_qkey: 0,
            local_qpn: 0x12_3456,
            responder_resources: 16,
            local_eecn: 0,
            initiator_depth: 15,
            remote_eecn: 0,
            remote_cm_response_timeout: 20,
            transport_service_type: 0,
            e2e_flow_control: true,
            starting_psn: 0xAB_CDEF,
            local_cm_response_timeout: 19,
            retry_count: 7,
            pkey: 0xFFFF,
            path_mtu: 5,
            rdc_exists: false,
            rnr_retry_count: 6,
            max_cm_retries: 15,
            srq: true,
            extended_transport_type: 0,
            primary: CmPath {
                local_lid: 0xFFFF,
                remote_lid: 0xFFFF,
                local_gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 127, 0, 0, 1],
                remote_gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 127, 0, 0, 2],
                flow_label: 0xF_EDCB,
                packet_rate: 0x2A,
                traffic_class: 0x28,
                hop_limit: 64,
                sl: 3,
                subnet_local: true,
                local_ack_timeout: 18,
            },
            alternate: CmPath::default(),
            sap_supported: true,
            private_data,
        }
    }

    #[test]
    fn req_fields_sit_where_the_ibta_table_puts_them() {
        let mad = CmMsg::Req(Box::new(req())).emit(0x0102_0304_0506_0708);
        assert_eq!(&mad[..4], &[1, 0x07, 2, 0x03]);
        assert_eq!(&mad[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&mad[16..18], &[0x00, 0x10]);
        let d = &mad[MAD_HEADER_LEN..];
        assert_eq!(&d[0..4], &[0xA1, 0xB2, 0xC3, 0xD4]);
        assert_eq!(&d[8..16], &[0, 0, 0, 0, 0x01, 0x06, 0x1C, 0x06]);
        assert_eq!(&d[32..36], &[0x12, 0x34, 0x56, 16]);
        assert_eq!(d[39], 15);
        // Remote CM response timeout 20 (5 bits), RC (00), flow control 1.
        assert_eq!(d[43], (20 << 3) | 1);
        assert_eq!(&d[44..48], &[0xAB, 0xCD, 0xEF, (19 << 3) | 7]);
        assert_eq!(&d[48..50], &[0xFF, 0xFF]);
        // MTU 5 in the top nibble, RDC 0, RNR retry 6; max CM retries 15, SRQ 1.
        assert_eq!(d[50], (5 << 4) | 6);
        assert_eq!(d[51], (15 << 4) | (1 << 3));
        assert_eq!(&d[52..56], &[0xFF; 4]);
        assert_eq!(&d[68..72], &[127, 0, 0, 1]);
        // Flow label 0xFEDCB in the top 20 bits, packet rate 0x2A in the low 6 of byte 91.
        assert_eq!(&d[88..92], &[0xFE, 0xDC, 0xB0, 0x2A]);
        assert_eq!(&d[92..96], &[0x28, 64, (3 << 4) | (1 << 3), 18 << 3]);
        assert_eq!(&d[96..139], &[0u8; 43][..], "no alternate path");
        // SAP supported: bit 2 of byte 139.
        assert_eq!(d[139], 1 << 2);
        assert_eq!(d[140], 0x5A);
    }

    #[test]
    fn every_message_round_trips_byte_for_byte() {
        let pd = |n: usize, seed: u8| {
            (0..n)
                .map(|i| (i as u8).wrapping_mul(seed))
                .collect::<Vec<_>>()
        };
        let arr = |v: Vec<u8>| -> [u8; 224] {
            let mut a = [0u8; 224];
            a[..v.len()].copy_from_slice(&v);
            a
        };
        let msgs = vec![
            CmMsg::Req(Box::new(req())),
            CmMsg::Rep(Box::new(Rep {
                local_comm_id: 1,
                remote_comm_id: 0xA1B2_C3D4,
                local_qkey: 0x8001_0000,
                local_qpn: 0xFF_FFFE,
                local_eecn: 0,
                starting_psn: 0x10_0001,
                responder_resources: 4,
                initiator_depth: 2,
                target_ack_delay: 15,
                failover_accepted: 3,
                e2e_flow_control: true,
                rnr_retry_count: 7,
                srq: true,
                local_ca_guid: 0xDEAD_BEEF_0000_0001,
                private_data: arr(pd(196, 3))[..196].try_into().unwrap(),
            })),
            CmMsg::Rej(Box::new(Rej {
                local_comm_id: 2,
                remote_comm_id: 3,
                message_rejected: 1,
                rejected_info_length: 72,
                reason: rej_reason::CONSUMER_REJECT,
                ari: arr(pd(72, 5))[..72].try_into().unwrap(),
                private_data: arr(pd(148, 7))[..148].try_into().unwrap(),
            })),
            CmMsg::Rtu(Box::new(Ids {
                local_comm_id: 4,
                remote_comm_id: 5,
                private_data: arr(pd(224, 9)),
            })),
            CmMsg::Drep(Box::new(Ids {
                local_comm_id: 6,
                remote_comm_id: 7,
                private_data: arr(pd(224, 11)),
            })),
            CmMsg::Dreq(Box::new(Dreq {
                ids: Ids {
                    local_comm_id: 8,
                    remote_comm_id: 9,
                    private_data: arr(pd(220, 13))[..220].try_into().unwrap(),
                },
                remote_qpn: 0xAB_CDEF,
            })),
            CmMsg::Mra(Box::new(Mra {
                ids: Ids {
                    local_comm_id: 10,
                    remote_comm_id: 11,
                    private_data: arr(pd(222, 15))[..222].try_into().unwrap(),
                },
                message_mraed: 2,
                service_timeout: 31,
            })),
            CmMsg::SidrReq(Box::new(SidrReq {
                request_id: 12,
                pkey: 0xFFFF,
                service_id: service_id(port_space::UDP, 7471),
                private_data: arr(pd(216, 17))[..216].try_into().unwrap(),
            })),
            CmMsg::SidrRep(Box::new(SidrRep {
                request_id: 12,
                status: 0,
                additional_info_length: 0,
                qpn: 0x11_2233,
                service_id: service_id(port_space::UDP, 7471),
                qkey: 0x0123_4567,
                additional_info: arr(pd(72, 19))[..72].try_into().unwrap(),
                private_data: arr(pd(136, 21))[..136].try_into().unwrap(),
            })),
        ];
        for (k, m) in msgs.iter().enumerate() {
            let mad = m.emit(k as u64);
            let (h, back) = CmMsg::parse(&mad).unwrap();
            assert_eq!(h, MadHeader::cm(m.attr(), k as u64));
            assert_eq!(&back, m, "{:?}", m.attr());
            assert_eq!(back.emit(k as u64), mad, "{:?}", m.attr());
        }
    }

    #[test]
    fn parse_refuses_what_is_not_a_cm_message() {
        let mad = CmMsg::Req(Box::new(req())).emit(1);
        assert_eq!(CmMsg::parse(&mad[..255]), Err(Error::Truncated));
        for (at, v) in [(0, 2), (1, 0x81), (2, 1), (3, 0x81), (17, 0x19)] {
            let mut bad = mad;
            bad[at] = v;
            assert_eq!(CmMsg::parse(&bad), Err(Error::NotCm), "byte {at} = {v:#x}");
        }
    }

    #[test]
    fn cma_header_v4_and_v6() {
        let h = CmaHeader {
            src_port: 0xC0DE,
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
        };
        let mut p = [0xEEu8; 40];
        h.emit(&mut p).unwrap();
        assert_eq!(&p[..4], &[0, 0x40, 0xC0, 0xDE]);
        assert_eq!(
            &p[4..20],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 1]
        );
        assert_eq!(&p[32..36], &[10, 0, 0, 2]);
        assert_eq!(&p[36..], &[0xEE; 4], "nothing past the header");
        assert_eq!(CmaHeader::parse(&p).unwrap(), h);
        let h6 = CmaHeader {
            src_port: 1,
            src: "fd00::1".parse().unwrap(),
            dst: "fd00::2".parse().unwrap(),
        };
        h6.emit(&mut p).unwrap();
        assert_eq!(p[1], 0x60);
        assert_eq!(CmaHeader::parse(&p).unwrap(), h6);
        let mixed = CmaHeader {
            dst: "10.0.0.2".parse().unwrap(),
            ..h6
        };
        assert_eq!(mixed.emit(&mut p), Err(Error::NotCm));
        p[1] = 0x50;
        assert_eq!(CmaHeader::parse(&p), Err(Error::NotCm));
        assert_eq!(CmaHeader::parse(&p[..35]), Err(Error::Truncated));
    }

    #[test]
    fn service_ids_of_rdma_cm() {
        assert_eq!(service_id(port_space::TCP, 7174), 0x0000_0000_0106_1C06);
        assert_eq!(split_service_id(0x0106_1C06), Some((port_space::TCP, 7174)));
        assert_eq!(split_service_id(0x1_0106_1C06), None);
        assert_eq!(split_service_id(0x0206_1C06), None);
    }

    #[test]
    fn rej_new_keeps_the_lengths_it_can_carry() {
        let r = Rej::new(1, 2, msg_response::REP, 28, &[7; 100], &[9; 200]);
        assert_eq!(r.rejected_info_length, 72);
        assert_eq!(r.ari, [7; 72]);
        assert_eq!(r.private_data, [9; private_len::REJ]);
        let r = Rej::new(1, 2, msg_response::REP, 28, &[7; 3], b"ab");
        assert_eq!(
            (r.rejected_info_length, &r.ari[..4]),
            (3, &[7, 7, 7, 0][..])
        );
        assert_eq!(&r.private_data[..3], b"ab\0");
    }
}
