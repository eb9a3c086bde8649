//! The client: connect, run every size, say done.

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use softrdma::cm::ConnectOptions;
use softrdma::{wr, Device, QueuePair, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion};

use crate::session::{self, Poller};
use crate::{cmconn, tcp};
use crate::{CmdResult, PerfArgs, PerfTest};

use super::cm_data::{decode_answer, CmRequest};
use super::line::{parse_peer, peer_fields, read_line, strip_magic, MAGIC};
use super::report::{lat_row, print_addr, BwRow, LatRow, Progress, Rows};
use super::side::{
    cm_err, cm_peer, lat_value, range_err, wait_byte, wait_wc, Peer, Resources, Side, SideQp,
};
use super::{Test, RQ_DEPTH, SQ_DEPTH};

fn bw_wr(
    test: PerfTest,
    side: &Side,
    remote: &Peer,
    size: usize,
    id: u64,
    sig: bool,
) -> CmdResult<SendWr> {
    let flags = if sig {
        SendFlags::SIGNALED
    } else {
        SendFlags::empty()
    };
    let (op, sg) = match test {
        PerfTest::WriteBw => (
            SendOp::Write {
                remote_addr: remote.mem.addr,
                rkey: remote.mem.rkey,
            },
            side.send_sge(size)?,
        ),
        PerfTest::ReadBw => (
            SendOp::Read {
                remote_addr: remote.mem.addr,
                rkey: remote.mem.rkey,
            },
            side.mr.sge(0..size).map_err(range_err)?,
        ),
        PerfTest::AtomicBw => (
            SendOp::FetchAdd {
                remote_addr: remote.mem.addr,
                rkey: remote.mem.rkey,
                add: 1,
            },
            side.send_sge(8)?,
        ),
        _ => (SendOp::Send, side.send_sge(size)?),
    };
    Ok(SendWr {
        wr_id: id,
        op,
        flags,
        sg_list: vec![sg],
        inline_data: None,
        ud: None,
    })
}

