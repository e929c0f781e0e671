//! The README's first command, `dev/demo.sh`, as pasted: the whole loop on a control
//! plane of its own (operator, sidecar, the example policies, a real BullMQ worker on a
//! Redis of its own), then `dev/demo.sh stop`, which must leave nothing running.
//!
//! The demo prints for people; the test checks what it left behind instead: the
//! RetryPolicies' conditions, and the totals the webhook-delivery run writes to
//! `REPORT_FILE` (examples/webhook-delivery/run.js).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use rebound_tests::{repo_root, unique_name};
use serde_json::Value;

/// Events the demo sends (`EVENTS=40` in dev/demo.sh).
const DEMO_EVENTS: u64 = 40;

/// A base port with `port`, `port + 1` and `port + 2` free (sidecar, admin, operator metrics).
fn free_port_triple() -> Result<u16> {
    for _ in 0..200 {
        let base = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if base > u16::MAX - 3 {
            continue;
        }
        let held: Vec<_> = (0..3)
            .map(|i| TcpListener::bind(("127.0.0.1", base + i)))
            .collect();
        if held.iter().all(Result::is_ok) {
            return Ok(base);
        }
    }
    bail!("no three consecutive free ports on 127.0.0.1")
}

/// Runs `dev/demo.sh stop` for its state dir when dropped, so a failed test leaves nothing.
struct Demo {
    state: PathBuf,
    port: u16,
    stopped: bool,
}

impl Demo {
    fn command(&self) -> Command {
        let mut cmd = Command::new(repo_root().join("dev/demo.sh"));
        cmd.current_dir(repo_root())
            .env("REBOUND_DEMO_STATE", &self.state)
            .env("REBOUND_DEMO_PORT", self.port.to_string());
        cmd
    }

    fn stop(&mut self) -> Result<()> {
        self.stopped = true;
        let out = self.command().arg("stop").output()?;
        ensure!(
            out.status.success(),
            "dev/demo.sh stop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.stop();
        }
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn pid_in(file: &Path) -> Result<i32> {
    let text = std::fs::read_to_string(file).with_context(|| format!("{}", file.display()))?;
    text.trim()
        .parse()
        .with_context(|| format!("pid in {}", file.display()))
}

fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

fn kubectl_json(kubeconfig: &Path, args: &[&str]) -> Result<Value> {
    let out = Command::new("kubectl")
        .env("KUBECONFIG", kubeconfig)
        .args(args)
        .args(["-o", "json"])
        .output()
        .context("running kubectl")?;
    ensure!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn count(v: &Value, field: &str) -> u64 {
    v[field].as_u64().unwrap_or(0)
}

#[test]
fn the_readme_first_command_runs_the_whole_loop_and_stop_ends_it() -> Result<()> {
    let state = repo_root().join(".state").join(unique_name("demo-test"));
    let mut demo = Demo {
        state: state.clone(),
        port: free_port_triple()?,
        stopped: false,
    };
    let report_file = state.join("delivery.json");
    let out = demo
        .command()
        .env("REPORT_FILE", &report_file)
        .output()
        .context("running dev/demo.sh")?;
    ensure!(
        out.status.success(),
        "dev/demo.sh failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The control plane it left running: every example policy Ready.
    let kubeconfig = state.join("kubeconfig");
    let policies = kubectl_json(&kubeconfig, &["-n", "shop", "get", "retrypolicies"])?;
    let items = policies["items"].as_array().context("items")?;
    ensure!(!items.is_empty(), "no RetryPolicies in shop");
    for p in items {
        let ready = p["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
            .map(|c| c["status"].clone());
        ensure!(
            ready == Some(Value::from("True")),
            "{} not Ready: {}",
            p["metadata"]["name"],
            p["status"]
        );
    }

    // The real worker's run, decided by the sidecar alone; nothing lost, nothing left over.
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&report_file)?)?;
    assert_eq!(count(&summary, "events"), DEMO_EVENTS, "{summary}");
    let (delivered, dead) = (
        count(&summary, "delivered"),
        count(&summary, "deadLettered"),
    );
    assert_eq!(
        delivered + dead,
        DEMO_EVENTS,
        "every event settled: {summary}"
    );
    assert_eq!(count(&summary, "deadLetterJobs"), dead, "{summary}");
    let counts = &summary["counts"];
    assert_eq!(
        (
            count(counts, "wait"),
            count(counts, "active"),
            count(counts, "delayed")
        ),
        (0, 0, 0),
        "{summary}"
    );
    assert_eq!(count(counts, "completed"), delivered, "{summary}");
    assert_eq!(count(counts, "failed"), dead, "{summary}");
    let sources = summary["decisionSources"]
        .as_object()
        .context("decisionSources")?;
    assert_eq!(
        sources.keys().collect::<Vec<_>>(),
        ["sidecar"],
        "answers only from the sidecar: {summary}"
    );
    assert!(
        count(&summary["decisions"], "DECISION_RETRY") > 0,
        "{summary}"
    );
    let applied = count(&summary, "applied");
    assert!(
        (delivered..=DEMO_EVENTS).contains(&applied),
        "each key applied at most once: {summary}"
    );

    // `dev/demo.sh stop` ends every process it started.
    let pids = ["operator.pid", "sidecar.pid", "redis/redis.pid"]
        .iter()
        .map(|f| pid_in(&state.join(f)))
        .collect::<Result<Vec<_>>>()?;
    let apiserver_pids: Vec<i32> = std::fs::read_dir(&state)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "pid"))
        .filter_map(|p| pid_in(&p).ok())
        .collect();
    ensure!(pids.iter().all(|&p| alive(p)), "demo processes {pids:?}");
    demo.stop()?;
    let left: Vec<i32> = pids
        .iter()
        .chain(&apiserver_pids)
        .copied()
        .filter(|&p| alive(p))
        .collect();
    assert!(left.is_empty(), "still running after stop: {left:?}");
    Ok(())
}
