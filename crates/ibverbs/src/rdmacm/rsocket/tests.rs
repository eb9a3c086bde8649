//! rsockets driven through their C entry points in this process, over the device on
//! loopback.

use std::ffi::c_int;
use std::ptr;

use super::super::abi;
use super::super::id as cmid;
use super::poll::rpoll;
use super::*;

/// 127.0.0.1:`port`.
fn loopback(port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// A port of this test run's own (the registry is per user, shared by test processes).
fn test_port(k: u16) -> u16 {
    20_000 + (std::process::id() % 20_000) as u16 + k
}

fn sa(a: &libc::sockaddr_in) -> *const libc::sockaddr {
    (a as *const libc::sockaddr_in).cast()
}

const SA_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;

/// A stream rsocket, non-blocking when `nonblock`.
fn stream_socket(nonblock: bool) -> c_int {
    // SAFETY: plain arguments.
    let fd = unsafe { rsocket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0, "rsocket: {}", std::io::Error::last_os_error());
    if nonblock {
        // SAFETY: our socket.
        assert_eq!(unsafe { rfcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) }, 0);
    }
    fd
}

/// A listener on 127.0.0.1:`port`.
fn listener(port: u16, nonblock: bool) -> c_int {
    let l = stream_socket(nonblock);
    let a = loopback(port);
    // SAFETY: our socket; `a` is a sockaddr_in.
    unsafe {
        assert_eq!(
            rbind(l, sa(&a), SA_LEN),
            0,
            "rbind: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(rlisten(l, 8), 0);
    }
    l
}

/// A connection request to 127.0.0.1:`port` that never completes its handshake: an
/// rdma_cm id without a QP sends the REQ (with rsockets' connection data, so the
/// listener answers it) and takes the REP as CONNECT_RESPONSE, but never calls
/// `rdma_establish`, so no RTU goes out. Returns the id, once the REP came.
fn half_open_request(port: u16) -> *mut abi::rdma_cm_id {
    let dst = loopback(port);
    let mut id = ptr::null_mut();
    // SAFETY: a synchronous id (no channel): each call below waits for its event.
    unsafe {
        assert_eq!(
            cmid::rdma_create_id(ptr::null_mut(), &mut id, ptr::null_mut(), abi::RDMA_PS_TCP),
            0
        );
        assert_eq!(
            cmid::rdma_resolve_addr(id, ptr::null_mut(), sa(&dst) as *mut _, 2000),
            0
        );
        assert_eq!(cmid::rdma_resolve_route(id, 2000), 0);
    }
    let mut cd = [0u8; softrdma_wire::rsocket::CONN_DATA_LEN];
    cd[0] = 1;
    cd[2..4].copy_from_slice(&64u16.to_be_bytes());
    cd[20..24].copy_from_slice(&2u32.to_be_bytes());
    cd[36..40].copy_from_slice(&4096u32.to_be_bytes());
    let mut p: abi::rdma_conn_param = crate::zeroed();
    p.private_data = cd.as_ptr().cast();
    p.private_data_len = cd.len() as u8;
    p.responder_resources = 1;
    p.initiator_depth = 1;
    p.flow_control = 1;
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    // A QP number of its own each (the CM refuses a second request from one QP as
    // stale).
    static QPN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0x00ab_0000);
    p.qp_num = QPN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the id; `p` and `cd` live across the call.
    let rc = unsafe { cmid::rdma_connect(id, &mut p) };
    assert_eq!(rc, 0, "rdma_connect: {}", std::io::Error::last_os_error());
    // SAFETY: the synchronous id holds the event its connect took.
    let ev = unsafe { (*(*id).event).event };
    assert_eq!(
        ev,
        abi::RDMA_CM_EVENT_CONNECT_RESPONSE,
        "the listener answered"
    );
    id
}

/// Poll `fd` for `events` up to `ms`: the events that came.
fn poll_one(fd: c_int, events: i16, ms: c_int) -> i16 {
    let mut p = [libc::pollfd {
        fd,
        events,
        revents: 0,
    }];
    // SAFETY: one pollfd.
    let n = unsafe { rpoll(p.as_mut_ptr(), 1, ms) };
    if n > 0 {
        p[0].revents
    } else {
        0
    }
}

