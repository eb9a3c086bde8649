//! The flow every RDMA tutorial teaches, over softrdma.
//!
//! Two processes exchange their QP number, GID, first PSN and a memory region's address and
//! rkey over a TCP socket (port 18516), connect an RC queue pair, then:
//! SEND/RECV a greeting, RDMA WRITE into the peer, RDMA READ it back, WRITE_WITH_IMM to
//! notify the peer, a DONE message, and an orderly teardown.
//!
//! ```text
//! server:  cargo run --example tutorial
//! client:  cargo run --example tutorial -- SERVER_IP
//! both on loopback, checked:  cargo run --example tutorial -- --self-test
//! ```
//! Each process opens the default device (with no configuration, the first free
//! 127.0.0.x:4791; set `SOFTRDMA_ADDR=IP` for another host).

#[path = "common/mod.rs"]
mod common;

use std::net::TcpStream;
use std::time::Duration;

use softrdma::{
    wr, Access, CompletionQueue, Device, QpInit, QpType, RemoteMemory, RemoteQp, WcOpcode,
    WcStatus, WorkCompletion,
};

const PORT: u16 = 18516;
const TIMEOUT: Duration = Duration::from_secs(10);
const GREETING: &[u8] = b"Hello from the client, over RoCEv2!";
const WRITTEN: &[u8] = b"This line was put here by an RDMA WRITE.";
const DONE: &[u8] = b"DONE";
const IMM: u32 = 0x1234_5678;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn wait_ok(cq: &CompletionQueue, what: &str) -> Res<WorkCompletion> {
    let wc = cq.wait(TIMEOUT)?;
    if wc.status != WcStatus::Success {
        return Err(format!("{what}: completion status {}", wc.status.as_str()).into());
    }
    println!(
        "  completion: {what} (wr_id {}, {} bytes)",
        wc.wr_id, wc.byte_len
    );
    Ok(wc)
}

