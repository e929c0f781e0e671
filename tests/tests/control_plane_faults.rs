//! Control-plane faults, with real `rebound-sidecar` processes in watch mode against a
//! real kube-apiserver of their own (the shared cluster is never disrupted):
//!
//! - the API server is stopped for 15 s and started again: an edit of the ConfigMap made
//!   as soon as it is back (`/readyz`) is served by every sidecar within 5 s; while it is
//!   gone every sidecar says so (`GetPolicy.config_source`, the metric) and keeps
//!   answering from the last good configuration;
//! - a connection that hangs silently (a TCP proxy between the sidecars and the API server
//!   that stops forwarding for 15 s without closing anything): noticed within 10 s, an
//!   edit made meanwhile served within 5 s of the traffic returning.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use rebound_sidecar::pb::v1::{
    ConfigSource, GetPolicyRequest, retry_advisor_client::RetryAdvisorClient,
};
use rebound_test_support::metrics::scrape_value;
use rebound_test_support::workspace_binary;
use rebound_tests::process::{Running, wait_listening};
use rebound_tests::proxy::{Proxy, api_server_addr, kubeconfig_through};
use rebound_tests::{DedicatedCluster, repo_root, unique_name};
use tonic::transport::Channel;

const CM: &str = "rebound-policies";
const QUEUE: &str = "orders";
const SIDECARS: usize = 3;

/// A sidecar process, killed when dropped, whatever happens.
struct Sidecar {
    _process: Running,
    client: RetryAdvisorClient<Channel>,
    admin: SocketAddr,
    log: PathBuf,
}

/// Creates or replaces the ConfigMap with a document whose one policy waits `base_ms`
/// (each value has its own hash); returns its hash.
async fn put_configmap(api: &Api<ConfigMap>, namespace: &str, base_ms: u64) -> Result<String> {
    let manifest = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: orders}}\nspec:\n  queues: [{QUEUE}]\n  backoff: {{strategy: constant, base: {base_ms}ms, jitter: {{kind: none}}}}\n  maxAttempts: 5\n"
    );
    let doc = rebound_sidecar::store::compile_manifests(
        &[(PathBuf::from("orders.yaml"), manifest)],
        namespace,
    )?;
    rebound_tests::compiled::put(api, &doc).await?;
    Ok(doc.hash)
}

