//! Writing results: JSON lines, stdout flushing, terminal detection.

use std::io::Write;

use serde::Serialize;

use crate::CmdResult;

pub fn flush_stdout() {
    let _ = std::io::stdout().flush();
}

/// Print `v` as one line of JSON, the form of every `--json` output.
pub fn print_json(v: &impl Serialize) -> CmdResult {
    let s = serde_json::to_string(v).map_err(|e| format!("cannot write JSON: {e}"))?;
    println!("{s}");
    Ok(())
}

/// Whether stderr is a terminal (for progress displays).
pub fn stderr_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}
