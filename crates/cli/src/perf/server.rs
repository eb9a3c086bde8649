//! The server: serve one client, over the TCP side channel or the rdma_cm.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use softrdma::cm::{self, AcceptOptions, Connection, Listener};
use softrdma::{wr, Device, QueuePair, RemoteMemory, WcOpcode, WcStatus, WorkCompletion};

use crate::session::{self, Poller};
use crate::{CmdResult, PerfTest};

use super::cm_data::{encode_answer, CmRequest};
use super::line::{field, parse_peer, peer_fields, read_line, MAGIC};
use super::side::{
    cm_err, cm_peer, lat_value, range_err, wait_byte, wait_wc, Peer, Resources, Side, SideQp,
};
use super::{Test, MAX_SIZE, RQ_DEPTH, SQ_DEPTH};

/// What a served session was.
pub struct Served {
    pub test: Test,
    pub peer: SocketAddr,
    pub local: Peer,
    pub remote: Peer,
}

/// Serve one client on `stream` with device `dev`.
pub fn serve_session(
    dev: &Device,
    stream: TcpStream,
    peer_addr: SocketAddr,
    timeout: Duration,
) -> CmdResult<Served> {
    let mut w = stream
        .try_clone()
        .map_err(|e| format!("side channel: {e}"))?;
    let mut r = BufReader::new(stream);
    let line = read_line(&mut r, "the client's request")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let reject = |w: &mut TcpStream, msg: String| -> CmdResult<Served> {
        let _ = writeln!(w, "{MAGIC} error {msg}");
        Err(msg)
    };
    if words.len() < 3 || format!("{} {}", words[0], words[1]) != MAGIC {
        return reject(&mut w, "not a softrdma perf client".into());
    }
    let Some(test) = Test::parse(words[2]) else {
        return reject(&mut w, format!("unknown test {:?}", words[2]));
    };
    let sizes: Vec<u32> = match field(&words, "sizes").map(|s| {
        s.split(',')
            .map(|x| x.parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
    }) {
        Ok(Ok(v)) if !v.is_empty() && v.iter().all(|&s| (1..=MAX_SIZE).contains(&s)) => v,
        _ => return reject(&mut w, "bad sizes".into()),
    };
    let iters: u32 = match field(&words, "iters").map(|s| s.parse()) {
        Ok(Ok(n)) if n > 0 => n,
        _ => return reject(&mut w, "bad iters".into()),
    };
    let mtu = match field(&words, "mtu")
        .ok()
        .and_then(|m| m.parse().ok())
        .map(session::mtu_of)
    {
        Some(Ok(m)) => m,
        _ => return reject(&mut w, "bad mtu".into()),
    };
    let remote = match parse_peer(&words) {
        Ok(p) => p,
        Err(e) => return reject(&mut w, e),
    };
    let max = sizes.iter().copied().max().unwrap_or(64);
    let mut side = match Side::new(dev, max) {
        Ok(s) => s,
        Err(e) => return reject(&mut w, e),
    };
    side.memory_wait = match field(&words, "wait") {
        Err(_) | Ok("poll") => false,
        Ok("memory") => true,
        Ok(other) => return reject(&mut w, format!("unknown wait mode {other:?}")),
    };
    if test.uses_recv() {
        if let Err(e) = side.post_recvs(RQ_DEPTH) {
            return reject(&mut w, e);
        }
    }
    if let Err(e) = side.connect(&remote, mtu) {
        return reject(&mut w, e);
    }
    let local = side.local();
    writeln!(w, "{MAGIC} ok {}", peer_fields(&local))
        .map_err(|e| format!("couldn't answer the client: {e}"))?;

    serve_test(
        &side,
        &mut Ctl::Tcp(&mut r),
        test,
        &remote,
        &sizes,
        iters,
        timeout,
    )?;
    let _ = writeln!(w, "bye");
    Ok(Served {
        test,
        peer: peer_addr,
        local,
        remote,
    })
}

/// What the server does for each test once connected, until the client is done.
fn serve_test(
    side: &Side,
    ctl: &mut Ctl<'_>,
    test: Test,
    remote: &Peer,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult {
    match test {
        Test::Perf(PerfTest::SendBw) => serve_recv(side, ctl, false),
        Test::Perf(PerfTest::SendLat) | Test::Demo => serve_recv(side, ctl, true),
        Test::Perf(PerfTest::WriteLat) => {
            serve_write_lat(side, remote, sizes, iters, timeout)?;
            wait_done(side, ctl)
        }
        _ => wait_done(side, ctl),
    }
}

/// How the server learns that the client is done: "done" on the side channel, or the
/// client disconnecting its rdma_cm connection.
enum Ctl<'a> {
    Tcp(&'a mut BufReader<TcpStream>),
    Cm(CmCtl<'a>),
}

/// The rdma_cm end of a session. A killed client sends no DREQ, so while waiting the
/// server probes it now and then with an empty RDMA WRITE, whose failure (the client's
/// QP is gone: no ACK) ends the wait, as a closed TCP connection does.
struct CmCtl<'a> {
    conn: &'a Connection,
    client: RemoteMemory,
    last_probe: Instant,
}

/// How often a waiting `--cm` server probes its client.
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// The probe's work request id.
const PROBE_WRID: u64 = u64::MAX;

impl CmCtl<'_> {
    /// Whether the client disconnected; probes it when due.
    fn done(&mut self) -> CmdResult<bool> {
        match self.conn.wait_disconnected(Some(Duration::ZERO)) {
            Ok(()) => return Ok(true),
            Err(e) if e.is_timeout() => {}
            Err(e) => return Err(format!("disconnecting: {e}")),
        }
        if self.last_probe.elapsed() >= PROBE_EVERY {
            self.last_probe = Instant::now();
            wr::write(PROBE_WRID, Vec::new(), &self.client, 0)
                .and_then(|w| self.conn.qp().post_send(w))
                .map_err(|e| format!("couldn't probe the client: {e}"))?;
        }
        Ok(false)
    }
}

fn wait_done(side: &Side, ctl: &mut Ctl<'_>) -> CmdResult {
    match ctl {
        Ctl::Tcp(r) => {
            // The run may be long: no timeout; a vanished client closes the connection.
            let _ = r.get_ref().set_read_timeout(None);
            let l = read_line(r, "the client's \"done\"")?;
            if l != "done" {
                return Err(format!("unexpected message from the client: {l:?}"));
            }
            Ok(())
        }
        Ctl::Cm(c) => {
            // The run may be long: no limit while the client answers the probes.
            let mut wcs = [WorkCompletion::default(); 16];
            loop {
                if c.done()? {
                    return Ok(());
                }
                // Drain what the server's sends left (write-lat) and the probes.
                let n = side
                    .cq
                    .poll(&mut wcs)
                    .map_err(|e| format!("poll CQ failed: {e}"))?;
                if let Some(wc) = wcs[..n].iter().find(|w| w.status != WcStatus::Success) {
                    return Err(gone(wc));
                }
                if n == 0 {
                    // Bounded: the probe ends the wait within its retries.
                    let _ = c.conn.wait_disconnected(Some(Duration::from_millis(50)));
                }
            }
        }
    }
}

/// The error line for a failed completion on a waiting server: a failed probe means the
/// client is gone.
fn gone(wc: &WorkCompletion) -> String {
    if wc.wr_id == PROBE_WRID {
        format!(
            "the client is gone: its QP stopped answering ({})",
            wc.status.as_str()
        )
    } else {
        session::wc_error(wc)
    }
}

/// Whether the client is done, without blocking.
fn done_arrived(ctl: &mut Ctl<'_>) -> CmdResult<bool> {
    let r = match ctl {
        Ctl::Tcp(r) => r,
        Ctl::Cm(c) => return c.done(),
    };
    let s = r.get_ref();
    s.set_nonblocking(true)
        .map_err(|e| format!("side channel: {e}"))?;
    let mut line = String::new();
    let res = r.read_line(&mut line);
    let _ = r.get_ref().set_nonblocking(false);
    match res {
        Ok(0) => Err("the client closed the connection before \"done\"".into()),
        Ok(_) if line.trim_end() == "done" => Ok(true),
        Ok(_) => Err(format!("unexpected message from the client: {line:?}")),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(format!("side channel: {e}")),
    }
}

/// SEND bandwidth (count and re-post) or SEND latency / demo (echo every message back).
/// Ends at the client's "done" or disconnect (or with an error when the client vanishes).
fn serve_recv(side: &Side, ctl: &mut Ctl<'_>, echo: bool) -> CmdResult {
    let mut wcs = [WorkCompletion::default(); 64];
    loop {
        // Not after every completion: the check costs system calls, and a SEND arriving
        // meanwhile would wait for them.
        let n = session::poll_within(&side.cq, &mut wcs, DONE_CHECK)?;
        if n == 0 && done_arrived(ctl)? {
            return Ok(());
        }
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(gone(wc));
            }
            if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                if echo {
                    let len = wc.byte_len as usize;
                    side.qp
                        .post_send(wr::send(1, [side.mr.sge(0..len).map_err(range_err)?]))
                        .map_err(|e| format!("couldn't post send: {e}"))?;
                }
                side.post_recvs(1)?;
            }
        }
    }
}

