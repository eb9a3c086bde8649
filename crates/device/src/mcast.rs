//! IP multicast for UD multicast groups: while any QP of the device is attached to a
//! group, the device has a receive socket joined to the group's IP address.
//!
//! Why real IP multicast, and not a same-host path of our own: the device socket is bound
//! to one unicast address (127.0.0.x or the configured one) and cannot see datagrams sent
//! to a group, so each group gets a socket of its own, bound to the group's address and
//! the device's port with `SO_REUSEADDR` and joined on the interface of the device's
//! address ([`udp::Driver::bind_multicast`]). Measured on Linux 6.18, on the host and in a
//! fresh network namespace that has only `lo`: two processes whose devices are 127.0.0.x
//! reach each other's group sockets with no setup, although `lo` has no MULTICAST flag.
//! A join by address finds `lo` for any 127.0.0.0/8 address; the sender's socket, bound
//! to its device address, sends multicast out of that address's interface (the kernel's
//! rule for multicast from a bound source, so no `IP_MULTICAST_IF` is needed); and
//! `IP_MULTICAST_LOOP`, on by default, gives each datagram once to every socket joined
//! on that interface, in every process, the sender's own included (so a QP attached on
//! the sending device gets a copy, as on an RNIC without multicast loopback blocking).
//! So the datagram on the wire is exactly what another host, or rxe, would receive: a
//! RoCEv2 UD SEND to the group's IP address with DQPN 0xFFFFFF and its ICRC sealed for
//! that address, and with a real interface the same sockets reach other hosts (IGMP is
//! the kernel's). The limits are the kernel's: IPv6 multicast has no route on `lo`
//! (`ENETUNREACH`), so IPv6 groups need an interface with the MULTICAST flag, and the
//! multicast TTL stays at the kernel's default of 1 (the local network only).
//!
//! Lock order: the engine lock, then [`Groups`] (joining and leaving, under the engine
//! lock that changed the attachments); the receive half, then [`Groups`] (receiving), then
//! the engine — never [`Groups`] before either lock.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::epoll;
use softrdma_net::udp;
use softrdma_transport::verbs::{self, Gid};
use softrdma_transport::Rnic;

/// Datagram slots per group and receive step.
pub(crate) const MC_BATCH: usize = 8;

/// The receive sockets of the groups the device's QPs are attached to.
pub(crate) struct Groups {
    /// One socket per group, by the group's IP address.
    pub(crate) socks: Vec<(IpAddr, udp::Driver)>,
    /// The last join that failed, for the attach that asked for it.
    last_error: Option<(IpAddr, io::Error)>,
}

impl Groups {
    /// No groups yet.
    pub(crate) fn new() -> Groups {
        Groups {
            socks: Vec::new(),
            last_error: None,
        }
    }

    /// An epoll instance for the group sockets, readable while any of them is: waiters
    /// poll it beside the device socket.
    pub(crate) fn new_poll() -> io::Result<OwnedFd> {
        Ok(epoll::create(epoll::CreateFlags::CLOEXEC)?)
    }

    /// Join the groups `rnic` has members in and leave the others, for the device at
    /// `dev` (its IP picks the interface, its port is the groups' port), keeping the
    /// sockets in the epoll set `poll`. A failed join is logged and kept for
    /// [`Groups::join_error`]; the group stays without a socket.
    pub(crate) fn sync(&mut self, rnic: &Rnic, dev: SocketAddr, poll: BorrowedFd<'_>) {
        let want: HashSet<IpAddr> = rnic.mcast_groups().map(Gid::to_ip).collect();
        self.socks.retain(|(ip, sock)| {
            let keep = want.contains(ip);
            if !keep {
                let _ = epoll::delete(poll, sock.as_fd());
                tracing::debug!(group = %ip, "left multicast group");
            }
            keep
        });
        for ip in want {
            if self.socks.iter().any(|(g, _)| *g == ip) {
                continue;
            }
            let joined = udp::Driver::bind_multicast(ip, dev.port(), dev.ip()).and_then(|s| {
                epoll::add(
                    poll,
                    s.as_fd(),
                    epoll::EventData::new_u64(0),
                    epoll::EventFlags::IN,
                )?;
                Ok(s)
            });
            match joined {
                Ok(s) => {
                    tracing::debug!(group = %ip, device = %dev, "joined multicast group");
                    self.socks.push((ip, s));
                }
                Err(e) => {
                    tracing::warn!(group = %ip, device = %dev, error = %e,
                        "cannot join multicast group: its datagrams will not arrive");
                    self.last_error = Some((ip, e));
                }
            }
        }
    }

    /// Why the device has no socket for group `mgid`, if it has none (the error of the
    /// last failed join of that group).
    pub(crate) fn join_error(&self, mgid: Gid) -> Option<verbs::Error> {
        let ip = mgid.to_ip();
        if self.socks.iter().any(|(g, _)| *g == ip) {
            return None;
        }
        let e = match &self.last_error {
            Some((g, e)) if *g == ip => e,
            _ => {
                return Some(verbs::Error::inval(
                    "the multicast group could not be joined",
                ))
            }
        };
        Some(match e.raw_os_error() {
            Some(c)
                if c == rustix::io::Errno::NOBUFS.raw_os_error()
                    || c == rustix::io::Errno::NOMEM.raw_os_error() =>
            {
                verbs::Error::new(
                    verbs::Errno::ENOMEM,
                    "the kernel refused another multicast membership",
                )
            }
            _ if e.kind() == io::ErrorKind::InvalidInput => {
                verbs::Error::inval("the group's address family is not the device's")
            }
            _ => verbs::Error::inval(
                "the multicast group could not be joined on the device's interface",
            ),
        })
    }
}
