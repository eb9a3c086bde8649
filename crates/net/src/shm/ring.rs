//! A single-producer single-consumer ring of packet slots in a sealed memfd, shared by two
//! processes of one host.
//!
//! Layout (all offsets fixed by this module, none read from the mapping): a 4 KiB header
//! with the consumer's index (`head`), the producer's index (`tail`), the consumer's
//! "asleep" flag and the producer's nudge count, each on its own cache line; then [`SLOTS`] slots of [`SLOT_SIZE`] bytes,
//! each a length word, a word of UDP source port and TOS, and the packet. Indices run
//! freely (wrapping `u32`) and are masked to a slot.
//!
//! Each side keeps its own index privately and only publishes it: the producer never
//! reads `tail` back, the consumer never reads `head` back, so a peer that scribbles on
//! them can make the ring look full or empty or corrupt, never make either side touch
//! memory outside the mapping. The consumer treats everything it reads as hostile: a
//! length beyond the slot is a corrupt ring (it is given up), a `tail` more than
//! [`SLOTS`] ahead likewise; nothing panics and no read leaves the slot.
//!
//! Wake-ups: the consumer sets `asleep` before it blocks, then looks at the ring once
//! more; the producer publishes `tail`, then looks at `asleep` (a SeqCst fence on both
//! sides orders the store before the load), and only then writes the ring's eventfd. A
//! consumer that is spinning costs the producer no system call. A one-sided WRITE that the
//! producer's process placed in the consumer's memory (no packet) is announced the same
//! way, by a count in the header the consumer compares before it blocks (a nudge), so a
//! thread waiting for its memory to change wakes for it; the eventfd is written for a
//! nudge only if such a thread sleeps ([`ASLEEP_NUDGE`]), not for one that waits for
//! packets alone, so that a stream of WRITEs into an idle peer wakes none of its threads.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::map::{check_sealed_memfd, sealed_memfd, Mapping};
use std::sync::atomic::{fence, Ordering};

/// Slots per ring (a power of two). As many as the packets a device's 8 MiB socket
/// buffer holds (Linux charges a 4 KiB datagram about 8.4 KiB of it): a sender's RC
/// windows are sized for that buffer, and a ring that holds fewer drops bursts the
/// socket would have taken. 4.4 MiB of memory per direction and peer, touched as used.
pub const SLOTS: u32 = 1024;
/// Bytes per slot: the largest RoCEv2 packet the device sends (4096 bytes of payload, the
/// largest MTU, plus BTH, RETH or AtomicETH, ImmDt and ICRC) with room to spare.
pub const SLOT_SIZE: usize = 4096 + 256;
/// Slot header: length word, port-and-TOS word.
const SLOT_HDR: usize = 8;
/// Largest packet a slot holds; a larger one takes another path.
pub const MAX_PACKET: usize = SLOT_SIZE - SLOT_HDR;
/// Bytes of the ring header.
const HDR_SIZE: usize = 4096;
/// Size of a ring's memfd.
pub const RING_BYTES: usize = HDR_SIZE + SLOTS as usize * SLOT_SIZE;

const MAGIC: u64 = u64::from_le_bytes(*b"SRDMAR1\0");
const OFF_MAGIC: usize = 0;
const OFF_HEAD: usize = 64;
const OFF_TAIL: usize = 128;
const OFF_ASLEEP: usize = 192;
/// The producer's count of one-sided operations it placed in the consumer's memory (see
/// [`Producer::nudge`]).
const OFF_PLACED: usize = 256;
const MASK: u32 = SLOTS - 1;
/// `asleep` bit: a thread of the consumer blocks, to be woken for packets.
pub const ASLEEP_PACKETS: u32 = 1;
/// `asleep` bit: one of those threads is also to be woken for a nudge (its memory changed).
pub const ASLEEP_NUDGE: u32 = 2;

/// Offset of slot `i` (any index: it is masked).
fn slot_off(i: u32) -> usize {
    HDR_SIZE + (i & MASK) as usize * SLOT_SIZE
}

