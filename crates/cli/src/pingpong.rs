//! `softrdma pingpong`: rdma-core's `ibv_rc_pingpong`, `ibv_uc_pingpong`, `ibv_ud_pingpong`
//! and `ibv_srq_pingpong` — the same TCP exchange, QP attributes and traffic pattern, so
//! either side can be the C example. With `--cm` the QPs are connected through the
//! rdma_cm instead, and the traffic is the same.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::cm::{self, CmId, ConnectOptions};
use softrdma::{
    wr, Access, AddressHandle, AhAttr, CompletionChannel, CompletionQueue, Gid, Mtu,
    ProtectionDomain, QpAttr, QpAttrMask, QpCap, QpInit, QpState, QpType, QueuePair, SendFlags,
    SharedReceiveQueue, WcStatus, WorkCompletion,
};

use crate::exch::{self, Dest};
use crate::session::{self, Poller};
use crate::{cmconn, output, tcp};
use crate::{stats, CmdResult, PingpongArgs, PpType};

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// The Q_Key of `ibv_ud_pingpong`.
const UD_QKEY: u32 = 0x1111_1111;
/// Bytes a UD receive needs in front of the payload for the GRH.
const GRH_LEN: usize = 40;

fn type_name(t: PpType) -> &'static str {
    match t {
        PpType::Rc => "rc",
        PpType::Uc => "uc",
        PpType::Ud => "ud",
        PpType::Srq => "srq",
    }
}

/// A QP's address as `--json` shows it.
#[derive(Serialize)]
struct DestJson {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: String,
}

impl From<&Dest> for DestJson {
    fn from(d: &Dest) -> DestJson {
        DestJson {
            lid: d.lid,
            qpn: d.qpn,
            psn: d.psn,
            gid: std::net::Ipv6Addr::from(d.gid.0).to_string(),
        }
    }
}

/// `softrdma pingpong --json`.
#[derive(Serialize)]
struct PingpongJson {
    #[serde(rename = "type")]
    ty: &'static str,
    role: &'static str,
    size: u32,
    iters: u32,
    events: bool,
    local: Vec<DestJson>,
    remote: Vec<DestJson>,
    bytes: u64,
    seconds: f64,
    mbit_per_sec: f64,
    usec_per_iter: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<stats::StatsJson>,
}

fn print_dest(label: &str, d: &Dest) {
    outln!(
        "  {label} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        d.lid,
        d.qpn,
        d.psn,
        std::net::Ipv6Addr::from(d.gid.0)
    );
}

struct Conn<'a> {
    ty: PpType,
    mtu: Mtu,
    gid_idx: u8,
    sl: u8,
    qps: &'a [QueuePair],
}