/// How long a serving loop waits for completions before it looks for the client's "done".
const DONE_CHECK: Duration = Duration::from_millis(20);

fn serve_write_lat(
    side: &Side,
    remote: &Peer,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult {
    let poller = Poller::new(timeout);
    let mut seq = 0u64;
    let mut outstanding = 0u32;
    for &size in sizes {
        let size = size as usize;
        for _ in 0..iters {
            let v = lat_value(seq);
            seq += 1;
            while outstanding >= SQ_DEPTH / 2 {
                wait_wc(side, &poller, false, &mut outstanding)?;
            }
            wait_byte(side, size - 1, v, &poller, &mut outstanding)?;
            side.mr
                .write(side.half + size - 1, &[v])
                .map_err(|e| format!("writing the buffer: {e}"))?;
            wr::write(1, [side.send_sge(size)?], &remote.mem, 0)
                .and_then(|w| side.qp.post_send(w))
                .map_err(|e| format!("couldn't post write: {e}"))?;
            outstanding += 1;
        }
    }
    Ok(())
}

/// Serve one `--cm` client from listener `l` of device `dev`.
pub fn serve_cm(dev: &Device, l: &Listener, timeout: Duration) -> CmdResult<Served> {
    let req = l
        .next_request(None)
        .map_err(|e| format!("waiting for a client: {e}"))?;
    let peer = req
        .peer_addr()
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
    let refuse = |req: cm::ConnectRequest, msg: String| -> CmdResult<Served> {
        let mut why = format!("{MAGIC} error {msg}").into_bytes();
        why.truncate(cm::MAX_REJECT_PRIVATE);
        let _ = req.reject(&why);
        Err(msg)
    };
    let q = match CmRequest::decode(req.private_data()) {
        Ok(q) => q,
        Err(e) => return refuse(req, e),
    };
    let sizes = match q.sizes() {
        Ok(s) => s,
        Err(e) => return refuse(req, e),
    };
    let test = Test::Perf(q.test);
    let max = sizes.iter().copied().max().unwrap_or(64);
    let r = match Resources::new(dev, max) {
        Ok(r) => r,
        Err(e) => return refuse(req, e),
    };
    let opts = AcceptOptions {
        timeout: Some(timeout),
        ..AcceptOptions::new(&encode_answer(&r.remote()))
    };
    let prepare = |qp: &QueuePair| {
        if test.uses_recv() {
            r.post_recvs(qp, RQ_DEPTH).map_err(cm_err)?;
        }
        Ok(())
    };
    let conn = req
        .accept_with(&r.pd, &r.qp_init(), &opts, prepare)
        .map_err(|e| format!("couldn't accept the client's connection: {e}"))?;
    let remote = cm_peer(conn.qp(), q.mem)?;
    let mut side = r.into_side(conn)?;
    side.memory_wait = q.memory_wait;
    let local = side.local();
    let SideQp::Cm(conn) = &side.qp else {
        return Err("the served QP lost its connection".into());
    };
    let mut ctl = Ctl::Cm(CmCtl {
        conn,
        client: q.mem,
        last_probe: Instant::now(),
    });
    serve_test(&side, &mut ctl, test, &remote, &sizes, q.iters, timeout)?;
    Ok(Served {
        test,
        peer,
        local,
        remote,
    })
}
