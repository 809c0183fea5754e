//! `docs/cli.md`, the command-line reference, made from the same clap definitions as `--help`,
//! `loopd man` and the completions, so that it cannot drift from the binary: `tests/docs.rs`
//! compares the file with [`markdown`] and, with `LOOPD_BLESS=1`, writes it.
//!
//! What it leaves out is what `--help` leaves out: hidden commands and flags, clap's own `help`
//! command, `--help` and `--version`. Global flags are listed once, at the top.

use std::fmt::Write as _;

use clap::{Arg, ArgAction, Command, CommandFactory as _};

use crate::cli::Cli;

/// The whole of `docs/cli.md`.
pub fn markdown() -> String {
    let mut root = Cli::command();
    root.build();
    let mut out = String::new();
    out.push_str(HEADER);
    if let Some(about) = root.get_long_about().or(root.get_about()) {
        let _ = writeln!(out, "{}\n", text(&about.to_string()));
    }
    let _ = writeln!(out, "    {}\n", usage(&mut root));
    out.push_str("## Global options\n\nEvery command takes these, before or after its name.\n\n");
    for arg in root.get_arguments().filter(|a| shown(a)) {
        item(&mut out, arg);
    }
    out.push_str("\n## Commands\n\n");
    let commands = commands(&root, "loopd");
    for (path, cmd) in &commands {
        let about = cmd.get_about().map(|a| a.to_string()).unwrap_or_default();
        let _ = writeln!(
            out,
            "- [`{path}`](#{}): {}",
            path.replace(' ', "-"),
            text(first_line(&about))
        );
    }
    for (path, cmd) in commands {
        command(&mut out, &path, cmd);
    }
    out
}

const HEADER: &str = "# The command line

For everyone who types `loopd`: every command and flag, as `loopd --help` and
`loopd COMMAND --help` say them. This page is generated from the binary's own definitions
(`src/cli_docs.rs`); `tests/docs.rs` fails when it differs from them, and
`LOOPD_BLESS=1 cargo test --test docs` writes it anew. It is made from a default build: a build
with `--features temporal` adds `loopd worker`, `--temporal HOST:PORT` and the flags that reach a
secured Temporal, described in [Beyond one machine](temporal.md).

";

/// Every command a person can name, depth first, with its path (`loopd task add`); commands
/// that only group others (`task`) are listed too, with their own text.
fn commands<'a>(parent: &'a Command, path: &str) -> Vec<(String, &'a Command)> {
    let mut all = Vec::new();
    for cmd in parent.get_subcommands() {
        if cmd.is_hide_set() || cmd.get_name() == "help" {
            continue;
        }
        let path = format!("{path} {}", cmd.get_name());
        all.push((path.clone(), cmd));
        all.extend(commands(cmd, &path));
    }
    all
}

fn command(out: &mut String, path: &str, cmd: &Command) {
    let _ = writeln!(out, "\n## {path}\n");
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = writeln!(out, "{}\n", text(&about.to_string()));
    }
    let mut cmd = cmd.clone();
    let _ = writeln!(out, "    {}", usage(&mut cmd));
    let own: Vec<&Arg> = cmd
        .get_arguments()
        .filter(|a| shown(a) && !a.is_global_set())
        .collect();
    if !own.is_empty() {
        out.push('\n');
        for arg in own {
            item(out, arg);
        }
    }
}

/// clap's usage line, `Usage: ` left out.
fn usage(cmd: &mut Command) -> String {
    let usage = cmd.render_usage().to_string();
    usage.trim_start_matches("Usage:").trim().to_owned()
}

/// Whether `--help` shows it.
fn shown(arg: &Arg) -> bool {
    !arg.is_hide_set() && !matches!(arg.get_action(), ArgAction::Help | ArgAction::Version)
}

/// One argument as a list item: its spelling, its help, its default, choices and variable.
fn item(out: &mut String, arg: &Arg) {
    let mut line = format!("- `{}`", spelling(arg));
    let help = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    if !help.is_empty() {
        let _ = write!(line, ": {}", text(&help).replace("\n\n", "\n\n  "));
    }
    let mut notes = Vec::new();
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if !defaults.is_empty() && arg.get_action().takes_values() {
        let shown = defaults.join(",");
        notes.push(if shown.is_empty() {
            "default: empty".to_owned()
        } else {
            format!("default: `{shown}`")
        });
    }
    let choices: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    if !choices.is_empty() && arg.get_action().takes_values() {
        notes.push(format!("one of {}", choices.join(", ")));
    }
    if let Some(env) = arg.get_env() {
        notes.push(format!("env `{}`", env.to_string_lossy()));
    }
    if arg.is_required_set() {
        notes.push("required".to_owned());
    }
    if matches!(arg.get_action(), ArgAction::Append) {
        notes.push("repeatable".to_owned());
    }
    if !notes.is_empty() {
        let _ = write!(line, " ({})", notes.join("; "));
    }
    let _ = writeln!(out, "{line}");
}

/// `-f, --follow`, `--root <DIR>`, `<ID>`, `[CHECKPOINT]`.
fn spelling(arg: &Arg) -> String {
    let names: Vec<String> = arg
        .get_value_names()
        .map(|n| n.iter().map(ToString::to_string).collect())
        .unwrap_or_else(|| vec![arg.get_id().as_str().to_uppercase()]);
    let values = names
        .iter()
        .map(|n| format!("<{n}>"))
        .collect::<Vec<_>>()
        .join(" ");
    if arg.is_positional() {
        return if arg.is_required_set() {
            values
        } else {
            format!("[{values}]")
        };
    }
    let mut flags = Vec::new();
    if let Some(short) = arg.get_short() {
        flags.push(format!("-{short}"));
    }
    if let Some(long) = arg.get_long() {
        flags.push(format!("--{long}"));
    }
    let flags = flags.join(", ");
    if arg.get_action().takes_values() {
        format!("{flags} {values}")
    } else {
        flags
    }
}

/// The first line of a command's text, for the list of commands.
fn first_line(about: &str) -> &str {
    about.lines().next().unwrap_or(about).trim()
}

/// Help text as Markdown: what would read as HTML or emphasis outside code spans is escaped.
fn text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_code = false;
    for c in s.trim().chars() {
        match c {
            '`' => {
                in_code = !in_code;
                out.push(c);
            }
            '<' if !in_code => out.push_str("&lt;"),
            '>' if !in_code => out.push_str("&gt;"),
            '*' | '_' | '[' | ']' | '|' if !in_code => {
                out.push('\\');
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}
