//! The one error type of the Rust API: an errno and a message.

use std::borrow::Cow;
use std::fmt;

use softrdma_transport::verbs;

/// An error from a softrdma call: the errno a C verbs program would see, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    errno: i32,
    msg: Cow<'static, str>,
    /// What the peer said when it refused a connection (rdma_cm only).
    rejection: Option<Box<Rejection>>,
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

impl Error {
    /// An error with an errno and a message.
    pub fn new(errno: i32, msg: impl Into<Cow<'static, str>>) -> Error {
        Error {
            errno,
            msg: msg.into(),
            rejection: None,
        }
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
    /// The errno (Linux numbering).
    pub fn errno(&self) -> i32 {
        self.errno
    }
    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.msg
    }
    /// Whether this is a timeout.
    pub fn is_timeout(&self) -> bool {
        self.errno == libc::ETIMEDOUT
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let os = std::io::Error::from_raw_os_error(self.errno);
        write!(f, "{} ({os})", self.msg)
    }
}

impl std::error::Error for Error {}

impl From<verbs::Error> for Error {
    fn from(e: verbs::Error) -> Error {
        Error::new(e.errno.code(), e.msg)
    }
}

impl From<softrdma_cm::cma::CmaError> for Error {
    fn from(e: softrdma_cm::cma::CmaError) -> Error {
        Error::new(e.errno, e.msg)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::new(e.raw_os_error().unwrap_or(libc::EIO), e.to_string())
    }
}

impl From<softrdma_device::config::ConfigError> for Error {
    fn from(e: softrdma_device::config::ConfigError) -> Error {
        Error::new(libc::EINVAL, e.to_string())
    }
}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        std::io::Error::new(
            std::io::Error::from_raw_os_error(e.errno).kind(),
            e.to_string(),
        )
    }
}
