//! softrdma wire layer.
