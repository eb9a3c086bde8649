//! `impair`: a seeded packet impairer on an NFQUEUE queue (loss, duplication, reordering,
//! corruption), for testing softrdma over a bad link without netem.
//!
//! Packets reach it through an iptables rule such as
//! `iptables -A OUTPUT -p udp --dport 4791 -m mark ! --mark 0x4791 -j NFQUEUE --queue-num 1`.
//! NFQUEUE hands over the packet as the kernel will send it and takes it back unchanged,
//! so no address, port or IP ID is rewritten: the RoCEv2 ICRC covers them.
//!
//! - loss: the verdict is DROP;
//! - corruption: one UDP payload byte is flipped and the packet is accepted with the new
//!   bytes (the UDP checksum is made to match, so the ICRC is what must catch it);
//! - reordering: the packet gets no verdict until K later packets have had theirs, or a
//!   bounded delay passes (NFQUEUE takes verdicts in any order);
//! - duplication: after the packet is accepted, the same bytes are written to the
//!   interface with an AF_PACKET socket to the peer's MAC. That path does not go through
//!   the IP stack, so the IP ID and everything else the ICRC covers stays as it was, and
//!   it does not pass the OUTPUT hook again; the copy also carries the skip mark, so a
//!   rule that excludes the mark keeps it out of the queue whatever path it takes.
//!
//! Packets other than IPv4/UDP (TCP, to compare with) are only ever dropped.
//!
//! The counters go to stdout when it stops on SIGTERM or SIGINT.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use softrdma_impair::decide::{Decider, Rates};
use softrdma_impair::nfq::{self, Msg};
use softrdma_impair::pkt;

/// Seeded NFQUEUE packet impairer: loss, duplication, reordering, corruption.
#[derive(Parser, Debug)]
#[command(name = "impair")]
struct Args {
    /// NFQUEUE queue number to serve.
    #[arg(long, default_value_t = 0)]
    queue: u16,
    /// Seed of the decisions (the same seed and traffic give the same fates).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Probability of dropping a packet.
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Probability of sending a packet twice.
    #[arg(long, default_value_t = 0.0)]
    dup: f64,
    /// Probability of holding a packet back behind later ones.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// Probability of flipping one byte of the UDP payload.
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// A held packet goes out after this many later packets...
    #[arg(long, default_value_t = 3)]
    reorder_after: u32,
    /// ...or after this many milliseconds, whichever comes first (at most 1000).
    #[arg(long, default_value_t = 5)]
    reorder_delay_ms: u64,
    /// Interface duplicates are written to (needed with --dup).
    #[arg(long)]
    inject_dev: Option<String>,
    /// Destination MAC of duplicates, aa:bb:cc:dd:ee:ff (needed with --dup).
    #[arg(long)]
    inject_mac: Option<String>,
    /// Mark carried by duplicates, which the queue rule should exclude (decimal or 0x hex).
    #[arg(long, default_value = "0x4791", value_parser = parse_u32)]
    mark: u32,
    /// Packets the kernel may hold for us before it drops new ones.
    #[arg(long, default_value_t = 8192)]
    maxlen: u32,
}

/// What happened, printed at exit.
#[derive(Debug, Default)]
struct Counters {
    seen: u64,
    passed: u64,
    dropped: u64,
    duplicated: u64,
    reordered: u64,
    corrupted: u64,
    not_udp: u64,
    csum_not_ready: u64,
    dup_errors: u64,
    verdict_errors: u64,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::Relaxed);
}

fn install_signals() -> io::Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction is valid (empty mask, no flags); the handler only
        // stores to an atomic, which is async-signal-safe. Without SA_RESTART, a blocked
        // poll() returns EINTR so the loop sees STOP at once.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The netlink socket bound to one queue.
struct Queue {
    fd: OwnedFd,
    queue: u16,
    seq: u32,
}

