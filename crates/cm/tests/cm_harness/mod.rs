//! The CM fuzz harness, shared by the stable test `crates/cm/tests/cm_fuzz.rs` and the
//! cargo-fuzz target `fuzz/fuzz_targets/cm.rs`.
//!
//! Two live rdma_cm models ([`Cma`]) — a client at 127.0.0.3 and a server at 127.0.0.7
//! listening on the wildcard address — establish one connection, then an input (any
//! bytes) drives them: MADs of random bytes, genuine MADs seen on the wire replayed with
//! mutations, well-formed REJ / DREQ / DREP / RTU / MRA / REP / REQ naming the live
//! connection's comm IDs, QPNs and CA GUIDs (what an observer of the handshake can forge),
//! and REQs built to reach the listener, each sent to either side from the other side's
//! address or from an address that is not a peer; time passing (timers, retransmissions,
//! timewait); and a server program that accepts, rejects or holds each request and
//! destroys what failed. When a MAD from the peer's address ends the connection, both
//! programs let go and connect again. After every step:
//!
//! - nothing panicked;
//! - each side's tables are bounded: protocol connections by the half-open cap plus what
//!   the programs hold, ids by the listener's backlog plus the half-open cap, timers by
//!   connections;
//! - a MAD from an address that is not the connection's peer changed nothing of the
//!   established connection on either side (ids, protocol states, events), even after
//!   whatever it made either side send was delivered.

// Beside this directory, so that the fuzz target, which takes this file by its path,
// finds it too.
#[path = "../common/mod.rs"]
mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use softrdma_cm::cma::{Cma, CmaEvent, ConnParam, EventType, IdHandle, IdState};
use softrdma_cm::ib::{CommId, Peer, State};
use softrdma_testkit::cm;
use softrdma_wire::cm::{
    port_space, rej_reason, service_id, CmMsg, CmPath, CmaHeader, Dreq, Ids, Mra, Rej, Rep, Req,
    MAD_LEN,
};
use softrdma_wire::SplitMix64;

use common::{ip, OneHost};

/// The listener's port.
const PORT: u16 = 7471;
/// The listener's backlog.
const BACKLOG: i32 = 8;
/// The half-open cap of both sides, small so that the fuzzer reaches it.
const HALF_OPEN: usize = 8;
/// Genuine MADs kept for mutated replays.
const KEEP: usize = 32;

/// Addresses that are nobody's peer.
fn stranger(k: u8) -> Peer {
    let ip = match k % 4 {
        0 => ip(66),
        1 => ip(99),
        2 => IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)),
        _ => IpAddr::V6(Ipv6Addr::LOCALHOST),
    };
    Peer {
        ip,
        qpn: if k & 0x10 != 0 { 1 } else { u32::from(k) },
    }
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    /// Inputs run.
    pub runs: u64,
    /// MADs injected from the peer's address.
    pub from_peer: u64,
    /// MADs injected from other addresses.
    pub from_others: u64,
    /// Genuine MADs delivered between the sides.
    pub genuine: u64,
    /// Connection requests the server program saw.
    pub requests: u64,
    /// REQs the protocol dropped at the half-open cap.
    pub refused: u64,
    /// Runs in which the established connection survived every injection.
    pub survived: u64,
    /// Strangers' MADs injected while the connection was established (each checked).
    pub checked: u64,
}

impl Counts {
    /// Add another run's counts.
    pub fn add(&mut self, o: &Counts) {
        self.runs += o.runs;
        self.from_peer += o.from_peer;
        self.from_others += o.from_others;
        self.genuine += o.genuine;
        self.requests += o.requests;
        self.refused += o.refused;
        self.survived += o.survived;
        self.checked += o.checked;
    }

    /// MADs injected.
    pub fn injected(&self) -> u64 {
        self.from_peer + self.from_others
    }
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} runs, {} MADs injected ({} from the peer's address, {} from others), {} genuine, \
             {} requests, {} refused at the half-open cap, {} strangers' MADs checked against \
             the live connection, {} runs kept it",
            self.runs,
            self.injected(),
            self.from_peer,
            self.from_others,
            self.genuine,
            self.requests,
            self.refused,
            self.checked,
            self.survived
        )
    }
}

