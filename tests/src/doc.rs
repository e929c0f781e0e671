//! Docs that run as pasted: the `sh`/`bash` blocks of a Markdown page, what the page says
//! about each (a `not run` marker, "from a checkout"), and a shell to run them.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cluster::repo_root;

/// What a page's commands run with: `KUBECONFIG`, the directories of `tools` (helm,
/// kubectl, ...) first on `PATH`, and Helm's homes under `helm_home`.
pub fn shell_env(
    kubeconfig: &Path,
    tools: &[&Path],
    helm_home: &Path,
) -> Vec<(&'static str, OsString)> {
    let mut path = OsString::new();
    for tool in tools {
        path.push(tool.parent().unwrap_or(Path::new("")));
        path.push(":");
    }
    path.push(std::env::var_os("PATH").unwrap_or_default());
    vec![
        ("KUBECONFIG", kubeconfig.into()),
        ("PATH", path),
        ("HELM_CACHE_HOME", helm_home.join("cache").into()),
        ("HELM_CONFIG_HOME", helm_home.join("config").into()),
        ("HELM_DATA_HOME", helm_home.join("data").into()),
    ]
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

/// A fenced `sh` or `bash` block of a Markdown page, with what the page says about it.
#[derive(Debug, Clone)]
pub struct ShellBlock {
    /// 1-based line of the opening fence.
    pub line: usize,
    /// The commands: continuation lines joined, comments and blank lines dropped.
    pub commands: Vec<String>,
    /// `Some(reason)` when the block is marked `<!-- not run: reason -->` (the last
    /// non-blank line before the fence); the reason may be empty, which is a mistake.
    pub not_run: Option<String>,
    /// `Some(reason)` when the block is marked `<!-- needs a node: reason -->`: it needs
    /// Pods to run (`docs/install.md`), so only a test on a real node runs it.
    pub needs_node: Option<String>,
    /// The paragraph right before the block says "from a checkout": run it from the
    /// repository root rather than from an empty directory.
    pub from_checkout: bool,
}

impl ShellBlock {
    /// The first command, which names the block in reports.
    pub fn first(&self) -> &str {
        self.commands.first().map(String::as_str).unwrap_or("")
    }
}

/// Every fenced `sh`/`bash` block of a page (fences may be indented, as in lists).
pub fn shell_blocks(text: &str) -> Vec<ShellBlock> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let fence = lines[i].trim();
        let Some(info) = fence.strip_prefix("```") else {
            i += 1;
            continue;
        };
        let lang = info.split_whitespace().next().unwrap_or("");
        let start = i;
        let mut end = i + 1;
        while end < lines.len() && lines[end].trim() != "```" {
            end += 1;
        }
        if lang == "sh" || lang == "bash" {
            blocks.push(ShellBlock {
                line: start + 1,
                commands: commands_of(&lines[start + 1..end.min(lines.len())]),
                not_run: marker_before(&lines[..start], "not run"),
                needs_node: marker_before(&lines[..start], "needs a node"),
                from_checkout: paragraph_before(&lines[..start])
                    .to_ascii_lowercase()
                    .contains("from a checkout"),
            });
        }
        i = end + 1;
    }
    blocks
}

/// The commands of a block's lines: continuation lines joined, comments and blank
/// lines dropped.
fn commands_of(lines: &[&str]) -> Vec<String> {
    let mut cmds = Vec::new();
    let mut pending = String::new();
    for line in lines {
        let l = line.trim_end();
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
    cmds
}

fn marker_before(lines: &[&str], kind: &str) -> Option<String> {
    let last = lines
        .iter()
        .rev()
        .map(|l| l.trim())
        .find(|l| !l.is_empty())?;
    let inner = last.strip_prefix("<!--")?.strip_suffix("-->")?.trim();
    let reason = inner.strip_prefix(kind)?;
    Some(reason.trim_start_matches(':').trim().to_owned())
}

/// The prose paragraph before a block (a marker line in between is skipped), joined.
fn paragraph_before(lines: &[&str]) -> String {
    let mut para: Vec<&str> = Vec::new();
    for l in lines.iter().rev().map(|l| l.trim()) {
        if l.starts_with("<!--") && para.is_empty() {
            continue;
        }
        if l.is_empty() {
            if para.is_empty() {
                continue;
            }
            break;
        }
        if l.starts_with("```") || l.starts_with('#') {
            break;
        }
        para.push(l);
    }
    para.reverse();
    para.join(" ")
}

/// One command of a block, run.
#[derive(Debug, Clone)]
pub struct CommandRun {
    pub cmd: String,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs a block's commands in order in one bash (so `cd` and `export` carry over, as
/// when pasted into a terminal) in `dir` with `env` added, in a process group of its own
/// that is stopped afterwards (with whatever a command left in the background), on
/// failure and on timeout too. Stops at the first command that fails; the runs so far,
/// the failing one last.
pub fn run_block(
    commands: &[String],
    dir: &Path,
    env: &[(&str, OsString)],
    timeout: Duration,
) -> Result<Vec<CommandRun>> {
    use std::fmt::Write as _;
    use std::os::unix::process::CommandExt;

    let out_dir = std::env::temp_dir().join(crate::unique_name("doc-block-out"));
    std::fs::create_dir_all(&out_dir)?;
    let mut script = String::from("set -o pipefail\n");
    for (i, cmd) in commands.iter().enumerate() {
        let o = out_dir.join(i.to_string());
        let o = o.display();
        writeln!(
            script,
            "{{ {cmd}\n}} >'{o}.out' 2>'{o}.err' </dev/null; rc=$?; echo $rc >'{o}.rc'; \
             if [ $rc -ne 0 ]; then exit $rc; fi"
        )?;
    }
    for cmd in commands {
        eprintln!("doc: $ {cmd}");
    }
    let mut child = Command::new("bash")
        .args(["-c", &script])
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("starting bash")?;
    let pgid = child.id();
    let deadline = Instant::now() + timeout;
    let waited = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() > deadline => {
                break Err(anyhow::anyhow!("timed out after {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(e.into()),
        }
    };
    stop_group(pgid);
    let _ = child.wait();
    let mut runs = Vec::new();
    for (i, cmd) in commands.iter().enumerate() {
        let read = |ext: &str| std::fs::read_to_string(out_dir.join(format!("{i}.{ext}")));
        let Ok(rc) = read("rc") else {
            // Started but never finished (timeout): its output so far.
            if let Ok(stdout) = read("out") {
                runs.push(CommandRun {
                    cmd: cmd.clone(),
                    code: None,
                    stdout,
                    stderr: read("err").unwrap_or_default(),
                });
            }
            break;
        };
        runs.push(CommandRun {
            cmd: cmd.clone(),
            code: rc.trim().parse().ok(),
            stdout: read("out").unwrap_or_default(),
            stderr: read("err").unwrap_or_default(),
        });
    }
    let _ = std::fs::remove_dir_all(&out_dir);
    waited?;
    Ok(runs)
}

/// SIGTERM to a process group, then SIGKILL to what is left of it after up to 5 s.
pub fn stop_group(pgid: u32) {
    let group = format!("-{pgid}");
    let signal = |sig: &str| {
        Command::new("kill")
            .args([sig, "--", &group])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !signal("-TERM") {
        return; // nothing left in it
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if !signal("-0") {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    signal("-KILL");
}
