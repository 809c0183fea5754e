//! The docs cannot rot (issue 61): README.md and every chapter of `docs/` are checked against the
//! binary they describe.
//!
//! - every `loopd ...` command line of a code block parses with the binary's own clap definitions
//!   (`loopd::cli::Cli`), and every `loopd ...` in inline code names a command and flags that
//!   exist;
//! - every TOML example loads as a config layer, and the tables of `docs/configuration.md` name
//!   every key the configuration knows, and no other;
//! - every relative link and `#anchor` resolves (anchors by GitHub's rule for headings, and
//!   `<a id>`);
//! - `docs/cli.md` is what `loopd::cli_docs::markdown` makes of the definitions
//!   (`LOOPD_BLESS=1 cargo test --test docs` writes it anew);
//! - the README is a front page (at most 300 lines, the demo and the tests first) whose tour runs,
//!   line by line as written, with a stand-in for Claude Code on `PATH`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use clap::{CommandFactory as _, Parser as _};
use common::*;
use loopd::cli::Cli;
use loopd_project::config::Config;

/// The repository's top.
fn top() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every chapter, by their paths from the top.
fn doc_files() -> Vec<String> {
    let mut files = vec!["README.md".to_owned()];
    let mut chapters: Vec<String> = std::fs::read_dir(top().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("an entry of docs/").file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    chapters.sort();
    files.extend(chapters);
    files
}

fn read(file: &str) -> String {
    std::fs::read_to_string(top().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// A Markdown file as the checks see it.
#[derive(Default)]
struct Doc {
    /// The lines of code blocks, fenced or indented, with their line number and the fence's
    /// language (empty for an indented block).
    code: Vec<(usize, String, String)>,
    /// Every fenced block, whole, with its language and first line number.
    blocks: Vec<(usize, String, String)>,
    /// The prose, code blocks left out (line numbers kept by empty lines).
    prose: String,
}

fn parse(text: &str) -> Doc {
    let mut doc = Doc::default();
    let mut fence: Option<(usize, String, String)> = None;
    let mut last_blank = true;
    let mut in_indented = false;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = line.trim_start();
        if let Some((start, lang, body)) = &mut fence {
            if trimmed.starts_with("```") {
                doc.blocks
                    .push((*start, std::mem::take(lang), std::mem::take(body)));
                fence = None;
            } else {
                doc.code.push((n, line.to_owned(), lang.clone()));
                body.push_str(line);
                body.push('\n');
            }
            doc.prose.push('\n');
            continue;
        }
        if let Some(lang) = trimmed.strip_prefix("```") {
            fence = Some((n + 1, lang.trim().to_owned(), String::new()));
            doc.prose.push('\n');
            last_blank = false;
            continue;
        }
        let blank = line.trim().is_empty();
        if !blank && line.starts_with("    ") && (last_blank || in_indented) {
            in_indented = true;
            doc.code.push((n, line[4..].to_owned(), String::new()));
            doc.prose.push('\n');
        } else {
            if !blank {
                in_indented = false;
            }
            doc.prose.push_str(line);
            doc.prose.push('\n');
        }
        last_blank = blank;
    }
    assert!(fence.is_none(), "a code fence is never closed");
    doc
}

/// The inline code spans of prose (which may run over a line break), with their line numbers.
fn code_spans(prose: &str) -> Vec<(usize, String)> {
    let mut spans = Vec::new();
    let mut line = 1;
    let mut rest = prose;
    while let Some(open) = rest.find('`') {
        line += rest[..open].matches('\n').count();
        let ticks = rest[open..].chars().take_while(|&c| c == '`').count();
        let after = &rest[open + ticks..];
        let closing = "`".repeat(ticks);
        let Some(close) = after.find(&closing) else {
            break;
        };
        spans.push((line, after[..close].replace('\n', " ").trim().to_owned()));
        line += after[..close].matches('\n').count();
        rest = &after[close + ticks..];
    }
    spans
}

/// Prose with its inline code blanked out, for the links.
fn without_code_spans(prose: &str) -> String {
    let mut out = String::with_capacity(prose.len());
    let mut in_code = false;
    for c in prose.chars() {
        if c == '`' {
            in_code = !in_code;
        }
        out.push(if in_code && c != '\n' { ' ' } else { c });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// (a) Command lines

/// Words as a POSIX shell splits them, without expansions; stops at a comment or an operator.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    word.push(c);
                }
            }
            '"' => {
                in_word = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        _ => word.push(c),
                    }
                }
            }
            '\\' => {
                in_word = true;
                word.extend(chars.next());
            }
            '#' if !in_word => break,
            '|' | '&' | ';' | '>' | '<' | '(' | ')' if !in_word || word.is_empty() => break,
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The arguments of a `loopd` invocation on this line, if it is one: a prompt (`$ `, `a$ `)
/// and variable assignments before it are left out.
fn invocation(line: &str) -> Option<Vec<String>> {
    let mut line = line.trim();
    if let Some((prompt, rest)) = line.split_once("$ ")
        && !prompt.contains(' ')
    {
        line = rest;
    }
    let words = shell_words(line);
    let mut words = words
        .into_iter()
        .skip_while(|w| w.contains('=') && !w.starts_with('-'));
    (words.next()? == "loopd").then(|| words.collect())
}

