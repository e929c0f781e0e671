//! The operator under control-plane faults, with two real `rebound-operator` processes
//! electing a leader on a short Lease (6 s, renewed 2 s before expiry) on an API server of
//! their own:
//!
//! - the leader's connection hangs silently (a black-holing proxy, 15 s) while the standby
//!   still reaches the API server: the standby takes the Lease over, and the old leader has
//!   stopped leading (its `rebound_operator_leader` gauge) before the new one starts: never
//!   two leaders at once;
//! - the API server is stopped for 20 s (the Lease expires meanwhile): still never two
//!   leaders, and a RetryPolicy edited as soon as it is back is compiled within 2 s.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rebound_test_support::{free_port, http_get, workspace_binary};
use rebound_tests::proxy::{Proxy, api_server_addr, kubeconfig_through};
use rebound_tests::{DedicatedCluster, repo_root, unique_name};

/// An operator process, killed when dropped, whatever happens.
struct Operator {
    child: Child,
    metrics: SocketAddr,
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_operator(kubeconfig: &Path, ns: &str, identity: &str) -> Result<Operator> {
    let metrics = free_port()?;
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "{}.log",
        unique_name(&format!("cpfault-operator-{identity}"))
    ));
    let child = Command::new(workspace_binary("rebound-operator")?)
        .env("KUBECONFIG", kubeconfig)
        .args([
            format!("--namespaces={ns}"),
            "--leader-elect=true".to_owned(),
            format!("--lease-namespace={ns}"),
            "--lease-duration=6".to_owned(),
            "--lease-grace=2".to_owned(),
            format!("--identity={identity}"),
            format!("--metrics-addr={metrics}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("starting rebound-operator (log {})", log.display()))?;
    Ok(Operator { child, metrics })
}

/// The operator's `rebound_operator_leader` sample; `None` while it does not answer.
fn leader(metrics: SocketAddr) -> Option<bool> {
    let text = http_get(metrics, "/metrics").ok()?.ok().ok()?;
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(name, _)| *name == "rebound_operator_leader")
        .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        .map(|v| v == 1.0)
}

/// When, and whether `a` and `b` said they lead.
type Sample = (Duration, Option<bool>, Option<bool>);

/// Samples both operators' leader gauges every 50 ms until dropped.
struct Monitor {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Monitor {
    fn start(a: SocketAddr, b: SocketAddr) -> Monitor {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, st) = (Arc::clone(&samples), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let sample = (start.elapsed(), leader(a), leader(b));
                s.lock().unwrap_or_else(|e| e.into_inner()).push(sample);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Monitor {
            samples,
            stop,
            thread: Some(thread),
        }
    }

    fn samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every sample where both said leader.
    fn both_leading(&self) -> Vec<Duration> {
        self.samples()
            .into_iter()
            .filter(|(_, a, b)| *a == Some(true) && *b == Some(true))
            .map(|(t, ..)| t)
            .collect()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn policy(base_ms: u64) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: orders}}\nspec:\n  queues: [orders]\n  backoff: {{strategy: constant, base: {base_ms}ms, jitter: {{kind: none}}}}\n  maxAttempts: 5\n"
    )
}

async fn until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<(T, Duration)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Ok((v, start.elapsed()));
        }
        if start.elapsed() > limit {
            bail!("{what}: not after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_through_a_hang_and_an_outage() -> Result<()> {
    let state_dir = repo_root().join(".state").join(unique_name("cpfault-op"));
    let cluster =
        tokio::task::spawn_blocking(move || DedicatedCluster::start(&state_dir)).await??;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "cpfault-op").await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &policy(100))?
        .ok()?;

    // `a` reaches the API server through the proxy, `b` directly.
    let proxy = Proxy::start(api_server_addr(&cluster)?).await?;
    let tmp = tempfile::tempdir()?;
    let proxied = kubeconfig_through(&cluster, proxy.addr(), tmp.path())?;
    let a = spawn_operator(&proxied, &ns, "a")?;
    until("a leads", Duration::from_secs(30), || async {
        leader(a.metrics).filter(|l| *l)
    })
    .await?;
    let b = spawn_operator(cluster.kubeconfig(), &ns, "b")?;
    until("b is up", Duration::from_secs(30), || async {
        leader(b.metrics).filter(|l| !*l)
    })
    .await?;
    let (first, _) = until("compiled", Duration::from_secs(30), || {
        rebound_tests::compiled::hash(&configmaps)
    })
    .await?;
    let monitor = Monitor::start(a.metrics, b.metrics);

    // The leader's connection hangs: b takes over, a stops first.
    proxy.blackhole(true);
    until("b leads", Duration::from_secs(30), || async {
        leader(b.metrics).filter(|l| *l)
    })
    .await?;
    ensure!(
        monitor.both_leading().is_empty(),
        "two leaders at once at {:?}",
        monitor.both_leading()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.blackhole(false);

    // The API server goes away for longer than the Lease.
    tokio::task::block_in_place(|| cluster.stop_apiserver())?;
    tokio::time::sleep(Duration::from_secs(20)).await;
    tokio::task::block_in_place(|| cluster.start_apiserver())?;
    let back = Instant::now();
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &policy(200))?
        .ok()?;
    let (edited, _) = until("edit compiled", Duration::from_secs(60), || async {
        rebound_tests::compiled::hash(&configmaps)
            .await
            .filter(|h| *h != first)
    })
    .await?;
    let compiled_after = back.elapsed();
    // A little longer, for a leader that would come back late.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let samples = monitor.samples();
    drop(monitor);
    eprintln!(
        "edit {edited} compiled {compiled_after:?} after the API server's return; {} samples",
        samples.len()
    );
    let both: Vec<_> = samples
        .iter()
        .filter(|(_, a, b)| *a == Some(true) && *b == Some(true))
        .map(|(t, ..)| *t)
        .collect();
    ensure!(both.is_empty(), "two leaders at once at {both:?}");
    ensure!(
        samples.iter().any(|(_, a, _)| *a == Some(true))
            && samples.iter().any(|(_, _, b)| *b == Some(true)),
        "each led at some point"
    );
    ensure!(
        compiled_after <= Duration::from_secs(2),
        "an edit at the API server's return compiled after {compiled_after:?} (> 2 s)"
    );
    Ok(())
}
