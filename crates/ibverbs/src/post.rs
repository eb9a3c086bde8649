//! Posting work requests (milestone 2).
