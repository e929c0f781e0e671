//! Memory benchmark: the operator's RSS under hostile input, on a control plane of its own.
//!
//!   cargo build --release -p rebound-operator --bins --examples
//!   target/release/examples/memory halfopen [--operator BIN] [--connections 5000]
//!   target/release/examples/memory foreign  [--operator BIN] [--configmaps 50]
//!
//! `halfopen`: N connections to the metrics port that send half a GET and then nothing;
//! RSS before, 2 s after they are open, and 15 s later (past the server's timeouts), and
//! whether `/livez` still answers meanwhile.
//! `foreign`: N unlabelled 1 MiB ConfigMaps named `rebound-policies` (someone else's), one
//! namespace each, plus one namespace with a policy; RSS with the operator running, and
//! peak RSS of a fresh operator started afterwards (its initial list holds them all).

#[path = "../scale/probe.rs"]
#[allow(dead_code)] // shared with the scale benchmark, which uses all of it
mod probe;

use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ObjectMeta, PostParams};
use rebound_tests::DedicatedCluster;

use probe::{Operator, free_port, rss_kib, scrape, wait_until};

struct Args {
    mode: String,
    operator: PathBuf,
    count: usize,
}

fn args() -> Result<Args> {
    let mut argv = std::env::args().skip(1);
    let mode = argv.next().ok_or_else(|| anyhow!("halfopen or foreign"))?;
    let mut a = Args {
        count: if mode == "halfopen" { 5000 } else { 50 },
        mode,
        operator: std::env::current_exe()?
            .parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("rebound-operator"))
            .context("locating rebound-operator")?,
    };
    let rest: Vec<String> = argv.collect();
    for pair in rest.chunks(2) {
        let value = pair
            .get(1)
            .ok_or_else(|| anyhow!("{} needs a value", pair[0]))?;
        match pair[0].as_str() {
            "--operator" => a.operator = value.into(),
            "--connections" | "--configmaps" => a.count = value.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = args()?;
    let dir = std::env::temp_dir().join(format!("rebound-memory-{}", std::process::id()));
    let cluster = tokio::task::spawn_blocking(move || DedicatedCluster::start(&dir)).await??;
    let client = cluster.client().await?;
    match args.mode.as_str() {
        "halfopen" => halfopen(&args, &cluster).await,
        "foreign" => foreign(&args, &cluster, &client).await,
        other => bail!("unknown mode {other}"),
    }
}

async fn halfopen(args: &Args, cluster: &DedicatedCluster) -> Result<()> {
    let metrics = free_port()?;
    let log = std::env::temp_dir().join("rebound-memory-halfopen.log");
    let op = Operator::start(&args.operator, cluster.kubeconfig(), metrics, &log)?;
    wait_until("the metrics port", Duration::from_secs(30), || {
        scrape(metrics, "rebound_operator_leader").map(|v| v == 1.0)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, before) = rss_kib(op.pid())?;
    let mut held = Vec::with_capacity(args.count);
    for _ in 0..args.count {
        let mut s = TcpStream::connect(metrics)?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")?;
        held.push(s);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, open) = rss_kib(op.pid())?;
    let live = scrape(metrics, "rebound_operator_leader").is_ok();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let (peak, later) = rss_kib(op.pid())?;
    let live_later = scrape(metrics, "rebound_operator_leader").is_ok();
    println!(
        "{} half-sent GETs: RSS before {}, 2 s after {} (metrics answered: {live}), \
         15 s later {} (metrics answered: {live_later}), peak {}",
        args.count,
        mib(before),
        mib(open),
        mib(later),
        mib(peak)
    );
    drop(held);
    Ok(())
}

async fn foreign(args: &Args, cluster: &DedicatedCluster, client: &kube::Client) -> Result<()> {
    let metrics = free_port()?;
    let log = std::env::temp_dir().join("rebound-memory-foreign.log");
    let mut op = Operator::start(&args.operator, cluster.kubeconfig(), metrics, &log)?;
    wait_until("the metrics port", Duration::from_secs(30), || {
        scrape(metrics, "rebound_operator_leader").map(|v| v == 1.0)
    })
    .await?;
    let ns = cluster.create_namespace(client, "mem-own").await?;
    cluster
        .kubectl_stdin(
            ["apply", "-n", &ns, "-f", "-"],
            "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: p\nspec:\n  \
             queues: [jobs]\n",
        )?
        .ok()?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (_, before) = rss_kib(op.pid())?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let blob = "x".repeat(1024 * 1024 - 1024);
    for i in 0..args.count {
        let name = format!("mem-foreign-{i}");
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let _ = namespaces.create(&PostParams::default(), &ns).await;
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &name);
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some("rebound-policies".to_owned()),
                ..ObjectMeta::default()
            },
            data: Some([("blob".to_owned(), blob.clone())].into()),
            ..ConfigMap::default()
        };
        cms.create(&PostParams::default(), &cm).await?;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (peak, with) = rss_kib(op.pid())?;
    op.stop();
    let metrics = free_port()?;
    let fresh = Operator::start(&args.operator, cluster.kubeconfig(), metrics, &log)?;
    wait_until("the metrics port", Duration::from_secs(60), || {
        scrape(metrics, "rebound_operator_leader").map(|v| v == 1.0)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (restart_peak, restart) = rss_kib(fresh.pid())?;
    println!(
        "{} foreign 1 MiB ConfigMaps: RSS before {}, with them {} (peak {}); \
         a fresh operator: {} (peak {})",
        args.count,
        mib(before),
        mib(with),
        mib(peak),
        mib(restart),
        mib(restart_peak)
    );
    Ok(())
}