impl Conn<'_> {
    /// `pp_connect_ctx`: RTR and RTS with the examples' attributes (UD: an AH instead).
    fn connect(
        &self,
        pd: &softrdma::ProtectionDomain,
        mine: &[Dest],
        theirs: &[Dest],
    ) -> CmdResult<Option<AddressHandle>> {
        let grh = |d: &Dest| AhAttr {
            sl: self.sl,
            dlid: d.lid,
            ..AhAttr::roce(d.gid, self.gid_idx)
        };
        for (i, qp) in self.qps.iter().enumerate() {
            let d = &theirs[i];
            let my_psn = mine[i].psn;
            let fail =
                |what: &str, e: softrdma::Error| format!("failed to modify QP to {what}: {e}");
            match self.ty {
                PpType::Rc | PpType::Srq | PpType::Uc => {
                    let rc = self.ty != PpType::Uc;
                    let mut a = QpAttr {
                        qp_state: QpState::Rtr,
                        path_mtu: self.mtu,
                        dest_qp_num: d.qpn,
                        rq_psn: d.psn,
                        ah_attr: grh(d),
                        ..Default::default()
                    };
                    let mut mask = QpAttrMask::STATE
                        | QpAttrMask::AV
                        | QpAttrMask::PATH_MTU
                        | QpAttrMask::DEST_QPN
                        | QpAttrMask::RQ_PSN;
                    if rc {
                        a.max_dest_rd_atomic = 1;
                        a.min_rnr_timer = 12;
                        mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
                    }
                    qp.modify(&a, mask).map_err(|e| fail("RTR", e))?;
                    let mut a = QpAttr {
                        qp_state: QpState::Rts,
                        sq_psn: my_psn,
                        ..Default::default()
                    };
                    let mut mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN;
                    if rc {
                        a.timeout = 14;
                        a.retry_cnt = 7;
                        a.rnr_retry = 7;
                        a.max_rd_atomic = 1;
                        mask |= QpAttrMask::TIMEOUT
                            | QpAttrMask::RETRY_CNT
                            | QpAttrMask::RNR_RETRY
                            | QpAttrMask::MAX_QP_RD_ATOMIC;
                    }
                    qp.modify(&a, mask).map_err(|e| fail("RTS", e))?;
                }
                PpType::Ud => {
                    let a = QpAttr {
                        qp_state: QpState::Rtr,
                        ..Default::default()
                    };
                    qp.modify(&a, QpAttrMask::STATE)
                        .map_err(|e| fail("RTR", e))?;
                    let a = QpAttr {
                        qp_state: QpState::Rts,
                        sq_psn: my_psn,
                        ..Default::default()
                    };
                    qp.modify(&a, QpAttrMask::STATE | QpAttrMask::SQ_PSN)
                        .map_err(|e| fail("RTS", e))?;
                    let ah = pd
                        .create_ah(&grh(d))
                        .map_err(|e| format!("failed to create AH: {e}"))?;
                    return Ok(Some(ah));
                }
            }
        }
        Ok(None)
    }
}

/// What both sides' setup shares, for connecting by TCP exchange or by the rdma_cm.
struct Setup<'a> {
    a: &'a PingpongArgs,
    ty: PpType,
    nqp: u32,
    mtu: Mtu,
    pd: &'a ProtectionDomain,
    init: &'a QpInit<'a>,
    lid: u16,
    my_gid: Gid,
    cq: &'a CompletionQueue,
    /// Arm the CQ once the receives are posted (`-e`).
    notify: bool,
}

/// Connected QPs, both sides' addresses, and for UD where to send.
struct Link {
    qps: Vec<QueuePair>,
    mine: Vec<Dest>,
    theirs: Vec<Dest>,
    ah: Option<AddressHandle>,
    /// The Q_Key UD sends carry.
    qkey: u32,
    /// A UD server of `--cm`: the peer's QP number comes with its first datagram.
    learn_peer: bool,
    /// The CM ids of `--cm` connections: dropping them disconnects.
    _ids: Vec<CmId>,
}

/// `-e`: ask for the first CQ event.
fn arm(cq: &CompletionQueue, on: bool) -> CmdResult {
    if on {
        cq.req_notify(false)
            .map_err(|e| format!("couldn't request CQ notification: {e}"))?;
    }
    Ok(())
}

fn print_all(json: bool, label: &str, ds: &[Dest]) {
    if !json {
        for d in ds {
            print_dest(label, d);
        }
        output::flush_stdout();
    }
}

