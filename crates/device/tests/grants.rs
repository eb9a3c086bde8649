//! A device's grants follow its registrations and QPs: a same-host peer reaches a region
//! registered for remote writes through a QP that takes them, and no longer once the
//! region is deregistered or the QP leaves RTS.

mod rc;

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use softrdma_device::rundir::RunDir;
use softrdma_device::verbs::{Access, QpAttr, QpAttrMask, QpState};
use softrdma_device::Link;
use softrdma_net::shm::cma;
use softrdma_net::shm::grants::{Ask, Refusal, REMOTE_WRITE};
use softrdma_net::shm::HostLink;
use softrdma_net::udp::{Driver, OutDatagram};

/// A bare same-host endpoint of this host, as a peer device's link is, to look at what
/// the device under test grants.
fn peer_link() -> HostLink {
    let dir = RunDir::open_default().unwrap().subdir("shm").unwrap();
    let udp = Driver::bind("127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
    HostLink::new(udp, dir.as_fd()).unwrap()
}

/// Try `ask` on `dev_addr` from `l` and write `data` at the hold: what the grants said.
fn write_through(
    l: &HostLink,
    dev_addr: SocketAddr,
    ask: &Ask,
    data: &[u8],
) -> Result<(), Refusal> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = l.with_peer_grants(dev_addr, |g, pid| {
            let h = g.hold(ask)?;
            cma::write_to(pid, h.host(), data).expect("process_vm_writev under a hold");
            Ok(())
        });
        match r {
            Some(r) => return r,
            // The device's answer to the ring has not been taken yet.
            None => {
                assert!(Instant::now() < deadline, "no grants from the device");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

#[test]
fn grants_follow_registrations_and_qp_states() {
    let h = rc::Host::new(
        "grants",
        4096,
        0,
        16,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    let qpn = h.rc_qp(4);
    let peer = rc::Peer::at(
        softrdma_device::verbs::Gid::from_ip([127, 0, 0, 1].into()),
        1,
        0,
    );
    h.connect(qpn, &rc::QpCfg::rc(), &peer, 0);
    let mut l = peer_link();
    // A datagram to the device sets up our ring to it; its answer brings its grants.
    let junk = [OutDatagram {
        dst: h.dev.addr(),
        tos: 0,
        data: b"not a packet",
    }];
    assert_eq!(l.send_batch(&junk).unwrap(), 1);
    let ask = Ask {
        qpn,
        rkey: h.rkey,
        va: h.addr(100),
        len: 5,
        access: REMOTE_WRITE,
    };
    assert_eq!(write_through(&l, h.dev.addr(), &ask, b"hello"), Ok(()));
    assert_eq!(&h.contents()[100..105], b"hello");
    // Past the region, or through a QP that is not there: refused.
    let past = Ask {
        va: h.addr(4092),
        ..ask
    };
    assert_eq!(
        write_through(&l, h.dev.addr(), &past, b"hello"),
        Err(Refusal::OutOfBounds)
    );
    let other_qp = Ask {
        qpn: qpn ^ 1,
        ..ask
    };
    assert_eq!(
        write_through(&l, h.dev.addr(), &other_qp, b"hello"),
        Err(Refusal::NoQp)
    );
    // The QP in error takes nothing.
    let err = QpAttr {
        qp_state: QpState::Err,
        ..Default::default()
    };
    h.dev.modify_qp(qpn, &err, QpAttrMask::STATE).unwrap();
    assert_eq!(
        write_through(&l, h.dev.addr(), &ask, b"again"),
        Err(Refusal::NoQp)
    );
    // A second QP that takes remote writes: reachable again, until deregistration.
    let q2 = h.rc_qp(4);
    h.connect(q2, &rc::QpCfg::rc(), &peer, 0);
    let ask2 = Ask { qpn: q2, ..ask };
    assert_eq!(write_through(&l, h.dev.addr(), &ask2, b"again"), Ok(()));
    assert_eq!(&h.contents()[100..105], b"again");
    h.dev.dereg_mr(h.lkey).unwrap();
    assert_eq!(
        write_through(&l, h.dev.addr(), &ask2, b"after"),
        Err(Refusal::NoRegion)
    );
    assert_eq!(&h.contents()[100..105], b"again");
}
