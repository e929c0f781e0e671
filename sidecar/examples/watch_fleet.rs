//! A fleet of watch-mode sidecars through an API server restart (`--example watch_fleet`):
//! `--clients` independent watches built from the sidecar's own source module (each its own
//! API client, connection, store and backoff, as N sidecar processes would have) on one
//! ConfigMap compiled by the real `rebound-operator`, on a cluster of its own. The API
//! server is stopped for `--outage` seconds and started again; as soon as it is ready a
//! RetryPolicy is edited. Prints the operator's compile latency, when each watch served the
//! new hash (p50, p99, max), and the API server's requests by verb in its first 30 s or
//! so (its own `apiserver_request_total`, which counts from the process start). A program
//! that prints figures, not a test.
//!
//! cargo build -p rebound-sidecar -p rebound-operator --bins --example watch_fleet \
//!   && target/debug/examples/watch_fleet --clients 200 --outage 20

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rebound_sidecar::{
    metrics::Metrics,
    source::kubernetes::{ConfigMapRef, ConfigMapSource},
    store::Store,
};
use rebound_tests::process::Running;
use rebound_tests::{DedicatedCluster, repo_root, unique_name};

#[derive(Parser)]
struct Args {
    /// Independent watch clients.
    #[arg(long, default_value_t = 200)]
    clients: usize,
    /// Seconds the API server stays stopped (after its graceful shutdown).
    #[arg(long, default_value_t = 20)]
    outage: u64,
}

fn policy(base_ms: u64) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: orders}}\nspec:\n  queues: [orders]\n  backoff: {{strategy: constant, base: {base_ms}ms, jitter: {{kind: none}}}}\n  maxAttempts: 5\n"
    )
}

/// `apiserver_request_total` summed by verb.
async fn requests_by_verb(client: &kube::Client) -> Result<BTreeMap<String, f64>> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    let mut by_verb = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let verb = labels
            .split(',')
            .find_map(|kv| {
                kv.trim_start_matches("apiserver_request_total{")
                    .strip_prefix("verb=\"")
            })
            .map(|v| v.trim_end_matches(['"', '}']).to_owned())
            .unwrap_or_default();
        *by_verb.entry(verb).or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    Ok(by_verb)
}

fn served(stores: &[Arc<Store>], hash: &str) -> usize {
    stores
        .iter()
        .filter(|s| s.current().is_some_and(|c| c.hash() == hash))
        .count()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let state_dir = repo_root().join(".state").join(unique_name("watch-fleet"));
    let cluster =
        tokio::task::spawn_blocking(move || DedicatedCluster::start(&state_dir)).await??;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "watch-fleet").await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &policy(100))?
        .ok()?;
    let log_dir = std::env::temp_dir();
    let _operator = Running::workspace_binary(
        "rebound-operator",
        cluster.kubeconfig(),
        &[
            format!("--namespaces={ns}"),
            "--leader-elect=false".to_owned(),
            format!("--metrics-addr={}", rebound_test_support::free_port()?),
        ],
        &log_dir,
    )?;
    println!("operator log: in {}", log_dir.display());
    let first = loop {
        if let Some(h) = rebound_tests::compiled::hash(&configmaps).await {
            break h;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let kube_config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(cluster.kubeconfig())?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    let target: ConfigMapRef = format!("{ns}/rebound-policies")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let mut stores = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..args.clients {
        let store = Store::new(Arc::new(Metrics::new()));
        let watch_client = rebound_runtime::api_client::from_config(kube_config.clone())?;
        let source = ConfigMapSource::new(target.clone(), None);
        tasks.push(tokio::spawn(source.run(watch_client, Arc::clone(&store))));
        stores.push(store);
    }
    let loading = Instant::now();
    while served(&stores, &first) < args.clients {
        if loading.elapsed() > Duration::from_secs(120) {
            bail!(
                "only {} of {} loaded",
                served(&stores, &first),
                args.clients
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "{} watches loaded in {:.1} s",
        args.clients,
        loading.elapsed().as_secs_f64()
    );

    tokio::task::block_in_place(|| cluster.stop_apiserver())?;
    tokio::time::sleep(Duration::from_secs(args.outage)).await;
    let restarted = Instant::now();
    tokio::task::block_in_place(|| cluster.start_apiserver())?;
    let back = Instant::now();
    // To line up with the operator's log.
    let back_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &policy(200))?
        .ok()?;
    let accepted = back.elapsed();
    let mut compiled = None;
    let mut when: Vec<Option<Duration>> = vec![None; args.clients];
    let mut resumed: Vec<Option<Duration>> = vec![None; args.clients];
    let mut edited = None;
    while (when.iter().any(Option::is_none) || resumed.iter().any(Option::is_none))
        && back.elapsed() < Duration::from_secs(120)
    {
        for (i, s) in stores.iter().enumerate() {
            if resumed[i].is_none() && s.metrics().source_link().status().connected {
                resumed[i] = Some(back.elapsed());
            }
        }
        if edited.is_none()
            && let Some(h) = rebound_tests::compiled::hash(&configmaps)
                .await
                .filter(|h| *h != first)
        {
            compiled = Some(back.elapsed());
            edited = Some(h);
        }
        if let Some(hash) = &edited {
            for (i, s) in stores.iter().enumerate() {
                if when[i].is_none() && s.current().is_some_and(|c| c.hash() == hash) {
                    when[i] = Some(back.elapsed());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(back.elapsed())).await;
    let after = requests_by_verb(&client).await?;
    // The new process counts from its start: everything since, start-up included.
    let window = restarted.elapsed().as_secs_f64();

    let mut up: Vec<Duration> = resumed.iter().flatten().copied().collect();
    up.sort();
    if let Some(last) = up.last() {
        println!(
            "{} of {} watches connected again {:.2} s after /readyz at the latest (some during start-up)",
            up.len(),
            args.clients,
            last.as_secs_f64()
        );
    }
    let mut times: Vec<Duration> = when.iter().flatten().copied().collect();
    times.sort();
    println!(
        "outage {} s, /readyz at unix {:.3}, edit applied then, accepted after {:.2} s",
        args.outage,
        back_unix.as_secs_f64(),
        accepted.as_secs_f64()
    );
    match compiled {
        Some(c) => println!("operator compiled the edit after {:.2} s", c.as_secs_f64()),
        None => println!("operator never compiled the edit"),
    }
    if times.is_empty() {
        println!("no watch served the edit");
    } else {
        println!(
            "{} of {} watches served it: p50 {:.2} s, p99 {:.2} s, max {:.2} s",
            times.len(),
            args.clients,
            percentile(&times, 0.5).as_secs_f64(),
            percentile(&times, 0.99).as_secs_f64(),
            percentile(&times, 1.0).as_secs_f64(),
        );
    }
    println!(
        "API server requests in its first {window:.0} s (start-up {:.1} s included; GET includes this program's polling):",
        (back - restarted).as_secs_f64()
    );
    let mut total = 0.0;
    for (verb, n) in &after {
        total += n;
        println!("  {verb:<8} {n:>7.0}  ({:.1}/s)", n / window);
    }
    println!("  total    {total:>7.0}  ({:.1}/s)", total / window);
    for t in tasks {
        t.abort();
    }
    Ok(())
}