impl Queue {
    fn open(queue: u16, maxlen: u32) -> io::Result<Queue> {
        // SAFETY: plain socket(2); the result is checked before it is owned.
        let fd = check(unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                nfq::NETLINK_NETFILTER,
            )
        })?;
        // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a zeroed sockaddr_nl is the kernel-assigned port id on any group-less
        // bind; the pointer and length describe that local value.
        check(unsafe {
            let mut sa: libc::sockaddr_nl = std::mem::zeroed();
            sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(sa).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        })?;
        // A large buffer rides out bursts while we sleep; FORCE exceeds rmem_max as root,
        // and the plain option is the fallback without CAP_NET_ADMIN.
        let big: libc::c_int = 32 << 20;
        if setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, big).is_err() {
            setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUF, big)?;
        }
        // If the buffer overflows anyway, the kernel drops packets (counted in
        // /proc/net/netfilter/nfnetlink_queue); an ENOBUFS error would only stop recv.
        let _ = setsockopt(&fd, libc::SOL_NETLINK, libc::NETLINK_NO_ENOBUFS, 1);
        let mut q = Queue { fd, queue, seq: 0 };
        let seq = q.next_seq();
        q.request(nfq::bind_msg(seq, queue), "bind to the queue")?;
        let seq = q.next_seq();
        q.request(nfq::params_msg(seq, queue, 0xFFFF, maxlen), "set copy mode")?;
        Ok(q)
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: a zeroed sockaddr_nl addresses the kernel (port id 0); `msg` is a live
        // buffer of `msg.len()` bytes.
        let n = check(unsafe {
            let mut sa: libc::sockaddr_nl = std::mem::zeroed();
            sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                std::ptr::addr_of!(sa).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            ) as libc::c_int
        })?;
        if n as usize != msg.len() {
            return Err(io::Error::other("short netlink send"));
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                flags,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// Send a configuration message and wait for its acknowledgement.
    fn request(&mut self, msg: Vec<u8>, what: &str) -> io::Result<()> {
        let seq = self.seq;
        self.send(&msg)?;
        let mut buf = vec![0u8; 8192];
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let n = self.recv(&mut buf, 0)?;
            for m in nfq::messages(&buf[..n]) {
                if let Msg::Ack { seq: s, errno } = m {
                    if s == seq {
                        return if errno == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::other(format!(
                                "{what}: {}",
                                io::Error::from_raw_os_error(errno)
                            )))
                        };
                    }
                }
            }
        }
        Err(io::Error::other(format!(
            "{what}: no answer from the kernel"
        )))
    }

    fn verdict(&mut self, id: u32, v: u32, payload: Option<&[u8]>) -> io::Result<()> {
        let m = nfq::verdict_msg(self.next_seq(), self.queue, id, v, payload, None);
        self.send(&m)
    }
}

fn setsockopt(fd: &OwnedFd, level: i32, opt: i32, v: libc::c_int) -> io::Result<()> {
    // SAFETY: the option value is a live c_int of the size passed.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            std::ptr::addr_of!(v).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

fn parse_u32(s: &str) -> Result<u32, String> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("{s}: {e}"))
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in mac.iter_mut() {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// An AF_PACKET socket that writes IP packets to one interface, to one MAC.
struct Injector {
    fd: OwnedFd,
    addr: libc::sockaddr_ll,
}

impl Injector {
    fn open(dev: &str, mac: [u8; 6], mark: u32) -> io::Result<Injector> {
        let name = std::ffi::CString::new(dev).map_err(|_| io::Error::other("bad name"))?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(io::Error::other(format!("no interface {dev}")));
        }
        let proto = (libc::ETH_P_IP as u16).to_be();
        // SAFETY: plain socket(2); the result is checked before it is owned.
        let fd = check(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::c_int::from(proto),
            )
        })?;
        // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        setsockopt(&fd, libc::SOL_SOCKET, libc::SO_MARK, mark as libc::c_int)?;
        // SAFETY: an all-zero sockaddr_ll is a valid value to fill in.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = ifindex as i32;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&mac);
        Ok(Injector { fd, addr })
    }

    fn send(&self, p: &[u8]) -> io::Result<()> {
        // SAFETY: `p` is a live buffer of `p.len()` bytes and `addr` a filled-in
        // sockaddr_ll of the size passed.
        check(unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                p.as_ptr().cast(),
                p.len(),
                0,
                std::ptr::addr_of!(self.addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            ) as libc::c_int
        })
        .map(|_| ())
    }
}

