//! The one error type of the verbs layer: an errno, a kind and a message.

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
    /// The kind an error of this errno has unless its raiser says better: verbs reuses a
    /// few errnos for many causes (EINVAL above all), so this is only a fallback.
    pub const fn kind(self) -> ErrorKind {
        match self {
            Errno::EPERM | Errno::EACCES => ErrorKind::PermissionDenied,
            Errno::ENOENT => ErrorKind::NotFound,
            Errno::EAGAIN => ErrorKind::WouldBlock,
            Errno::ENOMEM => ErrorKind::ResourceExhausted,
            Errno::EFAULT => ErrorKind::BadAddress,
            Errno::EBUSY => ErrorKind::Busy,
            Errno::EINVAL => ErrorKind::InvalidArgument,
            Errno::EOPNOTSUPP => ErrorKind::NotSupported,
        }
    }
}

/// What kind of failure an error is, for programs to match on.
///
/// The errno stays the C ABI's answer and is deliberately coarse (verbs gives EINVAL for a
/// QP in the wrong state, a CQ overflow and a bad range alike, ENOMEM for a full queue and
/// an exhausted device); the kind tells such causes apart. New kinds may be added, so a
/// `match` needs a catch-all arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is invalid on its own or against the device's limits (a field out of
    /// range, a flag combination verbs forbids, a missing or extra QP attribute).
    InvalidArgument,
    /// A handle or key names no live object (never created, or already destroyed).
    NotFound,
    /// A memory range lies (partly) outside the region or device memory it addresses.
    OutOfBounds,
    /// An address lacks the alignment the operation needs (atomics need 8 bytes).
    Misaligned,
    /// Memory the process has not mapped as needed, a null address, or a range wrapping
    /// the address space.
    BadAddress,
    /// Refused by access rights: the object's, or the operating system's.
    PermissionDenied,
    /// An object belongs to another device or protection domain than the one it is used
    /// with.
    ForeignObject,
    /// The QP's current state does not allow the operation (sending before RTS,
    /// receiving in RESET).
    QpState,
    /// The QP state machine does not allow the asked transition from the current state
    /// (for example ERROR to RTR: go through RESET).
    InvalidTransition,
    /// The CQ overflowed and lost completions; it is unusable from then on.
    CqOverflow,
    /// A work queue is full: wait for completions, then post again.
    QueueFull,
    /// A device-wide limit is reached (objects, keys, device memory).
    ResourceExhausted,
    /// The object is still in use (by other objects, or with events not acknowledged).
    Busy,
    /// Nothing is ready yet; retrying later may succeed.
    WouldBlock,
    /// The operation or option is not supported.
    NotSupported,
    /// A wait ended before what it waited for happened.
    TimedOut,
    /// The peer refused the connection (its reason is in the error's rejection).
    Rejected,
    /// The peer could not be reached (nothing answered, or no route).
    Unreachable,
    /// The local address or port is taken.
    AddrInUse,
    /// The address is not local, or nothing can be bound or resolved at it.
    AddrNotAvailable,
    /// No such device is configured.
    NoDevice,
    /// The peer or the connection manager behaved against the protocol.
    Protocol,
    /// An operating-system I/O error (its `source` is the `io::Error`).
    Io,
    /// The configuration (environment or file) is invalid.
    Config,
    /// A work request completed in error (the source is its completion's error).
    Completion,
    /// None of the above.
    Other,
}

/// A verbs error: the errno a C program would see, its kind, and a message saying why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg} ({errno:?})")]
pub struct Error {
    /// The errno.
    pub errno: Errno,
    /// The kind, as precise as the raiser knows it.
    pub kind: ErrorKind,
    /// What went wrong.
    pub msg: &'static str,
}

impl Error {
    /// An error with the given errno and message, of the errno's usual kind.
    pub const fn new(errno: Errno, msg: &'static str) -> Self {
        Error {
            errno,
            kind: errno.kind(),
            msg,
        }
    }
    /// EINVAL with a message.
    pub const fn inval(msg: &'static str) -> Self {
        Error::new(Errno::EINVAL, msg)
    }
    /// The same error, of a more precise kind than its errno implies (the errno stays).
    pub const fn with_kind(self, kind: ErrorKind) -> Self {
        Error { kind, ..self }
    }
}

/// Result with the verbs [`Error`].
pub type Result<T> = core::result::Result<T, Error>;