/// Bytes of the input, then zeros: any input decodes.
struct Input<'a> {
    data: &'a [u8],
    at: usize,
}

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) << 8 | u16::from(self.u8())
    }
    fn done(&self) -> bool {
        self.at >= self.data.len()
    }
}

/// The two sides and what the harness knows of them.
struct World {
    client: Cma,
    server: Cma,
    now: u64,
    /// The established connection: client id, server id, their comm IDs.
    main: Option<(IdHandle, IdHandle, CommId, CommId)>,
    /// Genuine MADs seen on the wire, with their sender's side (0 client, 1 server).
    seen: Vec<(usize, [u8; MAD_LEN])>,
    /// Ids the server program holds that came from requests, by when they came.
    held: Vec<IdHandle>,
    counts: Counts,
    policy: u8,
}

fn conn_param(qpn: u32) -> ConnParam {
    ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: qpn,
        ..ConnParam::default()
    }
}

/// A REQ a client at `src` would send to the listener.
fn req_to_listener(r: &mut SplitMix64, src: IpAddr) -> Req {
    let src_port = r.next_u64() as u16;
    let mut req = Req {
        local_comm_id: r.next_u64() as u32,
        local_ca_guid: r.next_u64(),
        local_qpn: r.next_u64() as u32 & 0xFF_FFFF,
        remote_cm_response_timeout: (r.next_u64() % 32) as u8,
        starting_psn: r.next_u64() as u32 & 0xFF_FFFF,
        local_cm_response_timeout: (r.next_u64() % 32) as u8,
        max_cm_retries: (r.next_u64() % 16) as u8,
        primary: CmPath {
            local_ack_timeout: (r.next_u64() % 32) as u8,
            ..CmPath::default()
        },
        ..cm::req(service_id(port_space::TCP, PORT), 0, 0)
    };
    let _ = CmaHeader {
        src_port,
        src,
        dst: ip(7),
    }
    .emit(&mut req.private_data);
    req
}