/// Placeholders the docs write for a value, with a value of the type clap wants.
fn example_value(word: &str) -> String {
    let word = word.trim_start_matches('[').trim_end_matches(']');
    match word {
        "N" => "3".into(),
        "USD" => "5".into(),
        "SHELL" => "bash".into(),
        _ => word.into(),
    }
}

/// What clap makes of the whole line, as the binary would; `Err` says why it is refused.
fn parses(args: &[String]) -> Result<(), String> {
    let argv = std::iter::once("loopd".to_owned()).chain(args.iter().map(|a| example_value(a)));
    match Cli::try_parse_from(argv) {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e.to_string().lines().next().unwrap_or_default().to_owned()),
    }
}

/// Subcommands and flags that only a build with `--features temporal` has.
const TEMPORAL_ONLY: [&str; 17] = [
    "worker",
    "--temporal",
    "--namespace",
    "--profile",
    "--tls",
    "--no-tls",
    "--tls-ca-path",
    "--tls-cert-path",
    "--tls-key-path",
    "--tls-server-name",
    "--api-key-file",
    "--task-queue",
    "--name",
    "--cache",
    "--max-actions",
    "--metrics",
    "worker-guard",
];

/// Whether the command and every flag named exist (for inline code, which may leave out
/// required arguments): `Err` names the first that does not.
fn names_exist(args: &[String]) -> Result<(), String> {
    let mut cmd = Cli::command();
    cmd.build();
    let mut cmd = &cmd;
    let mut positional = false;
    let mut words = args.iter().map(|w| example_value(w)).peekable();
    while let Some(word) = words.next() {
        if word == "--" {
            break;
        }
        if let Some(flag) = word.strip_prefix("--") {
            let name = flag.split(['=', '/']).next().unwrap_or_default();
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(name))
                .ok_or_else(|| format!("`{}` has no flag --{name}", cmd.get_bin_name_or_name()))?;
            if arg.get_action().takes_values() && !flag.contains('=') {
                words.next();
            }
        } else if word.len() == 2 && word.starts_with('-') && word != "--" {
            let short = word.chars().nth(1).unwrap_or_default();
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_short() == Some(short))
                .ok_or_else(|| format!("`{}` has no flag {word}", cmd.get_bin_name_or_name()))?;
            if arg.get_action().takes_values() {
                words.next();
            }
        } else if !positional && cmd.has_subcommands() {
            cmd = cmd
                .find_subcommand(&word)
                .ok_or_else(|| format!("no command `{word}`"))?;
        } else {
            positional = true;
        }
    }
    Ok(())
}

trait BinName {
    fn get_bin_name_or_name(&self) -> String;
}

impl BinName for clap::Command {
    fn get_bin_name_or_name(&self) -> String {
        self.get_bin_name().unwrap_or(self.get_name()).to_owned()
    }
}