fn run(server: bool, tcp: &mut TcpStream) -> Res<()> {
    // 1. Device, protection domain, completion queue, memory region, queue pair.
    let dev = Device::open_default()?;
    println!(
        "device {} at {} (GID {:02x?})",
        dev.name(),
        dev.addr(),
        dev.gid().0
    );
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(16, None)?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mr = pd.register(4096, access)?;
    // The CQ must have room for every WR its queues can complete: 8 + 8 of 16.
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq).depth(8, 8))?;
    // A random-looking first PSN, as real programs use.
    let psn = (std::process::id().wrapping_mul(2654435761)) & 0xFF_FFFF;

    // 2. Exchange QP number, GID, PSN, MR address and rkey over TCP.
    let mut msg = qp.local(psn).to_bytes().to_vec();
    msg.extend_from_slice(&mr.remote().to_bytes());
    let peer = common::exchange(tcp, &msg)?;
    let mut q = [0u8; 24];
    q.copy_from_slice(&peer[..24]);
    let mut m = [0u8; 20];
    m.copy_from_slice(&peer[24..44]);
    let (rqp, rmem) = (RemoteQp::from_bytes(&q), RemoteMemory::from_bytes(&m));
    println!(
        "peer: QPN {:#x}, PSN {:#x}, GID {:?}, memory at {:#x} rkey {:#x}",
        rqp.qpn,
        rqp.psn,
        rqp.gid.to_ip(),
        rmem.addr,
        rmem.rkey
    );

    // 3. RESET -> INIT -> RTR -> RTS. Receives are posted (in INIT or later) before the
    //    peer can send: a greeting (server) or DONE (client), and for the server one more
    //    for the WRITE_WITH_IMM notification.
    qp.to_init(access)?;
    qp.post_recv(wr::recv(100, [mr.sge(0..256)?]))?;
    if server {
        qp.post_recv(wr::recv(101, [mr.sge(256..512)?]))?;
    }
    qp.to_rtr(&rqp)?;
    qp.to_rts(psn)?;
    println!("QP {:#x} connected", qp.qpn());
    common::sync(tcp)?;

    if server {
        // 4. Receive the greeting.
        let wc = wait_ok(&cq, "RECV greeting")?;
        let text = mr.to_vec(0, wc.byte_len as usize)?;
        println!("received: {:?}", String::from_utf8_lossy(&text));
        if text != GREETING {
            return Err("greeting mismatch".into());
        }
        // 5. The client WRITEs and READs on its own; we only see the WRITE_WITH_IMM.
        let wc = wait_ok(&cq, "RECV_RDMA_WITH_IMM")?;
        if wc.opcode != WcOpcode::RecvRdmaWithImm || wc.imm_data != IMM {
            return Err(format!("unexpected notification {wc:?}").into());
        }
        let text = mr.to_vec(1024, WRITTEN.len())?;
        println!(
            "notified (imm {:#x}); our memory at 1024 now says {:?}",
            wc.imm_data,
            String::from_utf8_lossy(&text)
        );
        if text != WRITTEN {
            return Err("written data mismatch".into());
        }
        // 6. DONE.
        mr.write(2048, DONE)?;
        qp.post_send(wr::send(3, [mr.sge(2048..2048 + DONE.len())?]))?;
        wait_ok(&cq, "SEND DONE")?;
    } else {
        mr.write(0, GREETING)?;
        qp.post_send(wr::send(1, [mr.sge(0..GREETING.len())?]))?;
        wait_ok(&cq, "SEND greeting")?;
        // WRITE into the server's memory at offset 1024 (one-sided: the server's
        // process does nothing for it).
        mr.write(1024, WRITTEN)?;
        qp.post_send(wr::write(
            2,
            [mr.sge(1024..1024 + WRITTEN.len())?],
            &rmem,
            1024,
        )?)?;
        wait_ok(&cq, "RDMA WRITE")?;
        // READ it back into a different place of our own memory.
        qp.post_send(wr::read(
            3,
            [mr.sge(3072..3072 + WRITTEN.len())?],
            &rmem,
            1024,
        )?)?;
        wait_ok(&cq, "RDMA READ")?;
        let back = mr.to_vec(3072, WRITTEN.len())?;
        println!("read back: {:?}", String::from_utf8_lossy(&back));
        if back != WRITTEN {
            return Err("READ returned other bytes".into());
        }
        // WRITE_WITH_IMM (zero bytes) to notify the server.
        qp.post_send(wr::write_with_imm(4, [mr.sge(0..0)?], &rmem, 0, IMM)?)?;
        wait_ok(&cq, "RDMA WRITE_WITH_IMM")?;
        let wc = wait_ok(&cq, "RECV DONE")?;
        let text = mr.to_vec(0, wc.byte_len as usize)?;
        if text != DONE {
            return Err(format!("expected DONE, got {text:?}").into());
        }
        println!("server says DONE");
    }

    // 7. Orderly teardown: both sides are finished before anyone destroys its QP.
    common::sync(tcp)?;
    let s = dev.stats();
    println!(
        "packets sent {}, received {}, retransmitted {}",
        s.engine.tx_packets, s.engine.rx_packets, s.engine.retransmits
    );
    drop(qp);
    drop(mr);
    drop(cq);
    drop(pd);
    println!("teardown complete");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    common::check_args(
        "tutorial",
        &args,
        &[("--port", "TCP port of the side channel")],
    );
    if args.iter().any(|a| a == "--self-test") {
        let ok = common::self_test(&[], &[], 1, Duration::from_secs(60));
        println!("self-test {}", if ok { "passed" } else { "FAILED" });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let port = common::arg_value(&args, "--port")
        .and_then(|p| p.parse().ok())
        .unwrap_or(PORT);
    let r = match common::positional(&args, &["--port"]) {
        None => common::listen(port)
            .and_then(|l| l.accept())
            .map_err(|e| e.into())
            .and_then(|(mut s, _)| {
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                run(true, &mut s)
            }),
        Some(host) => common::connect(&host, port)
            .map_err(|e| e.into())
            .and_then(|mut s| run(false, &mut s)),
    };
    if let Err(e) = r {
        eprintln!("tutorial: {e}");
        std::process::exit(1);
    }
}
