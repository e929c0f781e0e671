//! The fleet-wide retry budget under a storm, across N real sidecars in watch mode on the
//! local API server (a benchmark program, not a test: it prints figures).
//!
//! For each N of `--sidecars` (default 1,3,6) it starts N release `rebound-sidecar`
//! processes with `--pod-name` in a fresh namespace, waits until all report a fleet of N,
//! and fires `--jobs` first failures (half on sidecar 0, the rest round-robin) at a
//! policy on the curve of examples/policies/webhooks.yaml with `retryBudget: {ratePerSecond:
//! --rate, burst: --burst}`. It prints, from each answer's `budget_retry_at_unix_ms`, the
//! fullest slot and 1 s window of the schedule across all N, and when the last retry is
//! due. Then, on sidecar 0 of the last fleet, sequential p50 latency of the health Check
//! (an empty RPC), an unbudgeted Decide and a budgeted Decide, alternated in five blocks.
//!
//! cargo build --release -p rebound-sidecar --bins
//! cargo run --release -p rebound-tests --example fleet_storm -- --sidecars 1,3,6 --jobs 10000
//! (`--sidecar PATH` for another binary, `--calls`, `--rate`, `--burst`, `--in-flight`)

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use kube::api::Api;
use rebound_sidecar::pb::v1::{
    DecideRequest, Decision, GetPolicyRequest, retry_advisor_client::RetryAdvisorClient,
};
use rebound_test_support::free_port;
use rebound_tests::{TestEnv, repo_root};
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const CM: &str = "rebound-policies";

struct Args {
    sidecars: Vec<usize>,
    jobs: u64,
    rate: u32,
    burst: u32,
    calls: usize,
    in_flight: usize,
    sidecar: PathBuf,
}

fn args() -> Result<Args> {
    let mut a = Args {
        sidecars: vec![1, 3, 6],
        jobs: 10_000,
        rate: 500,
        burst: 50,
        calls: 5_000,
        in_flight: 32,
        sidecar: repo_root().join("target/release/rebound-sidecar"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--sidecars" => {
                a.sidecars = value.split(',').map(str::parse).collect::<Result<_, _>>()?
            }
            "--jobs" => a.jobs = value.parse()?,
            "--rate" => a.rate = value.parse()?,
            "--burst" => a.burst = value.parse()?,
            "--calls" => a.calls = value.parse()?,
            "--in-flight" => a.in_flight = value.parse()?,
            "--sidecar" => a.sidecar = PathBuf::from(value),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn policies(rate: u32, burst: u32) -> String {
    let spec = "  backoff: {base: 2s, multiplier: 2, cap: 15m, jitter: {kind: full}}\n  maxAttempts: 25\n  maxRetryDuration: 24h\n";
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: storm-plain}}\nspec:\n  queues: [storm-plain]\n{spec}\
         ---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: storm-budget}}\nspec:\n  queues: [storm-budget]\n{spec}  retryBudget: {{ratePerSecond: {rate}, burst: {burst}}}\n"
    )
}

