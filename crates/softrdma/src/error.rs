//! The one error type of the Rust API: an errno and a message.

use std::borrow::Cow;
use std::fmt;

use softrdma_transport::verbs;

/// An error from a softrdma call: the errno a C verbs program would see, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    errno: i32,
    msg: Cow<'static, str>,
}

/// Result with the softrdma [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error with an errno and a message.
    pub fn new(errno: i32, msg: impl Into<Cow<'static, str>>) -> Error {
        Error {
            errno,
            msg: msg.into(),
        }
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
