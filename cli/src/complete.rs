//! `kubectl_complete-rebound`: shell completion for `kubectl rebound …`. kubectl (1.26+)
//! runs this executable with the words after `kubectl rebound`, the last one being the word
//! under the cursor, and expects cobra's `__complete` answer: one candidate per line
//! (`value<TAB>description`), then `:<directive>`.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Arg, Command, ValueEnum};

use crate::output;

/// `completion SHELL`.
#[derive(clap::Args)]
pub struct Args {
    #[arg(value_enum)]
    shell: Shell,
}

#[derive(Clone, Copy, ValueEnum)]
enum Shell {
    Bash,
    Zsh,
    Fish,
}

/// Prints the completion script of `root` for the shell, for the command name `name`.
pub fn script(args: &Args, root: &mut Command, name: &str) -> Result<ExitCode> {
    let shell = match args.shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    let mut out = Vec::new();
    clap_complete::generate(shell, root, name, &mut out);
    output::emit(&String::from_utf8_lossy(&out))?;
    Ok(ExitCode::SUCCESS)
}

/// Cobra's directives: 0 lets the shell complete file names, 4 does not.
const FILES: u8 = 0;
const NO_FILES: u8 = 4;

/// The answer for `words` (the last one is being completed).
pub fn answer(root: &Command, words: &[String]) -> String {
    let (partial, before) = match words.split_last() {
        Some((last, rest)) => (last.as_str(), rest),
        None => ("", &[][..]),
    };
    // Down the subcommands the words name (`rollout status`), as deep as they go.
    let mut command = root;
    for w in before {
        if let Some(s) = command.get_subcommands().find(|s| s.get_name() == w) {
            command = s;
        }
    }
    let mut lines = Vec::new();
    let mut directive = NO_FILES;

    // A value for the option just before the cursor.
    if let Some(arg) = before.last().and_then(|w| option(command, root, w)) {
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| v.get_name().to_owned())
            .collect();
        if values.is_empty() {
            // -f and --kubeconfig take paths; others free text.
            directive = if arg.get_value_hint() == clap::ValueHint::AnyPath
                || arg.get_id() == "files"
                || arg.get_id() == "kubeconfig"
            {
                FILES
            } else {
                NO_FILES
            };
        }
        lines.extend(values.into_iter().filter(|v| v.starts_with(partial)));
    } else if partial.starts_with('-') {
        for arg in command.get_arguments().chain(root.get_arguments()) {
            if let Some(long) = arg.get_long() {
                let flag = format!("--{long}");
                if flag.starts_with(partial) {
                    lines.push(described(&flag, arg.get_help()));
                }
            }
        }
        for flag in ["--help", "--version"] {
            if flag.starts_with(partial) {
                lines.push(flag.to_owned());
            }
        }
    } else if command.has_subcommands() {
        for s in command.get_subcommands().filter(|s| s.get_name() != "help") {
            if s.get_name().starts_with(partial) {
                lines.push(described(s.get_name(), s.get_about()));
            }
        }
    } else if let Some(positional) = command.get_positionals().next() {
        lines.extend(
            positional
                .get_possible_values()
                .iter()
                .map(|v| v.get_name().to_owned())
                .filter(|v| v.starts_with(partial)),
        );
    }
    lines.dedup();
    let mut out = lines.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(&format!(":{directive}\n"));
    out
}

/// The option `word` names (`-o`, `--output`), if it takes a value.
fn option<'a>(command: &'a Command, root: &'a Command, word: &str) -> Option<&'a Arg> {
    let matches = |a: &&Arg| {
        a.get_action().takes_values()
            && (word
                .strip_prefix("--")
                .is_some_and(|l| a.get_long() == Some(l))
                || word
                    .strip_prefix('-')
                    .and_then(|s| s.chars().next().filter(|_| s.len() == 1))
                    .is_some_and(|c| a.get_short() == Some(c)))
    };
    command
        .get_arguments()
        .find(matches)
        .or_else(|| root.get_arguments().find(matches))
}

fn described(value: &str, help: Option<&clap::builder::StyledStr>) -> String {
    match help {
        Some(h) => {
            let first = h.to_string();
            let first = first.lines().next().unwrap_or_default().to_owned();
            format!("{value}\t{first}")
        }
        None => value.to_owned(),
    }
}
