//! The GSI (QP1): the general services interface the connection manager talks through.
//! rdma_cm over RoCEv2 sends each IB CM MAD as one UD SEND_ONLY packet from QP1 to QP1
//! with Q_Key 0x80010000. QP1 is not a verbs QP here: the engine hands the MADs that
//! arrive to the layer above through a bounded inbox ([`Rnic::take_gsi`]) and sends the
//! MADs it is given ([`Rnic::send_gsi`]), shaping the packets as Linux rxe does.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

use softrdma_wire::cm::{
    msg_response, rej_reason, CmMsg, Rej, SidrRep, GSI_QKEY, GSI_QPN, MAD_LEN,
};
use softrdma_wire::{psn, Bth, Deth, Headers, Opcode};

use crate::device_ctx::DeviceCtx;
use crate::Rnic;

/// MADs the inbox holds at most, so a peer flooding QP1 costs under 300 KiB; what
/// arrives past it is dropped and counted, as a UD packet finding no receive WQE is.
pub const GSI_INBOX_MAX: usize = 1024;

/// A MAD that arrived on QP1, with what the CM needs to answer it (the sender's address
/// and QP, and the traffic class to answer with).
#[derive(Clone, PartialEq, Eq)]
pub struct GsiMad {
    /// The sender's IP (an IPv4-mapped IPv6 address is given as IPv4).
    pub src: IpAddr,
    /// The sender's QP (DETH source QP): 1 for a CM.
    pub src_qpn: u32,
    /// The IP TOS / traffic class byte the datagram carried.
    pub tos: u8,
    /// The BTH P_Key (a member of the default partition, or it would have been dropped).
    pub pkey: u16,
    /// The MAD, header included.
    pub mad: [u8; MAD_LEN],
}

impl std::fmt::Debug for GsiMad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The MAD header names the message; 256 bytes of it would drown a log line.
        f.debug_struct("GsiMad")
            .field("src", &self.src)
            .field("src_qpn", &self.src_qpn)
            .field("tos", &self.tos)
            .field("pkey", &format_args!("{:#06x}", self.pkey))
            .field("mad_header", &&self.mad[..24])
            .finish_non_exhaustive()
    }
}

/// The GSI's state: MADs received and not yet taken, and the send PSN.
#[derive(Debug, Default)]
pub(crate) struct Gsi {
    inbox: VecDeque<GsiMad>,
    /// PSN of the next MAD sent. Starts at 0: the kernel's MAD layer moves QP1 to RTS
    /// with SQ PSN 0, and rxe counts up from there, one per packet.
    next_psn: u32,
    /// A connection manager takes the inbox ([`Rnic::set_gsi_consumer`]).
    consumer: bool,
    /// QPs whose peer the keepalive found lost, for the connection manager
    /// ([`Rnic::take_lost_peer`]); each QP at most once, as it is in ERR after.
    lost: VecDeque<crate::verbs::Qpn>,
}

/// QP `qpn`'s peer was found lost (see [`crate::keepalive`]): the connection manager is
/// told, which disconnects the connection the QP serves; with none, the consumer gets
/// the QP's fatal event.
pub(crate) fn peer_lost(gsi: &mut Gsi, env: &mut DeviceCtx, qpn: crate::verbs::Qpn) {
    if gsi.consumer {
        gsi.lost.push_back(qpn);
    } else {
        env.ctx.push_event(crate::verbs::AsyncEvent::QpFatal(qpn));
    }
}

/// A packet to QP1 not taken: count it and say why.
fn drop_gsi(env: &mut DeviceCtx, src: SocketAddr, h: &Headers, reason: &'static str) {
    env.stats.gsi_dropped += 1;
    tracing::debug!(
        peer = %src,
        qpn = format_args!("{:#x}", h.bth.dest_qp),
        psn = h.bth.psn,
        opcode = %h.bth.opcode,
        src_qpn = format_args!("{:#x}", h.deth.map_or(0, |d| d.src_qp)),
        qkey = format_args!("{:#x}", h.deth.map_or(0, |d| d.qkey)),
        counter = "gsi_dropped",
        reason,
        "packet dropped"
    );
}

