//! Liveness of idle RC connections: a peer that dies without a word (SIGKILL, a crash,
//! the OOM killer, a host gone) is noticed by its idle peers.
//!
//! On Linux the kernel sends a dead process's DREQ when its rdma_cm file closes; a
//! softrdma device lives in the process and dies with it, so nobody says goodbye, and a
//! peer that only waits for a receive would wait forever (an RC requester with requests
//! in flight already notices, by its local ACK timeout and retries).
//!
//! So a connected RC QP in RTS or SQD that has nothing in flight and has heard nothing
//! from its peer for [`Keepalive::idle_ns`] sends a probe every
//! [`Keepalive::interval_ns`]; after [`Keepalive::probes`] of them go unanswered for an
//! interval each, the peer is declared lost: the QP goes to ERR (its posted receives
//! complete with WR_FLUSH_ERR) and the loss is reported ([`crate::Rnic::take_lost_peer`]
//! for the connection manager, which disconnects the connection as the peer's DREQ
//! would have; without one, the QP's `IBV_EVENT_QP_FATAL`).
//!
//! The probe is a zero-length RDMA WRITE ONLY with AckReq at the PSN before the next
//! one, which every RC responder has already executed: a duplicate, which IBTA 9.7.5.1.2
//! has the responder acknowledge and not execute again (Linux rxe's `duplicate_request`
//! sends that ACK; a zero-length WRITE needs no valid rkey). The responder's state does
//! not change, so a probe never disturbs a live connection, whoever the peer is.
//!
//! Any packet the QP takes from its peer counts as hearing from it, and the clock is lazy:
//! a packet only notes the time, and the deadline, when it comes, looks at that time
//! again, so the busy path pays a store per packet, not a timer move.

//!
//! This module holds the settings and a QP's state; [`crate::liveness`] runs the checks.

/// How an idle RC connection checks that its peer is alive. A silent peer is declared
/// lost [`Keepalive::bound_ns`] after it was last heard from, at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Quiet time, in nanoseconds, after which the first probe goes out.
    pub idle_ns: u64,
    /// Nanoseconds between probes, and after the last one before the peer is lost.
    pub interval_ns: u64,
    /// Unanswered probes that make the peer lost (at least 1).
    pub probes: u8,
}

const MS: u64 = 1_000_000;

impl Keepalive {
    /// For a peer on the same host: lost within a second (250 ms idle, then 5 probes
    /// 150 ms apart). Five rather than three so that a probe or its answer lost now and
    /// then (a full socket buffer) does not end a live connection.
    pub const LOCAL: Keepalive = Keepalive {
        idle_ns: 250 * MS,
        interval_ns: 150 * MS,
        probes: 5,
    };
    /// For a peer on another host: lost within 20 s (10 s idle, then 5 probes 2 s apart),
    /// TCP keepalive's scheme at a scale for RDMA, where a dead peer holds registered
    /// memory and a waiting receive.
    pub const REMOTE: Keepalive = Keepalive {
        idle_ns: 10_000 * MS,
        interval_ns: 2_000 * MS,
        probes: 5,
    };

    /// The longest a silent peer goes unnoticed: idle time plus every probe's interval.
    pub fn bound_ns(&self) -> u64 {
        self.idle_ns
            .saturating_add(self.interval_ns.saturating_mul(u64::from(self.probes)))
    }

    /// Parse `idle_ms,interval_ms,probes`; `0` (or `off`) is None (no keepalive).
    pub fn parse(s: &str) -> Result<Option<Keepalive>, String> {
        let s = s.trim();
        if s == "0" || s.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let [idle, interval, probes] = parts[..] else {
            return Err(format!(
                "{s:?}: expected IDLE_MS,INTERVAL_MS,PROBES (or 0 for off)"
            ));
        };
        let ms = |v: &str, what: &str| match v.parse::<u64>() {
            Ok(n) if n > 0 => Ok(n.saturating_mul(MS)),
            _ => Err(format!("{s:?}: {what} must be a positive number of ms")),
        };
        let probes = match probes.parse::<u8>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("{s:?}: PROBES must be 1 to 255")),
        };
        Ok(Some(Keepalive {
            idle_ns: ms(idle, "IDLE_MS")?,
            interval_ns: ms(interval, "INTERVAL_MS")?,
            probes,
        }))
    }
}

/// Which [`Keepalive`] a device's RC QPs use: one for peers on the same host (a loopback
/// address or one of the device's own), one for the others; None turns it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeepalivePolicy {
    /// For peers on this host.
    pub local: Option<Keepalive>,
    /// For peers elsewhere.
    pub remote: Option<Keepalive>,
}

impl KeepalivePolicy {
    /// No keepalive (the engine's default: it sets no timer nobody asked for).
    pub const OFF: KeepalivePolicy = KeepalivePolicy {
        local: None,
        remote: None,
    };
    /// [`Keepalive::LOCAL`] and [`Keepalive::REMOTE`] (a device's default).
    pub const DEFAULT: KeepalivePolicy = KeepalivePolicy {
        local: Some(Keepalive::LOCAL),
        remote: Some(Keepalive::REMOTE),
    };
}

/// A QP's keepalive state.
#[derive(Debug, Default)]
pub(crate) struct KaState {
    /// The QP's settings, chosen when it entered RTS.
    pub cfg: Option<Keepalive>,
    /// When the peer was last heard from (or the QP entered RTS).
    pub heard: u64,
    /// When to look again (None: off, or the QP is not in RTS/SQD).
    pub deadline: Option<u64>,
    /// Probes sent since the peer was last heard from.
    pub sent: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_settings() {
        assert_eq!(Keepalive::parse("0"), Ok(None));
        assert_eq!(Keepalive::parse(" off "), Ok(None));
        assert_eq!(Keepalive::parse("250, 150,5"), Ok(Some(Keepalive::LOCAL)));
        assert_eq!(
            Keepalive::parse("10000,2000,5"),
            Ok(Some(Keepalive::REMOTE))
        );
        for bad in [
            "", "1,2", "1,2,3,4", "0,1,1", "1,0,1", "1,1,0", "1,1,256", "a,b,c",
        ] {
            assert!(Keepalive::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Keepalive::LOCAL.bound_ns(), 1_000 * MS);
        assert_eq!(Keepalive::REMOTE.bound_ns(), 20_000 * MS);
    }
}
