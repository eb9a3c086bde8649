//! The one error type of the verbs layer: an errno plus a message.

/// errno values a verbs user expects (Linux numbering, so the C ABI can pass them through).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Errno {
    /// Operation not permitted.
    EPERM = 1,
    /// No such object.
    ENOENT = 2,
    /// Try again (queue full, nothing ready).
    EAGAIN = 11,
    /// Out of memory or a resource limit reached.
    ENOMEM = 12,
    /// Access denied.
    EACCES = 13,
    /// Bad address or range.
    EFAULT = 14,
    /// Object in use.
    EBUSY = 16,
    /// Invalid argument.
    EINVAL = 22,
    /// Operation not supported.
    EOPNOTSUPP = 95,
}

impl Errno {
    /// The numeric value (Linux).
    pub fn code(self) -> i32 {
        self as i32
    }
}

/// A verbs error: the errno a C program would see, and a message saying why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg} ({errno:?})")]
pub struct Error {
    /// The errno.
    pub errno: Errno,
    /// What went wrong.
    pub msg: &'static str,
}

impl Error {
    /// An error with the given errno and message.
    pub const fn new(errno: Errno, msg: &'static str) -> Self {
        Error { errno, msg }
    }
    /// EINVAL with a message.
    pub const fn inval(msg: &'static str) -> Self {
        Error::new(Errno::EINVAL, msg)
    }
}

/// Result with the verbs [`Error`].
pub type Result<T> = core::result::Result<T, Error>;
