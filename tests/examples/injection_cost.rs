//! What the injection policy costs the API server: the median latency of 50 Pod creates
//! without and with the policies of `rebound inject --admission-policy`, and the API
//! server's CPU time (utime + stime of /proc/<pid>/stat) over each run. A benchmark that
//! prints figures, not a test:
//!
//!   cargo build -p rebound-cli && cargo run -p rebound-tests --example injection_cost

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use rebound_tests::TestEnv;
use rebound_tests::injection::{Installed, create_pod};
use serde_json::json;

const CREATES: usize = 50;

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: &str) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) closed by ')'.
    let rest = stat.rsplit_once(')').context("no ')' in stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11).context("no utime")?.parse()?;
    let stime: u64 = fields.get(12).context("no stime")?.parse()?;
    Ok(utime + stime)
}

fn ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a constant of the running system.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(t).unwrap_or(100)
}

async fn run(env: &TestEnv, pid: &str, label: &str, prefix: &str, annotated: bool) -> Result<()> {
    let mut times = Vec::with_capacity(CREATES);
    let before = cpu_ticks(pid)?;
    for i in 0..CREATES {
        let mut annotations = json!({});
        if annotated {
            annotations = json!({"rebound.dev/inject": "true"});
        }
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{prefix}-{i}"), "annotations": annotations},
            "spec": {
                "serviceAccountName": "default",
                "containers": [{"name": "worker", "image": "worker:1"}]
            }
        });
        let start = Instant::now();
        create_pod(&env.client, &env.namespace, &pod, false).await?;
        times.push(start.elapsed());
    }
    let cpu = cpu_ticks(pid)? - before;
    times.sort();
    let median = times[CREATES / 2];
    let per_pod_ms = cpu as f64 * 1000.0 / ticks_per_second() as f64 / CREATES as f64;
    println!(
        "{label:<28} median {:>7.2} ms   p90 {:>7.2} ms   apiserver CPU {per_pod_ms:>5.2} ms/Pod",
        ms(median),
        ms(times[CREATES * 9 / 10]),
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() -> Result<()> {
    let env = TestEnv::new("inject-cost").await?;
    let state = env
        .cluster
        .state_dir()
        .context("the benchmark needs a cluster it started (no REBOUND_KUBECONFIG)")?;
    let pid = std::fs::read_to_string(state.join("kube-apiserver.pid"))?;
    let pid = pid.trim();
    println!("{CREATES} Pod creates each, one at a time, kube-apiserver pid {pid}");
    run(&env, pid, "no policy", "plain", false).await?;
    let system = env
        .cluster
        .create_namespace(&env.client, "inject-cost-system")
        .await?;
    let installed = Installed::apply(env.cluster, &system, "rebound.dev/sidecar:bench")?;
    installed
        .wait_until_in_effect(&env.client, &env.namespace)
        .await?;
    run(&env, pid, "policy, Pod not annotated", "other", false).await?;
    run(&env, pid, "policy, Pod injected", "injected", true).await?;
    drop(installed);
    Ok(())
}