/// Whether the words need the Temporal driver, which this build does not have.
fn needs_temporal(args: &[String]) -> bool {
    !cfg!(feature = "temporal")
        && args.iter().any(|w| {
            let flag = w.split('=').next().unwrap_or_default();
            TEMPORAL_ONLY.contains(&flag)
        })
}

/// A placeholder in a command's place (`loopd COMMAND --help`, `loopd ...`): no command to
/// check.
fn placeholder_command(args: &[String]) -> bool {
    args.iter()
        .find(|w| !w.starts_with('-'))
        .is_some_and(|w| w == "..." || w.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
}

/// Every problem with the `loopd` command lines of one file's text.
fn command_problems(file: &str, text: &str) -> (Vec<String>, usize, usize) {
    let doc = parse(text);
    let mut problems = Vec::new();
    let (mut checked, mut skipped) = (0, 0);
    // Code lines, a backslash at the end joining the next.
    let mut joined: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (n, line, lang) in &doc.code {
        if !matches!(lang.as_str(), "" | "sh" | "bash" | "console" | "shell") {
            continue;
        }
        let (start, mut acc) = pending.take().unwrap_or((*n, String::new()));
        match line.trim_end().strip_suffix('\\') {
            Some(head) => {
                acc.push_str(head);
                acc.push(' ');
                pending = Some((start, acc));
            }
            None => {
                acc.push_str(line);
                joined.push((start, acc));
            }
        }
    }
    for (n, line) in joined {
        let Some(args) = invocation(&line) else {
            continue;
        };
        if needs_temporal(&args) {
            skipped += 1;
            continue;
        }
        checked += 1;
        if let Err(why) = parses(&args) {
            problems.push(format!("{file}:{n}: `{}`: {why}", line.trim()));
        }
    }
    for (n, span) in code_spans(&doc.prose) {
        let Some(args) = invocation(&span) else {
            continue;
        };
        if needs_temporal(&args) || placeholder_command(&args) {
            skipped += 1;
            continue;
        }
        checked += 1;
        if let Err(why) = names_exist(&args) {
            problems.push(format!("{file}:{n}: `{span}`: {why}"));
        }
    }
    (problems, checked, skipped)
}

#[test]
fn every_command_line_of_the_docs_parses_with_the_binary_s_definitions() {
    let (mut problems, mut checked, mut skipped) = (Vec::new(), 0, 0);
    // docs/cli.md is clap's own synopsis (`loopd diff [OPTIONS] <ID> [CHECKPOINT]`), checked
    // whole against the definitions below.
    for file in doc_files().into_iter().filter(|f| f != "docs/cli.md") {
        let (p, c, s) = command_problems(&file, &read(&file));
        problems.extend(p);
        checked += c;
        skipped += s;
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    assert!(
        checked > 100,
        "only {checked} command lines found: is the scan broken?"
    );
    eprintln!(
        "{checked} command lines checked; {skipped} left out (a placeholder for the command, or \
         the Temporal driver in a build without it)"
    );
}

#[test]
fn a_made_up_flag_or_command_is_caught() {
    let text = "Text with `loopd pause ID --gently`.\n\n    loopd stop ID --now\n    loopd frobnicate ID\n    loopd status ID   # fine\n";
    let (problems, checked, _) = command_problems("t.md", text);
    assert_eq!(checked, 4, "{problems:?}");
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(problems[0].contains("t.md:3") && problems[0].contains("--now"));
    assert!(problems[1].contains("frobnicate"));
    assert!(problems[2].contains("t.md:1") && problems[2].contains("--gently"));
}

// ---------------------------------------------------------------------------------------------
// (b) Configuration keys

/// The keys the configuration knows in one section, from its own refusal of an unknown key
/// (serde's "unknown field `x`, expected one of `a`, `b`").
fn known_keys(section: &str) -> BTreeSet<String> {
    let probe = format!("{section}\nloopd_docs_probe = 1\n");
    let err = Config::builtin_with(&probe)
        .map(|_| ())
        .expect_err("an unknown key is refused")
        .to_string();
    let list = err
        .split_once("expected one of")
        .or_else(|| err.split_once("expected"))
        .unwrap_or_else(|| panic!("{section}: cannot read the known keys from: {err}"))
        .1;
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The sections of `docs/configuration.md`'s tables, as the config file spells their header.
const SECTIONS: [(&str, &str); 6] = [
    ("Top-level keys", ""),
    ("`[executor_defaults]`", "[executor_defaults]"),
    ("`[executors.NAME]`", "[executors.claude]"),
    ("`[actions.NAME]`", "[actions.validate]"),
    (
        "`[[notify]]`",
        "[[notify]]\nurl = \"https://example.com/hook\"",
    ),
    ("`[temporal]`", "[temporal]"),
];

/// The top-level key of a section's header: `executors` of `[executors.claude]`.
fn table_of(header: &str) -> &str {
    header
        .lines()
        .next()
        .unwrap_or_default()
        .trim_matches(['[', ']'])
        .split('.')
        .next()
        .unwrap_or_default()
}

/// The keys each table of the chapter names in its first column, by section.
fn documented_keys(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut keys: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut section = None;
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("### ") {
            section = Some(h.trim().to_owned());
            continue;
        }
        if line.starts_with("## ") {
            section = None;
        }
        let Some(section) = &section else { continue };
        let Some(first) = line.strip_prefix('|').and_then(|l| l.split('|').next()) else {
            continue;
        };
        if first.trim() == "key" || first.trim().starts_with("---") {
            continue;
        }
        let names = first.split('`').skip(1).step_by(2).map(str::to_owned);
        keys.entry(section.clone()).or_default().extend(names);
    }
    keys
}

/// Every problem of the configuration chapter's tables against the configuration.
fn config_table_problems(text: &str) -> Vec<String> {
    let documented = documented_keys(text);
    let mut problems = Vec::new();
    for (heading, header) in SECTIONS {
        let mut known = known_keys(header);
        if header.is_empty() {
            // The tables, each documented under a heading of its own.
            known.retain(|k| !SECTIONS.iter().any(|(_, h)| table_of(h) == k));
        }
        let Some(named) = documented.get(heading) else {
            problems.push(format!("no table under `### {heading}`"));
            continue;
        };
        for key in named.difference(&known) {
            problems.push(format!(
                "{heading}: `{key}` is no key the configuration knows"
            ));
        }
        for key in known.difference(named) {
            problems.push(format!("{heading}: `{key}` is not documented"));
        }
    }
    for heading in documented.keys() {
        if !SECTIONS.iter().any(|(h, _)| h == heading) {
            problems.push(format!(
                "a table under `### {heading}`, which is no section"
            ));
        }
    }
    problems
}

/// Every TOML example that does not load as a config layer over the built-in one.
fn toml_problems(file: &str, text: &str) -> Vec<String> {
    parse(text)
        .blocks
        .into_iter()
        .filter(|(_, lang, _)| lang == "toml")
        .filter_map(|(n, _, body)| {
            Config::builtin_with(&body)
                .err()
                .map(|e| format!("{file}:{n}: the example does not load: {e}"))
        })
        .collect()
}

#[test]
fn the_configuration_chapter_names_every_key_and_only_known_ones() {
    let problems = config_table_problems(&read("docs/configuration.md"));
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn every_toml_example_of_the_docs_loads() {
    let mut problems = Vec::new();
    let mut examples = 0;
    for file in doc_files() {
        let text = read(&file);
        examples += parse(&text)
            .blocks
            .iter()
            .filter(|(_, lang, _)| lang == "toml")
            .count();
        problems.extend(toml_problems(&file, &text));
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    assert!(examples >= 5, "only {examples} TOML examples found");
}

#[test]
fn an_unknown_key_is_caught() {
    let table = "### Top-level keys\n\n| key | default | meaning |\n|---|---|---|\n| `max_iteratons` | 10 | typo |\n";
    let problems = config_table_problems(table);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("`max_iteratons` is no key")),
        "{problems:#?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("`max_iterations` is not documented")),
        "{problems:#?}"
    );
    let example = "```toml\n[executor_defaults]\ntimeout = 10.0\nkill_grase = 1.0\n```\n";
    let problems = toml_problems("t.md", example);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(problems[0].contains("kill_grase"), "{problems:#?}");
}

// ---------------------------------------------------------------------------------------------
// (c) Links and anchors

/// A heading's anchor, by GitHub's rule: lower case, spaces to `-`, punctuation but `-` and `_`
/// dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file: its headings' (a repeated one gets `-1`, `-2`, ...) and
/// those of `<a id>` or `<a name>`.
fn anchors(text: &str) -> BTreeSet<String> {
    let doc = parse(text);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for line in doc.prose.lines() {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let base = slug(&line[hashes..]);
            let n = seen.entry(base.clone()).or_default();
            anchors.insert(if *n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            });
            *n += 1;
        }
        for attr in ["id=\"", "name=\""] {
            for part in line.split("<a ").skip(1) {
                if let Some(rest) = part.split_once(attr).map(|(_, r)| r)
                    && let Some((id, _)) = rest.split_once('"')
                {
                    anchors.insert(id.to_owned());
                }
            }
        }
    }
    anchors
}

