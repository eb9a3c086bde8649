//! Receive demultiplexing: a datagram's ICRC and headers are checked, then it goes to
//! the QP it names (its responder or its completer), to the GSI, to the members of a
//! multicast group, or to the SACK handler.

use std::net::{IpAddr, SocketAddr};

use softrdma_wire::{self as wire, Addrs, Headers};

use crate::device_ctx::DeviceCtx;
use crate::qp::QpCtx;
use crate::verbs::{self, QpState, QpType};
use crate::{completer, gsi, liveness, requester, responder, sack, same_ip, Rnic};

impl Rnic {
    /// A UDP datagram arrived from `src` to `dst` (our address), with IP TOS 0: see
    /// [`Rnic::handle_datagram_tos`].
    pub fn handle_datagram(&mut self, now: u64, src: SocketAddr, dst: SocketAddr, data: &[u8]) {
        self.handle_datagram_tos(now, src, dst, 0, data)
    }

    /// A UDP datagram arrived from `src` to `dst` (our address) with IP TOS / traffic
    /// class `tos` (which a UD receive reports in the GRH it places before the payload).
    /// Checks the ICRC for any IPv4 ID (bad: counted, dropped), parses (malformed:
    /// counted, dropped) and dispatches to the responder (requests) or the completer
    /// (responses) of the destination QP, or to the GSI inbox ([`Rnic::take_gsi`]) when
    /// the destination is QP1.
    pub fn handle_datagram_tos(
        &mut self,
        now: u64,
        src: SocketAddr,
        dst: SocketAddr,
        tos: u8,
        data: &[u8],
    ) {
        self.receive(now, src, dst, tos, data, false)
    }

    /// A datagram that came through a same-host ring rather than the network: as
    /// [`Rnic::handle_datagram_tos`], and a placed WRITE ([`wire::ext::PLACED_WRITE`]),
    /// whose payload its requester copied into our memory itself, is taken only here.
    pub fn handle_datagram_from_ring(
        &mut self,
        now: u64,
        src: SocketAddr,
        dst: SocketAddr,
        tos: u8,
        data: &[u8],
    ) {
        self.receive(now, src, dst, tos, data, true)
    }