async fn spawn_sidecar(kubeconfig: &Path, namespace: &str) -> Result<Sidecar> {
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.log", unique_name("cpfault-sidecar")));
    let mut child = Command::new(workspace_binary("rebound-sidecar")?)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info")
        .args([
            format!("--configmap={namespace}/{CM}"),
            "--listen=127.0.0.1:0".to_owned(),
            "--admin-listen=127.0.0.1:0".to_owned(),
            "--shutdown-grace=1s".to_owned(),
            "--log-format=json".to_owned(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting rebound-sidecar")?;
    // Ports bound by the sidecar itself: none can be taken between choosing and binding.
    let listening = wait_listening(&mut child, &log, Duration::from_secs(30))?;
    let process = Running(child);
    let grpc = listening.grpc.context("no gRPC listener")?;
    let channel = rebound_sidecar::client::tcp_channel(grpc).await;
    Ok(Sidecar {
        _process: process,
        client: RetryAdvisorClient::new(channel.context("connecting to the sidecar")?),
        admin: listening.admin.context("no admin listener")?,
        log,
    })
}

/// [`SIDECARS`] sidecars, returned once each serves `hash` with its source connected.
async fn start_sidecars(kubeconfig: &Path, namespace: &str, hash: &str) -> Result<Vec<Sidecar>> {
    let mut sidecars = Vec::new();
    for _ in 0..SIDECARS {
        sidecars.push(spawn_sidecar(kubeconfig, namespace).await?);
    }
    until_each(
        &mut sidecars,
        Instant::now(),
        Duration::from_secs(30),
        "first load",
        |h, s| h == hash && s.connected,
    )
    .await?;
    Ok(sidecars)
}

/// What a sidecar's `GetPolicy` says: the hash it answers from and its source's state.
async fn policy(sidecar: &mut Sidecar) -> Option<(String, ConfigSource)> {
    let request = GetPolicyRequest {
        queue: QUEUE.to_owned(),
    };
    let answer = sidecar.client.get_policy(request).await.ok()?.into_inner();
    Some((answer.policy?.config_hash, answer.config_source?))
}

/// Polls every sidecar until `done` holds for its `GetPolicy`; returns when each first
/// did, measured from `since`.
async fn until_each(
    sidecars: &mut [Sidecar],
    since: Instant,
    limit: Duration,
    what: &str,
    done: impl Fn(&str, &ConfigSource) -> bool,
) -> Result<Vec<Duration>> {
    let mut when: Vec<Option<Duration>> = vec![None; sidecars.len()];
    while when.iter().any(Option::is_none) {
        for (i, s) in sidecars.iter_mut().enumerate() {
            if when[i].is_none()
                && let Some((hash, source)) = policy(s).await
                && done(&hash, &source)
            {
                when[i] = Some(since.elapsed());
            }
        }
        if since.elapsed() > limit {
            let logs: Vec<_> = sidecars
                .iter()
                .map(|s| s.log.display().to_string())
                .collect();
            bail!("{what}: after {limit:?} only {when:?} (logs {logs:?})");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(when.into_iter().flatten().collect())
}

/// A metric sample's value from the sidecar's admin endpoint.
async fn start_cluster(prefix: &str) -> Result<DedicatedCluster> {
    let state_dir = repo_root().join(".state").join(unique_name(prefix));
    tokio::task::spawn_blocking(move || DedicatedCluster::start(&state_dir)).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sidecar_serves_an_edit_within_5s_of_the_api_server_return() -> Result<()> {
    let cluster = start_cluster("cpfault-restart").await?;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "cpfault").await?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let first = put_configmap(&api, &ns, 100).await?;
    let mut sidecars = start_sidecars(cluster.kubeconfig(), &ns, &first).await?;
    ensure!(scrape_value(sidecars[0].admin, "rebound_sidecar_config_source_connected")? == 1.0);

    // Returns once the process is gone (after its graceful shutdown, up to 15 s).
    tokio::task::block_in_place(|| cluster.stop_apiserver())?;
    let stopped = Instant::now();
    let stopped_ms = rebound_sidecar::system_now_ms();
    // Stale, said so, and still answering from the last good configuration.
    until_each(
        &mut sidecars,
        stopped,
        Duration::from_secs(10),
        "stale",
        |h, s| h == first && !s.connected && s.served_hash == first,
    )
    .await?;
    for s in &mut sidecars {
        let (_, source) = policy(s).await.context("answers while stale")?;
        let since = source.disconnected_since_unix_ms;
        ensure!(
            since + 16_000 >= stopped_ms && since <= rebound_sidecar::system_now_ms(),
            "disconnected since {since}, stopped at {stopped_ms}"
        );
    }
    ensure!(scrape_value(sidecars[0].admin, "rebound_sidecar_config_source_connected")? == 0.0);
    ensure!(
        scrape_value(
            sidecars[0].admin,
            "rebound_sidecar_config_source_disconnected_seconds"
        )? > 0.0
    );
    let outage = Duration::from_secs(15);
    tokio::time::sleep(outage.saturating_sub(stopped.elapsed())).await;
    tokio::task::block_in_place(|| cluster.start_apiserver())?;
    let back = Instant::now();
    let edited = put_configmap(&api, &ns, 200).await?;
    ensure!(edited != first);
    let took = until_each(
        &mut sidecars,
        back,
        Duration::from_secs(60),
        "edit served",
        |h, s| h == edited && s.connected && s.disconnected_since_unix_ms == 0,
    )
    .await?;
    eprintln!(
        "outage {:?}: edit served after {took:?}",
        stopped.elapsed() - back.elapsed()
    );
    ensure!(
        took.iter().all(|t| *t <= Duration::from_secs(5)),
        "an edit made at the API server's return was served after {took:?} (> 5 s)"
    );
    ensure!(scrape_value(sidecars[0].admin, "rebound_sidecar_config_source_connected")? == 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_hanging_connection_is_noticed_within_10s() -> Result<()> {
    let cluster = start_cluster("cpfault-hang").await?;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "cpfault").await?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let first = put_configmap(&api, &ns, 100).await?;
    let proxy = Proxy::start(api_server_addr(&cluster)?).await?;
    let tmp = tempfile::tempdir()?;
    let kubeconfig = kubeconfig_through(&cluster, proxy.addr(), tmp.path())?;
    let mut sidecars = start_sidecars(&kubeconfig, &ns, &first).await?;

    let hung = Instant::now();
    proxy.blackhole(true);
    let noticed = until_each(
        &mut sidecars,
        hung,
        Duration::from_secs(20),
        "stale",
        |h, s| h == first && !s.connected,
    )
    .await?;
    eprintln!("black-hole noticed after {noticed:?}");
    ensure!(
        noticed.iter().all(|t| *t <= Duration::from_secs(10)),
        "a silent hang noticed after {noticed:?} (> 10 s)"
    );
    // An edit the sidecars cannot see yet (made directly, not through the proxy).
    let edited = put_configmap(&api, &ns, 300).await?;
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(hung.elapsed())).await;
    for s in &mut sidecars {
        let (hash, source) = policy(s).await.context("answers while hung")?;
        ensure!(
            hash == first && !source.connected,
            "still the last good one, stale"
        );
    }
    proxy.blackhole(false);
    let back = Instant::now();
    let took = until_each(
        &mut sidecars,
        back,
        Duration::from_secs(60),
        "edit served",
        |h, s| h == edited && s.connected,
    )
    .await?;
    eprintln!("edit served after {took:?} of traffic returning");
    ensure!(
        took.iter().all(|t| *t <= Duration::from_secs(5)),
        "served {took:?} after the traffic returned (> 5 s)"
    );
    Ok(())
}
