//! The one error type of the Rust API: a kind to match on, the errno of the C face, a
//! message, and the underlying error where there is one.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use softrdma_transport::verbs;

pub use softrdma_device::config::ConfigError;
pub use softrdma_transport::verbs::ErrorKind;

/// An error from a softrdma call: what kind of failure it is ([`Error::kind`]), the errno a
/// C verbs program would see, and why.
///
/// Match on the kind, not the errno: verbs gives one errno to many causes.
///
/// ```
/// use softrdma::{Error, ErrorKind};
/// let e = Error::new(22, "QP not ready to send").with_kind(ErrorKind::QpState);
/// match e.kind() {
///     ErrorKind::QpState => {} // bring the QP to RTS first
///     _ => unreachable!(),
/// }
/// assert_eq!(e.errno(), 22);
/// ```
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    errno: i32,
    msg: Cow<'static, str>,
    /// What the peer said when it refused a connection (rdma_cm only).
    rejection: Option<Box<Rejection>>,
    /// Shared so that the error stays `Clone` although `io::Error` is not.
    source: Option<Arc<dyn StdError + Send + Sync + 'static>>,
}

/// A refused connection request: the REJ the peer's connection manager sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The IBTA REJ reason: 8 (invalid service ID) when nothing listens on the port,
    /// 28 (consumer reject) when the server's program refused. A UD request's SIDR_REP
    /// status is given as the reason of the same meaning (unsupported: 8, rejected: 28).
    pub reason: u16,
    /// The private data the server refused with, padded with zeros to the REJ's 148
    /// bytes as the rdma_cm delivers it (empty when no REJ message carried it).
    pub private_data: Vec<u8>,
}

/// Result with the softrdma [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// The kind an errno usually means, for errors that come with nothing more precise (the
/// connection manager's, the operating system's, a caller's [`Error::new`]).
fn kind_of_errno(errno: i32) -> ErrorKind {
    match errno {
        libc::EPERM | libc::EACCES => ErrorKind::PermissionDenied,
        libc::ENOENT => ErrorKind::NotFound,
        libc::EAGAIN => ErrorKind::WouldBlock,
        libc::ENOMEM | libc::ENOSPC | libc::EMFILE | libc::ENFILE => ErrorKind::ResourceExhausted,
        libc::EFAULT => ErrorKind::BadAddress,
        libc::EBUSY => ErrorKind::Busy,
        libc::EINVAL | libc::ERANGE => ErrorKind::InvalidArgument,
        libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT | libc::EAFNOSUPPORT => {
            ErrorKind::NotSupported
        }
        libc::ETIMEDOUT => ErrorKind::TimedOut,
        libc::ECONNREFUSED => ErrorKind::Rejected,
        libc::EHOSTUNREACH | libc::ENETUNREACH => ErrorKind::Unreachable,
        libc::EADDRINUSE => ErrorKind::AddrInUse,
        libc::EADDRNOTAVAIL => ErrorKind::AddrNotAvailable,
        libc::ENODEV | libc::ENXIO => ErrorKind::NoDevice,
        libc::EPROTO => ErrorKind::Protocol,
        libc::EIO => ErrorKind::Io,
        _ => ErrorKind::Other,
    }
}

