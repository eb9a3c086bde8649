//! rsockets' protocol core over the transport on the `sim` network: two connections whose
//! work requests go to real RC QPs of two `Rnic`s, through loss, duplication and
//! reordering. The byte streams, shutdowns, disconnects and direct writes are checked at
//! the far end, in virtual time.

use proptest::prelude::*;
use softrdma_rsocket::conn::{partial_result, TransferSizes};
use softrdma_rsocket::{Config, Conn, Keys, Phase, Post, Shutdown};
use softrdma_testkit::*;
use softrdma_wire::rsocket::{Ctrl, Sge as RSge};

/// One side: its connection and its QP's objects.
struct Side {
    conn: Conn,
    ep: Ep,
}

/// Two connected rsockets (side 0 on device 0, side 1 on device 1). The connections are
/// dropped after the world: their regions outlive the devices that may write them.
struct Pair {
    world: World,
    sides: [Side; 2],
}

fn faults(loss: f64, duplicate: f64, reorder: f64) -> Faults {
    Faults {
        loss,
        duplicate,
        reorder,
        ..Faults::default()
    }
}

fn small() -> Config {
    Config {
        sq_size: 64,
        rq_size: 32,
        sq_inline: 64,
        sbuf_size: 16 << 10,
        rbuf_size: 16 << 10,
        iomap_size: 4,
    }
}

impl Pair {
    fn new(seed: u64, f: Faults, cfg: Config) -> Pair {
        let mut world = World::new(2, seed, f);
        let mut qcfg = QpCfg::rc();
        qcfg.access = Access::REMOTE_WRITE;
        qcfg.cap.max_send_wr = u32::from(cfg.sq_size);
        qcfg.cap.max_recv_wr = u32::from(cfg.rq_size);
        qcfg.cap.max_inline_data = cfg.sq_inline;
        qcfg.sq_sig_all = true;
        qcfg.min_rnr_timer = 1;
        let mut sides = Vec::new();
        for d in 0..2 {
            let pd = world.pd(d);
            let cq = world.cq(d, u32::from(cfg.sq_size) + u32::from(cfg.rq_size));
            let ep = world.create_qp(d, pd, cq, cq, None, &qcfg);
            let mut conn = Conn::new(cfg).expect("memory");
            let [s, t, r] = conn.regions();
            let reg = |w: &mut World, p: *mut u8, len: usize, access: Access| {
                // SAFETY: the connection's regions outlive the world (see `Pair`).
                unsafe { w.nic(d).reg_mr(pd, p, len, p as u64, access) }.expect("reg_mr")
            };
            let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
            let (sp, sl) = (s.as_ptr(), s.len());
            let (tp, tl) = (t.as_ptr(), t.len());
            let (rp, rl) = (r.as_ptr(), r.len());
            let keys = Keys {
                send_lkey: reg(&mut world, sp, sl, Access::LOCAL_WRITE).lkey,
                target_rkey: reg(&mut world, tp, tl, remote).rkey,
                recv_rkey: reg(&mut world, rp, rl, remote).rkey,
            };
            conn.set_keys(keys);
            sides.push(Side { conn, ep });
        }
        let [a, b]: [Side; 2] = sides.try_into().ok().expect("two sides");
        world.connect(&a.ep, &qcfg, 0x100, &b.ep, &qcfg, 0x200);
        let mut p = Pair {
            world,
            sides: [a, b],
        };
        // The CM's exchange of connection data: each side starts with the other's.
        let d0 = p.sides[0].conn.conn_data();
        let d1 = p.sides[1].conn.conn_data();
        p.sides[0].conn.start(&d1);
        p.sides[1].conn.start(&d0);
        p.pump();
        p
    }

    /// Post what each side asked for, and feed each its completions.
    fn pump(&mut self) {
        for s in 0..2 {
            let now = self.world.now();
            let side = &mut self.sides[s];
            let nic = &mut self.world.sim.endpoints[s].nic;
            side.conn.update_credits();
            while let Some(p) = side.conn.poll_post() {
                let r = match p {
                    Post::Send(wr) => nic.post_send(now, side.ep.qpn, wr),
                    Post::Recv(wr) => nic.post_recv(now, side.ep.qpn, wr),
                };
                if let Err(e) = r {
                    panic!("side {s}: post refused: {e}");
                }
            }
            let mut wcs = [WorkCompletion::default(); 32];
            loop {
                let n = nic.poll_cq(side.ep.scq, &mut wcs).expect("poll_cq");
                if n == 0 {
                    break;
                }
                let _ = side.conn.on_completions(&wcs[..n]);
            }
            side.conn.update_credits();
            while let Some(p) = side.conn.poll_post() {
                let _ = match p {
                    Post::Send(wr) => nic.post_send(now, side.ep.qpn, wr),
                    Post::Recv(wr) => nic.post_recv(now, side.ep.qpn, wr),
                };
            }
        }
    }

    /// Run the network a little, then pump.
    fn step(&mut self) {
        self.world.run_for(20 * US);
        self.pump();
    }
}