/// A checked datagram (ICRC right, headers parsed) to QP1: into the inbox if it is a MAD
/// as the GSI takes them, else dropped and counted.
pub(crate) fn receive(
    gsi: &mut Gsi,
    env: &mut DeviceCtx,
    src: SocketAddr,
    tos: u8,
    h: &Headers,
    payload: &[u8],
) {
    if !crate::default_partition(h.bth.pkey) {
        return drop_gsi(env, src, h, "P_Key not in the default partition");
    }
    if h.bth.opcode != Opcode::UD_SEND_ONLY {
        return drop_gsi(env, src, h, "not a UD SEND_ONLY");
    }
    let Some(deth) = h.deth else {
        return drop_gsi(env, src, h, "UD request without a DETH");
    };
    if deth.qkey != GSI_QKEY {
        return drop_gsi(env, src, h, "Q_Key is not the GSI's");
    }
    let Ok(mad) = <[u8; MAD_LEN]>::try_from(payload) else {
        return drop_gsi(env, src, h, "payload is not one MAD");
    };
    if !gsi.consumer {
        // Nobody here runs a CM: answer as a Linux host's CM with nothing open does, so a
        // peer's connect is refused at once instead of timing out after a minute.
        env.stats.gsi_unserved += 1;
        if let Some(answer) = answer_without_cm(&mad) {
            let dst = SocketAddr::new(src.ip().to_canonical(), env.addr.port());
            send(gsi, env, dst, deth.src_qp, tos, &answer);
        }
        return;
    }
    if gsi.inbox.len() >= GSI_INBOX_MAX {
        return drop_gsi(env, src, h, "GSI inbox full");
    }
    gsi.inbox.push_back(GsiMad {
        src: src.ip().to_canonical(),
        src_qpn: deth.src_qp,
        tos,
        pkey: h.bth.pkey,
        mad,
    });
}

/// What a CM that has nothing (no listener, no connection) answers to the MAD `mad`, as
/// the Linux CM does for every RoCE device whether or not a program uses rdma_cm: a REQ
/// gets a REJ "invalid service ID" (8), a SIDR_REQ a SIDR_REP "unsupported", a DREQ a
/// DREP (so a peer stops asking); anything else, and what does not parse, gets nothing.
fn answer_without_cm(mad: &[u8]) -> Option<[u8; MAD_LEN]> {
    let (h, msg) = CmMsg::parse(mad).ok()?;
    let answer = match msg {
        CmMsg::Req(req) => CmMsg::Rej(Box::new(Rej::new(
            0,
            req.local_comm_id,
            msg_response::REQ,
            rej_reason::INVALID_SERVICE_ID,
            &[],
            &[],
        ))),
        CmMsg::SidrReq(req) => CmMsg::SidrRep(Box::new(SidrRep::unsupported(&req))),
        CmMsg::Dreq(dreq) => CmMsg::Drep(Box::new(dreq.drep())),
        _ => return None,
    };
    Some(answer.emit(h.tid))
}

impl Rnic {
    /// The oldest MAD received on QP1 and not yet taken.
    pub fn take_gsi(&mut self) -> Option<GsiMad> {
        self.gsi.inbox.pop_front()
    }

    /// Whether a connection manager takes the MADs QP1 receives ([`Rnic::take_gsi`]).
    /// Until one does (and after it stops), the GSI keeps no inbox: it answers a REQ,
    /// SIDR_REQ or DREQ as a CM with no listener and no connection would
    /// (`answer_without_cm`), drops the rest and counts them all in
    /// [`Stats::gsi_unserved`](crate::Stats::gsi_unserved). Stopping empties the inbox.
    pub fn set_gsi_consumer(&mut self, on: bool) {
        self.gsi.consumer = on;
        if !on {
            self.gsi.inbox.clear();
            // Nobody will disconnect their connections: their QPs' consumers hear it.
            while let Some(qpn) = self.gsi.lost.pop_front() {
                self.raise_qp_fatal(qpn);
            }
        }
    }

