use std::process::ExitCode;

use clap::Parser as _;
use loopd::cli::Cli;

/// mimalloc rather than glibc's malloc: a daemon's work is many short-lived JSON trees, and glibc
/// spent a fifth of `loopd serve`'s CPU in its allocator (merging its fast bins at each larger
/// request, `malloc_consolidate`). Transparent huge pages are left out: with them, each thread's
/// first heap page took a huge page, and `loopd run`'s peak RSS went from 13 to 22 MiB.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Before anything opens a descriptor: what children are given passes through these.
    loopd_exec::spawn::reserve();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version go to stdout as clap prints them.
        Err(e) if !e.use_stderr() => e.exit(),
        // A usage error in one line: clap's, with its tip ("a similar subcommand exists"),
        // without its usage block.
        Err(e) => {
            let text = e.to_string();
            let first: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let line = first.join("; ");
            eprintln!(
                "loopd: {} (see loopd --help)",
                line.trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    loopd::logging::init();
    match loopd::cli::run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // The reader of stdout went away (`loopd list | head -1`): nothing more to say.
        Err(e) if loopd::output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // One line in words: no error's debug dump (a gRPC status's) reaches a person.
            let said = loopd_exec::result::without_dumps(&format!("{e:#}"));
            eprintln!("loopd: {said}");
            ExitCode::from(u8::try_from(loopd_file_driver::error::exit_code_of(&e)).unwrap_or(1))
        }
    }
}