/// Stream `data[s]` from each side to the other at once, sending in rsockets' growing
/// transfers and reading in chunks of `read_chunk`; returns what each side read.
fn exchange(p: &mut Pair, data: [&[u8]; 2], read_chunk: usize) -> [Vec<u8>; 2] {
    let mut sent = [0usize; 2];
    let mut sizes = [
        TransferSizes::new(data[0].len()),
        TransferSizes::new(data[1].len()),
    ];
    let mut got = [Vec::new(), Vec::new()];
    let mut buf = vec![0u8; read_chunk];
    for _ in 0..2_000_000 {
        if (0..2).all(|s| sent[s] == data[s].len() && got[1 - s].len() == data[s].len()) {
            break;
        }
        for s in 0..2 {
            while sent[s] < data[s].len() && p.sides[s].conn.can_send() {
                let left = data[s].len() - sent[s];
                let want = sizes[s].next(left);
                let src = &data[s][sent[s]..];
                let mut at = 0;
                let n = p.sides[s].conn.send_data(want, &mut |dst: &mut [u8]| {
                    dst.copy_from_slice(&src[at..at + dst.len()]);
                    at += dst.len();
                });
                assert_eq!(n as usize, at, "side {s}: filled what it sent");
                sent[s] += n as usize;
                if n == 0 {
                    break;
                }
            }
            let n = p.sides[s].conn.recv(&mut buf, false);
            got[s].extend_from_slice(&buf[..n]);
        }
        p.step();
        for s in 0..2 {
            assert_eq!(p.sides[s].conn.phase(), Phase::Connected, "side {s}");
        }
    }
    got
}

#[test]
fn both_directions_stream_in_order_on_a_perfect_link() {
    let mut p = Pair::new(1, Faults::default(), small());
    let a = pattern(1, 200_000);
    let b = pattern(2, 150_001);
    let [at_a, at_b] = exchange(&mut p, [&a, &b], 3000);
    assert_eq!(at_b, a);
    assert_eq!(at_a, b);
}

#[test]
fn the_stream_survives_loss_duplication_and_reordering() {
    let mut p = Pair::new(7, faults(0.03, 0.02, 0.05), small());
    let a = pattern(3, 120_000);
    let b = pattern(4, 90_000);
    let [at_a, at_b] = exchange(&mut p, [&a, &b], 777);
    assert_eq!(at_b, a);
    assert_eq!(at_a, b);
    assert!(
        p.world.sim.net.stats().dropped() > 0,
        "the link lost packets"
    );
    assert!(
        p.world.stats(0).retransmits > 0,
        "and the transport resent them"
    );
}

#[test]
fn a_peek_leaves_the_bytes_and_a_partial_read_keeps_the_rest() {
    let mut p = Pair::new(2, Faults::default(), small());
    let a = pattern(5, 5000);
    let mut at = 0;
    let n = p.sides[0].conn.send_data(5000, &mut |dst: &mut [u8]| {
        dst.copy_from_slice(&a[at..at + dst.len()]);
        at += dst.len();
    });
    assert_eq!(n, 5000);
    for _ in 0..100 {
        p.step();
    }
    let mut peek = [0u8; 10];
    assert_eq!(p.sides[1].conn.recv(&mut peek, true), 10);
    assert_eq!(&peek, &a[..10]);
    let mut first = [0u8; 1000];
    assert_eq!(p.sides[1].conn.recv(&mut first, false), 1000);
    assert_eq!(&first[..], &a[..1000]);
    let mut rest = vec![0u8; 8000];
    assert_eq!(p.sides[1].conn.recv(&mut rest, false), 4000);
    assert_eq!(&rest[..4000], &a[1000..]);
    assert!(!p.sides[1].conn.have_rdata());
}

#[test]
fn shutdown_of_writing_closes_one_direction_and_both_ends_disconnect() {
    let mut p = Pair::new(3, faults(0.02, 0.0, 0.0), small());
    assert_eq!(
        p.sides[0].conn.shutdown(Shutdown::Write),
        Some(Ctrl::Shutdown)
    );
    assert!(p.sides[0].conn.send_ctrl(Ctrl::Shutdown));
    for _ in 0..2000 {
        p.step();
        if !p.sides[1].conn.readable() {
            break;
        }
    }
    assert!(
        !p.sides[1].conn.readable(),
        "the peer learned no more comes"
    );
    assert!(p.sides[1].conn.writable(), "it may still send");
    assert!(!p.sides[0].conn.writable());
    // The other way still works.
    let b = pattern(6, 30_000);
    let mut sent = 0;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let mut sizes = TransferSizes::new(b.len());
    for _ in 0..100_000 {
        if got.len() == b.len() {
            break;
        }
        if sent < b.len() && p.sides[1].conn.can_send() {
            let want = sizes.next(b.len() - sent);
            let src = &b[sent..];
            let mut at = 0;
            sent += p.sides[1].conn.send_data(want, &mut |d: &mut [u8]| {
                d.copy_from_slice(&src[at..at + d.len()]);
                at += d.len();
            }) as usize;
        }
        let n = p.sides[0].conn.recv(&mut buf, false);
        got.extend_from_slice(&buf[..n]);
        p.step();
    }
    assert_eq!(got, b);
    // Side 1 shuts its writing too: with neither direction open that is a disconnect.
    assert_eq!(
        p.sides[1].conn.shutdown(Shutdown::Write),
        Some(Ctrl::Disconnect)
    );
    assert!(p.sides[1].conn.send_ctrl(Ctrl::Disconnect));
    for _ in 0..2000 {
        p.step();
        if p.sides[0].conn.phase() == Phase::Disconnected
            && p.sides[1].conn.phase() == Phase::Disconnected
        {
            break;
        }
    }
    assert_eq!(p.sides[0].conn.phase(), Phase::Disconnected);
    assert_eq!(p.sides[1].conn.phase(), Phase::Disconnected);
}