/// The sending side of a ring: it made the memfd and writes packets into it.
#[derive(Debug)]
pub struct Producer {
    map: Mapping,
    memfd: OwnedFd,
    /// Our index: the next slot to write. Never read back from the mapping.
    tail: u32,
    /// Slots written since the last [`Producer::publish`].
    pending: u32,
    /// Our count of nudges. Never read back from the mapping.
    placed: u32,
    /// The consumer's index as last read: slots up to it are free without reading the
    /// mapping again (a cache line the consumer writes), until the ring looks full.
    head_seen: u32,
}

/// Why [`Producer::push`] did not take a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// The consumer has not freed a slot yet (or reports an index that makes no sense).
    Full,
    /// Larger than [`MAX_PACKET`].
    TooBig,
}

impl Producer {
    /// A new empty ring in a fresh memfd, sealed against resizing. The consumer, once it
    /// has mapped the ring, drains what it already holds (it cannot be woken before).
    pub fn create() -> io::Result<Producer> {
        let memfd = sealed_memfd(c"softrdma-ring", RING_BYTES)?;
        let map = Mapping::map(memfd.as_fd(), RING_BYTES)?;
        map.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(Producer {
            placed: 0,
            map,
            memfd,
            tail: 0,
            pending: 0,
            head_seen: 0,
        })
    }

    /// The ring's memfd, to pass to the consumer.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// Slots free at least, as far as the consumer's published index says (0 if it says
    /// something impossible). The index is read again only once the ring looks full.
    pub fn free(&mut self) -> u32 {
        let used = self.tail.wrapping_sub(self.head_seen);
        if used < SLOTS {
            return SLOTS - used;
        }
        self.head_seen = self.map.u32_at(OFF_HEAD).load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(self.head_seen);
        SLOTS.saturating_sub(used)
    }

    /// Write one packet into the next slot (not yet visible: [`Producer::publish`]).
    pub fn push(&mut self, src_port: u16, tos: u8, data: &[u8]) -> Result<(), PushError> {
        if data.len() > MAX_PACKET {
            return Err(PushError::TooBig);
        }
        if self.free() == 0 {
            return Err(PushError::Full);
        }
        let off = slot_off(self.tail);
        self.map
            .u32_at(off)
            .store(data.len() as u32, Ordering::Relaxed);
        self.map.u32_at(off + 4).store(
            u32::from(src_port) | u32::from(tos) << 16,
            Ordering::Relaxed,
        );
        // SAFETY: `off + SLOT_HDR + data.len() <= off + SLOT_SIZE <= RING_BYTES`, inside
        // the mapping; the source is our own slice, which cannot overlap it. The consumer
        // does not read this slot before `publish` releases it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.ptr().as_ptr().add(off + SLOT_HDR),
                data.len(),
            );
        }
        self.tail = self.tail.wrapping_add(1);
        self.pending += 1;
        Ok(())
    }

    /// Make the packets pushed so far visible to the consumer. Returns whether it is (or
    /// may be) asleep, so the caller must write the ring's eventfd; `false` when nothing
    /// was pending or it is polling.
    pub fn publish(&mut self) -> bool {
        if self.pending == 0 {
            return false;
        }
        self.pending = 0;
        self.map
            .u32_at(OFF_TAIL)
            .store(self.tail, Ordering::Release);
        // Pairs with the consumer's fence in `Consumer::prepare_sleep`: either it sees the
        // new tail, or we see it asleep.
        fence(Ordering::SeqCst);
        self.take_sleeper(ASLEEP_PACKETS | ASLEEP_NUDGE)
    }
}

impl Producer {
    /// Whether the consumer is (or may be) asleep, marking it awake: the caller writes its
    /// eventfd once, and the producers after it, who find it awake, make no system call
    /// while it has not blocked again (it marks itself asleep anew before every block).
    fn take_sleeper(&self, bits: u32) -> bool {
        // Read first: a polling consumer's flag stays 0, and the line stays shared.
        let asleep = self.map.u32_at(OFF_ASLEEP);
        asleep.load(Ordering::Relaxed) & bits != 0 && asleep.swap(0, Ordering::Relaxed) != 0
    }

