//! The flow every RDMA tutorial teaches, over softrdma.
//!
//! Two processes exchange their endpoints — QP number, GID, first PSN and a memory region's
//! address and rkey — over a TCP socket (port 18516), connect an RC queue pair, then:
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

use std::time::Duration;

use common::Role;
use softrdma::{
    tcp, wr, Access, CompletionQueue, Device, QpInit, QpType, WcOpcode, WcStatus, WorkCompletion,
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

fn run(role: Role) -> Res<()> {
    let server = role.is_server();
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
    // 2. Our endpoint: QP number, GID, the first PSN the QP chose, and the memory the
    //    peer may write and read.
    let me = qp.endpoint().with_memory(mr.remote());
    println!("us:   {me}");

    // 3. Exchange endpoints over TCP and go RESET -> INIT -> RTR -> RTS, in one call.
    //    Receives are posted in INIT, before the peer can send: a greeting (server) or
    //    DONE (client), and for the server one more for the WRITE_WITH_IMM notification.
    //    (By hand: qp.to_init, post, qp.to_rtr(&peer.remote_qp()), qp.to_rts.)
    let opts = tcp::Options::new(access).with_memory(mr.remote());
    let post_recvs = |qp: &softrdma::QueuePair| {
        qp.post_recv(wr::recv(100, [mr.sge(0..256)?]))?;
        if server {
            qp.post_recv(wr::recv(101, [mr.sge(256..512)?]))?;
        }
        Ok(())
    };
    let mut link = match role {
        Role::Server(l) => tcp::accept_with(&l, &qp, &opts, post_recvs)?,
        Role::Client(addr) => tcp::connect_with(addr, &qp, &opts, post_recvs)?,
    };
    let peer = link.peer;
    println!("peer: {peer}");
    let rmem = peer.memory.ok_or("the peer offered no memory")?;
    println!("QP {:#x} connected", qp.qpn());

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
    link.barrier()?;
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
    let r = common::role(&args, &["--port"], port).and_then(run);
    if let Err(e) = r {
        eprintln!("tutorial: {e}");
        std::process::exit(1);
    }
}