/// The targets of a file's links (`[text](target)`, images too), with line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let prose = without_code_spans(&parse(text).prose);
    let mut found = Vec::new();
    for (i, line) in prose.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or_default();
            found.push((i + 1, target.to_owned()));
            rest = &after[end..];
        }
    }
    found
}

/// Every link of `file` (its text `text`) that leads nowhere; `read` gives other files' text.
fn link_problems(file: &str, text: &str, read: &dyn Fn(&Path) -> Option<String>) -> Vec<String> {
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for (n, target) in links(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let (target_file, target_text) = if path.is_empty() {
            (file.to_owned(), Some(text.to_owned()))
        } else {
            let joined = normalize(&dir.join(path));
            let exists = top().join(&joined).exists();
            if !exists {
                problems.push(format!("{file}:{n}: {target}: no such file"));
                continue;
            }
            let display = joined.display().to_string();
            (display, read(&joined))
        };
        if anchor.is_empty() {
            continue;
        }
        match target_text {
            Some(t) if anchors(&t).contains(anchor) => {}
            Some(_) => problems.push(format!(
                "{file}:{n}: {target}: {target_file} has no anchor #{anchor}"
            )),
            None => problems.push(format!(
                "{file}:{n}: {target}: an anchor into a file that is not Markdown"
            )),
        }
    }
    problems
}