    /// Whether the consumer marked itself asleep (a thread of it blocks, or is about to).
    pub fn consumer_asleep(&self) -> bool {
        self.map.u32_at(OFF_ASLEEP).load(Ordering::Relaxed) != 0
    }

    /// Tell the consumer that its memory changed with no packet (a one-sided WRITE placed
    /// in it): a thread of its device that waits for the device to change (a program
    /// watching its memory through `wait_or`) looks again. Returns whether such a thread
    /// is (or may be) asleep, so the caller must write the ring's eventfd; threads that
    /// sleep waiting for packets alone are left asleep. The same pairing as
    /// [`Producer::publish`]: the consumer, about to block, looks at the count after
    /// marking itself asleep.
    pub fn nudge(&mut self) -> bool {
        self.placed = self.placed.wrapping_add(1);
        self.map
            .u32_at(OFF_PLACED)
            .store(self.placed, Ordering::Release);
        fence(Ordering::SeqCst);
        self.take_sleeper(ASLEEP_NUDGE)
    }
}

/// Why a ring was given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

/// The receiving side of a ring: it maps the producer's memfd and reads packets out.
#[derive(Debug)]
pub struct Consumer {
    map: Mapping,
    /// Our index: the next slot to read. Never read back from the mapping.
    head: u32,
    /// Slots read since the last [`Consumer::commit`].
    pending: u32,
    /// The producer's nudge count as last taken ([`Consumer::take_nudge`]).
    placed_seen: u32,
    /// The producer's index as last read: slots before it are filled without reading
    /// the mapping again (a cache line the producer writes), until we catch up with it.
    tail_seen: u32,
}

impl Consumer {
    /// Map the ring in `memfd`, a peer's: refused unless it is a memfd of exactly
    /// [`RING_BYTES`] bytes sealed against resizing (shrink, grow and further seals
    /// refused), so that it stays backed for as long as we map it whatever the peer does.
    pub fn open(memfd: BorrowedFd<'_>) -> io::Result<Consumer> {
        check_sealed_memfd(memfd, RING_BYTES, "ring")?;
        let map = Mapping::map(memfd, RING_BYTES)?;
        // A ring starts empty at index 0 (the producer made it so before passing it on).
        Ok(Consumer {
            map,
            head: 0,
            pending: 0,
            placed_seen: 0,
            tail_seen: 0,
        })
    }

    /// Whether packets wait (as far as the producer's index says).
    pub fn is_empty(&self) -> bool {
        self.map.u32_at(OFF_TAIL).load(Ordering::Acquire) == self.head
    }