    /// Whether a MAD or a lost-peer notice ([`Rnic::take_lost_peer`]) waits for the
    /// connection manager (a runtime signals its CM with this).
    pub fn gsi_pending(&self) -> bool {
        !self.gsi.inbox.is_empty() || !self.gsi.lost.is_empty()
    }

    /// The oldest QP whose peer the keepalive found lost ([`crate::Keepalive`]) while a
    /// connection manager takes the GSI: the QP is in ERR already, and the CM ends the
    /// connection it serves as the peer's DREQ would have.
    pub fn take_lost_peer(&mut self) -> Option<crate::verbs::Qpn> {
        self.gsi.lost.pop_front()
    }

    /// Raise QP `qpn`'s `IBV_EVENT_QP_FATAL` (if the QP still exists): how a lost peer
    /// is reported for a QP no connection manager serves.
    pub fn raise_qp_fatal(&mut self, qpn: crate::verbs::Qpn) {
        if self.qps.contains_key(&qpn) {
            self.env
                .ctx
                .push_event(crate::verbs::AsyncEvent::QpFatal(qpn));
        }
    }

    /// Send a MAD from QP1 to QP `dst_qpn` (1 for a CM) at `dst`, on our UDP port, with IP
    /// TOS `tos`. The packet is what rxe sends from its GSI QP: UD SEND_ONLY, P_Key
    /// 0xFFFF, AckReq set, the GSI's own PSN sequence, DETH Q_Key 0x80010000 and source
    /// QP 1, from UDP source port `udp_src_port(1)`. It is queued for
    /// [`Rnic::poll_transmit`] as a request, which a runtime sends at once.
    pub fn send_gsi(&mut self, dst: IpAddr, dst_qpn: u32, tos: u8, mad: &[u8; MAD_LEN]) {
        let dst = SocketAddr::new(dst, self.env.addr.port());
        send(&mut self.gsi, &mut self.env, dst, dst_qpn, tos, mad);
    }
}