impl Error {
    /// An error with an errno and a message, of the kind the errno usually means (refine
    /// it with [`Error::with_kind`]).
    pub fn new(errno: i32, msg: impl Into<Cow<'static, str>>) -> Error {
        Error {
            kind: kind_of_errno(errno),
            errno,
            msg: msg.into(),
            rejection: None,
            source: None,
        }
    }
    /// The same error, of kind `kind`; the errno stays, so the C face answers with the same errno.
    pub fn with_kind(mut self, kind: ErrorKind) -> Error {
        self.kind = kind;
        self
    }
    /// The same error, with `source` as the error it comes from.
    pub(crate) fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Error {
        self.source = Some(Arc::new(source));
        self
    }
    /// An operating-system error `e` met while doing what `msg` says: its errno and
    /// kind, with `e` as the source (`fallback` when it carries no errno).
    pub(crate) fn io(e: std::io::Error, fallback: i32, msg: impl Into<Cow<'static, str>>) -> Error {
        let errno = e.raw_os_error().unwrap_or(fallback);
        Error::new(errno, msg)
            .with_kind(io_kind(&e, errno))
            .with_source(e)
    }
    /// The same error with another message (the kind, errno, source and rejection stay),
    /// for a caller that knows better what was being done.
    pub(crate) fn with_message(mut self, msg: impl Into<Cow<'static, str>>) -> Error {
        self.msg = msg.into();
        self
    }
    /// ECONNREFUSED carrying the peer's REJ (what librdmacm's synchronous calls return
    /// for a REJECTED event).
    pub(crate) fn rejected(msg: impl Into<Cow<'static, str>>, rejection: Rejection) -> Error {
        Error {
            rejection: Some(Box::new(rejection)),
            ..Error::new(libc::ECONNREFUSED, msg)
        }
    }
    /// For a connection the peer refused: its reason and private data.
    pub fn rejection(&self) -> Option<&Rejection> {
        self.rejection.as_deref()
    }
    /// EINVAL.
    pub fn invalid(msg: impl Into<Cow<'static, str>>) -> Error {
        Error::new(libc::EINVAL, msg)
    }
    /// ETIMEDOUT: a wait ended without the awaited event.
    pub fn timed_out(msg: impl Into<Cow<'static, str>>) -> Error {
        Error::new(libc::ETIMEDOUT, msg)
    }
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The errno (Linux numbering), as the C face reports the same failure.
    pub fn errno(&self) -> i32 {
        self.errno
    }
    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.msg
    }
    /// Whether this is a timeout.
    pub fn is_timeout(&self) -> bool {
        self.kind == ErrorKind::TimedOut
    }
}

/// The kind of an `io::Error`: its errno's where that says something, `Io` otherwise.
fn io_kind(e: &std::io::Error, errno: i32) -> ErrorKind {
    if e.kind() == std::io::ErrorKind::TimedOut {
        return ErrorKind::TimedOut;
    }
    match kind_of_errno(errno) {
        ErrorKind::Other | ErrorKind::InvalidArgument => ErrorKind::Io,
        k => k,
    }
}

/// Equal when kind, errno, message and rejection are; the source is not compared (errors
/// like `io::Error` have no equality).
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        self.kind == other.kind
            && self.errno == other.errno
            && self.msg == other.msg
            && self.rejection == other.rejection
    }
}

impl Eq for Error {}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let os = std::io::Error::from_raw_os_error(self.errno);
        write!(f, "{} ({os})", self.msg)
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

impl From<verbs::Error> for Error {
    fn from(e: verbs::Error) -> Error {
        Error::new(e.errno.code(), e.msg)
            .with_kind(e.kind)
            .with_source(e)
    }
}

/// A failed work completion, for `wc.result()?` in a function returning [`Result`]: EIO
/// to the errno, the completion's status and detail as the message and the source.
impl From<verbs::WcError> for Error {
    fn from(e: verbs::WcError) -> Error {
        Error::new(libc::EIO, format!("work request failed: {e}"))
            .with_kind(ErrorKind::Completion)
            .with_source(e)
    }
}

impl From<softrdma_cm::cma::CmaError> for Error {
    fn from(e: softrdma_cm::cma::CmaError) -> Error {
        Error::new(e.errno, e.msg).with_source(e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        let msg = e.to_string();
        Error::io(e, libc::EIO, msg)
    }
}

impl From<softrdma_device::config::ConfigError> for Error {
    fn from(e: softrdma_device::config::ConfigError) -> Error {
        Error::new(libc::EINVAL, e.to_string())
            .with_kind(ErrorKind::Config)
            .with_source(e)
    }
}

/// The `io::Error` of the errno's kind, wrapping this error (reach it with
/// `io::Error::get_ref` and `downcast_ref`).
impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        std::io::Error::new(std::io::Error::from_raw_os_error(e.errno).kind(), e)
    }
}