fn run_bw(
    test: PerfTest,
    side: &Side,
    remote: &Peer,
    size: u32,
    iters: u32,
    tx_depth: u32,
    timeout: Duration,
) -> CmdResult<BwRow> {
    let tx_depth = tx_depth.clamp(1, SQ_DEPTH) as u64;
    let cq_mod = (tx_depth / 2).clamp(1, 64);
    let n = iters as u64;
    let mut posted = 0u64;
    let mut done = 0u64;
    let mut wcs = [WorkCompletion::default(); 64];
    let poller = Poller::new(timeout);
    let mut progress = Progress::new();
    // (time, completed) samples for the peak.
    let mut samples: Vec<(Instant, u64)> = Vec::new();
    let start = Instant::now();
    samples.push((start, 0));
    while done < n {
        while posted < n && posted - done < tx_depth {
            let sig = (posted + 1) % cq_mod == 0 || posted + 1 == n;
            side.qp
                .post_send(bw_wr(test, side, remote, size as usize, posted, sig)?)
                .map_err(|e| format!("couldn't post send: {e}"))?;
            posted += 1;
        }
        let k = poller.poll(&side.cq, &mut wcs)?;
        for wc in &wcs[..k] {
            if wc.status != WcStatus::Success {
                return Err(session::wc_error(wc));
            }
            done = done.max(wc.wr_id + 1);
        }
        samples.push((Instant::now(), done));
        progress.show(size, done, iters);
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    progress.clear();
    let bytes = size as f64 * n as f64;
    let mb = (1u64 << 20) as f64;
    let avg = bytes / secs / mb;
    // Peak: the best stretch of the run, each at least 1/8 of it and two windows long
    // (completions arrive in bursts of a window; shorter stretches would measure those).
    let chunk = (n / 8).max(2 * tx_depth);
    let mut peak: f64 = avg;
    let mut from = samples[0];
    for s in &samples[1..] {
        if s.1 - from.1 >= chunk {
            let dt = s.0.duration_since(from.0).as_secs_f64();
            if dt > 0.0 {
                peak = peak.max((s.1 - from.1) as f64 * size as f64 / dt / mb);
            }
            from = *s;
        }
    }
    Ok(BwRow {
        bytes: size,
        iters,
        peak_mb: peak,
        avg_mb: avg,
        mpps: n as f64 / secs / 1e6,
    })
}

fn run_lat(
    test: PerfTest,
    side: &Side,
    remote: &Peer,
    size: u32,
    iters: u32,
    seq: &mut u64,
    timeout: Duration,
) -> CmdResult<LatRow> {
    let poller = Poller::new(timeout);
    let mut progress = Progress::new();
    let mut t = Vec::with_capacity(iters as usize);
    let sz = size as usize;
    let mut outstanding = 0u32;
    for i in 0..iters {
        let t0 = Instant::now();
        match test {
            PerfTest::WriteLat => {
                let v = lat_value(*seq);
                *seq += 1;
                side.mr
                    .write(side.half + sz - 1, &[v])
                    .map_err(|e| format!("writing the buffer: {e}"))?;
                wr::write(1, [side.send_sge(sz)?], &remote.mem, 0)
                    .and_then(|w| side.qp.post_send(w))
                    .map_err(|e| format!("couldn't post write: {e}"))?;
                outstanding += 1;
                wait_byte(side, sz - 1, v, &poller, &mut outstanding)?;
                t.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
            PerfTest::SendLat => {
                side.qp
                    .post_send(wr::send(1, [side.send_sge(sz)?]))
                    .map_err(|e| format!("couldn't post send: {e}"))?;
                outstanding += 1;
                wait_wc(side, &poller, true, &mut outstanding)?;
                t.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
                side.post_recvs(1)?;
            }
            PerfTest::ReadLat => {
                wr::read(1, [side.mr.sge(0..sz).map_err(range_err)?], &remote.mem, 0)
                    .and_then(|w| side.qp.post_send(w))
                    .map_err(|e| format!("couldn't post read: {e}"))?;
                outstanding += 1;
                while outstanding > 0 {
                    wait_wc(side, &poller, false, &mut outstanding)?;
                }
                t.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            _ => {
                wr::fetch_add(1, side.send_sge(8)?, &remote.mem, 0, 1)
                    .and_then(|w| side.qp.post_send(w))
                    .map_err(|e| format!("couldn't post atomic: {e}"))?;
                outstanding += 1;
                while outstanding > 0 {
                    wait_wc(side, &poller, false, &mut outstanding)?;
                }
                t.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        // Send completions of the ping-pong tests: collect them before the queue fills.
        while outstanding >= SQ_DEPTH / 2 {
            wait_wc(side, &poller, false, &mut outstanding)?;
        }
        progress.show(size, i as u64 + 1, iters);
    }
    progress.clear();
    Ok(lat_row(size, t))
}

/// Client: connect, run every size, say done.
pub struct ClientRun {
    pub local: Peer,
    pub remote: Peer,
    pub rows: Rows,
}

/// The side channel of a client session, for its closing "done".
pub struct Channel {
    pub w: TcpStream,
    pub r: BufReader<TcpStream>,
}

impl Channel {
    /// Say "done" and wait for "bye" (best effort: the results are already in).
    pub fn finish(mut self) {
        if writeln!(self.w, "done").is_ok() {
            let _ = read_line(&mut self.r, "bye");
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn client_session(
    dev: &Device,
    mut stream: TcpStream,
    test: Test,
    sizes: &[u32],
    iters: u32,
    tx_depth: u32,
    mtu: u32,
    timeout: Duration,
    announce: bool,
    memory_wait: bool,
) -> CmdResult<(ClientRun, Side, Channel)> {
    let mtu_v = session::mtu_of(mtu)?;
    let max = sizes.iter().copied().max().unwrap_or(64);
    let mut side = Side::new(dev, max)?;
    side.memory_wait = memory_wait;
    if test.uses_recv() {
        side.post_recvs(RQ_DEPTH)?;
    }
    let local = side.local();
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    writeln!(
        stream,
        "{MAGIC} {} sizes={} iters={iters} {} mtu={mtu}{}",
        test.name(),
        list.join(","),
        peer_fields(&local),
        if memory_wait { " wait=memory" } else { "" }
    )
    .map_err(|e| format!("couldn't send the request: {e}"))?;
    let mut r = BufReader::new(
        stream
            .try_clone()
            .map_err(|e| format!("side channel: {e}"))?,
    );
    let line = read_line(&mut r, "the server's answer")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    if words.len() < 3 || format!("{} {}", words[0], words[1]) != MAGIC {
        return Err("the peer is not a softrdma perf server".into());
    }
    if words[2] == "error" {
        return Err(format!("the server refused: {}", words[3..].join(" ")));
    }
    let remote = parse_peer(&words)?;
    side.connect(&remote, mtu_v)?;
    if announce {
        print_addr("local address: ", &local);
        print_addr("remote address:", &remote);
    }
    let rows = run_rows(test, &side, &remote, sizes, iters, tx_depth, timeout)?;
    Ok((
        ClientRun {
            local,
            remote,
            rows,
        },
        side,
        Channel { w: stream, r },
    ))
}

/// The client's part: every size of `test` against `remote`.
fn run_rows(
    test: Test,
    side: &Side,
    remote: &Peer,
    sizes: &[u32],
    iters: u32,
    tx_depth: u32,
    timeout: Duration,
) -> CmdResult<Rows> {
    Ok(match test {
        Test::Demo => Rows::Bw(Vec::new()),
        Test::Perf(t) if test.is_lat() => {
            let mut seq = 0;
            let mut v = Vec::new();
            for &s in sizes {
                v.push(run_lat(t, side, remote, s, iters, &mut seq, timeout)?);
            }
            Rows::Lat(v)
        }
        Test::Perf(t) => {
            let mut v = Vec::new();
            for &s in sizes {
                v.push(run_bw(t, side, remote, s, iters, tx_depth, timeout)?);
            }
            Rows::Bw(v)
        }
    })
}

/// A `--cm` client session: connect with the request in the private data, run, and
/// disconnect.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_cm(
    a: &PerfArgs,
    dev: &Device,
    host: &str,
    port: u16,
    test: PerfTest,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult<ClientRun> {
    let max = sizes.iter().copied().max().unwrap_or(64);
    let r = Resources::new(dev, max)?;
    let q = CmRequest {
        test,
        size: (!a.all).then(|| sizes.first().copied().unwrap_or(64)),
        iters,
        memory_wait: a.memory_wait,
        mem: r.remote(),
    };
    let opts = ConnectOptions {
        timeout: Some(timeout),
        ..ConnectOptions::new(&q.encode())
    };
    let prepare = |qp: &QueuePair| {
        if Test::Perf(test).uses_recv() {
            r.post_recvs(qp, RQ_DEPTH).map_err(cm_err)?;
        }
        Ok(())
    };
    let conn = cmconn::connect(&r.pd, &r.qp_init(), host, port, &opts, prepare)
        .map_err(|e| strip_magic(&e))?;
    let remote = cm_peer(conn.qp(), decode_answer(conn.private_data())?)?;
    let mut side = r.into_side(conn)?;
    side.memory_wait = a.memory_wait;
    let local = side.local();
    if !a.json {
        print_addr("local address: ", &local);
        print_addr("remote address:", &remote);
    }
    let rows = run_rows(
        Test::Perf(test),
        &side,
        &remote,
        sizes,
        iters,
        a.tx_depth,
        timeout,
    )?;
    // "done": the server ends when it hears the disconnect; best effort, the results are in.
    if let SideQp::Cm(c) = &side.qp {
        if c.disconnect().is_ok() {
            let _ = c.wait_disconnected(Some(timeout));
        }
    }
    Ok(ClientRun {
        local,
        remote,
        rows,
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run_tcp(
    a: &PerfArgs,
    dev: &Device,
    host: &str,
    port: u16,
    test: Test,
    sizes: &[u32],
    iters: u32,
    timeout: Duration,
) -> CmdResult {
    let s = tcp::connect(host, port)?;
    let (run, _side, ch) = client_session(
        dev,
        s,
        test,
        sizes,
        iters,
        a.tx_depth,
        a.mtu.unwrap_or(cmconn::DEFAULT_MTU),
        timeout,
        !a.json,
        a.memory_wait,
    )?;
    ch.finish();
    super::report::client(a, dev, test, &run)
}