/// One request that never completes its handshake (its REP timeout is the CM's default,
/// over a minute) does not keep a listener from accepting: a legitimate non-blocking
/// `rconnect` is established and accepted within a few polls, data flows both ways, and
/// `raccept` never returns the half-open one. rdma-core's accept thread (and this one's,
/// before) waited in `rdma_accept` for that request's RTU until the REP timed out.
#[test]
fn a_request_that_never_completes_does_not_stall_the_listener() {
    let port = test_port(1);
    let l = listener(port, true);
    let half = half_open_request(port);

    let c = stream_socket(true);
    let a = loopback(port);
    // SAFETY: our socket; `a` is a sockaddr_in.
    let rc = unsafe { rconnect(c, sa(&a), SA_LEN) };
    assert!(
        rc == 0 || crate::errno_now() == libc::EINPROGRESS,
        "rconnect: {}",
        std::io::Error::last_os_error()
    );
    let (mut connected, mut accepted) = (false, -1);
    for _ in 0..20 {
        if !connected && poll_one(c, libc::POLLOUT, 250) & libc::POLLOUT != 0 {
            let mut err: c_int = -1;
            let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
            // SAFETY: our socket; room for an int.
            let rc = unsafe {
                rgetsockopt(
                    c,
                    libc::SOL_SOCKET,
                    libc::SO_ERROR,
                    (&mut err as *mut c_int).cast(),
                    &mut len,
                )
            };
            assert_eq!((rc, err), (0, 0), "the connect failed");
            connected = true;
        }
        if accepted < 0 && poll_one(l, libc::POLLIN, 250) & libc::POLLIN != 0 {
            // SAFETY: our listener; no address wanted.
            accepted = unsafe { raccept(l, ptr::null_mut(), ptr::null_mut()) };
        }
        if connected && accepted >= 0 {
            break;
        }
    }
    assert!(connected && accepted >= 0, "connected {connected}, accepted {accepted}: the listener stalled behind the half-open request");
    // Only the legitimate connection is accepted.
    // SAFETY: our listener.
    assert_eq!(unsafe { raccept(l, ptr::null_mut(), ptr::null_mut()) }, -1);
    assert_eq!(crate::errno_now(), libc::EAGAIN);
    // It works: a few bytes each way.
    for (from, to) in [(c, accepted), (accepted, c)] {
        let msg = *b"over rsockets";
        let mut got = [0u8; 13];
        let mut sent = false;
        let mut n = 0;
        for _ in 0..40 {
            if !sent {
                // SAFETY: our socket; `msg` is readable.
                sent =
                    unsafe { rsend(from, msg.as_ptr().cast(), msg.len(), 0) } == msg.len() as isize;
            }
            if sent && poll_one(to, libc::POLLIN, 250) & libc::POLLIN != 0 {
                // SAFETY: our socket; `got` has room.
                let r = unsafe { rrecv(to, got[n..].as_mut_ptr().cast(), got.len() - n, 0) };
                if r > 0 {
                    n += r as usize;
                }
            }
            if n == got.len() {
                break;
            }
        }
        assert_eq!(got, msg);
    }
    // SAFETY: our sockets and id, each closed once.
    unsafe {
        assert_eq!(rclose(c), 0);
        assert_eq!(rclose(accepted), 0);
        assert_eq!(rclose(l), 0);
        cmid::rdma_destroy_id(half);
    }
}

/// A blocking listener's `raccept` waits for a connection and returns it established, as
/// rdma-core's does (its accept thread answers without waiting; `raccept` still sees
/// only established connections).
#[test]
fn blocking_raccept_returns_an_established_connection() {
    let port = test_port(2);
    let l = listener(port, false);
    // SAFETY: our listener; no address wanted.
    let server =
        std::thread::spawn(move || unsafe { raccept(l, ptr::null_mut(), ptr::null_mut()) });
    let c = stream_socket(false);
    let a = loopback(port);
    // SAFETY: our socket; `a` is a sockaddr_in.
    assert_eq!(
        unsafe { rconnect(c, sa(&a), SA_LEN) },
        0,
        "rconnect: {}",
        std::io::Error::last_os_error()
    );
    let s = server.join().expect("raccept thread");
    assert!(s >= 0, "raccept: {}", std::io::Error::last_os_error());
    let msg = *b"blocking";
    let mut got = [0u8; 8];
    // SAFETY: our sockets; the buffers are as long as given.
    unsafe {
        assert_eq!(
            rsend(s, msg.as_ptr().cast(), msg.len(), 0),
            msg.len() as isize
        );
        assert_eq!(
            rrecv(c, got.as_mut_ptr().cast(), got.len(), libc::MSG_WAITALL),
            got.len() as isize
        );
        assert_eq!(rclose(c), 0);
        assert_eq!(rclose(s), 0);
        assert_eq!(rclose(l), 0);
    }
    assert_eq!(got, msg);
}

/// The CM event that comes next on `id`'s channel within a few polls, if any.
fn next_event(id: *mut abi::rdma_cm_id) -> Option<abi::rdma_cm_event_type> {
    // SAFETY: the live synchronous id's own channel.
    let fd = unsafe { (*(*id).channel).fd };
    for _ in 0..20 {
        if !wait_readable(&[fd], 250)[0] {
            continue;
        }
        let mut ev = ptr::null_mut();
        // SAFETY: the id's channel has an event; it is acknowledged at once.
        unsafe {
            if super::super::event::rdma_get_cm_event((*id).channel, &mut ev) != 0 {
                return None;
            }
            let t = (*ev).event;
            super::super::event::rdma_ack_cm_event(ev);
            return Some(t);
        }
    }
    None
}

/// Requests that never complete hold a bounded amount of the listener: past 64 answered
/// connections waiting for their RTU, the oldest is refused (its requester gets REJECTED)
/// for each new one, and the newest keep waiting.
#[test]
fn answered_requests_waiting_are_bounded() {
    let port = test_port(4);
    let l = listener(port, true);
    let ids: Vec<_> = (0..softrdma_rsocket::Listener::MAX_ANSWERED + 2)
        .map(|_| half_open_request(port))
        .collect();
    for (k, &id) in ids.iter().enumerate().take(2) {
        assert_eq!(
            next_event(id),
            Some(abi::RDMA_CM_EVENT_REJECTED),
            "request {k}, among the oldest"
        );
    }
    // The newest is still answered and waiting: nothing came for it.
    // SAFETY: the live synchronous id's own channel.
    let fd = unsafe { (*(*ids[ids.len() - 1]).channel).fd };
    assert!(!wait_readable(&[fd], 0)[0]);
    // SAFETY: our listener and ids, each closed once.
    unsafe {
        assert_eq!(rclose(l), 0);
        for id in ids {
            cmid::rdma_destroy_id(id);
        }
    }
}