    /// Copy the next packet into `buf` (which must hold [`MAX_PACKET`] bytes; a shorter
    /// one gets the packet cut, as a socket cuts a datagram): its length, UDP source port
    /// and TOS, or `None` if the ring is empty. The slot is freed at the next
    /// [`Consumer::commit`]. `Err(Corrupt)` if the producer wrote something impossible
    /// (an index too far ahead, a length beyond the slot): the ring must be given up.
    pub fn pop(&mut self, buf: &mut [u8]) -> Result<Option<(usize, u16, u8)>, Corrupt> {
        if self.tail_seen == self.head {
            self.tail_seen = self.map.u32_at(OFF_TAIL).load(Ordering::Acquire);
            let avail = self.tail_seen.wrapping_sub(self.head);
            if avail == 0 {
                return Ok(None);
            }
            if avail > SLOTS {
                return Err(Corrupt);
            }
        }
        let off = slot_off(self.head);
        let len = self.map.u32_at(off).load(Ordering::Relaxed) as usize;
        let meta = self.map.u32_at(off + 4).load(Ordering::Relaxed);
        if len > MAX_PACKET {
            return Err(Corrupt);
        }
        let n = len.min(buf.len());
        // SAFETY: `off + SLOT_HDR + n <= off + SLOT_SIZE <= RING_BYTES`: inside the
        // mapping. The bytes are plain `u8` (every value valid); a hostile producer
        // rewriting them meanwhile only changes which bytes we get, which the transport
        // checks like any datagram's. `buf` is ours and does not overlap the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.ptr().as_ptr().add(off + SLOT_HDR),
                buf.as_mut_ptr(),
                n,
            );
        }
        self.head = self.head.wrapping_add(1);
        self.pending += 1;
        Ok(Some((n, meta as u16, (meta >> 16) as u8)))
    }

    /// Whether the producer nudged ([`Producer::nudge`]) since the last call. Any value a
    /// hostile producer writes only makes a waiter look again.
    pub fn take_nudge(&mut self) -> bool {
        let p = self.map.u32_at(OFF_PLACED).load(Ordering::Acquire);
        let new = p != self.placed_seen;
        self.placed_seen = p;
        new
    }

    /// The producer's nudge count as it stands (any value a hostile producer writes only
    /// changes which small WRITEs of ours count as a stream).
    pub fn nudges(&self) -> u32 {
        self.map.u32_at(OFF_PLACED).load(Ordering::Acquire)
    }

    /// Whether a nudge waits to be taken.
    fn nudged(&self) -> bool {
        self.map.u32_at(OFF_PLACED).load(Ordering::Acquire) != self.placed_seen
    }

    /// Whether neither packets nor a nudge wait.
    pub fn is_quiet(&self) -> bool {
        self.is_empty() && !self.nudged()
    }

    /// Free the slots read so far for the producer.
    pub fn commit(&mut self) {
        if self.pending > 0 {
            self.pending = 0;
            self.map
                .u32_at(OFF_HEAD)
                .store(self.head, Ordering::Release);
        }
    }

    /// A thread of ours is about to block on the ring's eventfd: mark us asleep (`bits`:
    /// [`ASLEEP_PACKETS`], and [`ASLEEP_NUDGE`] if a sleeping thread is to be woken for
    /// nudges too), then look once more. Returns `true` if the ring is quiet (block),
    /// `false` if packets or a nudge arrived meanwhile (don't: take them).
    pub fn sleep_begin(&self, bits: u32) -> bool {
        self.map
            .u32_at(OFF_ASLEEP)
            .store(bits | ASLEEP_PACKETS, Ordering::Relaxed);
        // Pairs with the producer's fence in `Producer::publish` and `Producer::nudge`.
        fence(Ordering::SeqCst);
        self.is_quiet()
    }

    /// No thread of ours blocks any more: producers need not write the eventfd.
    pub fn sleep_end(&self) {
        self.map.u32_at(OFF_ASLEEP).store(0, Ordering::Relaxed);
    }

    /// Whether the `asleep` word is set, for tests.
    #[cfg(test)]
    fn consumer_asleep_for_test(&self) -> bool {
        self.map.u32_at(OFF_ASLEEP).load(Ordering::Relaxed) != 0
    }

    /// Write `bytes` at `off` into the mapping, for tests of hostile contents.
    #[cfg(test)]
    fn scribble(&self, off: usize, bytes: &[u8]) {
        let end = (off + bytes.len()).min(RING_BYTES);
        for (k, b) in bytes[..end.saturating_sub(off)].iter().enumerate() {
            // SAFETY: `off + k < end <= RING_BYTES`: inside the mapping.
            unsafe { self.map.ptr().as_ptr().add(off + k).write_volatile(*b) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::map::SEALS;
    use std::os::fd::{AsRawFd, FromRawFd};

    fn pair() -> (Producer, Consumer) {
        let p = Producer::create().unwrap();
        let c = Consumer::open(p.memfd()).unwrap();
        (p, c)
    }

    #[test]
    fn packets_in_order_up_to_slot_size() {
        let (mut p, mut c) = pair();
        let mut buf = vec![0u8; MAX_PACKET];
        for round in 0..3u32 {
            for i in 0..SLOTS {
                let len = ((i as usize * 97 + round as usize) % (MAX_PACKET + 1)).max(1);
                let data: Vec<u8> = (0..len).map(|k| (k as u32 ^ i) as u8).collect();
                p.push(i as u16, (i % 251) as u8, &data).unwrap();
            }
            assert_eq!(p.push(1, 0, &[1]), Err(PushError::Full));
            p.publish();
            for i in 0..SLOTS {
                let (n, port, tos) = c.pop(&mut buf).unwrap().unwrap();
                let len = ((i as usize * 97 + round as usize) % (MAX_PACKET + 1)).max(1);
                assert_eq!((n, port, tos), (len, i as u16, (i % 251) as u8));
                assert!(buf[..n]
                    .iter()
                    .enumerate()
                    .all(|(k, b)| *b == (k as u32 ^ i) as u8));
            }
            assert_eq!(c.pop(&mut buf), Ok(None));
            c.commit();
            assert_eq!(p.free(), SLOTS);
        }
        assert_eq!(
            p.push(0, 0, &vec![0; MAX_PACKET + 1]),
            Err(PushError::TooBig)
        );
        p.push(0, 0, &vec![7; MAX_PACKET]).unwrap();
        p.publish();
        assert_eq!(c.pop(&mut buf).unwrap().unwrap().0, MAX_PACKET);
    }

    #[test]
    fn unpublished_packets_are_invisible() {
        let (mut p, mut c) = pair();
        let mut buf = vec![0u8; MAX_PACKET];
        p.push(9, 0, b"abc").unwrap();
        assert!(c.is_empty());
        assert_eq!(c.pop(&mut buf), Ok(None));
        p.publish();
        assert_eq!(c.pop(&mut buf), Ok(Some((3, 9, 0))));
        assert_eq!(&buf[..3], b"abc");
    }

    #[test]
    fn producer_wakes_only_a_sleeping_consumer() {
        let (mut p, mut c) = pair();
        let mut buf = vec![0u8; MAX_PACKET];
        p.push(1, 0, b"y").unwrap();
        assert!(!p.publish(), "no wake-up while the consumer polls");
        // Not empty: the consumer must not block.
        assert!(!c.sleep_begin(ASLEEP_NUDGE));
        c.sleep_end();
        while c.pop(&mut buf).unwrap().is_some() {}
        c.commit();
        assert!(c.sleep_begin(ASLEEP_NUDGE));
        p.push(1, 0, b"z").unwrap();
        assert!(p.publish(), "a sleeping consumer is woken");
        // Nothing pending: nothing to wake for.
        assert!(!p.publish());
        // Woken once: the next packet makes no second wake-up before it blocks again.
        p.push(1, 0, b"v").unwrap();
        assert!(!p.publish(), "woken already");
        assert!(!p.nudge(), "woken already");
        assert!(!c.sleep_begin(ASLEEP_NUDGE), "packets wait");
        while c.pop(&mut buf).unwrap().is_some() {}
        c.commit();
        assert!(c.take_nudge());
        assert!(c.sleep_begin(ASLEEP_NUDGE));
        assert!(p.nudge(), "a nudge wakes it once it sleeps again");
        assert!(!c.sleep_begin(ASLEEP_NUDGE), "a nudge waits");
        assert!(c.take_nudge());
        c.sleep_end();
        p.push(1, 0, b"w").unwrap();
        assert!(!p.publish());
    }

    #[test]
    fn a_nudge_wakes_only_a_consumer_waiting_for_its_memory() {
        let (mut p, mut c) = pair();
        let mut buf = vec![0u8; MAX_PACKET];
        // Only threads that wait for packets sleep: a nudge leaves them asleep.
        assert!(c.sleep_begin(0));
        assert!(!p.nudge(), "no thread waits for its memory");
        assert!(c.consumer_asleep_for_test());
        p.push(1, 0, b"a").unwrap();
        assert!(p.publish(), "a packet wakes it");
        c.sleep_end();
        while c.pop(&mut buf).unwrap().is_some() {}
        c.commit();
        assert!(c.take_nudge());
        // A thread that waits for its memory sleeps too: the nudge wakes.
        assert!(c.sleep_begin(ASLEEP_NUDGE));
        assert!(p.nudge());
    }

    #[test]
    fn a_short_buffer_cuts_the_packet() {
        let (mut p, mut c) = pair();
        p.push(1, 2, &[5; 100]).unwrap();
        p.publish();
        let mut buf = [0u8; 10];
        assert_eq!(c.pop(&mut buf), Ok(Some((10, 1, 2))));
    }

    #[test]
    fn hostile_indices_and_lengths_give_up_the_ring() {
        let (mut p, mut c) = pair();
        let mut buf = vec![0u8; MAX_PACKET];
        // Tail far ahead of head.
        c.scribble(OFF_TAIL, &(SLOTS + 1).to_ne_bytes());
        assert_eq!(c.pop(&mut buf), Err(Corrupt));
        // A length beyond the slot.
        let (mut p2, mut c2) = pair();
        p2.push(1, 0, b"ok").unwrap();
        p2.publish();
        c2.scribble(slot_off(0), &u32::MAX.to_ne_bytes());
        assert_eq!(c2.pop(&mut buf), Err(Corrupt));
        // A consumer index that makes no sense: the producer sees a full ring (it reads
        // the index once its own count says the ring is full).
        for i in 0..SLOTS {
            p.push(i as u16, 0, b"f").unwrap();
        }
        c.scribble(OFF_HEAD, &(1u32 << 31).to_ne_bytes());
        assert_eq!(p.free(), 0);
        assert_eq!(p.push(1, 0, b"x"), Err(PushError::Full));
    }

    #[test]
    fn unsealed_or_wrong_size_memfds_are_refused() {
        let make = |size: usize, seals: libc::c_int| {
            // SAFETY: a valid C string and flags.
            let fd = unsafe {
                libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
            };
            assert!(fd >= 0);
            // SAFETY: ours.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: plain calls on our descriptor.
            unsafe {
                assert_eq!(libc::ftruncate(fd.as_raw_fd(), size as libc::off_t), 0);
                if seals != 0 {
                    assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
                }
            }
            fd
        };
        assert!(Consumer::open(make(RING_BYTES, 0).as_fd()).is_err());
        assert!(Consumer::open(make(RING_BYTES - 4096, SEALS).as_fd()).is_err());
        assert!(Consumer::open(make(RING_BYTES * 2, SEALS).as_fd()).is_err());
        assert!(Consumer::open(make(RING_BYTES, SEALS).as_fd()).is_ok());
        // Not a memfd at all.
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(Consumer::open(f.as_fd()).is_err());
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            /// Random bytes anywhere in the shared mapping (header and slots), between
            /// and during reads: the consumer never panics, never returns more than a slot
            /// or more packets than the ring has slots before it reports corruption or
            /// runs dry.
            #[test]
            fn hostile_contents_never_panic(
                writes in proptest::collection::vec((0..RING_BYTES, proptest::collection::vec(any::<u8>(), 1..64)), 0..32),
                packets in 0..8u32,
            ) {
                let (mut p, mut c) = pair();
                for i in 0..packets {
                    p.push(i as u16, 0, &[i as u8; 32]).unwrap();
                }
                p.publish();
                let mut buf = vec![0u8; MAX_PACKET];
                for (off, bytes) in &writes {
                    c.scribble(*off, bytes);
                }
                let mut got = 0u32;
                while let Ok(Some((n, _, _))) = c.pop(&mut buf) {
                    prop_assert!(n <= MAX_PACKET);
                    got += 1;
                    prop_assert!(got <= SLOTS);
                }
                c.commit();
                // The producer stays within its mapping whatever the consumer wrote.
                let _ = p.push(1, 1, &[1; 16]);
                let _ = p.free();
                let _ = p.publish();
            }
        }
    }
}
