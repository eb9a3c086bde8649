//! The engine's counters.

/// Counters (for `softrdma stats`).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Datagrams produced.
    pub tx_packets: u64,
    /// Bytes of UDP payload produced.
    pub tx_bytes: u64,
    /// Datagrams received (before any check).
    pub rx_packets: u64,
    /// Bytes of UDP payload received.
    pub rx_bytes: u64,
    /// Request packets sent again (timeout, sequence NAK, RNR).
    pub retransmits: u64,
    /// Local ACK timeouts that fired.
    pub timeouts: u64,
    /// Retransmission timer (from the measured round trip) expiries: a lost tail resent
    /// before the local ACK timeout, without spending a retry.
    pub rtt_timeouts: u64,
    /// PSN sequence error NAKs sent.
    pub naks_sent_seq: u64,
    /// Invalid request NAKs sent.
    pub naks_sent_inv: u64,
    /// Remote access error NAKs sent.
    pub naks_sent_access: u64,
    /// Remote operational error NAKs sent.
    pub naks_sent_op: u64,
    /// PSN sequence error NAKs received.
    pub naks_rcvd_seq: u64,
    /// Invalid request NAKs received.
    pub naks_rcvd_inv: u64,
    /// Remote access error NAKs received.
    pub naks_rcvd_access: u64,
    /// Remote operational error NAKs received.
    pub naks_rcvd_op: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_rcvd: u64,
    /// Datagrams dropped for a bad ICRC.
    pub icrc_errors: u64,
    /// Datagrams dropped as unparseable.
    pub malformed: u64,
    /// Duplicate requests seen by the responder.
    pub duplicates: u64,
    /// Datagrams dropped: wrong peer, unknown QP, bad state.
    pub dropped: u64,
    /// Duplicate READ requests re-executed (the responses sent again).
    pub read_replays: u64,
    /// Duplicate READ requests refused, or re-executions cut short: past the responses a
    /// READ's duplicates may cost (`READ_REPLAY_FACTOR`), which bounds what a READ can be
    /// made to reflect, or too many parts of one READ waiting to be sent again.
    pub read_replays_refused: u64,
    /// RC WRITEs whose payload went straight into a same-host peer's memory, one copy by
    /// cross-memory attach ([`crate::Placement`]): with no packet, or (with immediate data)
    /// with only a placed WRITE through the ring.
    pub placed_writes: u64,
    /// RC READs whose data came straight out of a same-host peer's memory, one copy by
    /// cross-memory attach, with no packet.
    pub placed_reads: u64,
    /// Placed WRITEs taken by the responder.
    pub placed_writes_taken: u64,
    /// Requests ahead of the expected PSN.
    pub out_of_sequence: u64,
    /// Of those, RC requests held until the gap before them filled (`qp::Held`).
    pub held: u64,
    /// SACKs sent: a responder told a softrdma requester which packets past a gap it
    /// holds (softrdma's extension message, `softrdma_wire::ext`).
    pub sacks_sent: u64,
    /// SACKs received and acted on.
    pub sacks_rcvd: u64,
    /// Packets resent because a SACK showed them missing.
    pub sack_resends: u64,
    /// Datagrams to QP1 (the GSI) dropped: not a MAD as the GSI takes them (opcode,
    /// Q_Key, length, P_Key), or the inbox was full.
    pub gsi_dropped: u64,
    /// MADs to QP1 while no connection manager ran: requests answered as a CM with
    /// nothing open answers them (REJ "invalid service ID", SIDR_REP "unsupported",
    /// DREP), the rest dropped.
    pub gsi_unserved: u64,
    /// Keepalive probes sent on idle RC connections ([`Keepalive`](crate::Keepalive)).
    pub keepalive_probes: u64,
    /// Acknowledgements of keepalive probes received.
    pub keepalive_acks: u64,
    /// RC connections whose peer left keepalive probes unanswered: failed, their peers
    /// taken for dead.
    pub peers_lost: u64,
}
