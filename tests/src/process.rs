//! Processes a test starts: killed and reaped when the test ends, on failure too.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

/// A child process killed and reaped when dropped.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Running {
    /// The workspace binary `binary` (`rebound-operator`, `rebound-sidecar`) with `args`,
    /// talking to the cluster of `kubeconfig`; its stderr goes to a log of its own in
    /// `log_dir` (a test's `CARGO_TARGET_TMPDIR`), named in the error if it cannot start.
    pub fn workspace_binary(
        binary: &str,
        kubeconfig: &Path,
        args: &[String],
        log_dir: &Path,
    ) -> Result<Running> {
        let log = log_dir.join(format!("{}.log", crate::unique_name(binary)));
        let child = Command::new(rebound_test_support::workspace_binary(binary)?)
            .env("KUBECONFIG", kubeconfig)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting {binary} (log {})", log.display()))?;
        Ok(Running(child))
    }
}

/// The bin directory of a tool the project builds and caches: the last line `dev/<script>`
/// prints (the scripts build on first use, then answer from the cache).
pub fn built_tool_dir(script: &str) -> Result<PathBuf> {
    let script = crate::repo_root().join("dev").join(script);
    let out = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    Ok(PathBuf::from(last.trim()))
}

/// Where a Rebound server started with port 0 listens: the addresses of its JSON
/// `listening` log line (`None` when that listener is off).
#[derive(Clone, Copy, Debug)]
pub struct Listening {
    pub grpc: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
}

/// Waits for `child`'s `listening` line in its JSON log `log`. Binding port 0 in the server
/// itself leaves no window in which another process takes a port chosen beforehand. On
/// failure `child` is killed and reaped, and a server that exited first is reported with
/// its log.
pub fn wait_listening(child: &mut Child, log: &Path, timeout: Duration) -> Result<Listening> {
    let found = read_listening(child, log, timeout);
    if found.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    found
}

fn read_listening(child: &mut Child, log: &Path, timeout: Duration) -> Result<Listening> {
    let start = Instant::now();
    let field = |line: &serde_json::Value, name: &str| -> Result<Option<SocketAddr>> {
        match line["fields"][name].as_str() {
            None | Some("") => Ok(None),
            Some(addr) => Ok(Some(
                addr.parse().with_context(|| format!("{name}: {addr}"))?,
            )),
        }
    };
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let listening = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|l| l["fields"]["message"] == "listening");
        if let Some(line) = listening {
            return Ok(Listening {
                grpc: field(&line, "grpc")?,
                admin: field(&line, "admin")?,
            });
        }
        if let Some(status) = child.try_wait()? {
            bail!("exited ({status}) before listening:\n{text}");
        }
        if start.elapsed() > timeout {
            bail!("not listening after {timeout:?} (log {})", log.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
