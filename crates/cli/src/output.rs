//! Writing results: JSON lines, stdout flushing, terminal detection, and what happens
//! when the output cannot be written.
//!
//! Every line the CLI prints goes through [`write_out`] and [`write_err`] (the crate's
//! `outln!`, `errln!` and `errout!`); its clippy.toml forbids `println!`, `print!`,
//! `eprintln!` and `eprint!`, which panic on a write error.
//! A reader that went away (`softrdma devices | head -1`) ends the process quietly, as
//! it ends coreutils; any other failure (a full disk) ends it with one line on stderr and
//! exit status 1.

use std::fmt;
use std::io::{self, Write};

use serde::Serialize;

use crate::CmdResult;

/// Write `args` to stdout, or end the process as [`stdout_failed`] says.
pub fn write_out(args: fmt::Arguments<'_>) {
    if let Err(e) = io::stdout().lock().write_fmt(args) {
        stdout_failed(&e);
    }
}

/// Write `args` to stderr; a failure there has nowhere to be reported, so it is ignored
/// (`eprintln!` would panic).
pub fn write_err(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

pub fn flush_stdout() {
    if let Err(e) = io::stdout().flush() {
        stdout_failed(&e);
    }
}

/// End the process after stdout failed with `e`. A closed pipe is the reader's choice,
/// not an error: the process dies of SIGPIPE, as a C program or coreutils would (Rust
/// ignores the signal, so it arrives as EPIPE). Anything else is one line and status 1.
/// The process exits from wherever it was writing: its devices close with it, as on any
/// exit, and the peer of a session sees the connection end.
pub fn stdout_failed(e: &io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        // SAFETY: restoring the default disposition and raising the signal touch no
        // memory of this process.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::raise(libc::SIGPIPE);
        }
        // Not reached unless the signal is blocked: the status a shell shows for it.
        std::process::exit(128 + libc::SIGPIPE);
    }
    write_err(format_args!(
        "softrdma: cannot write to standard output: {e}\n"
    ));
    std::process::exit(1);
}

/// Print `v` as one line of JSON, the form of every `--json` output.
pub fn print_json(v: &impl Serialize) -> CmdResult {
    let s = serde_json::to_string(v).map_err(|e| format!("cannot write JSON: {e}"))?;
    outln!("{s}");
    Ok(())
}

/// Whether stderr is a terminal (for progress displays).
pub fn stderr_is_tty() -> bool {
    use std::io::IsTerminal;
    io::stderr().is_terminal()
}