/// `docs/../README.md` as `README.md`.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn read_markdown(path: &Path) -> Option<String> {
    (path.extension().is_some_and(|e| e == "md"))
        .then(|| std::fs::read_to_string(top().join(path)).ok())
        .flatten()
}

#[test]
fn every_link_and_anchor_of_the_docs_resolves() {
    let mut problems = Vec::new();
    let mut count = 0;
    for file in doc_files() {
        let text = read(&file);
        count += links(&text).len();
        problems.extend(link_problems(&file, &text, &read_markdown));
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    assert!(count > 100, "only {count} links found: is the scan broken?");
}

#[test]
fn a_broken_link_or_anchor_is_caught() {
    let text = "# Here\n\nSee [there](docs/control.md#exit-codes), [gone](docs/nowhere.md), \
                [no anchor](docs/control.md#exit-code), [here](#here), [not here](#there).\n";
    let problems = link_problems("README.md", text, &read_markdown);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(problems[0].contains("nowhere.md: no such file"));
    assert!(problems[1].contains("no anchor #exit-code"));
    assert!(problems[2].contains("no anchor #there"));
    assert_eq!(
        slug("Who owns which field of `{id}.json`"),
        "who-owns-which-field-of-idjson"
    );
    assert_eq!(
        slug("A fleet: work trees that follow their loop"),
        "a-fleet-work-trees-that-follow-their-loop"
    );
}

#[test]
fn the_readme_links_every_chapter() {
    let readme = read("README.md");
    for file in doc_files().into_iter().skip(1) {
        assert!(
            readme.contains(&format!("]({file})")),
            "the README's guide does not link {file}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (d) The command-line reference

#[test]
#[cfg(not(feature = "temporal"))]
fn the_command_line_reference_is_generated_from_the_binary() {
    let made = loopd::cli_docs::markdown();
    let path = top().join("docs/cli.md");
    if std::env::var_os("LOOPD_BLESS").is_some() {
        std::fs::write(&path, &made).expect("write docs/cli.md");
        return;
    }
    let there = std::fs::read_to_string(&path).unwrap_or_default();
    if there != made {
        let line = there
            .lines()
            .zip(made.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || there.lines().count().min(made.lines().count()),
                |i| i + 1,
            );
        panic!(
            "docs/cli.md is not what the binary's definitions make (first difference at line \
             {line}); write it anew with `LOOPD_BLESS=1 cargo test --test docs`"
        );
    }
}

#[test]
fn the_reference_names_every_command_and_flag_of_help() {
    let reference = read("docs/cli.md");
    let mut root = Cli::command();
    root.build();
    for sub in root.get_subcommands().filter(|c| !c.is_hide_set()) {
        if sub.get_name() == "help" || TEMPORAL_ONLY.contains(&sub.get_name()) {
            continue;
        }
        assert!(
            reference.contains(&format!("\n## loopd {}\n", sub.get_name())),
            "docs/cli.md has no section for `loopd {}`",
            sub.get_name()
        );
        for arg in sub.get_arguments().filter(|a| !a.is_hide_set()) {
            if let Some(long) = arg.get_long()
                && !TEMPORAL_ONLY.contains(&format!("--{long}").as_str())
            {
                assert!(
                    reference.contains(&format!("--{long}")),
                    "docs/cli.md does not name `loopd {} --{long}`",
                    sub.get_name()
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (e) The README: a front page, and its tour

#[test]
fn the_readme_is_a_front_page() {
    let readme = read("README.md");
    let lines: Vec<&str> = readme.lines().collect();
    assert!(lines.len() <= 300, "README.md has {} lines", lines.len());
    assert_eq!(lines[0], "# loopd");
    assert_eq!(
        lines[2].trim_end(),
        "    cargo run --release -- demo      # a complete loop in a temporary project, nothing else needed"
    );
    assert_eq!(
        lines[3].trim_end(),
        "    cargo test --locked              # the test suite"
    );
    assert!(
        readme.contains("](contrib/dashboard.png)"),
        "the picture of the page"
    );
}

/// The `loopd` lines of the README's tour, in order.
fn tour() -> Vec<Vec<String>> {
    let readme = read("README.md");
    let section = readme
        .split("\n## A tour of five minutes\n")
        .nth(1)
        .expect("a section `A tour of five minutes`");
    let section = section.split("\n## ").next().unwrap_or(section);
    parse(section)
        .code
        .iter()
        .filter_map(|(_, line, _)| invocation(line))
        .collect()
}

/// Claude Code as the tour meets it: on `PATH` as `claude`, answering `--version`, reading the
/// prompt and printing its stream-json events. Its first develop writes `hello.txt`; its second
/// waits (at most 30 s) until it is ended, so that the tour finds it working.
const STAND_IN: &str = r#"#!/bin/sh
case "$1" in --version) echo "2.1.70 (Claude Code)"; exit 0 ;; esac
cat > /dev/null
result() {
  echo "{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"$1\",\"total_cost_usd\":0.01,\"usage\":{\"input_tokens\":100,\"output_tokens\":20}}"
}
case "$LOOPD_ACTION" in
  develop)
    if [ "$LOOPD_TASK_ID" = task-001 ]; then
      echo hello > hello.txt
      echo "wrote hello.txt"
      echo '{"status":"success","summary":"wrote hello.txt","files_changed":["hello.txt"]}' > "$LOOPD_RESULT_FILE"
    else
      echo "working on $LOOPD_TASK_ID"
      i=0; while [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done
    fi
    result "developed" ;;
  validate) echo '{"status":"success","summary":"ok","state_updates":{"passed":false,"pass_rate":50}}' > "$LOOPD_RESULT_FILE"; result "validated" ;;
  *) echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE"; result "done" ;;
esac
"#;

/// Where the tour runs: a git project, a user's home, and the stand-in on `PATH`.
struct Tour {
    _dir: tempfile::TempDir,
    project: Project,
    path: String,
    id: Option<String>,
    service: Option<std::process::Child>,
}

impl Tour {
    fn new() -> Tour {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().canonicalize().expect("canonical tempdir");
        let (root, home, bin) = (base.join("project"), base.join("home"), base.join("bin"));
        for d in [&root, &home, &bin] {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        let claude = bin.join("claude");
        std::fs::write(&claude, STAND_IN).expect("write the stand-in");
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&claude, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::write(root.join("README"), "a project\n").expect("write README");
        git(&root, &["init", "-q"]);
        git(&root, &["add", "README"]);
        git(&root, &["commit", "-q", "-m", "start"]);
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Tour {
            _dir: dir,
            project: Project::at(root, home),
            path,
            id: None,
            service: None,
        }
    }

    fn loopd(&self, args: &[String]) -> Command {
        let mut cmd = self.project.loopd();
        cmd.env("PATH", &self.path)
            .env("ANTHROPIC_API_KEY", "stand-in");
        let id = self.id.clone().unwrap_or_default();
        cmd.args(
            args.iter()
                .map(|a| if a == "ID" { id.clone() } else { a.clone() }),
        );
        cmd
    }

    fn output(&self, args: &[String]) -> std::process::Output {
        let out = self.loopd(args).output().expect("run loopd");
        eprintln!(
            "$ loopd {}\n{}{}",
            args.join(" "),
            stdout(&out),
            stderr(&out)
        );
        out
    }

    fn id(&self) -> &str {
        self.id
            .as_deref()
            .expect("a loop, made by the tour's create")
    }

    fn tasks_started(&self, task: &str) -> usize {
        self.project
            .events_named(self.id(), "action_started")
            .iter()
            .filter(|e| e["task_id"] == task)
            .count()
    }

    /// Runs one line of the tour and checks that it did what the README says.
    fn step(&mut self, args: &[String]) {
        let command = args.first().map(String::as_str).unwrap_or_default();
        match command {
            "logs" => return self.follow(args),
            "serve" => return self.serve(args),
            "rollback" => return self.rollback(args),
            _ => {}
        }
        let out = self.output(args);
        assert_eq!(code(&out), 0, "loopd {}: {}", args.join(" "), stderr(&out));
        match command {
            "doctor" => assert!(stdout(&out).contains("claude"), "{}", stdout(&out)),
            "trust" => {}
            "create" => self.id = Some(stdout(&out).trim().to_owned()),
            "start" => wait_for("the second task to be worked on", || {
                self.tasks_started("task-002") > 0
            }),
            "pause" => {
                assert_eq!(self.project.state(self.id())["status"], "paused");
                wait_for_telling(
                    "the attempt to be recorded interrupted",
                    || {
                        !self
                            .project
                            .events_named(self.id(), "action_interrupted")
                            .is_empty()
                    },
                    || self.daemon_log(),
                );
            }
            "resume" => wait_for("the interrupted develop to run again", || {
                self.tasks_started("task-002") > 1
            }),
            "stop" => assert_eq!(self.project.state(self.id())["status"], "failed"),
            "checkpoints" => {
                let listed = stdout(&out);
                assert!(
                    listed.contains("0-start") && listed.contains("1-develop"),
                    "{listed}"
                );
            }
            "diff" => assert!(stdout(&out).contains("hello.txt"), "{}", stdout(&out)),
            other => panic!(
                "the tour has `loopd {other}`, which this test does not know how to check: \
                 teach Tour::step"
            ),
        }
    }

    /// The loop's daemon's log and its events, for a step that timed out.
    fn daemon_log(&self) -> String {
        let log = std::fs::read_to_string(self.project.progress(self.id()).join("daemon.log"))
            .unwrap_or_else(|e| format!("(no daemon.log: {e})"));
        format!(
            "daemon.log:\n{log}\nevents: {:?}",
            self.project.event_names(self.id())
        )
    }

    /// `logs --follow`: it shows the loop's actions and the agent's output as they come; the
    /// reader then leaves it (Ctrl-C).
    fn follow(&mut self, args: &[String]) {
        let mut child = self
            .loopd(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn loopd logs --follow");
        let out = child.stdout.take().expect("its stdout");
        let reader = std::thread::spawn(move || {
            use std::io::BufRead as _;
            let mut seen = String::new();
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains("working on task-002") {
                    break;
                }
            }
            seen
        });
        let started = std::time::Instant::now();
        while !reader.is_finished() && started.elapsed() < DEADLINE {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .expect("Ctrl-C");
        let _ = child.wait();
        let seen = reader.join().expect("the reader");
        eprintln!("$ loopd {}\n{seen}", args.join(" "));
        for what in ["develop", "wrote hello.txt", "working on task-002"] {
            assert!(
                seen.contains(what),
                "logs --follow showed no `{what}`:\n{seen}"
            );
        }
    }

    /// `serve --listen`: the service answers with its page once logged in with its token.
    fn serve(&mut self, args: &[String]) {
        let port = free_port();
        let args: Vec<String> = args
            .iter()
            .map(|a| {
                if a.starts_with("127.0.0.1:") {
                    format!("127.0.0.1:{port}")
                } else {
                    a.clone()
                }
            })
            .collect();
        let child = self
            .loopd(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn loopd serve");
        self.service = Some(child);
        let token_file = self.project.home.join(".local/state/loopd/run/token");
        let addr = format!("127.0.0.1:{port}");
        wait_for("the service's page", || {
            let Ok(token) = std::fs::read_to_string(&token_file) else {
                return false;
            };
            std::net::TcpStream::connect(&addr).is_ok()
                && common::http::fetch(
                    &common::http::To::Tcp(&addr, Some(token.trim())),
                    "GET",
                    "/",
                    None,
                    &[],
                )
                .0 == 200
        });
        let token = std::fs::read_to_string(&token_file).expect("the token");
        let (status, page) = common::http::fetch(
            &common::http::To::Tcp(&addr, Some(token.trim())),
            "GET",
            "/",
            None,
            &[],
        );
        assert_eq!(status, 200);
        assert!(
            page.contains("<html") || page.contains("<!doctype"),
            "{page}"
        );
    }

    /// `rollback`: once nothing drives the stopped loop, the work tree is as it was then.
    fn rollback(&mut self, args: &[String]) {
        let mut last = None;
        wait_for("the rollback, once nothing drives the loop", || {
            let out = self.output(args);
            let done = code(&out) == 0;
            last = Some(out);
            done
        });
        drop(last);
        let checkpoint = args.last().expect("a checkpoint");
        assert_eq!(
            checkpoint, "0-start",
            "the test knows the tree at 0-start only"
        );
        assert!(!self.project.root.join("hello.txt").exists());
        assert!(self.project.root.join("README").exists());
    }
}

impl Drop for Tour {
    fn drop(&mut self) {
        if let Some(id) = self.id.clone() {
            let _ = self.loopd(&["stop".into(), id]).output();
        }
        if let Some(mut service) = self.service.take() {
            end_child(&mut service);
        }
    }
}

#[test]
fn the_readme_s_tour_runs_as_written_with_a_stand_in_agent() {
    let steps = tour();
    assert!(steps.len() >= 10, "the tour: {steps:?}");
    let mut tour = Tour::new();
    for args in &steps {
        tour.step(args);
    }
    let has = |c: &str| steps.iter().any(|s| s.first().is_some_and(|f| f == c));
    for command in [
        "doctor", "create", "start", "logs", "serve", "pause", "stop", "diff", "rollback",
    ] {
        assert!(has(command), "the tour has no `loopd {command}`");
    }
}
