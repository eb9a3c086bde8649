//! softrdma net layer.
