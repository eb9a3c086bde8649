//! Diagnostic logging, off unless `SOFTRDMA_LOG` asks for it.
//!
//! The engine emits [`tracing`] events where it decides: every dropped packet with its
//! reason and the counter it raised, NAKs sent and received, QP state changes and the
//! engine's own moves to ERROR with their cause, retransmission timeouts and RNR waits.
//! Their targets are the module paths (`softrdma_transport::responder`, …). Nothing is
//! formatted unless a subscriber wants the event, so logging that is off costs a load
//! and a compare per event site reached.

use std::io::Write;
use std::sync::Once;

use tracing_subscriber::EnvFilter;

/// The environment variable [`init_from_env`] reads: a filter in `RUST_LOG` syntax, for
/// example `debug` or `softrdma_transport=trace,info`.
pub const ENV_VAR: &str = "SOFTRDMA_LOG";

/// Turn diagnostic logging on if `SOFTRDMA_LOG` is set and not empty: events the filter
/// admits are written to stderr, one line each.
///
/// The faces call this when a device opens; only the first call in a process does
/// anything. A program that installed its own global `tracing` subscriber keeps it (and
/// gets the events through it). A filter that does not parse is reported in one line on
/// stderr and logging stays off. Never panics.
pub fn init_from_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Some(spec) = std::env::var_os(ENV_VAR) else {
            return;
        };
        let spec = spec.to_string_lossy();
        if spec.trim().is_empty() {
            return;
        }
        match EnvFilter::try_new(spec.trim()) {
            Ok(filter) => {
                // Fails only when a global subscriber is already set: the program's
                // choice, which stands.
                let _ = tracing_subscriber::fmt()
                    .with_env_filter(filter)
                    .with_writer(std::io::stderr)
                    .with_thread_names(true)
                    .try_init();
            }
            Err(e) => {
                // Not eprintln!, which panics when stderr cannot be written.
                let _ = writeln!(
                    std::io::stderr(),
                    "softrdma: {ENV_VAR}={spec:?} is not a valid filter ({e}); logging stays off"
                );
            }
        }
    });
}
