//! Packet buffers for reuse: a datagram's buffer comes back once the driver has sent it
//! ([`crate::Rnic::recycle`]), and the next packet is built in it instead of a fresh
//! allocation.

/// Packets up to this size are built in "small" buffers, larger ones in "large" buffers,
/// so that recycling an ACK buffer never shrinks a buffer that will carry data again.
const SMALL_PKT: usize = 256;

/// Free buffers kept per size class (at most; the rest are freed).
const POOL_MAX: usize = 4096;

/// Free packet buffers in two size classes.
#[derive(Debug, Default)]
pub(crate) struct BufPool {
    /// Free buffers up to [`SMALL_PKT`] bytes of capacity.
    small: Vec<Vec<u8>>,
    /// Free buffers of more capacity.
    large: Vec<Vec<u8>>,
}

impl BufPool {
    /// A buffer of exactly `len` bytes (contents unspecified), from the pool when it can.
    pub fn take(&mut self, len: usize) -> Vec<u8> {
        let (pool, cap) = if len <= SMALL_PKT {
            (&mut self.small, SMALL_PKT)
        } else {
            (&mut self.large, len)
        };
        let mut b = pool.pop().unwrap_or_else(|| Vec::with_capacity(cap));
        // Recycled buffers keep their length, so this writes only past the old length.
        b.resize(len, 0);
        b
    }

    /// Keep a buffer for reuse (up to [`POOL_MAX`] per class; the rest are freed).
    pub fn recycle(&mut self, b: Vec<u8>) {
        let pool = match b.capacity() {
            0 => return,
            c if c <= SMALL_PKT => &mut self.small,
            _ => &mut self.large,
        };
        if pool.len() < POOL_MAX {
            pool.push(b);
        }
    }
}