/// A packet waiting for its verdict.
struct Held {
    id: u32,
    bytes: Option<Vec<u8>>,
    dup: Option<Vec<u8>>,
    after: u32,
    until: Instant,
}

struct Impairer {
    q: Queue,
    decider: Decider,
    inject: Option<Injector>,
    held: Vec<Held>,
    after: u32,
    delay: Duration,
    c: Counters,
}

impl Impairer {
    fn packet(&mut self, id: u32, payload: &[u8], skb_info: u32) -> io::Result<()> {
        self.c.seen += 1;
        let not_ready = skb_info & nfq::SKB_CSUM_NOT_READY != 0;
        self.c.csum_not_ready += not_ready as u64;
        let d = self.decider.decide();
        if d.drop {
            self.c.dropped += 1;
            self.q.verdict(id, nfq::NF_DROP, None)?;
            return self.tick();
        }
        if pkt::udp4(payload).is_none() {
            // Any packet may be lost (so TCP can be measured through the same impairer),
            // but only IPv4/UDP is edited, duplicated or held: the rest passes untouched.
            self.c.not_udp += 1;
            self.c.passed += 1;
            self.q.verdict(id, nfq::NF_ACCEPT, None)?;
            return self.tick();
        }
        let mut bytes = None;
        if let Some((pick, mask)) = d.corrupt {
            let mut b = payload.to_vec();
            if pkt::corrupt(&mut b, pick, mask, not_ready).is_some() {
                self.c.corrupted += 1;
                bytes = Some(b);
            }
        }
        let dup = if d.dup && self.inject.is_some() {
            pkt::duplicate(bytes.as_deref().unwrap_or(payload))
        } else {
            None
        };
        // A bounded number held keeps memory and the kernel's queue in check.
        if d.reorder && self.held.len() < 1024 {
            self.c.reordered += 1;
            self.held.push(Held {
                id,
                bytes,
                dup,
                after: self.after,
                until: Instant::now() + self.delay,
            });
            return Ok(());
        }
        self.accept(id, bytes.as_deref(), dup.as_deref())?;
        self.tick()
    }

    fn accept(&mut self, id: u32, bytes: Option<&[u8]>, dup: Option<&[u8]>) -> io::Result<()> {
        self.c.passed += 1;
        self.q.verdict(id, nfq::NF_ACCEPT, bytes)?;
        if let (Some(d), Some(inj)) = (dup, &self.inject) {
            match inj.send(d) {
                Ok(()) => self.c.duplicated += 1,
                Err(_) => self.c.dup_errors += 1,
            }
        }
        Ok(())
    }

    /// One more packet went by: release the held packets whose turn it is.
    fn tick(&mut self) -> io::Result<()> {
        for h in &mut self.held {
            h.after = h.after.saturating_sub(1);
        }
        self.release(|h, _| h.after == 0)
    }