    fn receive(
        &mut self,
        now: u64,
        src: SocketAddr,
        dst: SocketAddr,
        tos: u8,
        data: &[u8],
        via_ring: bool,
    ) {
        let env = &mut self.env;
        env.stats.rx_packets += 1;
        env.stats.rx_bytes += data.len() as u64;
        if data.len() < wire::BTH_LEN + wire::ICRC_LEN {
            tracing::debug!(
                peer = %src,
                len = data.len(),
                counter = "malformed",
                reason = "shorter than a BTH and an ICRC",
                "packet dropped"
            );
            env.stats.malformed += 1;
            return;
        }
        let addrs = Addrs::new(src, dst);
        // The ICRC guards against corruption on a wire; a same-host ring is memory, which
        // corrupts nothing, and a hostile peer there can seal whatever it writes anyway
        // (what follows checks every field as for any packet). Not checked from a ring.
        //
        // The ICRC covers the IPv4 ID, which a UDP socket does not report. softrdma sends
        // ID 0 (the fast path) and numbers GSO segments from 0; Linux rxe numbers its
        // packets. Some ID makes the ICRC of a corrupted packet right with probability
        // about 2^-16, so the ID must also be one this sender plausibly used.
        let solved = if via_ring {
            None
        } else {
            wire::icrc::verify_unknown_ip_id_with(&mut env.ip_ids, &addrs, data)
        };
        let believed = via_ring
            || match (solved, src.ip().to_canonical()) {
                (Some(id), IpAddr::V4(ip)) => env.ip_id_guard.admit(now, ip, id),
                (solved, _) => solved.is_some(),
            };
        if !believed {
            // The header fields may be the corrupted ones: they are what the packet claims.
            // (The length was checked above, so the view always exists.)
            let claims = wire::BthView::new_checked(data).ok();
            tracing::debug!(
                peer = %src,
                len = data.len(),
                qpn = format_args!("{:#x}", claims.map_or(0, |b| b.dest_qp())),
                psn = claims.map_or(0, |b| b.psn()),
                opcode = %claims.map_or(wire::Opcode(0), |b| b.opcode()),
                ip_id = ?solved,
                counter = "icrc_errors",
                reason = if solved.is_some() {
                    "ICRC right only for an IPv4 ID off the sender's count"
                } else {
                    "bad ICRC"
                },
                "packet dropped"
            );
            env.stats.icrc_errors += 1;
            return;
        }
        // A placed WRITE is parsed as the WRITE ONLY whose headers it carries.
        let as_write;
        let (data, placed) = match wire::ext::placed_as(wire::Opcode(data[0])) {
            Some(op) if via_ring => {
                as_write = {
                    let mut v = data.to_vec();
                    v[0] = op.0;
                    v
                };
                (&as_write[..], true)
            }
            Some(_) => {
                tracing::debug!(
                    peer = %src,
                    counter = "malformed",
                    reason = "a placed WRITE from the network (taken only from a same-host ring)",
                    "packet dropped"
                );
                env.stats.malformed += 1;
                return;
            }
            None => (data, false),
        };
        if wire::ext::is_vendor(wire::Opcode(data[0])) {
            self.receive_ext(now, src, data);
            return;
        }
        let (h, payload) = match Headers::parse(data) {
            Ok(parsed) => parsed,
            Err(e) => return unparsed(env, src, data, e),
        };
        let Some(info) = h.bth.opcode.info() else {
            tracing::debug!(
                peer = %src,
                opcode = %h.bth.opcode,
                counter = "malformed",
                reason = "unknown opcode",
                "packet dropped"
            );
            env.stats.malformed += 1;
            return;
        };
        // QP1 is no verbs QP: its MADs go to the GSI inbox.
        if h.bth.dest_qp == wire::cm::GSI_QPN {
            gsi::receive(&mut self.gsi, env, src, tos, &h, payload);
            return;
        }
        if !crate::default_partition(h.bth.pkey) {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", h.bth.dest_qp),
                psn = h.bth.psn,
                opcode = %h.bth.opcode,
                pkey = format_args!("{:#06x}", h.bth.pkey),
                counter = "dropped",
                reason = "P_Key not in the default partition",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        }
        if h.bth.dest_qp == wire::MULTICAST_QPN {
            self.receive_multicast(now, &addrs, tos, &h, payload, data.len(), info);
            return;
        }
        let Some(qp) = self.qps.get_mut(&h.bth.dest_qp) else {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", h.bth.dest_qp),
                psn = h.bth.psn,
                opcode = %h.bth.opcode,
                counter = "dropped",
                reason = "unknown QP",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        };
        if !admit(qp, env, info, &h, src) {
            return;
        }
        liveness::heard(qp, now);
        if placed && qp.qp_type != QpType::Rc {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", h.bth.dest_qp),
                counter = "dropped",
                reason = "a placed WRITE for a QP that is not RC",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        }
        if info.is_request {
            responder::handle_request(qp, env, now, &addrs, tos, &h, payload, data.len(), placed);
        } else {
            completer::handle_response(qp, env, now, src.port(), &h, payload);
        }
        self.sync_timer(h.bth.dest_qp);
    }

