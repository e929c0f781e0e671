//! Docs that run as pasted: the `sh` blocks of a Markdown page, and a shell to run them.

use std::ffi::OsString;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::cluster::repo_root;

/// The shell commands of a page's `sh` blocks, one list per block (continuation lines
/// joined, comments and blank lines dropped).
pub fn sh_blocks(text: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    let mut pending = String::new();
    for line in text.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(Vec::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(cmds), l) => {
                if let Some(head) = l.strip_suffix('\\') {
                    pending.push_str(head);
                    continue;
                }
                pending.push_str(l);
                let cmd = std::mem::take(&mut pending);
                if !cmd.trim().is_empty() && !cmd.trim_start().starts_with('#') {
                    cmds.push(cmd.trim().to_owned());
                }
            }
            (None, _) => {}
        }
    }
    blocks
}

/// Runs `cmd` with bash from the repository root with `env` added; its stdout, or an
/// error with its output when it fails.
pub fn run_shell(cmd: &str, env: &[(&str, OsString)]) -> Result<String> {
    eprintln!("doc: $ {cmd}");
    let out = Command::new("bash")
        .args(["-c", cmd])
        .current_dir(repo_root())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "`{cmd}` failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}