/// [`Rnic::send_gsi`] to the device at `dst`.
fn send(
    gsi: &mut Gsi,
    env: &mut DeviceCtx,
    dst: SocketAddr,
    dst_qpn: u32,
    tos: u8,
    mad: &[u8; MAD_LEN],
) {
    let pkt_psn = gsi.next_psn;
    gsi.next_psn = psn::add(pkt_psn, 1);
    let mut bth = Bth::new(Opcode::UD_SEND_ONLY, dst_qpn, pkt_psn);
    // rxe sets AckReq on the last packet of a message of every QP type but UD and UC;
    // its GSI QP is a type of its own, so its MADs carry it (the receiver ignores it).
    bth.ack_req = true;
    let mut h = Headers::new(bth);
    h.deth = Some(Deth {
        qkey: GSI_QKEY,
        src_qp: GSI_QPN,
    });
    env.send(GSI_QPN, dst, tos, &h, mad);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{pump, Node};
    use crate::TransmitKind;
    use softrdma_testkit::cm;
    use softrdma_wire::cm::{
        port_space, private_len, service_id, sidr_status, Dreq, Ids, Req, Rtu, SidrReq,
    };
    use softrdma_wire::{icrc, udp_src_port, Addrs, DEFAULT_PKEY, ROCEV2_UDP_PORT};

    const A: &str = "10.0.0.1";
    const B: &str = "10.0.0.2";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A MAD whose bytes all differ from their neighbours', tagged with `tag`.
    fn mad(tag: u8) -> [u8; MAD_LEN] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(7).wrapping_add(tag))
    }

    /// Two nodes whose MADs a connection manager takes.
    fn nodes() -> (Node, Node) {
        let (mut a, mut b) = (Node::new(A, 1), Node::new(B, 2));
        a.nic.set_gsi_consumer(true);
        b.nic.set_gsi_consumer(true);
        (a, b)
    }

    /// A sealed packet from A to B with headers `h` and `payload`.
    fn packet(h: &Headers, payload: &[u8]) -> (SocketAddr, SocketAddr, Vec<u8>) {
        let src = SocketAddr::new(ip(A), udp_src_port(GSI_QPN));
        let dst = SocketAddr::new(ip(B), ROCEV2_UDP_PORT);
        let mut data = vec![0u8; h.packet_len(payload.len())];
        h.emit(payload, &mut data).unwrap();
        icrc::seal(&Addrs::new(src, dst), &mut data);
        (src, dst, data)
    }

    /// The headers of a MAD as a CM sends it, with PSN `psn`.
    fn gsi_headers(psn: u32) -> Headers {
        let mut h = Headers::new(Bth::new(Opcode::UD_SEND_ONLY, GSI_QPN, psn));
        h.deth = Some(Deth {
            qkey: GSI_QKEY,
            src_qp: GSI_QPN,
        });
        h
    }

    #[test]
    fn sent_mad_is_what_rxe_sends_and_arrives_whole() {
        let (mut a, mut b) = nodes();
        let m = mad(3);
        a.nic.send_gsi(ip(B), GSI_QPN, 0x28, &m);
        let t = a.nic.poll_transmit(0).expect("the MAD's packet");
        assert_eq!(t.src, SocketAddr::new(ip(A), udp_src_port(1)));
        assert_eq!(t.dst, SocketAddr::new(ip(B), 4791));
        assert_eq!((t.tos, t.kind), (0x28, TransmitKind::Request));
        assert_eq!(t.data.len(), 12 + 8 + MAD_LEN + 4);
        assert!(icrc::verify(&Addrs::new(t.src, t.dst), &t.data));
        let (h, payload) = Headers::parse(&t.data).unwrap();
        assert_eq!(h.bth.opcode, Opcode::UD_SEND_ONLY);
        assert_eq!(h.bth.dest_qp, 1);
        assert_eq!(h.bth.pkey, DEFAULT_PKEY);
        assert_eq!(h.bth.psn, 0);
        assert!(h.bth.ack_req);
        assert!(!h.bth.solicited && !h.bth.mig_req && !h.bth.fecn && !h.bth.becn);
        assert_eq!((h.bth.pad, h.bth.tver), (0, 0));
        assert_eq!(
            h.deth,
            Some(Deth {
                qkey: 0x8001_0000,
                src_qp: 1
            })
        );
        assert_eq!(payload, m);
        // The same bytes, field by field: BTH, then DETH.
        assert_eq!(
            t.data[..12],
            [0x64, 0, 0xFF, 0xFF, 0, 0, 0, 1, 0x80, 0, 0, 0]
        );
        assert_eq!(t.data[12..20], [0x80, 0x01, 0, 0, 0, 0, 0, 1]);

        b.nic.handle_datagram_tos(0, t.src, t.dst, t.tos, &t.data);
        assert!(b.nic.gsi_pending());
        let got = b.nic.take_gsi().expect("the MAD");
        assert_eq!(got.src, ip(A));
        assert_eq!((got.src_qpn, got.tos, got.pkey), (1, 0x28, 0xFFFF));
        assert_eq!(got.mad, m);
        assert!(!b.nic.gsi_pending());
        assert!(b.nic.take_gsi().is_none());
        assert_eq!(b.nic.stats().gsi_dropped, 0);
        assert_eq!(b.nic.stats().dropped, 0);
    }

    #[test]
    fn mads_cross_the_sim_in_order_with_consecutive_psns() {
        let (mut a, mut b) = nodes();
        let mut psns = Vec::new();
        for k in 0..3 {
            a.nic.send_gsi(ip(B), GSI_QPN, 0, &mad(k));
        }
        let mut now = 0;
        pump(&mut a, &mut b, &mut now, |_, t| {
            psns.push(Headers::parse(&t.data).unwrap().0.bth.psn);
            false
        });
        assert_eq!(psns, [0, 1, 2]);
        for k in 0..3 {
            let got = b.nic.take_gsi().expect("a MAD");
            assert_eq!((got.src, got.src_qpn), (ip(A), 1));
            assert_eq!(got.mad, mad(k));
        }
        assert!(b.nic.take_gsi().is_none());
        // Nothing came back: QP1 answers nothing by itself.
        assert!(a.nic.take_gsi().is_none());
        assert_eq!(a.nic.stats().rx_packets, 0);
    }

    #[test]
    fn any_destination_qp_and_mapped_source_address() {
        let (mut a, mut b) = nodes();
        a.nic.send_gsi(ip(B), 0x12_3456, 0, &mad(0));
        let t = a.nic.poll_transmit(0).unwrap();
        assert_eq!(Headers::parse(&t.data).unwrap().0.bth.dest_qp, 0x12_3456);
        // From an IPv4-mapped IPv6 address, as a dual-stack socket reports IPv4 peers:
        // the ICRC is the same, and the MAD's source is the plain IPv4 address.
        let m = mad(9);
        let (src, dst, data) = packet(&gsi_headers(5), &m);
        let mapped = SocketAddr::new(ip("::ffff:10.0.0.1"), src.port());
        b.nic.handle_datagram(0, mapped, dst, &data);
        let got = b.nic.take_gsi().expect("the MAD");
        assert_eq!(got.src, ip(A));
        assert_eq!(got.mad, m);
    }

    #[test]
    fn what_is_not_a_gsi_mad_is_dropped_and_counted() {
        let (_, mut b) = nodes();
        let m = mad(1);
        let mut cases: Vec<(&str, Headers, Vec<u8>)> = Vec::new();
        let mut h = gsi_headers(0);
        h.deth = Some(Deth {
            qkey: 0x8001_0001,
            src_qp: 1,
        });
        cases.push(("wrong Q_Key", h, m.to_vec()));
        let mut h = gsi_headers(0);
        h.deth = Some(Deth {
            qkey: 0x1111_1111,
            src_qp: 1,
        });
        cases.push(("a UD QP's Q_Key", h, m.to_vec()));
        let mut h = gsi_headers(0);
        h.bth.opcode = Opcode::UD_SEND_ONLY_IMM;
        h.imm = Some(7);
        cases.push(("with immediate", h, m.to_vec()));
        let h = Headers::new(Bth::new(Opcode::RC_SEND_ONLY, GSI_QPN, 0));
        cases.push(("RC SEND", h, m.to_vec()));
        let h = Headers::new(Bth::new(Opcode::UC_SEND_ONLY, GSI_QPN, 0));
        cases.push(("UC SEND", h, m.to_vec()));
        cases.push(("short", gsi_headers(0), m[..MAD_LEN - 1].to_vec()));
        cases.push(("4 bytes short", gsi_headers(0), m[..MAD_LEN - 4].to_vec()));
        let mut long = m.to_vec();
        long.extend_from_slice(&[0; 4]);
        cases.push(("long", gsi_headers(0), long));
        cases.push(("empty", gsi_headers(0), Vec::new()));
        let mut h = gsi_headers(0);
        h.bth.pkey = 0x8001;
        cases.push(("another partition", h, m.to_vec()));
        for (n, (what, h, payload)) in cases.iter().enumerate() {
            let (src, dst, data) = packet(h, payload);
            b.nic.handle_datagram(0, src, dst, &data);
            assert_eq!(b.nic.stats().gsi_dropped, n as u64 + 1, "{what}");
            assert!(!b.nic.gsi_pending(), "{what}");
        }
        // Counted as GSI drops only, and no malformed or ICRC error among them.
        let s = b.nic.stats();
        assert_eq!((s.dropped, s.malformed, s.icrc_errors), (0, 0, 0));
        // A limited member of the default partition is in it, as rxe's check has it.
        let mut h = gsi_headers(0);
        h.bth.pkey = 0x7FFF;
        let (src, dst, data) = packet(&h, &m);
        b.nic.handle_datagram(0, src, dst, &data);
        assert_eq!(b.nic.take_gsi().map(|g| (g.pkey, g.mad)), Some((0x7FFF, m)));
        assert_eq!(b.nic.stats().gsi_dropped, cases.len() as u64);
    }

    #[test]
    fn inbox_is_bounded_and_keeps_the_oldest() {
        let (_, mut b) = nodes();
        let extra = 5;
        for k in 0..GSI_INBOX_MAX + extra {
            let mut m = [0u8; MAD_LEN];
            m[..4].copy_from_slice(&(k as u32).to_be_bytes());
            let (src, dst, data) = packet(&gsi_headers(k as u32), &m);
            b.nic.handle_datagram(0, src, dst, &data);
        }
        assert_eq!(b.nic.stats().gsi_dropped, extra as u64);
        let mut taken = 0u32;
        while let Some(g) = b.nic.take_gsi() {
            assert_eq!(g.mad[..4], taken.to_be_bytes(), "in arrival order");
            taken += 1;
        }
        assert_eq!(taken as usize, GSI_INBOX_MAX);
        // Room again once taken.
        let (src, dst, data) = packet(&gsi_headers(0), &mad(2));
        b.nic.handle_datagram(0, src, dst, &data);
        assert!(b.nic.gsi_pending());
        assert_eq!(b.nic.stats().gsi_dropped, extra as u64);
    }

    #[test]
    fn a_cm_with_nothing_open_refuses_requests_and_answers_disconnects() {
        let tid = 0x1122_3344_5566_7788;
        let answer = |m: CmMsg| answer_without_cm(&m.emit(tid)).map(|a| CmMsg::parse(&a).unwrap());

        let req = Req {
            local_comm_id: 0xA1B2_C3D4,
            ..cm::req(service_id(port_space::TCP, 7174), 0x12_3456, 0xAB_CDEF)
        };
        let (h, rej) = answer(CmMsg::Req(Box::new(req))).expect("a REQ is answered");
        assert_eq!(h.tid, tid);
        let CmMsg::Rej(rej) = rej else {
            panic!("not a REJ: {rej:?}")
        };
        assert_eq!((rej.local_comm_id, rej.remote_comm_id), (0, 0xA1B2_C3D4));
        assert_eq!(rej.message_rejected, msg_response::REQ);
        assert_eq!(rej.reason, rej_reason::INVALID_SERVICE_ID);
        assert_eq!(rej.rejected_info_length, 0);

        let sidr = SidrReq {
            request_id: 77,
            pkey: 0xFFFF,
            service_id: service_id(port_space::UDP, 7174),
            private_data: [3; private_len::SIDR_REQ],
        };
        let (_, rep) = answer(CmMsg::SidrReq(Box::new(sidr))).expect("a SIDR_REQ is answered");
        let CmMsg::SidrRep(rep) = rep else {
            panic!("not a SIDR_REP: {rep:?}")
        };
        assert_eq!((rep.request_id, rep.status), (77, sidr_status::UNSUPPORTED));
        assert_eq!(rep.service_id, service_id(port_space::UDP, 7174));
        assert_eq!((rep.qpn, rep.qkey), (0, 0));

        let dreq = Dreq {
            ids: Ids {
                local_comm_id: 5,
                remote_comm_id: 9,
                private_data: [0; private_len::DREQ],
            },
            remote_qpn: 0x11,
        };
        let (_, drep) = answer(CmMsg::Dreq(Box::new(dreq))).expect("a DREQ is answered");
        let CmMsg::Drep(drep) = drep else {
            panic!("not a DREP: {drep:?}")
        };
        assert_eq!((drep.local_comm_id, drep.remote_comm_id), (9, 5));

        // Answers and what cannot be parsed get nothing.
        let rtu = Rtu {
            local_comm_id: 1,
            remote_comm_id: 2,
            private_data: [0; private_len::RTU],
        };
        assert!(answer(CmMsg::Rtu(Box::new(rtu))).is_none());
        let rej = Rej::new(
            1,
            2,
            msg_response::REQ,
            rej_reason::CONSUMER_REJECT,
            &[],
            b"no",
        );
        assert!(answer(CmMsg::Rej(Box::new(rej))).is_none());
        assert!(answer_without_cm(&[0u8; MAD_LEN]).is_none());
        assert!(answer_without_cm(&[1u8; 12]).is_none());
    }
}
