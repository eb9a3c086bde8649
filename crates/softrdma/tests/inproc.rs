//! Two devices in one process over real loopback UDP: every opcode on RC, UC and UD.

use std::time::Duration;

use softrdma::*;

const T: Duration = Duration::from_secs(10);
const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

fn open() -> Device {
    let cfg = DeviceConfig::new("test", DeviceAddr::AutoLoopback(4791));
    Device::open_with(&cfg).expect("open device")
}

struct Side {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(t: QpType) -> Side {
    let dev = open();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(256, None).unwrap();
    let qp = pd.create_qp(&QpInit::new(t, &cq)).unwrap();
    let mr = pd.register(8192, ALL).unwrap();
    Side {
        dev,
        pd,
        cq,
        qp,
        mr,
    }
}

fn pair(t: QpType) -> (Side, Side) {
    let a = side(t);
    let b = side(t);
    let (pa, pb) = (a.qp.local(100), b.qp.local(2000));
    a.qp.connect(&pb, 100, ALL).unwrap();
    b.qp.connect(&pa, 2000, ALL).unwrap();
    (a, b)
}

#[test]
fn rc_every_opcode() {
    let (a, b) = pair(QpType::Rc);
    assert_ne!(a.dev.addr(), b.dev.addr());
    // SEND
    a.mr.write(0, b"hello over RoCEv2").unwrap();
    b.qp.post_recv(wr::recv(7, [b.mr.sge(0..1024)])).unwrap();
    a.qp.post_send(wr::send(1, [a.mr.sge(0..17)])).unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    let wc = b.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (7, WcStatus::Success, WcOpcode::Recv, 17)
    );
    assert_eq!(b.mr.to_vec(0, 17).unwrap(), b"hello over RoCEv2");
    // SEND_WITH_IMM
    b.qp.post_recv(wr::recv(8, [b.mr.sge(0..1024)])).unwrap();
    a.qp.post_send(wr::send_with_imm(2, [a.mr.sge(0..5)], 0xABCD))
        .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().status, WcStatus::Success);
    let wc = b.cq.wait(T).unwrap();
    assert_eq!(wc.imm_data, 0xABCD);
    assert!(wc.wc_flags.contains(WcFlags::WITH_IMM));
    // WRITE of 3000 bytes (3 packets)
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    a.mr.write(1000, &data).unwrap();
    a.qp.post_send(wr::write(3, [a.mr.sge(1000..4000)], &b.mr.remote(), 4096))
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (3, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(b.mr.to_vec(4096, 3000).unwrap(), data);
    // READ it back
    a.qp.post_send(wr::read(4, [a.mr.sge(5000..8000)], &b.mr.remote(), 4096))
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (4, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(a.mr.to_vec(5000, 3000).unwrap(), data);
    // WRITE_WITH_IMM
    b.qp.post_recv(wr::recv(9, [b.mr.sge(0..0)])).unwrap();
    a.qp.post_send(wr::write_with_imm(
        5,
        [a.mr.sge(0..4)],
        &b.mr.remote(),
        100,
        77,
    ))
    .unwrap();
    assert_eq!(a.cq.wait(T).unwrap().status, WcStatus::Success);
    let wc = b.cq.wait(T).unwrap();
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.imm_data),
        (9, WcOpcode::RecvRdmaWithImm, 77)
    );
    assert_eq!(b.mr.to_vec(100, 4).unwrap(), b"hell");
    // FAA and CAS at offset 8000 (8-aligned)
    b.mr.write_u64(8000, 40).unwrap();
    a.qp.post_send(wr::fetch_add(6, a.mr.sge(0..8), &b.mr.remote(), 8000, 2))
        .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(a.mr.read_u64(0).unwrap(), 40);
    assert_eq!(b.mr.read_u64(8000).unwrap(), 42);
    a.qp.post_send(wr::compare_swap(
        7,
        a.mr.sge(8..16),
        &b.mr.remote(),
        8000,
        42,
        99,
    ))
    .unwrap();
    let wc = a.cq.wait(T).unwrap();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::CompSwap)
    );
    assert_eq!(a.mr.read_u64(8).unwrap(), 42);
    assert_eq!(b.mr.read_u64(8000).unwrap(), 99);
    let s = a.dev.stats();
    assert!(s.engine.tx_packets > 0 && s.link.tx_datagrams > 0);
    assert_eq!(s.engine.icrc_errors, 0);
    assert_eq!(b.dev.stats().engine.icrc_errors, 0);
    drop(b.pd);
}
