//! The device runtime on the `sim` network instead of UDP ([`Device::open_on`] with a
//! [`SimLink`]): two devices on one `SimNet` that loses, duplicates and reorders, an RC
//! WRITE and a SEND posted through the device's operations, their bytes checked where
//! they landed.

mod rc;

use std::net::SocketAddr;
use std::time::Duration;

use rc::{Host, Peer, QpCfg};
use softrdma_device::verbs::{Access, RecvWr, SendFlags, SendOp, WcOpcode, WcStatus};
use softrdma_device::{Device, DeviceAddr, DeviceConfig};
use softrdma_net::sim::{Faults, SimNet};

const LEN: usize = 64 << 10;
const WITHIN: Duration = Duration::from_secs(20);

fn host(net: &SimNet, name: &str, addr: &str, fill: u8) -> Host {
    let addr: SocketAddr = addr.parse().unwrap();
    let mut cfg = DeviceConfig::new(name, DeviceAddr::Fixed(addr));
    cfg.stats_dir = None;
    let link = net.attach(addr).expect("attach to the sim network");
    let dev = Device::open_on(&cfg, Box::new(link)).expect("open on sim");
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    Host::on(dev, LEN + 4096, fill, 64, access)
}

/// Returns what the network did.
fn rc_write_and_send(faults: Faults, seed: u64) -> softrdma_net::sim::Stats {
    let net = SimNet::new(seed, faults);
    let a = host(&net, "sim-a", "10.9.0.1:4791", 0xA5);
    let b = host(&net, "sim-b", "10.9.0.2:4791", 0x11);
    let (qa, qb) = (a.rc_qp(32), b.rc_qp(32));
    let cfg = QpCfg {
        access: Access::REMOTE_WRITE,
        ..rc::cfg()
    };
    a.connect(qa, &cfg, &Peer::at(b.dev.gid(), qb, 0), 0);
    b.connect(qb, &cfg, &Peer::at(a.dev.gid(), qa, 0), 0);
    // A 64 KiB WRITE (64 packets at MTU 1024) into B's buffer, then a SEND B receives
    // past it.
    let write = SendOp::Write {
        remote_addr: b.addr(0),
        rkey: b.rkey,
    };
    a.post_send(qa, 1, write, SendFlags::SIGNALED, a.sge(0, LEN));
    let recv = RecvWr {
        wr_id: 7,
        sg_list: vec![b.sge(LEN, 4096)],
    };
    b.dev.post_recv(qb, recv).unwrap();
    a.post_send(qa, 2, SendOp::Send, SendFlags::SIGNALED, a.sge(0, 100));
    let sent = a.wait_wcs(2, WITHIN);
    assert!(
        sent.iter().all(|w| w.status == WcStatus::Success),
        "{sent:?}"
    );
    let got = b.wait_wcs(1, WITHIN);
    assert_eq!(got[0].status, WcStatus::Success, "{got:?}");
    assert_eq!(got[0].opcode, WcOpcode::Recv);
    assert_eq!(got[0].byte_len, 100);
    let mem = b.contents();
    assert!(
        mem[..LEN].iter().all(|&x| x == 0xA5),
        "the WRITE landed whole"
    );
    assert!(
        mem[LEN..LEN + 100].iter().all(|&x| x == 0xA5),
        "the SEND landed"
    );
    assert!(
        mem[LEN + 100..].iter().all(|&x| x == 0x11),
        "nothing past it"
    );
    // The datagrams went through the sim network, not a socket.
    let st = net.stats();
    assert!(st.delivered >= 66, "{st:?}");
    st
}

#[test]
fn rc_write_and_send_over_a_perfect_sim_network() {
    rc_write_and_send(Faults::default(), 1);
}

#[test]
fn rc_write_and_send_over_a_lossy_sim_network() {
    let faults = Faults {
        loss: 0.1,
        duplicate: 0.05,
        reorder: 0.1,
        ..Faults::default()
    };
    let st = rc_write_and_send(faults, 2);
    // The runtime's timers recovered what the network lost.
    assert!(st.dropped_loss > 0, "{st:?}");
}