impl World {
    fn new(seed: u64) -> World {
        let host = OneHost::default();
        let mut server = Cma::new(
            SocketAddr::new(ip(7), 4791),
            0xB,
            seed ^ 7,
            Box::new(host.clone()),
        );
        let mut client = Cma::new(SocketAddr::new(ip(3), 4791), 0xA, seed ^ 3, Box::new(host));
        server.set_max_half_open(HALF_OPEN);
        client.set_max_half_open(HALF_OPEN);
        let l = server.create_id(1, port_space::TCP, None).expect("id");
        server
            .bind(l, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT))
            .expect("bind");
        server.listen(l, BACKLOG).expect("listen");
        World {
            client,
            server,
            now: 0,
            main: None,
            seen: Vec::new(),
            held: Vec::new(),
            counts: Counts::default(),
            policy: 0,
        }
    }

    fn side(&mut self, k: usize) -> &mut Cma {
        if k == 0 {
            &mut self.client
        } else {
            &mut self.server
        }
    }

    /// Deliver what each side sends to the other until both are quiet (MADs for anyone
    /// else go nowhere); the events, as (side, event).
    fn pump(&mut self) -> Vec<(usize, CmaEvent)> {
        let mut events = Vec::new();
        loop {
            let mut moved = false;
            for k in 0..2 {
                let other = ip(if k == 0 { 7 } else { 3 });
                let me = ip(if k == 0 { 3 } else { 7 });
                while let Some((to, mad)) = self.side(k).poll_transmit() {
                    if to.ip != other {
                        continue;
                    }
                    if self.seen.len() == KEEP {
                        self.seen.remove(0);
                    }
                    self.seen.push((k, mad));
                    let now = self.now;
                    self.side(1 - k).handle_mad(now, Peer::gsi(me), &mad);
                    self.counts.genuine += 1;
                    moved = true;
                }
            }
            for k in 0..2 {
                while let Some(e) = self.side(k).poll_event() {
                    events.push((k, e));
                }
            }
            if !moved {
                return events;
            }
        }
    }

    /// Connect the client to the listener and establish.
    fn establish(&mut self) {
        let now = self.now;
        let c = &mut self.client;
        let id = c.create_id(1, port_space::TCP, None).expect("id");
        c.resolve_addr(id, None, SocketAddr::new(ip(7), PORT))
            .expect("resolve");
        c.resolve_route(id).expect("route");
        c.connect(now, id, &conn_param(0x111)).expect("connect");
        let ev = self.pump();
        let sid = ev
            .iter()
            .find(|(k, e)| *k == 1 && e.event == EventType::ConnectRequest)
            .map(|(_, e)| e.id)
            .expect("request");
        self.server
            .accept(now, sid, &conn_param(0x222))
            .expect("accept");
        self.pump();
        self.client
            .accept(now, id, &ConnParam::default())
            .expect("rtu");
        let ev = self.pump();
        assert!(
            ev.iter()
                .any(|(k, e)| *k == 1 && e.event == EventType::Established),
            "not established: {ev:?}"
        );
        // The comm IDs, from the REQ and the REP on the wire.
        let (mut ccomm, mut scomm) = (None, None);
        for (k, m) in &self.seen {
            match CmMsg::parse(m).map(|x| x.1) {
                Ok(CmMsg::Req(r)) if *k == 0 => ccomm = Some(r.local_comm_id),
                Ok(CmMsg::Rep(r)) if *k == 1 => scomm = Some(r.local_comm_id),
                _ => {}
            }
        }
        let (Some(cc), Some(sc)) = (ccomm, scomm) else {
            panic!("no REQ or REP seen")
        };
        self.main = Some((id, sid, cc, sc));
    }

    /// Once the peer's address ended the connection: both programs destroy their ids,
    /// the server lets every request it holds go, and a new connection is made, so that
    /// strangers' MADs keep meeting a live one.
    fn reestablish(&mut self) {
        let Some((cid, sid, _, _)) = self.main.take() else {
            return;
        };
        let now = self.now;
        let _ = self.client.destroy_id(now, cid);
        let _ = self.server.destroy_id(now, sid);
        for h in std::mem::take(&mut self.held) {
            let _ = self.server.destroy_id(now, h);
        }
        let ev = self.pump();
        self.program(&ev);
        self.pump();
        self.establish();
    }

    /// The established connection as both sides see it; None once it is not.
    fn snapshot(&self) -> Option<(IdState, IdState, Option<State>, Option<State>)> {
        let (cid, sid, cc, sc) = self.main?;
        let s = (
            self.client.state(cid).ok()?,
            self.server.state(sid).ok()?,
            self.client.ib().state(cc),
            self.server.ib().state(sc),
        );
        (s.2 == Some(State::Established) && s.3 == Some(State::Established)).then_some(s)
    }

    /// The server program: take each request as the policy says, destroy what failed.
    /// The client program destroys nothing; the main connection's events are checked by
    /// the caller.
    fn program(&mut self, events: &[(usize, CmaEvent)]) {
        let now = self.now;
        let main = self.main.map(|m| (m.0, m.1));
        for (k, e) in events {
            if main.is_some_and(|(c, s)| (*k == 0 && e.id == c) || (*k == 1 && e.id == s)) {
                // A disconnect the peer asked for is answered, as a program would.
                if e.event == EventType::Disconnected {
                    let _ = self.side(*k).disconnect(now, e.id);
                }
                continue;
            }
            if *k != 1 {
                continue;
            }
            match e.event {
                EventType::ConnectRequest => {
                    self.counts.requests += 1;
                    self.policy = self.policy.wrapping_add(1);
                    match self.policy % 3 {
                        0 => {
                            let _ = self.server.accept(now, e.id, &conn_param(0x300));
                        }
                        1 => {
                            let _ = self.server.reject(now, e.id, b"no");
                            let _ = self.server.destroy_id(now, e.id);
                            continue;
                        }
                        _ => {}
                    }
                    self.held.push(e.id);
                    // A program that holds too many lets the oldest go.
                    if self.held.len() > 2 * BACKLOG as usize {
                        let old = self.held.remove(0);
                        let _ = self.server.destroy_id(now, old);
                    }
                }
                EventType::Unreachable
                | EventType::Rejected
                | EventType::Disconnected
                | EventType::ConnectError => {
                    self.held.retain(|h| *h != e.id);
                    let _ = self.server.destroy_id(now, e.id);
                }
                _ => {}
            }
        }
    }

    /// The bounds both sides keep whatever arrived.
    fn check_bounds(&self) {
        for (name, c) in [("client", &self.client), ("server", &self.server)] {
            let ib = c.ib();
            // Half-open ones, plus what the programs hold past the handshake (the main
            // connection, the server's held and accepted ones), plus connections in
            // timewait or idle that an id still names.
            let bound = HALF_OPEN + 2 * BACKLOG as usize + 4;
            assert!(
                ib.len() <= bound,
                "{name}: {} protocol connections (bound {bound})",
                ib.len()
            );
            assert!(
                ib.half_open() <= HALF_OPEN,
                "{name}: half-open {}",
                ib.half_open()
            );
            assert!(ib.timers() <= ib.len(), "{name}: {} timers", ib.timers());
            assert!(
                c.id_count() <= 2 + 2 * BACKLOG as usize + 2,
                "{name}: {} ids",
                c.id_count()
            );
        }
    }

    /// One MAD for side `to`, from the other side's address (`peer`) or a stranger's.
    fn inject(&mut self, inp: &mut Input, r: &mut SplitMix64) -> (usize, bool, [u8; MAD_LEN]) {
        let op = inp.u8();
        let to = usize::from(op & 1);
        // One MAD in sixteen from the peer's address (which may end the connection, as the
        // peer may); the rest from strangers, which must not.
        let peer = op & 0xF0 == 0;
        let from = if peer {
            Peer::gsi(ip(if to == 0 { 7 } else { 3 }))
        } else {
            stranger(inp.u8())
        };
        let mut mad = [0u8; MAD_LEN];
        match (op >> 1) % 8 {
            0 => mad.iter_mut().for_each(|b| *b = r.next_u64() as u8),
            4..=7 if self.main.is_some() => mad = self.forge(to, inp, r),
            1 | 2 if !self.seen.is_empty() => {
                let at = usize::from(inp.u8()) % self.seen.len();
                mad = self.seen[at].1;
                for _ in 0..inp.u8() % 6 {
                    let pos = usize::from(inp.u16()) % MAD_LEN;
                    match inp.u8() % 3 {
                        0 => mad[pos] ^= 1 << (inp.u8() % 8),
                        1 => mad[pos] = inp.u8(),
                        _ => mad[pos] = r.next_u64() as u8,
                    }
                }
            }
            _ => {
                let src = if inp.u8() & 1 == 0 { from.ip } else { ip(3) };
                let mut q = req_to_listener(r, src);
                if inp.u8() % 8 == 0 {
                    // Reuse the client's CA GUID and QPN: a stale-connection REQ if it
                    // comes from the client.
                    q.local_ca_guid = 0xA;
                    q.local_qpn = 0x111;
                }
                mad = CmMsg::Req(Box::new(q)).emit(r.next_u64());
            }
        }
        let now = self.now;
        self.side(to).handle_mad(now, from, &mad);
        if peer {
            self.counts.from_peer += 1;
        } else {
            self.counts.from_others += 1;
        }
        (to, peer, mad)
    }

    /// A well-formed message for side `to` that names the established connection as its
    /// peer would (comm IDs, QPN, CA GUID), the rest random: what an observer of the
    /// handshake can forge.
    fn forge(&self, to: usize, inp: &mut Input, r: &mut SplitMix64) -> [u8; MAD_LEN] {
        let Some((_, _, cc, sc)) = self.main else {
            return [0; MAD_LEN];
        };
        // The sender's comm ID, the receiver's, the receiver's QPN, the sender's CA GUID.
        let (local, remote, qpn, guid) = if to == 1 {
            (cc, sc, 0x222, 0xAu64)
        } else {
            (sc, cc, 0x111, 0xB)
        };
        let tid = r.next_u64();
        // Now and then with the receiver's ID unknown (0), as before a REP.
        fn ids<const N: usize>(local: CommId, remote: CommId, n: u8) -> Ids<N> {
            Ids {
                local_comm_id: local,
                remote_comm_id: if n % 5 == 0 { 0 } else { remote },
                private_data: [0; N],
            }
        }
        let pick = inp.u8();
        let msg = match pick % 7 {
            0 => {
                let reasons = [
                    rej_reason::NO_QP,
                    rej_reason::TIMEOUT,
                    rej_reason::INVALID_SERVICE_ID,
                    rej_reason::STALE_CONN,
                    rej_reason::CONSUMER_REJECT,
                    r.next_u64() as u16,
                ];
                let reason = reasons[usize::from(inp.u8()) % reasons.len()];
                CmMsg::Rej(Box::new(Rej::new(
                    local,
                    if pick & 0x80 != 0 { 0 } else { remote },
                    inp.u8() % 3,
                    reason,
                    &guid.to_be_bytes(),
                    &[],
                )))
            }
            1 => CmMsg::Dreq(Box::new(Dreq {
                ids: ids(local, remote, inp.u8()),
                remote_qpn: if inp.u8() % 4 == 0 {
                    r.next_u64() as u32 & 0xFF_FFFF
                } else {
                    qpn
                },
            })),
            2 => CmMsg::Drep(Box::new(ids(local, remote, inp.u8()))),
            3 => CmMsg::Rtu(Box::new(ids(local, remote, inp.u8()))),
            4 => CmMsg::Mra(Box::new(Mra {
                ids: ids(local, remote, inp.u8()),
                message_mraed: inp.u8() % 4,
                service_timeout: inp.u8() % 32,
            })),
            5 => CmMsg::Rep(Box::new(Rep {
                local_comm_id: local,
                remote_comm_id: remote,
                target_ack_delay: inp.u8() % 32,
                local_ca_guid: guid,
                // The input and the generator are separate streams: drawing the QPN
                // after the input byte changes neither.
                ..cm::rep(r.next_u64() as u32 & 0xFF_FFFF, 1)
            })),
            _ => {
                // The client's own REQ again, or a new one from its QP (stale).
                let mut q = req_to_listener(r, ip(3));
                q.local_ca_guid = 0xA;
                q.local_qpn = 0x111;
                if inp.u8() & 1 == 0 {
                    q.local_comm_id = cc;
                }
                CmMsg::Req(Box::new(q))
            }
        };
        msg.emit(tid)
    }

    fn step(&mut self, inp: &mut Input, r: &mut SplitMix64) {
        if self.snapshot().is_none() {
            self.reestablish();
        }
        if inp.u8() % 8 == 0 {
            // Time passes: 1 ms, 1 s, 70 s or 10 min.
            self.now += [1_000_000, 1_000_000_000, 70_000_000_000, 600_000_000_000]
                [usize::from(inp.u8() % 4)];
            let now = self.now;
            self.client.handle_timeout(now);
            self.server.handle_timeout(now);
            let ev = self.pump();
            self.program(&ev);
            self.pump();
            return;
        }
        let before = self.snapshot();
        let (to, peer, mad) = self.inject(inp, r);
        let ev = self.pump();
        if !peer {
            if let (Some(b), Some((cid, sid, _, _))) = (before, self.main) {
                self.counts.checked += 1;
                let main_events: Vec<_> = ev
                    .iter()
                    .filter(|(k, e)| (*k == 0 && e.id == cid) || (*k == 1 && e.id == sid))
                    .collect();
                assert!(
                    main_events.is_empty() && self.snapshot() == Some(b),
                    "a MAD from a stranger to side {to} changed the connection: {:?} -> \
                     {:?}, events {main_events:?}; MAD {:02x?}",
                    b,
                    self.snapshot(),
                    &mad[..]
                );
            }
        }
        self.program(&ev);
        let ev = self.pump();
        self.program(&ev);
    }
}

/// Run one input of at most `max_steps` steps. Panics when an invariant fails.
pub fn run(data: &[u8], max_steps: usize) -> Counts {
    let seed = data
        .iter()
        .take(8)
        .fold(0u64, |a, &b| a << 8 | u64::from(b));
    let mut r = SplitMix64::new(seed);
    let mut w = World::new(seed);
    w.establish();
    let mut inp = Input {
        data,
        at: 8.min(data.len()),
    };
    let mut steps = 0;
    while steps < max_steps && (steps == 0 || !inp.done()) {
        w.step(&mut inp, &mut r);
        w.check_bounds();
        steps += 1;
    }
    let mut c = w.counts.clone();
    c.runs = 1;
    c.refused = w.client.ib().stats().refused + w.server.ib().stats().refused;
    c.survived = u64::from(w.snapshot().is_some());
    c
}
