//! `SOFTRDMA_LOG` with a filter that does not parse: reported, logging stays off, no panic.
//! Its own test binary, since the environment and the global subscriber are per process.

#[test]
fn bad_filter_keeps_logging_off() {
    std::env::set_var(softrdma_device::log::ENV_VAR, "softrdma_transport=loud");
    softrdma_device::log::init_from_env();
    assert!(
        !tracing::dispatcher::has_been_set(),
        "a bad filter must not install a subscriber"
    );
    // A second call (every device open makes one) does nothing either.
    softrdma_device::log::init_from_env();
    assert!(!tracing::dispatcher::has_been_set());
}
