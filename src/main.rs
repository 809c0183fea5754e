use std::process::ExitCode;

use clap::Parser;
use loopd::cli::{Cli, UsageError};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // LOOPD_LOG: error, warn, info (the default), debug or trace.
    let level = std::env::var("LOOPD_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing_subscriber::filter::LevelFilter>().ok())
        .unwrap_or(tracing_subscriber::filter::LevelFilter::INFO);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .with_level(false)
        .init();
    match loopd::cli::run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("loopd: {e:#}");
            ExitCode::from(exit_code_of(&e))
        }
    }
}

/// Bad input is 2, everything else an internal error (1).
fn exit_code_of(e: &anyhow::Error) -> u8 {
    let bad_input = e.chain().any(|cause| {
        cause.is::<UsageError>()
            || cause.is::<loopd::config::ConfigError>()
            || cause.is::<loopd::actions::ActionError>()
            || cause
                .downcast_ref::<loopd::state::store::StoreError>()
                .is_some_and(|s| s.is_bad_input())
    });
    if bad_input { 2 } else { 1 }
}