    fn release(&mut self, due: impl Fn(&Held, Instant) -> bool) -> io::Result<()> {
        let now = Instant::now();
        let (go, keep): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| due(h, now));
        self.held = keep;
        for h in go {
            self.accept(h.id, h.bytes.as_deref(), h.dup.as_deref())?;
        }
        Ok(())
    }

    fn wait_ms(&self) -> libc::c_int {
        let now = Instant::now();
        let next = self.held.iter().map(|h| h.until).min();
        match next {
            // Round up: waking before the deadline would only loop.
            Some(t) => {
                (t.saturating_duration_since(now).as_micros().div_ceil(1000) as i32).clamp(0, 100)
            }
            None => 100,
        }
    }

    fn run(&mut self) -> io::Result<()> {
        let mut buf = vec![0u8; 256 * 1024];
        while !STOP.load(Ordering::Relaxed) {
            let mut pfd = libc::pollfd {
                fd: self.q.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd, count 1.
            let rc = unsafe { libc::poll(&mut pfd, 1, self.wait_ms()) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            self.release(|h, now| h.until <= now)?;
            // Drain what is there, a bounded batch at a time so timers stay on time.
            for _ in 0..256 {
                let n = match self.q.recv(&mut buf, libc::MSG_DONTWAIT) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => break,
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
                    Err(e) => return Err(e),
                };
                // Collect first: handling a packet sends on the same socket.
                let msgs: Vec<(u32, Vec<u8>, u32)> = nfq::messages(&buf[..n])
                    .filter_map(|m| match m {
                        Msg::Packet {
                            id,
                            payload,
                            skb_info,
                        } => Some((id, payload.to_vec(), skb_info)),
                        Msg::Ack { errno, .. } if errno != 0 => {
                            self.c.verdict_errors += 1;
                            None
                        }
                        _ => None,
                    })
                    .collect();
                for (id, p, info) in msgs {
                    self.packet(id, &p, info)?;
                }
            }
        }
        // Nothing stays held: a packet without a verdict would be lost when we close.
        self.release(|_, _| true)
    }
}

fn main() {
    let a = Args::parse();
    let rates = Rates {
        loss: a.loss,
        dup: a.dup,
        reorder: a.reorder,
        corrupt: a.corrupt,
    };
    if let Some((name, p)) = rates.invalid() {
        eprintln!("impair: --{name} {p} is not a probability in [0, 1]");
        std::process::exit(2);
    }
    let inject = match (a.dup > 0.0, &a.inject_dev, &a.inject_mac) {
        (false, _, _) => None,
        (true, Some(dev), Some(mac)) => {
            let Some(mac) = parse_mac(mac) else {
                eprintln!("impair: --inject-mac {mac}: not aa:bb:cc:dd:ee:ff");
                std::process::exit(2);
            };
            match Injector::open(dev, mac, a.mark) {
                Ok(i) => Some(i),
                Err(e) => {
                    eprintln!("impair: packet socket on {dev}: {e}");
                    std::process::exit(1);
                }
            }
        }
        _ => {
            eprintln!("impair: --dup needs --inject-dev and --inject-mac");
            std::process::exit(2);
        }
    };
    if let Err(e) = install_signals() {
        eprintln!("impair: signals: {e}");
        std::process::exit(1);
    }
    let q = match Queue::open(a.queue, a.maxlen) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("impair: NFQUEUE {}: {e}", a.queue);
            std::process::exit(1);
        }
    };
    println!(
        "impair: queue {} seed {} loss {} dup {} reorder {} corrupt {}: ready",
        a.queue, a.seed, a.loss, a.dup, a.reorder, a.corrupt
    );
    let mut imp = Impairer {
        q,
        decider: Decider::new(rates, a.seed),
        inject,
        held: Vec::new(),
        after: a.reorder_after.max(1),
        delay: Duration::from_millis(a.reorder_delay_ms.min(1000)),
        c: Counters::default(),
    };
    let r = imp.run();
    let c = &imp.c;
    println!(
        "impair: queue {} seen={} passed={} dropped={} duplicated={} reordered={} corrupted={} \
         not_udp={} csum_not_ready={} dup_errors={} verdict_errors={}",
        a.queue,
        c.seen,
        c.passed,
        c.dropped,
        c.duplicated,
        c.reordered,
        c.corrupted,
        c.not_udp,
        c.csum_not_ready,
        c.dup_errors,
        c.verdict_errors
    );
    if let Err(e) = r {
        eprintln!("impair: {e}");
        std::process::exit(1);
    }
}