    /// One of softrdma's extension messages ([`wire::ext`]) with a good ICRC: taken only
    /// by an RC QP, in a state that speaks to its peer, from the connected peer's IP and
    /// the UDP port that peer was learnt to send from (counted and dropped otherwise).
    fn receive_ext(&mut self, now: u64, src: SocketAddr, data: &[u8]) {
        use wire::ext::Ext;
        let env = &mut self.env;
        let m = match Ext::parse(data) {
            Ok(m) => m,
            Err(e) => return unparsed(env, src, data, e),
        };
        let (Ext::SackPermit(bth) | Ext::Sack(bth, _)) = m;
        let qp = self.qps.get_mut(&bth.dest_qp);
        let ok = qp.as_ref().is_some_and(|qp| {
            let state_ok = match m {
                Ext::SackPermit(_) => matches!(
                    qp.state,
                    QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
                ),
                Ext::Sack(..) => matches!(qp.state, QpState::Rts | QpState::Sqd),
            };
            qp.qp_type == QpType::Rc
                && state_ok
                && crate::default_partition(bth.pkey)
                && qp.peer.is_some_and(|p| same_ip(p.ip(), src.ip()))
                && qp.peer_port == Some(src.port())
        });
        let Some(qp) = qp.filter(|_| ok) else {
            tracing::debug!(
                peer = %src,
                qpn = format_args!("{:#x}", bth.dest_qp),
                psn = bth.psn,
                opcode = %bth.opcode,
                counter = "dropped",
                reason = "no RC QP here takes it from that address and port",
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        };
        liveness::heard(qp, now);
        match m {
            Ext::SackPermit(_) => sack::on_permit(qp, env),
            Ext::Sack(b, bits) => {
                sack::on_sack(qp, env, now, b.psn, bits);
                // Packets the SACK shows held are in flight no more: the window they
                // leave is used now, not at the next acknowledgement or post.
                requester::run(qp, env, now);
            }
        }
        self.sync_timer(bth.dest_qp);
    }

    /// A datagram to the multicast QPN: a copy for every QP attached to the group its
    /// destination IP names (rxe's `rxe_rcv_mcast_pkt`), each QP checked as for a unicast
    /// datagram (service, state, then Q_Key in the responder) and given its own receive
    /// WQE. Dropped when the destination is not a multicast address or no QP of this
    /// device is attached to the group.
    #[allow(clippy::too_many_arguments)]
    fn receive_multicast(
        &mut self,
        now: u64,
        addrs: &Addrs,
        tos: u8,
        h: &Headers,
        payload: &[u8],
        udp_len: usize,
        info: &wire::OpcodeInfo,
    ) {
        let env = &mut self.env;
        let mgid = verbs::Gid::from_ip(addrs.dst.ip());
        let reason = if !mgid.is_multicast() {
            Some("multicast QPN to a unicast address")
        } else if env.ctx.mcast_members(&mgid).is_empty() {
            Some("no QP attached to the multicast group")
        } else {
            None
        };
        if let Some(reason) = reason {
            tracing::debug!(
                peer = %addrs.src,
                group = %addrs.dst.ip(),
                psn = h.bth.psn,
                opcode = %h.bth.opcode,
                counter = "dropped",
                reason,
                "packet dropped"
            );
            env.stats.dropped += 1;
            return;
        }
        // Indexing rather than iterating: the responder needs the context mutably, and
        // nothing it does changes the group's members.
        for i in 0..self.env.ctx.mcast_members(&mgid).len() {
            let Some(&qpn) = self.env.ctx.mcast_members(&mgid).get(i) else {
                break;
            };
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            if admit(qp, &mut self.env, info, h, addrs.src) && info.is_request {
                responder::handle_request(
                    qp,
                    &mut self.env,
                    now,
                    addrs,
                    tos,
                    h,
                    payload,
                    udp_len,
                    false,
                );
            }
            self.sync_timer(qpn);
        }
    }
}

/// Whether QP `qp` takes a packet `h` (of opcode `info`) from `src`: its transport service
/// is the QP's, the QP's state accepts it, and an RC/UC packet comes from the connected
/// peer: its IP, and its UDP source port once the QP knows it ([`QpCtx::peer_port`])
/// (counted and logged as dropped otherwise). The first packet a QP takes in RTR
/// raises COMM_EST.
fn admit(
    qp: &mut QpCtx,
    env: &mut DeviceCtx,
    info: &wire::OpcodeInfo,
    h: &Headers,
    src: SocketAddr,
) -> bool {
    let service_ok = matches!(
        (info.service, qp.qp_type),
        (wire::ServiceType::Rc, QpType::Rc)
            | (wire::ServiceType::Uc, QpType::Uc)
            | (wire::ServiceType::Ud, QpType::Ud)
    );
    let state_ok = if info.is_request {
        matches!(
            qp.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    } else {
        matches!(qp.state, QpState::Rts | QpState::Sqd)
    };
    // RC/UC accept packets only from the connected peer's address, as rxe does, and
    // from the port it sends from once known (which rxe does not check).
    let peer_ok = match qp.peer {
        Some(p) => same_ip(p.ip(), src.ip()),
        None => true,
    };
    let port_ok = qp.peer_port.map_or(true, |p| p == src.port());
    if !service_ok || !state_ok || !peer_ok || !port_ok {
        tracing::debug!(
            peer = %src,
            qpn = format_args!("{:#x}", qp.qpn),
            psn = h.bth.psn,
            opcode = %h.bth.opcode,
            state = ?qp.state,
            qp_type = ?qp.qp_type,
            connected_peer = ?qp.peer,
            peer_port = ?qp.peer_port,
            counter = "dropped",
            reason = if !service_ok {
                "transport service differs from the QP type"
            } else if !state_ok {
                "QP state does not accept it"
            } else if !peer_ok {
                "not from the connected peer"
            } else {
                "not from the UDP port the connected peer sends from"
            },
            "packet dropped"
        );
        env.stats.dropped += 1;
        return false;
    }
    if qp.state == QpState::Rtr && !qp.resp.comm_est {
        qp.resp.comm_est = true;
        env.ctx.push_event(verbs::AsyncEvent::CommEst(qp.qpn));
    }
    true
}

/// A datagram with a good ICRC that does not parse: logged with why, and counted.
fn unparsed(env: &mut DeviceCtx, src: SocketAddr, data: &[u8], e: wire::Error) {
    tracing::debug!(
        peer = %src,
        len = data.len(),
        opcode = %wire::Opcode(data[0]),
        counter = "malformed",
        reason = %e,
        "packet dropped"
    );
    env.stats.malformed += 1;
}
