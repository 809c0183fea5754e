//! What a command prints on stdout: one result, as JSON with `--json` or a line for people, and
//! nothing that panics when the reader has gone away.

use anyhow::Result;
use serde_json::Value;

/// `println!` that returns an error instead of panicking when the reader of stdout has gone away
/// (`loopd list | head -1`); `main` ends such a command quietly.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// `print!` that returns an error instead of panicking, as [`outln!`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// Whether an error is only that the reader of stdout went away.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Prints a command's result on stdout: `value` with `--json`, else `text` (nothing when empty).
pub fn print_result(as_json: bool, value: &Value, text: &str) -> Result<()> {
    if as_json {
        crate::outln!("{value}")?;
    } else if !text.is_empty() {
        crate::outln!("{text}")?;
    }
    Ok(())
}
