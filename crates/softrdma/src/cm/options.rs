//! What the one-call helpers offer and answer with: private data, READ/atomic depths,
//! retries, the RNR timer and how long to wait.

use std::net::SocketAddr;
use std::time::Duration;

use super::PortSpace;

/// Outstanding RDMA READs and atomics the helpers offer by default, each way.
const DEFAULT_RD_ATOMIC: u8 = 16;

/// The RNR NAK timer code the helpers advertise by default: 0.64 ms, as rdma-core's
/// pingpong examples use.
const DEFAULT_MIN_RNR_TIMER: u8 = 12;

/// What a client offers in [`connect`](super::connect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Private data for the server, at most
    /// [`MAX_CONNECT_PRIVATE`](super::MAX_CONNECT_PRIVATE) bytes (56;
    /// [`MAX_UD_CONNECT_PRIVATE`](super::MAX_UD_CONNECT_PRIVATE) for UD).
    pub private_data: Vec<u8>,
    /// RDMA READs and atomics the server may have outstanding against us.
    pub responder_resources: u8,
    /// RDMA READs and atomics we may have outstanding against the server.
    pub initiator_depth: u8,
    /// Transport retries on timeouts and sequence errors (at most 7).
    pub retry_count: u8,
    /// Retries on RNR NAKs (7: forever).
    pub rnr_retry_count: u8,
    /// The RNR NAK timer code our receive side advertises (12: 0.64 ms). The rdma_cm
    /// gives 0 (655 ms), which makes a peer that sends before we posted a receive wait
    /// that long.
    pub min_rnr_timer: u8,
    /// The port space; None takes the QP type's ([`PortSpace::for_qp_type`]).
    pub port_space: Option<PortSpace>,
    /// The local address to bind; None: the device's, with an ephemeral port.
    pub src: Option<SocketAddr>,
    /// How long to wait for the whole exchange; None: until the CM's own verdict (it
    /// retries an unanswered request 15 times, about a minute, before UNREACHABLE).
    pub timeout: Option<Duration>,
}

impl ConnectOptions {
    /// Options with `private_data` and the defaults: 16 READs/atomics each way, 7
    /// retries, RNR retries forever.
    pub fn new(private_data: &[u8]) -> ConnectOptions {
        ConnectOptions {
            private_data: private_data.to_vec(),
            ..ConnectOptions::default()
        }
    }
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            private_data: Vec::new(),
            responder_resources: DEFAULT_RD_ATOMIC,
            initiator_depth: DEFAULT_RD_ATOMIC,
            retry_count: 7,
            rnr_retry_count: 7,
            min_rnr_timer: DEFAULT_MIN_RNR_TIMER,
            port_space: None,
            src: None,
            timeout: None,
        }
    }
}

/// What a server answers with in [`ConnectRequest::accept`](super::ConnectRequest::accept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptOptions {
    /// Private data for the client, at most
    /// [`MAX_ACCEPT_PRIVATE`](super::MAX_ACCEPT_PRIVATE) bytes (196;
    /// [`MAX_UD_ACCEPT_PRIVATE`](super::MAX_UD_ACCEPT_PRIVATE) for UD).
    pub private_data: Vec<u8>,
    /// Most RDMA READs and atomics the client may have outstanding against us (the
    /// client's request lowers it).
    pub responder_resources: u8,
    /// Most RDMA READs and atomics we may have outstanding against the client (the
    /// client's request lowers it).
    pub initiator_depth: u8,
    /// Retries on RNR NAKs the client should make (7: forever).
    pub rnr_retry_count: u8,
    /// The RNR NAK timer code our receive side advertises (as
    /// [`ConnectOptions::min_rnr_timer`]).
    pub min_rnr_timer: u8,
    /// How long to wait for the client's RTU; None: until the CM's own verdict.
    pub timeout: Option<Duration>,
}

impl AcceptOptions {
    /// Options with `private_data` and the defaults (as [`ConnectOptions::new`]).
    pub fn new(private_data: &[u8]) -> AcceptOptions {
        AcceptOptions {
            private_data: private_data.to_vec(),
            ..AcceptOptions::default()
        }
    }
}

impl Default for AcceptOptions {
    fn default() -> AcceptOptions {
        AcceptOptions {
            private_data: Vec::new(),
            responder_resources: DEFAULT_RD_ATOMIC,
            initiator_depth: DEFAULT_RD_ATOMIC,
            rnr_retry_count: 7,
            min_rnr_timer: DEFAULT_MIN_RNR_TIMER,
            timeout: None,
        }
    }
}