impl Setup<'_> {
    /// rdma-core's way: QPs to INIT, receives, the TCP exchange, RTR and RTS.
    fn tcp_link(&self, post_recv: &dyn Fn(Option<&QueuePair>, u32) -> u32) -> CmdResult<Link> {
        let (a, nqp, ty, my_gid) = (self.a, self.nqp, self.ty, self.my_gid);
        let mut qps = Vec::new();
        for i in 0..nqp {
            let qp = self
                .pd
                .create_qp(self.init)
                .map_err(|e| format!("couldn't create QP[{i}]: {e}"))?;
            qp.to_init(Access::empty())
                .map_err(|e| format!("failed to modify QP[{i}] to INIT: {e}"))?;
            qps.push(qp);
        }
        let routs = post_recv(qps.first(), a.rx_depth);
        if routs < a.rx_depth {
            return Err(format!("couldn't post receive ({routs})"));
        }
        arm(self.cq, self.notify)?;

        let mine: Vec<Dest> = qps
            .iter()
            .map(|q| Dest {
                lid: self.lid,
                qpn: q.qpn(),
                psn: q.endpoint().psn,
                gid: my_gid,
            })
            .collect();
        print_all(a.json, "local address: ", &mine);

        let count = if ty == PpType::Srq {
            exch::SRQ_MAX_QP
        } else {
            1
        };
        let conn = Conn {
            ty,
            mtu: self.mtu,
            gid_idx: a.gid_idx,
            sl: a.sl,
            qps: &qps,
        };
        let fix_gids = |theirs: &mut Vec<Dest>, peer: SocketAddr| -> CmdResult {
            theirs.truncate(nqp as usize);
            for (i, d) in theirs.iter_mut().enumerate() {
                if d.qpn == 0 {
                    return Err(format!(
                        "the peer has fewer QPs than our {nqp} (none for QP[{i}]): use the same -q"
                    ));
                }
                // A peer run without -g sends a zero GID: reach it at its TCP address.
                if d.gid == Gid::default() {
                    d.gid = Gid::from_ip(peer.ip());
                }
            }
            if my_gid.to_ip().is_loopback() && !peer.ip().is_loopback() {
                errln!(
                    "softrdma: warning: this device is on loopback ({}) but the peer is at {}: set SOFTRDMA_ADDR to a reachable address",
                    my_gid.to_ip(),
                    peer.ip()
                );
            }
            Ok(())
        };
        let mut ah = None;
        let theirs = match &a.peer {
            Some(host) => {
                let mut s = tcp::connect(host, a.port)?;
                let peer = s
                    .peer_addr()
                    .map(tcp::canonical)
                    .map_err(|e| e.to_string())?;
                let mut theirs = exch::client(&mut s, &mine, count)?;
                fix_gids(&mut theirs, peer)?;
                theirs
            }
            None => {
                let l = tcp::listen(a.port)?;
                let (mut s, peer) = tcp::accept(&l)?;
                drop(l);
                let mut theirs = exch::server_read(&mut s, count)?;
                fix_gids(&mut theirs, peer)?;
                ah = conn
                    .connect(self.pd, &mine, &theirs)
                    .map_err(|e| format!("couldn't connect to remote QP: {e}"))?;
                exch::server_answer(&mut s, &mine, count)?;
                theirs
            }
        };
        print_all(a.json, "remote address:", &theirs);
        if a.peer.is_some() {
            ah = conn.connect(self.pd, &mine, &theirs)?;
        }
        Ok(Link {
            qps,
            mine,
            theirs,
            ah,
            qkey: UD_QKEY,
            learn_peer: false,
            _ids: Vec::new(),
        })
    }

    /// `--cm`: one rdma_cm connection per QP (-q of them for srq) on port -p; the
    /// connection manager moves the QPs to RTS and, for UD, names the server's QP. A UD
    /// server learns the client's QP from its first datagram, as UD servers of the
    /// rdma_cm do.
    fn cm_link(&self, post_recv: &dyn Fn(Option<&QueuePair>, u32) -> u32) -> CmdResult<Link> {
        let a = self.a;
        let timeout = Some(Duration::from_secs(a.timeout.max(1)));
        let srq = self.ty == PpType::Srq;
        // A QP's own receives go before the peer may send; an SRQ's once, here.
        let prepare = |qp: &QueuePair| -> softrdma::Result<()> {
            if !srq && post_recv(Some(qp), a.rx_depth) < a.rx_depth {
                // ENOMEM, as a full receive queue is.
                return Err(softrdma::Error::new(12, "couldn't post receive"));
            }
            Ok(())
        };
        if srq {
            let n = post_recv(None, a.rx_depth);
            if n < a.rx_depth {
                return Err(format!("couldn't post receive ({n})"));
            }
        }
        // Armed before any QP connects: the peer may send the moment its side is up.
        arm(self.cq, self.notify)?;
        let listener = match &a.peer {
            Some(_) => None,
            None => Some(cmconn::listen(self.pd.device(), a.port, self.init.qp_type)?),
        };
        let (mut qps, mut ids, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
        let mut ah = None;
        let mut qkey = cm::UDP_QKEY;
        for i in 0..self.nqp {
            let conn = match (&a.peer, &listener) {
                (Some(host), _) => {
                    let opts = ConnectOptions {
                        timeout,
                        ..ConnectOptions::default()
                    };
                    cmconn::connect(self.pd, self.init, host, a.port, &opts, prepare)?
                }
                (None, Some(l)) => {
                    let opts = cm::AcceptOptions {
                        timeout,
                        ..cm::AcceptOptions::default()
                    };
                    l.next_request(None)
                        .and_then(|r| r.accept_with(self.pd, self.init, &opts, prepare))
                        .map_err(|e| format!("couldn't accept QP[{i}]'s connection: {e}"))?
                }
                (None, None) => return Err("no listener".into()),
            };
            if let Some(ud) = conn.ud_param() {
                ah = Some(
                    self.pd
                        .create_ah(&ud.ah_attr)
                        .map_err(|e| format!("failed to create AH: {e}"))?,
                );
                // A client hears the server's QP and Q_Key; a server learns the
                // client's QP from its first datagram.
                if a.peer.is_some() {
                    qkey = ud.qkey;
                }
                theirs.push(Dest {
                    lid: 0,
                    qpn: ud.qp_num,
                    psn: 0,
                    gid: ud.ah_attr.grh.dgid,
                });
            }
            let (qp, id) = conn.into_parts();
            qps.push(qp);
            ids.push(id);
        }
        drop(listener);
        let attr = |q: &QueuePair| {
            q.query()
                .map_err(|e| format!("couldn't query QP {:#x}: {e}", q.qpn()))
        };
        let mut mine = Vec::new();
        for q in &qps {
            mine.push(Dest {
                lid: self.lid,
                qpn: q.qpn(),
                psn: attr(q)?.sq_psn,
                gid: self.my_gid,
            });
            if self.ty != PpType::Ud {
                let at = attr(q)?;
                theirs.push(Dest {
                    lid: 0,
                    qpn: at.dest_qp_num,
                    psn: at.rq_psn,
                    gid: at.ah_attr.grh.dgid,
                });
            }
        }
        print_all(a.json, "local address: ", &mine);
        let learn = self.ty == PpType::Ud && a.peer.is_none();
        if !learn {
            print_all(a.json, "remote address:", &theirs);
        }
        Ok(Link {
            qps,
            mine,
            theirs,
            ah,
            qkey,
            learn_peer: learn,
            _ids: ids,
        })
    }
}