#[test]
fn a_direct_write_lands_in_the_region_the_peer_mapped() {
    let mut p = Pair::new(4, faults(0.02, 0.01, 0.02), small());
    // Side 1 maps 64 KiB of its memory at offset 1 MiB.
    let mem = p.world.mem(65536);
    let pd = p.sides[1].ep.pd;
    let mr = p.world.reg(
        1,
        pd,
        &mem,
        0,
        65536,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let sge = RSge {
        addr: mr.va(0),
        key: mr.rkey(),
        length: 65536,
    };
    assert_eq!(p.sides[1].conn.map_iomap(1 << 20, sge, None), Ok(0));
    let k = p.sides[1].conn.iomap_to_send().expect("an entry to send");
    assert!(p.sides[1].conn.send_iomap(k));
    for _ in 0..2000 {
        p.step();
        if p.sides[0].conn.peer_iomap((1 << 20) + 100).is_some() {
            break;
        }
    }
    let e = p.sides[0]
        .conn
        .peer_iomap((1 << 20) + 100)
        .expect("the entry arrived");
    assert_eq!((e.offset, e.sge), (1 << 20, sge));
    assert!(
        p.sides[0].conn.peer_iomap(5).is_none(),
        "no region holds offset 5"
    );
    let data = pattern(9, 40_000);
    let mut done = 0;
    let mut sizes = TransferSizes::new(data.len());
    for _ in 0..100_000 {
        if done == data.len() {
            break;
        }
        let want = sizes.next(data.len() - done);
        let src = &data[done..];
        let mut at = 0;
        let n = p.sides[0]
            .conn
            .write_direct(
                (1 << 20) + 100 + done as u64,
                want,
                &mut |d: &mut [u8]| {
                    d.copy_from_slice(&src[at..at + d.len()]);
                    at += d.len();
                },
            )
            .expect("in the region");
        done += n as usize;
        p.step();
    }
    for _ in 0..2000 {
        p.step();
        if p.sides[0].conn.all_sends_done() {
            break;
        }
    }
    assert!(p.sides[0].conn.all_sends_done());
    assert_eq!(mem.read(100, data.len()), data);
    assert_eq!(
        mem.read(0, 100),
        vec![0u8; 100],
        "nothing before the offset"
    );
    // Map errors: a taken index, one past the table.
    assert_eq!(p.sides[1].conn.map_iomap(0, sge, Some(0)), Err(libc::EBUSY));
    assert_eq!(
        p.sides[1].conn.map_iomap(0, sge, Some(4)),
        Err(libc::EINVAL)
    );
}

/// A peer gone mid-stream: its QP is destroyed, so this side's writes fail with an error
/// completion and the connection fails with EIO (what a keepalive finds too).
#[test]
fn a_vanished_peer_fails_the_connection() {
    let mut p = Pair::new(5, Faults::default(), small());
    let qpn = p.sides[1].ep.qpn;
    p.world.nic(1).destroy_qp(qpn).expect("destroy");
    p.sides[0].conn.send_keepalive();
    for _ in 0..200_000 {
        p.step();
        if p.sides[0].conn.phase() != Phase::Connected {
            break;
        }
    }
    assert_eq!(p.sides[0].conn.phase(), Phase::Failed(libc::EIO));
    assert!(!p.sides[0].conn.can_send());
    assert_eq!(partial_result(0, p.sides[0].conn.error()), Err(libc::EIO));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Any seed, any fault mix within reason, any read size: the bytes arrive in order.
    #[test]
    fn any_faults_deliver_the_stream_in_order(
        seed in 1u64..1_000_000,
        loss in 0.0f64..0.05,
        dup in 0.0f64..0.05,
        reorder in 0.0f64..0.1,
        len in 1usize..200_000,
        chunk in 1usize..10_000,
    ) {
        let mut p = Pair::new(seed, faults(loss, dup, reorder), small());
        let a = pattern(seed, len);
        let [_, at_b] = exchange(&mut p, [&a, &[]], chunk);
        prop_assert_eq!(at_b, a);
    }
}
