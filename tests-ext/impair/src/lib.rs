//! Test tools for running softrdma over an impaired link: the pieces of the `impair`
//! NFQUEUE impairer that need no privileges (its seeded decisions, the nfnetlink_queue
//! messages it speaks, the IPv4/UDP edits it makes), so they are unit-tested as a normal
//! user, and the data patterns of the `soak` checker.
//!
//! The binaries: `impair` (see `src/bin/impair.rs`) and `soak` (`src/bin/soak.rs`);
//! `tests-ext/impair/run.sh` puts them together in two network namespaces.

#![warn(missing_docs)]

pub mod decide;
pub mod nfq;
pub mod pattern;
pub mod pkt;