pub fn run(a: &PingpongArgs) -> CmdResult {
    let ty = a.qp_type;
    let mtu_bytes = a.mtu.unwrap_or(cmconn::DEFAULT_MTU);
    // A UD message is one packet, so it is bounded by the port's active MTU, which `-m`
    // sets for ud (ibv_ud_pingpong's rule: size <= the port's active MTU); upstream's
    // default of 2048 would not fit the default MTU of 1024.
    let size = a.size.unwrap_or(if ty == PpType::Ud {
        mtu_bytes.min(2048)
    } else {
        4096
    });
    if size < 1 {
        return Err("size must be at least 1".into());
    }
    if a.iters < 1 {
        return Err("iters must be at least 1".into());
    }
    if a.rx_depth < 1 {
        return Err("rx-depth must be at least 1".into());
    }
    let mtu = session::mtu_of(mtu_bytes)?;
    if a.cm {
        cmconn::check_mtu(a.mtu)?;
    }
    let nqp = if ty == PpType::Srq { a.num_qp } else { 1 };
    if ty == PpType::Srq {
        if nqp < 1 || nqp as usize > exch::SRQ_MAX_QP {
            return Err(format!("num-qp must be 1..={}", exch::SRQ_MAX_QP));
        }
        if nqp > a.rx_depth {
            return Err(format!(
                "rx_depth {} is too small for {nqp} QPs -- must have at least one receive per QP",
                a.rx_depth
            ));
        }
    }
    let size_us = size as usize;

    let dev = session::open_device(&a.dev)?;
    if ty == PpType::Ud {
        dev.set_port_mtu(mtu)
            .map_err(|e| format!("couldn't set the port MTU to {mtu_bytes}: {e}"))?;
    }
    let port = dev
        .query_port(1)
        .map_err(|e| format!("couldn't get port info: {e}"))?;
    if ty == PpType::Ud && size_us > port.active_mtu.bytes() {
        return Err(format!(
            "requested size larger than port MTU ({})",
            port.active_mtu.bytes()
        ));
    }
    let my_gid = dev
        .query_gid(a.gid_idx)
        .map_err(|e| format!("could not get local gid for gid index {}: {e}", a.gid_idx))?;

    let channel: Option<CompletionChannel> = if a.events {
        Some(
            dev.create_channel()
                .map_err(|e| format!("couldn't create completion channel: {e}"))?,
        )
    } else {
        None
    };
    let pd = dev
        .alloc_pd()
        .map_err(|e| format!("couldn't allocate PD: {e}"))?;
    let buf_len = size_us + if ty == PpType::Ud { GRH_LEN } else { 0 };
    let mr = pd
        .register(vec![0x7bu8; buf_len], Access::LOCAL_WRITE)
        .map_err(|e| format!("couldn't register MR: {e}"))?;
    let cq = dev
        .create_cq(a.rx_depth + nqp, channel.as_ref())
        .map_err(|e| format!("couldn't create CQ: {e}"))?;
    let srq: Option<SharedReceiveQueue> = if ty == PpType::Srq {
        Some(
            pd.create_srq(a.rx_depth, 1)
                .map_err(|e| format!("couldn't create SRQ: {e}"))?,
        )
    } else {
        None
    };
    let qp_type = match ty {
        PpType::Rc | PpType::Srq => QpType::Rc,
        PpType::Uc => QpType::Uc,
        PpType::Ud => QpType::Ud,
    };
    let mut init = QpInit::new(qp_type, &cq);
    init.srq = srq.as_ref();
    init.cap = QpCap {
        max_send_wr: 1,
        max_recv_wr: if srq.is_some() { 0 } else { a.rx_depth },
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: init.cap.max_inline_data,
    };
    // pp_post_recv
    let post_recv = |qp: Option<&QueuePair>, n: u32| -> u32 {
        let mut posted = 0;
        for _ in 0..n {
            let Ok(sge) = mr.sge(0..buf_len) else { break };
            let w = wr::recv(RECV_WRID, [sge]);
            let r = match (&srq, qp) {
                (Some(s), _) => s.post_recv(w),
                (None, Some(qp)) => qp.post_recv(w),
                (None, None) => break,
            };
            if r.is_err() {
                break;
            }
            posted += 1;
        }
        posted
    };
    let setup = Setup {
        a,
        ty,
        nqp,
        mtu,
        pd: &pd,
        init: &init,
        lid: port.lid,
        my_gid,
        cq: &cq,
        notify: channel.is_some(),
    };
    let link = if a.cm {
        setup.cm_link(&post_recv)?
    } else {
        setup.tcp_link(&post_recv)?
    };
    let Link {
        qps,
        mine,
        mut theirs,
        ah,
        qkey,
        learn_peer,
        _ids,
    } = link;
    let mut routs = a.rx_depth;
    let inline = qps
        .iter()
        .all(|q| q.cap().max_inline_data as usize >= size_us);

    // pp_post_send
    let ud_peer = std::cell::Cell::new(theirs[0].qpn);
    let post_send = |i: usize| -> CmdResult {
        let ud_dest = ah.as_ref().map(|h| h.dest(ud_peer.get(), qkey));
        let range_err = |e| format!("buffer range: {e}");
        let mut w = match ud_dest {
            Some(d) => wr::ud_send(
                SEND_WRID,
                [mr.sge(GRH_LEN..GRH_LEN + size_us).map_err(range_err)?],
                d,
            ),
            None => wr::send(SEND_WRID, [mr.sge(0..size_us).map_err(range_err)?]),
        };
        if inline {
            w.flags |= SendFlags::INLINE;
        }
        qps[i]
            .post_send(w)
            .map_err(|e| format!("couldn't post send: {e}"))
    };

    let mut pending = vec![RECV_WRID; qps.len()];
    if a.peer.is_some() {
        for (i, p) in pending.iter_mut().enumerate() {
            post_send(i)?;
            *p = RECV_WRID | SEND_WRID;
        }
    }

    let timeout = Duration::from_secs(a.timeout.max(1));
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut num_cq_events = 0u32;
    let mut wcs = vec![WorkCompletion::default(); (a.rx_depth + nqp) as usize];
    let poller = Poller::new(timeout);
    let refill_at = nqp;
    while rcnt < a.iters || scnt < a.iters {
        let ne = match &channel {
            Some(ch) => {
                let id = ch.wait(Some(timeout)).map_err(|e| {
                    if e.is_timeout() {
                        format!(
                            "no completion event for {} s: the peer is gone or unreachable",
                            timeout.as_secs()
                        )
                    } else {
                        format!("failed to get cq_event: {e}")
                    }
                })?;
                num_cq_events += 1;
                if id != cq.id() {
                    return Err("CQ event for an unknown CQ".into());
                }
                cq.req_notify(false)
                    .map_err(|e| format!("couldn't request CQ notification: {e}"))?;
                cq.poll(&mut wcs)
                    .map_err(|e| format!("poll CQ failed: {e}"))?
            }
            None => poller.poll(&cq, &mut wcs)?,
        };
        for wc in &wcs[..ne] {
            if wc.status != WcStatus::Success {
                return Err(session::wc_error(wc));
            }
            let Some(qi) = qps.iter().position(|q| q.qpn() == wc.qp_num) else {
                return Err(format!("couldn't find QPN {:06x}", wc.qp_num));
            };
            match wc.wr_id {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    if learn_peer && ud_peer.get() == 0 {
                        ud_peer.set(wc.src_qp);
                        theirs[0].qpn = wc.src_qp;
                        print_all(a.json, "remote address:", &theirs);
                    }
                    routs -= 1;
                    if routs <= refill_at {
                        routs += post_recv(qps.first(), a.rx_depth - routs);
                        if routs < a.rx_depth {
                            return Err(format!("couldn't post receive ({routs})"));
                        }
                    }
                    rcnt += 1;
                }
                other => return Err(format!("completion for unknown wr_id {other}")),
            }
            pending[qi] &= !wc.wr_id;
            if scnt < a.iters && pending[qi] == 0 {
                post_send(qi)?;
                pending[qi] = RECV_WRID | SEND_WRID;
            }
        }
    }
    let usec = start.elapsed().as_secs_f64() * 1e6;
    let bytes = size as u64 * a.iters as u64 * 2;
    let mbit = bytes as f64 * 8.0 / usec;
    let per_iter = usec / a.iters as f64;
    let _ = cq.ack_events(num_cq_events);

    if a.json {
        output::print_json(&PingpongJson {
            ty: type_name(ty),
            role: if a.peer.is_some() { "client" } else { "server" },
            size,
            iters: a.iters,
            events: a.events,
            local: mine.iter().map(DestJson::from).collect(),
            remote: theirs.iter().map(DestJson::from).collect(),
            bytes,
            seconds: usec / 1e6,
            mbit_per_sec: mbit,
            usec_per_iter: per_iter,
            stats: a.dev.stats.then(|| stats::device_json(&dev)),
        })?;
    } else {
        outln!(
            "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
            usec / 1e6,
            mbit
        );
        outln!(
            "{} iters in {:.2} seconds = {:.2} usec/iter",
            a.iters,
            usec / 1e6,
            per_iter
        );
        if a.dev.stats {
            stats::print_device(&dev);
        }
    }
    Ok(())
}
