use std::process::ExitCode;

use clap::Parser;
use loopd::cli::{Cli, UsageError};

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOOPD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
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
