//! Scale benchmark: RetryPolicies across namespaces (1,000 in 10 by default) against a real
//! API server.
//!
//! Prints: time until every policy is Ready and every ConfigMap holds the final hash (two
//! watches, not polls: see `track.rs`); the operator's peak RSS; single-policy update
//! latency (apply → ConfigMap updated, as a watcher sees it); API writes per minute at
//! rest; a fresh operator's time to confirm every namespace, its writes and peak RSS.
//!
//!   cargo build --release -p rebound-operator --bins --examples
//!   target/release/examples/scale [--policies 1000] [--namespaces 10] [--updates 100] [--rest-secs 60]
//!       [--in-flight 32] [--converge-secs 300] [--operator BIN]
//!
//! Starts a control plane of its own (dev/cluster-up.sh) so nothing else pollutes the
//! API server's request counters, and stops it at the end.

mod probe;
mod track;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use rebound_policy::compiled::{CONFIGMAP_KEY, CompiledDocument};
use rebound_policy::{PolicySource, RetryPolicy, RetryPolicySpec, compile};
use rebound_tests::DedicatedCluster;
use tokio::sync::mpsc;

use probe::{Operator, apiserver_writes, cpu_seconds, free_port, rss_kib, scrape, wait_until};
use track::Tracker;

struct Args {
    policies: usize,
    namespaces: usize,
    updates: usize,
    rest_secs: u64,
    in_flight: usize,
    converge_secs: u64,
    operator: Option<std::path::PathBuf>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        policies: 1000,
        namespaces: 10,
        updates: 100,
        rest_secs: 60,
        in_flight: 32,
        converge_secs: 300,
        operator: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = pair
            .get(1)
            .ok_or_else(|| anyhow!("{} needs a value", pair[0]))?;
        match pair[0].as_str() {
            "--policies" => a.policies = value.parse()?,
            "--namespaces" => a.namespaces = value.parse()?,
            "--updates" => a.updates = value.parse()?,
            "--rest-secs" => a.rest_secs = value.parse()?,
            "--in-flight" => a.in_flight = value.parse()?,
            "--converge-secs" => a.converge_secs = value.parse()?,
            "--operator" => a.operator = Some(value.into()),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = args()?;
    let operator_bin = match args.operator.clone() {
        Some(bin) => bin,
        None => std::env::current_exe()?
            .parent()
            .and_then(|d| d.parent())
            .map(|d| d.join("rebound-operator"))
            .filter(|p| p.is_file())
            .context(
                "build the operator first: cargo build --release -p rebound-operator --bins --examples",
            )?,
    };
    let dir = std::env::temp_dir().join(format!("rebound-scale-{}", std::process::id()));
    let cluster = tokio::task::spawn_blocking(move || DedicatedCluster::start(&dir)).await??;
    let client = cluster.client().await?;
    let mut namespaces = Vec::new();
    for i in 0..args.namespaces {
        namespaces.push(
            cluster
                .create_namespace(&client, &format!("scale-{i}"))
                .await?,
        );
    }

    let metrics = free_port()?;
    let log =
        std::env::temp_dir().join(format!("rebound-scale-operator-{}.log", std::process::id()));
    let mut operator = Operator::start(&operator_bin, cluster.kubeconfig(), metrics, &log)?;
    wait_until("the operator to lead", Duration::from_secs(60), || {
        Ok(scrape(metrics, "rebound_operator_leader")? == 1.0)
    })
    .await?;

    // 1. Burst: all policies created at once (`--in-flight` requests at a time), followed
    // by two watches; the expected hash of each namespace comes from the created objects.
    let tracker = Tracker::start(&client);
    let per_ns = args.policies / args.namespaces;
    let total = per_ns * args.namespaces;
    let started = Instant::now();
    let creates = namespaces
        .iter()
        .flat_map(|ns| (0..per_ns).map(move |i| (ns.clone(), i)));
    let created_objects: Vec<RetryPolicy> = futures::stream::iter(creates)
        .map(|(ns, i)| {
            let api: Api<RetryPolicy> = Api::namespaced(client.clone(), &ns);
            async move { api.create(&PostParams::default(), &make_policy(i)).await }
        })
        .buffer_unordered(args.in_flight)
        .try_collect()
        .await?;
    let created = started.elapsed();
    let expected = expected_hashes(&created_objects);
    drop(created_objects);
    let mut last_report = Instant::now();
    let converged = loop {
        let (ready, at_hash) = tracker.progress(&expected);
        if ready >= total && at_hash == expected.len() {
            break started.elapsed();
        }
        if started.elapsed() > created + Duration::from_secs(args.converge_secs) {
            bail!(
                "not converged {}s after the last create ({ready}/{total} Ready, {at_hash}/{} ConfigMaps at the final hash); log: {}",
                args.converge_secs,
                expected.len(),
                log.display()
            );
        }
        if last_report.elapsed() > Duration::from_secs(5) {
            eprintln!(
                "converging: {ready}/{total} Ready, {at_hash}/{} ConfigMaps at the final hash",
                expected.len()
            );
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drop(tracker);
    let (peak_converged, _) = rss_kib(operator.pid())?;
    let hashes = final_hashes(&client, &namespaces).await?;
    let mismatched = hashes
        .iter()
        .filter(|(ns, actual)| expected.get(ns) != Some(actual))
        .count();
    let weights = weigh(&client).await?;

    // 2. Update latency, one policy at a time.
    let (tx, mut rx) = mpsc::unbounded_channel::<(String, Instant, HashMap<String, i64>)>();
    let cms: Api<ConfigMap> = Api::all(client.clone());
    let watch = tokio::spawn(async move {
        let stream = watcher(
            cms,
            watcher::Config::default().fields("metadata.name=rebound-policies"),
        )
        .applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(cm)) = stream.next().await {
            let seen = Instant::now();
            let Some(doc) = document(&cm) else {
                continue;
            };
            let generations = doc
                .policies
                .iter()
                .map(|p| (p.name.clone(), p.generation))
                .collect();
            if tx.send((doc.namespace, seen, generations)).is_err() {
                break;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    while rx.try_recv().is_ok() {}
    let mut latencies = Vec::new();
    for u in 0..args.updates {
        let ns = &namespaces[u % namespaces.len()];
        let name = format!("p{:03}", (u * 7) % per_ns);
        let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
        let patch = serde_json::json!({"spec": {"maxAttempts": 30 + (u % 50)}});
        let start = Instant::now();
        let updated = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let generation = updated.metadata.generation.unwrap_or(0);
        let deadline = start + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, rx.recv()).await {
                Ok(Some((doc_ns, seen, generations))) => {
                    if &doc_ns == ns && generations.get(&name).is_some_and(|g| *g >= generation) {
                        latencies.push(seen.duration_since(start));
                        break;
                    }
                }
                _ => bail!("update {u} of {ns}/{name} not seen within 30s"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    watch.abort();
    latencies.sort();

    // 3. At rest.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let op_before = scrape(metrics, "rebound_operator_api_writes_total")?;
    let api_before = apiserver_writes(&cluster)?;
    tokio::time::sleep(Duration::from_secs(args.rest_secs)).await;
    let op_after = scrape(metrics, "rebound_operator_api_writes_total")?;
    let api_after = apiserver_writes(&cluster)?;
    let reconciles = scrape(metrics, "rebound_operator_reconciles_total")?;
    let (peak_rss, rss) = rss_kib(operator.pid())?;
    let cpu = cpu_seconds(operator.pid())?;
    operator.stop();

    // 4. A fresh operator with every policy in place: until each namespace has been
    // reconciled once (every status confirmed), and the writes that took.
    let restart_log = log.with_extension("restart.log");
    let restarted = Instant::now();
    let mut fresh = Operator::start(&operator_bin, cluster.kubeconfig(), metrics, &restart_log)?;
    wait_until(
        "the restarted operator to confirm every namespace",
        Duration::from_secs(600),
        || Ok(scrape(metrics, "rebound_operator_reconciles_total")? >= args.namespaces as f64),
    )
    .await?;
    let restart = restarted.elapsed();
    let restart_writes = scrape(metrics, "rebound_operator_api_writes_total")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (restart_peak, _) = rss_kib(fresh.pid())?;
    fresh.stop();

    let minutes = args.rest_secs as f64 / 60.0;
    let quantile = |q: f64| {
        let i = ((q * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i].as_secs_f64() * 1000.0
    };
    println!(
        "policies: {} in {} namespaces",
        args.policies, args.namespaces
    );
    println!(
        "created ({} in flight): {:.2}s, {:.0}/s",
        args.in_flight,
        created.as_secs_f64(),
        total as f64 / created.as_secs_f64()
    );
    println!(
        "converged (all Ready, all ConfigMaps final): {:.2}s after the first create, {:.2}s after the last",
        converged.as_secs_f64(),
        (converged - created).as_secs_f64()
    );
    println!(
        "operator RSS: peak {:.1} MiB, now {:.1} MiB",
        peak_rss as f64 / 1024.0,
        rss as f64 / 1024.0
    );
    println!(
        "update latency over {} updates: p50 {:.0}ms, p99 {:.0}ms, max {:.0}ms",
        latencies.len(),
        quantile(0.50),
        quantile(0.99),
        quantile(1.0)
    );
    println!(
        "at rest ({}s): operator writes/min {:.1} (its own counter)",
        args.rest_secs,
        (op_after - op_before) / minutes
    );
    for (resource, after) in &api_after {
        let before = api_before.get(resource).copied().unwrap_or(0.0);
        println!(
            "at rest: API server write requests/min on {resource}: {:.1}",
            (after - before) / minutes
        );
    }
    println!(
        "operator peak RSS when converged: {:.1} MiB",
        peak_converged as f64 / 1024.0
    );
    println!(
        "restart with every policy in place: all namespaces reconciled after {:.2}s, {:.0} writes, peak RSS {:.1} MiB",
        restart.as_secs_f64(),
        restart_writes.abs(),
        restart_peak as f64 / 1024.0
    );
    println!("{weights}");
    println!("reconciles so far: {reconciles}; operator CPU time: {cpu:.2}s");
    let unconverged = hashes.iter().filter(|(_, h)| h.is_empty()).count();
    println!(
        "final hashes: {} namespaces, {unconverged} without a document, {mismatched} not the hash compile() gives",
        hashes.len()
    );
    Ok(())
}

/// A varied but valid policy (every strategy in turn).
fn make_policy(i: usize) -> RetryPolicy {
    let backoff = match i % 5 {
        0 => serde_json::json!({"strategy": "exponential", "base": "1s", "cap": "10m"}),
        1 => {
            serde_json::json!({"strategy": "linear", "base": "2s", "cap": "5m", "jitter": {"kind": "equal"}})
        }
        2 => {
            serde_json::json!({"strategy": "constant", "base": "30s", "jitter": {"kind": "proportional", "ratio": 0.2}})
        }
        3 => serde_json::json!({"strategy": "decorrelated", "base": "500ms", "cap": "2m"}),
        _ => serde_json::json!({"strategy": "schedule", "schedule": ["1s", "10s", "1m"]}),
    };
    let spec: RetryPolicySpec = serde_json::from_value(serde_json::json!({
        "queues": [format!("queue-{i}"), format!("queue-{i}-*")],
        "maxAttempts": 3 + i % 20,
        "backoff": backoff,
    }))
    .unwrap_or_else(|e| panic!("benchmark policy {i}: {e}"));
    RetryPolicy::new(&format!("p{i:03}"), spec)
}

/// The hash `compile` gives each namespace's created policies (the create responses
/// carry the uid and creation time the compiler orders by).
fn expected_hashes(created: &[RetryPolicy]) -> HashMap<String, String> {
    let mut by_namespace: HashMap<String, Vec<PolicySource>> = HashMap::new();
    for p in created {
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        let source = PolicySource::from_object(p, &ns);
        by_namespace.entry(ns).or_default().push(source);
    }
    by_namespace
        .into_iter()
        .map(|(ns, sources)| {
            let hash = compile(&ns, sources).document.hash;
            (ns, hash)
        })
        .collect()
}

/// (namespace, hash of the document its ConfigMap holds, or empty), read and decoded.
async fn final_hashes(
    client: &kube::Client,
    namespaces: &[String],
) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for ns in namespaces {
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        let actual = cms
            .get_opt("rebound-policies")
            .await?
            .and_then(|cm| document(&cm))
            .map(|d| d.hash);
        out.push((ns.clone(), actual.unwrap_or_default()));
    }
    Ok(out)
}

/// Every object of `api`, a page at a time (one list of 100,000 policies would be a
/// single response of hundreds of megabytes).
async fn list_all<K>(api: &Api<K>, params: ListParams) -> Result<Vec<K>>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut items = Vec::new();
    let mut params = params.limit(1000);
    loop {
        let page = api.list(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}

/// The compiled document of a ConfigMap, plain (`data`) or gzip'd (`binaryData`).
fn document(cm: &ConfigMap) -> Option<CompiledDocument> {
    if let Some(json) = cm.data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY)) {
        return CompiledDocument::from_json(json.as_bytes()).ok();
    }
    let gz = cm.binary_data.as_ref()?.get(CONFIGMAP_KEY)?;
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz.0[..]), &mut json).ok()?;
    CompiledDocument::from_json(&json).ok()
}

/// Where the bytes of the watched objects go, as the API server sends them: the JSON of
/// every RetryPolicy split into managedFields, other metadata, spec and status, and the
/// ConfigMaps' documents.
async fn weigh(client: &kube::Client) -> Result<String> {
    let all: Api<kube::api::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<RetryPolicy>(&()),
    );
    let list = list_all(&all, ListParams::default()).await?;
    let size = |v: &serde_json::Value| serde_json::to_vec(v).map_or(0, |b| b.len());
    let (mut managed, mut meta, mut spec, mut status) = (0, 0, 0, 0);
    for p in &list {
        let mut m = p.metadata.clone();
        managed += m
            .managed_fields
            .take()
            .map_or(0, |f| serde_json::to_vec(&f).map_or(0, |b| b.len()));
        meta += serde_json::to_vec(&m).map_or(0, |b| b.len());
        spec += p.data.get("spec").map_or(0, size);
        status += p.data.get("status").map_or(0, size);
    }
    let cms: Api<ConfigMap> = Api::all(client.clone());
    let docs: usize = list_all(
        &cms,
        ListParams::default().fields("metadata.name=rebound-policies"),
    )
    .await?
    .iter()
    .map(|cm| {
        cm.data
            .as_ref()
            .and_then(|d| d.get(CONFIGMAP_KEY))
            .map_or(0, String::len)
            + cm.binary_data
                .as_ref()
                .and_then(|d| d.get(CONFIGMAP_KEY))
                .map_or(0, |b| b.0.len())
    })
    .sum();
    let n = list.len().max(1);
    let kib = |b: usize| b as f64 / 1024.0;
    Ok(format!(
        "JSON per RetryPolicy: managedFields {:.0} B, other metadata {:.0} B, spec {:.0} B, status {:.0} B; ConfigMap documents {:.0} KiB in all",
        managed as f64 / n as f64,
        meta as f64 / n as f64,
        spec as f64 / n as f64,
        status as f64 / n as f64,
        kib(docs)
    ))
}