async fn connect(addr: SocketAddr) -> Result<Channel> {
    let start = Instant::now();
    loop {
        match rebound_sidecar::client::tcp_channel(addr).await {
            Ok(channel) => return Ok(channel),
            Err(e) if start.elapsed() > Duration::from_secs(30) => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn fleet(env: &TestEnv, n: usize, a: &Args) -> Result<(Vec<Sidecar>, Vec<Channel>)> {
    let doc = rebound_sidecar::store::compile_manifests(
        &[(PathBuf::from("storm.yaml"), policies(a.rate, a.burst))],
        &env.namespace,
    )?;
    rebound_tests::compiled::put(&Api::namespaced(env.client.clone(), &env.namespace), &doc)
        .await?;
    let bin = &a.sidecar;
    ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p rebound-sidecar --bins",
        bin.display()
    );
    let (mut sidecars, mut channels) = (Vec::new(), Vec::new());
    for i in 0..n {
        let grpc = free_port()?;
        let child = Command::new(bin)
            .env("KUBECONFIG", env.cluster.kubeconfig())
            .args([
                format!("--configmap={}/{CM}", env.namespace),
                format!("--pod-name=storm-{i}"),
                format!("--listen={grpc}"),
                "--no-admin".to_owned(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        sidecars.push(Sidecar(child));
        channels.push(connect(grpc).await?);
    }
    let start = Instant::now();
    for c in &channels {
        loop {
            let scope = RetryAdvisorClient::new(c.clone())
                .get_policy(GetPolicyRequest {
                    queue: "storm-budget".into(),
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().budget_scope);
            if scope.is_some_and(|s| s.members as usize == n && !s.stale) {
                break;
            }
            ensure!(start.elapsed() < Duration::from_secs(60), "no fleet of {n}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok((sidecars, channels))
}

/// Fires the jobs; returns each answer's retry time (ms), and the DEADLINE count.
async fn storm(channels: &[Channel], jobs: u64, in_flight: usize) -> Result<(Vec<u64>, u64)> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (next, channels) = (next.clone(), channels.to_vec());
        tasks.push(tokio::spawn(async move {
            let (mut at, mut deadline) = (Vec::new(), 0u64);
            loop {
                let job = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if job >= jobs {
                    return Ok::<_, anyhow::Error>((at, deadline));
                }
                let n = channels.len() as u64;
                let i = if job.is_multiple_of(2) || n == 1 {
                    0
                } else {
                    1 + (job / 2) % (n - 1)
                };
                let answer = RetryAdvisorClient::new(channels[i as usize].clone())
                    .decide(DecideRequest {
                        queue: "storm-budget".into(),
                        attempt: 1,
                        job_id: format!("job-{job}"),
                        ..DecideRequest::default()
                    })
                    .await?
                    .into_inner();
                if answer.decision == i32::from(Decision::Retry) {
                    at.push(answer.budget_retry_at_unix_ms);
                } else {
                    deadline += 1;
                }
            }
        }));
    }
    let (mut all, mut deadline) = (Vec::new(), 0);
    for t in tasks {
        let (at, d) = t.await??;
        all.extend(at);
        deadline += d;
    }
    Ok((all, deadline))
}

async fn latency(channel: &Channel, calls: usize) -> Result<[f64; 3]> {
    let mut health = HealthClient::new(channel.clone());
    let mut advisor = RetryAdvisorClient::new(channel.clone());
    let mut samples: [Vec<f64>; 3] = Default::default();
    let mut job = 0u64;
    for _block in 0..5 {
        for (kind, series) in samples.iter_mut().enumerate() {
            for _ in 0..calls / 5 {
                job += 1;
                let started = Instant::now();
                match kind {
                    0 => {
                        health.check(HealthCheckRequest::default()).await?;
                    }
                    q => {
                        advisor
                            .decide(DecideRequest {
                                queue: if q == 1 {
                                    "storm-plain"
                                } else {
                                    "storm-budget"
                                }
                                .into(),
                                attempt: 1,
                                job_id: format!("lat-{job}"),
                                ..DecideRequest::default()
                            })
                            .await?;
                    }
                }
                series.push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    Ok(samples.map(|mut s| {
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    }))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let a = args()?;
    println!(
        "{} first failures (half on one sidecar), budget {}/s burst {} ({} ms slots)\n",
        a.jobs,
        a.rate,
        a.burst,
        1000 * u64::from(a.burst) / u64::from(a.rate)
    );
    println!(
        "| sidecars | retries | DEADLINE | fullest slot | fullest 1 s window | last retry due |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let slot_ms = (1000 * u64::from(a.burst) / u64::from(a.rate)).max(1);
    let per_second = (1000 / slot_ms).max(1) as usize;
    let mut last_channel = None;
    let mut _keep = Vec::new();
    for &n in &a.sidecars {
        let env = TestEnv::new("fleet-storm").await?;
        let (sidecars, channels) = fleet(&env, n, &a).await?;
        let started_ms = rebound_sidecar::system_now_ms();
        let (at, deadline) = storm(&channels, a.jobs, a.in_flight).await?;
        let mut per_slot: BTreeMap<u64, usize> = BTreeMap::new();
        for t in &at {
            *per_slot.entry(t / slot_ms).or_default() += 1;
        }
        let (first, last) = (
            per_slot.keys().next().copied().unwrap_or(0),
            per_slot.keys().next_back().copied().unwrap_or(0),
        );
        let counts: Vec<usize> = (first..=last)
            .map(|s| per_slot.get(&s).copied().unwrap_or(0))
            .collect();
        let window = counts
            .windows(per_second.min(counts.len()).max(1))
            .map(|w| w.iter().sum::<usize>())
            .max()
            .unwrap_or(0);
        let last_due = at.iter().max().copied().unwrap_or(started_ms);
        println!(
            "| {n} | {} | {deadline} | {} | {window} | {:.1} s |",
            at.len(),
            counts.iter().max().unwrap_or(&0),
            last_due.saturating_sub(started_ms) as f64 / 1e3
        );
        last_channel = channels.first().cloned();
        _keep = sidecars;
    }
    if let Some(channel) = last_channel {
        let [check, plain, budgeted] = latency(&channel, a.calls).await?;
        println!(
            "\np50 on sidecar 0 of {} ({} calls each, sequential): Check {check:.1} µs, Decide {plain:.1} µs ({:.2}×), budgeted Decide {budgeted:.1} µs ({:.2}×)",
            a.sidecars.last().unwrap_or(&0),
            a.calls,
            plain / check,
            budgeted / check
        );
    }
    Ok(())
}
