//! Burst benchmark: many RetryPolicies with `maxAttempts: 10000` (the most expensive
//! schedule summaries) created at once, on a control plane of its own. Prints the time
//! until all are Ready, the operator's CPU time, reconcile latency (from its histogram) and
//! the Lease renewals seen meanwhile (the leader renews every 10 s by default).
//!
//!   cargo build --release -p rebound-operator --bins --examples
//!   target/release/examples/burst [--operator BIN] [--policies 200] [--namespaces 4]

#[path = "../scale/probe.rs"]
#[allow(dead_code)] // shared with the scale benchmark, which uses all of it
mod probe;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams, PostParams};
use rebound_policy::RetryPolicy;
use rebound_tests::DedicatedCluster;

use probe::{Operator, cpu_seconds, free_port, scrape, wait_until};

struct Args {
    operator: PathBuf,
    policies: usize,
    namespaces: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        operator: std::env::current_exe()?
            .parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("rebound-operator"))
            .context("locating rebound-operator")?,
        policies: 200,
        namespaces: 4,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = pair
            .get(1)
            .ok_or_else(|| anyhow!("{} needs a value", pair[0]))?;
        match pair[0].as_str() {
            "--operator" => a.operator = value.into(),
            "--policies" => a.policies = value.parse()?,
            "--namespaces" => a.namespaces = value.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

fn policy(i: usize) -> Result<RetryPolicy> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "rebound.dev/v1alpha1",
        "kind": "RetryPolicy",
        "metadata": {"name": format!("p{i:03}")},
        "spec": {
            "queues": [format!("queue-{i}")],
            "maxAttempts": 10000,
            "backoff": {"base": format!("{}ms", 100 + i), "cap": "5m"}
        }
    }))?)
}

fn metrics_text(addr: SocketAddr) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

/// Upper bound of the histogram bucket holding quantile `q` of
/// `rebound_operator_reconcile_duration_seconds`.
fn quantile(text: &str, q: f64) -> Option<f64> {
    let prefix = "rebound_operator_reconcile_duration_seconds_bucket{le=\"";
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.parse().ok()?))
        })
        .collect();
    let total = buckets.last()?.1;
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = args()?;
    let dir = std::env::temp_dir().join(format!("rebound-burst-{}", std::process::id()));
    let cluster = tokio::task::spawn_blocking(move || DedicatedCluster::start(&dir)).await??;
    let client = cluster.client().await?;
    let mut namespaces = Vec::new();
    for i in 0..args.namespaces {
        namespaces.push(
            cluster
                .create_namespace(&client, &format!("burst-{i}"))
                .await?,
        );
    }
    let metrics = free_port()?;
    let log = std::env::temp_dir().join(format!("rebound-burst-{}.log", std::process::id()));
    let op = Operator::start(&args.operator, cluster.kubeconfig(), metrics, &log)?;
    wait_until("the operator to lead", Duration::from_secs(60), || {
        Ok(scrape(metrics, "rebound_operator_leader")? == 1.0)
    })
    .await?;

    // Lease renewals, sampled every 100 ms while the burst runs.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(async move {
        let mut renewals: Vec<(Instant, String)> = Vec::new();
        while !*stop_rx.borrow() {
            if let Ok(lease) = leases.get("rebound-operator").await {
                let renew = lease
                    .spec
                    .and_then(|s| s.renew_time)
                    .map(|t| t.0.to_string())
                    .unwrap_or_default();
                if renewals.last().is_none_or(|(_, r)| *r != renew) {
                    renewals.push((Instant::now(), renew));
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stop_rx.changed() => {}
            }
        }
        renewals
    });

    let cpu_before = cpu_seconds(op.pid())?;
    let started = Instant::now();
    let per_ns = args.policies / args.namespaces;
    let creates: Vec<(String, usize)> = namespaces
        .iter()
        .flat_map(|ns| (0..per_ns).map(move |i| (ns.clone(), i)))
        .collect();
    futures::stream::iter(creates)
        .map(|(ns, i)| {
            let api: Api<RetryPolicy> = Api::namespaced(client.clone(), &ns);
            async move {
                api.create(&PostParams::default(), &policy(i)?)
                    .await
                    .map_err(anyhow::Error::from)
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    loop {
        let mut ready = 0;
        for ns in &namespaces {
            let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
            ready += api
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|p| {
                    let status = p.status.clone().unwrap_or_default();
                    status.summary.is_some()
                        && status.conditions.iter().any(|c| {
                            c.type_ == "Ready"
                                && c.status == "True"
                                && c.observed_generation == p.metadata.generation
                        })
                })
                .count();
        }
        if ready == per_ns * args.namespaces {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!("not Ready within 300 s; log {}", log.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_ready = started.elapsed();
    let cpu = cpu_seconds(op.pid())? - cpu_before;
    let _ = stop_tx.send(true);
    let renewals = sampler.await?;
    let text = metrics_text(metrics)?;
    let fmt =
        |q: f64| quantile(&text, q).map_or("-".to_owned(), |s| format!("≤ {:.0} ms", s * 1000.0));
    let gaps: Vec<f64> = renewals
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).as_secs_f64())
        .collect();
    let max_gap = gaps.iter().copied().fold(0.0, f64::max);
    println!(
        "{} policies (maxAttempts 10000) in {} namespaces: all Ready after {:.1} s, operator CPU \
         {:.2} s; reconcile p50 {}, p99 {}, max {}; Lease renewals seen {} (max gap {:.1} s, \
         during {:.1} s)",
        per_ns * args.namespaces,
        args.namespaces,
        all_ready.as_secs_f64(),
        cpu,
        fmt(0.5),
        fmt(0.99),
        fmt(1.0),
        renewals.len().saturating_sub(1),
        max_gap,
        all_ready.as_secs_f64()
    );
    Ok(())
}
