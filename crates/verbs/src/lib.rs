//! softrdma verbs layer.
