//! The few system calls the device needs beyond the driver: eventfd, poll and the timer
//! slack, through rustix's typed, safe calls.

use std::io;
use std::num::NonZeroU64;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

/// A non-blocking eventfd used as a level signal: readable while "set".
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new, cleared, non-blocking, close-on-exec eventfd.
    pub fn new() -> io::Result<EventFd> {
        let fd = rustix::event::eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        Ok(EventFd { fd })
    }

    /// Make it readable. Adding to a counter that is already set only grows the count.
    pub fn set(&self) {
        // A failure (EAGAIN at counter saturation) leaves the fd readable, which is what
        // we want.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Make it unreadable (reads the counter; a cleared fd stays cleared).
    ///
    /// Reads only when the fd polls readable: an fd handed to a program (a completion
    /// channel, the async-event fd) may have been made blocking, and reading a zero
    /// counter then would block.
    pub fn clear(&self) {
        if !poll_readable(&[self.fd.as_fd()], Some(Duration::ZERO)).is_ok_and(|r| r[0]) {
            return;
        }
        let mut v = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut v);
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Wait until one of `fds` is readable (or in error or hung up) or `timeout` passes
/// (None: forever). Returns which fds are; EINTR counts as an early return with none.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(fd, PollFlags::IN))
        .collect();
    let ts = timeout.map(|d| Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos().into(),
    });
    match rustix::event::poll(&mut pfds, ts.as_ref()) {
        Ok(_) => {}
        Err(rustix::io::Errno::INTR) => return Ok(vec![false; fds.len()]),
        Err(e) => return Err(e.into()),
    }
    Ok(pfds
        .iter()
        .map(|p| {
            p.revents()
                .intersects(PollFlags::IN | PollFlags::ERR | PollFlags::HUP)
        })
        .collect())
}

/// 256 bits from the kernel's CSPRNG, the key of the generators of memory keys, QP
/// numbers, first PSNs and the connection manager's IDs and PSNs: `getrandom`, or
/// `/dev/urandom` where the call is refused (a seccomp filter, an old kernel). Never the
/// clock: with neither, an error, and no device opens.
pub fn os_seed() -> io::Result<softrdma_wire::Seed> {
    let mut k = [0u8; 32];
    let mut got = 0;
    while got < k.len() {
        // SAFETY: writes at most `k.len() - got` bytes into `k` from offset `got`.
        let n = unsafe { libc::getrandom(k[got..].as_mut_ptr().cast(), k.len() - got, 0) };
        if n > 0 {
            got += n as usize;
            continue;
        }
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        break;
    }
    if got < k.len() {
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut k))
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "no randomness for memory keys: getrandom failed and /dev/urandom: {e}"
                    ),
                )
            })?;
    }
    Ok(softrdma_wire::Seed(k))
}

/// A random seed without a dependency: std's per-process random hasher keys. For
/// spreading choices (ephemeral ports, temporary names), never for key material, which
/// comes from [`os_seed`].
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish()
}

/// Set the calling thread's timer slack (how late the kernel may fire its timed sleeps, to
/// batch wake-ups). Best effort: without it, sleeps are only less precise.
pub fn set_timer_slack(slack: Duration) {
    let ns = slack.as_nanos().clamp(1, u128::from(u64::MAX)) as u64;
    let _ = rustix::thread::set_current_timer_slack(NonZeroU64::new(ns));
}
