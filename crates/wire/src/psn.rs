//! 24-bit packet sequence number arithmetic.

/// PSNs are 24 bits wide.
pub const MASK: u32 = 0xFF_FFFF;

/// `psn + n` modulo 2^24.
pub fn add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & MASK
}

/// `psn - n` modulo 2^24.
pub fn sub(psn: u32, n: u32) -> u32 {
    psn.wrapping_sub(n) & MASK
}

/// Signed distance `a - b` in 24-bit space, in `-2^23 ..= 2^23 - 1`.
pub fn diff(a: u32, b: u32) -> i32 {
    // sign-extend the low 24 bits of the difference
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// `a` comes before `b`.
pub fn lt(a: u32, b: u32) -> bool {
    diff(a, b) < 0
}

/// `a` comes before or is `b`.
pub fn le(a: u32, b: u32) -> bool {
    diff(a, b) <= 0
}

/// `a` comes after `b`.
pub fn gt(a: u32, b: u32) -> bool {
    diff(a, b) > 0
}

/// `a` comes after or is `b`.
pub fn ge(a: u32, b: u32) -> bool {
    diff(a, b) >= 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps() {
        assert_eq!(add(MASK, 1), 0);
        assert_eq!(add(0xFF_FFFE, 5), 3);
        assert_eq!(sub(0, 1), MASK);
        assert_eq!(diff(0, MASK), 1);
        assert_eq!(diff(MASK, 0), -1);
        assert_eq!(diff(5, 3), 2);
        assert_eq!(diff(3, 5), -2);
        assert_eq!(diff(0x80_0000, 0), -0x80_0000);
        assert_eq!(diff(0x7F_FFFF, 0), 0x7F_FFFF);
        assert!(lt(MASK, 0) && le(MASK, 0) && le(7, 7) && !lt(7, 7));
        assert!(gt(0, MASK) && ge(0, 0));
        // upper bits are ignored
        assert_eq!(diff(0xFF00_0001, 0), 1);
    }
}
