//! softrdma transport layer.
