//! The sidecar's load benchmark (`cargo run --release -p rebound-sidecar --example load`). Starts the real `rebound-sidecar`
//! binary on a generated table (10,000 policies by default) in a reproduced ConfigMap
//! volume and prints, from one run: start-up time to SERVING; idle RSS; Decide against the
//! health Check baseline over TCP loopback and the Unix socket, sequential and concurrent
//! (p50/p99, throughput, ratio); RSS under load; reload time for the whole table, with the
//! latency of calls made during the reload. A program that prints figures, not a test.
//!
//! cargo build --release -p rebound-sidecar --bins --example load && target/release/examples/load

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use rebound_policy::decide::mix64;
use rebound_sidecar::{
    client,
    pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient},
    testkit::{
        self, AtomicWriter,
        process::{Spawned, main_thread_cpu_ns, mib, rss_detail, rss_kib, sidecar_binary},
    },
};
use rebound_test_support::{free_port, http_get};
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[derive(Debug, Parser)]
#[command(name = "load")]
struct Args {
    /// Policies in the generated table.
    #[arg(long, default_value_t = 10_000)]
    policies: usize,
    /// Calls per measured series (each of Decide and Check, per transport and mode).
    #[arg(long, default_value_t = 20_000)]
    calls: usize,
    /// Concurrent calls in the concurrent mode.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Kubelet-style swaps of the whole table to time.
    #[arg(long, default_value_t = 7)]
    reloads: usize,
    /// The sidecar binary; by default the one next to this program.
    #[arg(long)]
    sidecar: Option<PathBuf>,
    /// Only measure the worst valid configuration (50 policies × 64 queue and 64 error
    /// patterns `*aaa…b<i>.<j>`) against exact-name lookups, and exit.
    #[arg(long)]
    worst_case: bool,
    /// Write every document gzip'd, as the operator stores a namespace's document over
    /// 900 KiB (`binaryData`, which the kubelet projects as the raw bytes).
    #[arg(long)]
    compressed: bool,
    /// Every policy in rollout (a second revision, one 50 % step started an hour ago), for
    /// the cost of a rollout on the Decide path: compare the decision/baseline p50 ratio
    /// with a run without it.
    #[arg(long)]
    rollout: bool,
    /// Extra arguments for the sidecar (e.g. --worker-threads=2).
    #[arg(long, allow_hyphen_values = true)]
    sidecar_arg: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn serving(channel: Channel) -> bool {
    HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .is_ok_and(|r| r.into_inner().status == 1)
}

async fn run(args: Args) -> Result<()> {
    let sidecar_bin = sidecar_binary(args.sidecar.clone())?;
    if args.worst_case {
        return worst_case(&sidecar_bin, args.calls).await;
    }
    let dir = std::env::temp_dir().join(format!("rebound-load-{}", std::process::id()));
    let mount = dir.join("policies");
    let socket = dir.join("rebound.sock");
    let writer = AtomicWriter::new(&mount);
    let doc_a = table(&args, 0);
    let bytes_a = doc_a.to_json();
    let stored_a = stored(&bytes_a, args.compressed);
    writer.write(&[("policies.json", &stored_a[..])])?;
    println!(
        "table: {} policies{}, {} queues + {} patterns, document {:.1} MiB{}",
        args.policies,
        if args.rollout { " all in rollout" } else { "" },
        args.policies,
        args.policies,
        bytes_a.len() as f64 / (1024.0 * 1024.0),
        if args.compressed {
            format!(", stored gzip'd: {:.0} KiB", stored_a.len() as f64 / 1024.0)
        } else {
            String::new()
        }
    );

    let (grpc, admin) = (free_port()?, free_port()?);
    let started = Instant::now();
    let child = Command::new(&sidecar_bin)
        .arg("--policies-dir")
        .arg(&mount)
        .args([
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
        ])
        .arg("--uds")
        .arg(&socket)
        .args(&args.sidecar_arg)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", sidecar_bin.display()))?;
    let pid = child.id();
    let sidecar = Spawned { child, dir };
    let startup = loop {
        if let Ok(channel) = client::tcp_channel(grpc).await
            && serving(channel).await
        {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the sidecar did not report SERVING within 30 s");
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_rss = rss_detail(pid);
    println!(
        "start-up to SERVING (process spawn to first SERVING health answer, 10k policies): {:.1} ms",
        startup.as_secs_f64() * 1e3
    );
    println!("RSS idle with {} policies: {idle_rss}", args.policies);

    let requests = Arc::new(make_requests(args.policies, 4096, false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (Arc::clone(&peak), Arc::clone(&sampling));
        std::thread::spawn(move || {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    println!();
    println!("| transport | mode | call | p50 µs | p99 µs | calls/s | sidecar CPU µs/call |");
    println!("|---|---|---|---:|---:|---:|---:|");
    let mut ratios = Vec::new();
    for transport in ["tcp", "uds"] {
        let channel = match transport {
            "tcp" => client::tcp_channel(grpc).await?,
            _ => client::uds_channel(socket.clone()).await?,
        };
        for concurrency in [1, args.concurrency] {
            let mode = if concurrency == 1 {
                "sequential".to_owned()
            } else {
                format!("{concurrency} concurrent")
            };
            // Warm up both paths, then alternate short series so drift hits both alike.
            series(&channel, Call::Check, &requests, 2_000, concurrency).await?;
            series(&channel, Call::Decide, &requests, 2_000, concurrency).await?;
            let (mut check, mut decide) = (Stats::default(), Stats::default());
            for _ in 0..5 {
                let cpu = main_thread_cpu_ns(pid);
                check.add(
                    series(
                        &channel,
                        Call::Check,
                        &requests,
                        args.calls / 5,
                        concurrency,
                    )
                    .await?,
                );
                check.server_ns += main_thread_cpu_ns(pid) - cpu;
                let cpu = main_thread_cpu_ns(pid);
                decide.add(
                    series(
                        &channel,
                        Call::Decide,
                        &requests,
                        args.calls / 5,
                        concurrency,
                    )
                    .await?,
                );
                decide.server_ns += main_thread_cpu_ns(pid) - cpu;
            }
            for (name, s) in [("Check (baseline)", &mut check), ("Decide", &mut decide)] {
                println!(
                    "| {transport} | {mode} | {name} | {:.1} | {:.1} | {:.0} | {:.1} |",
                    s.percentile(0.50),
                    s.percentile(0.99),
                    s.throughput(),
                    s.server_us_per_call()
                );
            }
            ratios.push((
                format!("{transport}, {mode}"),
                decide.percentile(0.50) / check.percentile(0.50),
                decide.percentile(0.99) / check.percentile(0.99),
                decide.throughput() / check.throughput(),
                decide.server_us_per_call() / check.server_us_per_call(),
            ));
        }
    }
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.join();
    println!();
    println!(
        "| decision/baseline | p50 ratio | p99 ratio | throughput ratio | sidecar CPU ratio |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (what, p50, p99, tput, cpu) in &ratios {
        println!("| {what} | {p50:.2} | {p99:.2} | {tput:.2} | {cpu:.2} |");
    }
    println!();
    println!(
        "RSS peak under load with {} policies: {}",
        args.policies,
        mib(peak.load(Ordering::Relaxed))
    );
    println!("RSS after the load: {}", rss_detail(pid));

    // Queues that only a glob matches: the table scans its patterns in specificity order.
    let globbed = Arc::new(make_requests(args.policies, 512, true));
    let channel = client::tcp_channel(grpc).await?;
    let mut glob = series(&channel, Call::Decide, &globbed, 500, 1).await?;
    println!(
        "Decide on queues matched only by a glob, among {} glob patterns (tcp, sequential): p50 {:.1} µs, p99 {:.1} µs",
        args.policies,
        glob.percentile(0.5),
        glob.percentile(0.99)
    );

    reload(&writer, &args, grpc, admin, &requests, pid).await?;
    drop(sidecar);
    small_idle(&sidecar_bin).await?;
    breakdown(&bytes_a, args.compressed.then_some(&stored_a[..]));
    Ok(())
}

/// The generated table, in rollout with `--rollout`.
fn table(args: &Args, salt: i64) -> rebound_policy::CompiledDocument {
    let doc = testkit::document("bench", args.policies, salt);
    if !args.rollout {
        return doc;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    testkit::in_rollout(doc, now.saturating_sub(3_600_000))
}

/// The bytes of the mounted file: the JSON, or the JSON gzip'd as the operator stores it.
fn stored(json: &str, compressed: bool) -> Vec<u8> {
    if !compressed {
        return json.as_bytes().to_vec();
    }
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = encoder.write_all(json.as_bytes());
    encoder.finish().unwrap_or_default()
}

/// The worst valid configuration the CRD allows for glob matching: 50 policies, each with
/// 64 queue patterns and 64 non-retryable error patterns `*` + 125 × `a` + `b<i>.<j>`,
/// with the 64th queue an exact name, for the ordinary case on the same table.
fn worst_document() -> rebound_policy::CompiledDocument {
    let filler = "a".repeat(125);
    let sources = (0..50)
        .map(|i| {
            let mut spec = testkit::spec(0);
            spec.queues = (0..63).map(|j| format!("*{filler}b{i}.{j}")).collect();
            spec.queues.push(format!("exact-{i}"));
            spec.non_retryable_errors = (0..64).map(|j| format!("*{filler}b{i}.{j}")).collect();
            rebound_policy::PolicySource {
                name: format!("worst-{i}"),
                namespace: "bench".to_owned(),
                uid: String::new(),
                generation: 1,
                created: Some(i),
                spec,
            }
        })
        .collect();
    rebound_policy::compile("bench", sources).document
}

/// Sidecar CPU per decision on the worst configuration: a 253-byte queue that only the last
/// pattern matches and a 253-byte error class (`a` × 253) that every error pattern almost
/// matches, unary and in 256-item batches, next to
/// exact-name lookups on the same table and the health Check baseline.
async fn worst_case(sidecar_bin: &std::path::Path, calls: usize) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("rebound-load-worst-{}", std::process::id()));
    let writer = AtomicWriter::new(dir.join("policies"));
    let doc = worst_document();
    let bytes = doc.to_json();
    writer.write(&[("policies.json", bytes.as_bytes())])?;
    println!(
        "worst case: {} policies, document {:.0} KB",
        doc.policies.len(),
        bytes.len() as f64 / 1000.0
    );
    let grpc = free_port()?;
    let child = Command::new(sidecar_bin)
        .arg("--policies-dir")
        .arg(writer.dir())
        .args(["--listen", &grpc.to_string(), "--no-admin"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let _sidecar = Spawned { child, dir };
    let started = Instant::now();
    loop {
        if let Ok(channel) = client::tcp_channel(grpc).await
            && serving(channel).await
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the worst-case sidecar did not report SERVING within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let channel = client::tcp_channel(grpc).await?;
    let long = "a".repeat(253);
    let question = |queue: String, error_class: String| pb::DecideRequest {
        queue,
        attempt: 2,
        job_id: "job-1".to_owned(),
        error_class,
        ..Default::default()
    };
    let exact = Arc::new(
        (0..50)
            .map(|i| question(format!("exact-{i}"), "Timeout".to_owned()))
            .collect::<Vec<_>>(),
    );
    // Matched only by the last policy's last pattern, after almost matching every other.
    let worst_queue = format!("{}b49.62", "a".repeat(247));
    let worst = Arc::new(vec![question(worst_queue.clone(), long.clone())]);
    println!();
    println!("| configuration | call | sidecar CPU µs/decision | p50 µs |");
    println!("|---|---|---:|---:|");
    for (name, call, requests) in [
        ("worst, exact queue", Call::Check, &exact),
        ("worst, exact queue", Call::Decide, &exact),
        ("worst, 253-byte queue and error", Call::Decide, &worst),
    ] {
        series(&channel, call, requests, (calls / 10).max(1), 1).await?;
        let cpu = main_thread_cpu_ns(pid);
        let mut stats = series(&channel, call, requests, calls, 1).await?;
        stats.server_ns = main_thread_cpu_ns(pid) - cpu;
        let label = match call {
            Call::Check => "Check (baseline)",
            Call::Decide => "Decide",
        };
        println!(
            "| {name} | {label} | {:.1} | {:.1} |",
            stats.server_us_per_call(),
            stats.percentile(0.5)
        );
    }
    let mut advisor = RetryAdvisorClient::new(channel);
    let batch = pb::DecideBatchRequest {
        requests: vec![question(worst_queue, long); 256],
    };
    let rounds = (calls / 256).max(1);
    let cpu = main_thread_cpu_ns(pid);
    let t = Instant::now();
    for _ in 0..rounds {
        advisor.decide_batch(batch.clone()).await?;
    }
    let wall = t.elapsed();
    let per_decision = (main_thread_cpu_ns(pid) - cpu) as f64 / 1e3 / (rounds * 256) as f64;
    println!(
        "| worst, 253-byte queue and error, 256-item DecideBatch | DecideBatch | {per_decision:.1} | {:.1} per batch |",
        wall.as_secs_f64() * 1e6 / rounds as f64
    );
    Ok(())
}

/// Swaps in a new 10k-policy document the way kubelet does, and measures how long until
/// answers come from it, what the sidecar itself timed, and the latency of sequential
/// Decide calls made throughout.
async fn reload(
    writer: &AtomicWriter,
    args: &Args,
    grpc: SocketAddr,
    admin: SocketAddr,
    requests: &Arc<Vec<pb::DecideRequest>>,
    pid: u32,
) -> Result<()> {
    let channel = client::tcp_channel(grpc).await?;
    let mut advisor = RetryAdvisorClient::new(channel);
    let (policies, reloads) = (args.policies, args.reloads);
    // Quiet-period latency for comparison.
    let mut quiet = Stats::default();
    let t = Instant::now();
    for req in requests.iter().take(2_000) {
        let s = Instant::now();
        advisor.decide(req.clone()).await?;
        quiet.lat.push(s.elapsed());
    }
    quiet.wall += t.elapsed();

    let mut during = Stats::default();
    let (mut inside, mut visible) = (Vec::new(), Vec::new());
    let mut i = 0usize;
    for round in 0..reloads {
        let doc = table(args, 1 + round as i64);
        let bytes = stored(&doc.to_json(), args.compressed);
        let swapped = Instant::now();
        writer.write(&[("policies.json", &bytes[..])])?;
        loop {
            let req = &requests[i % requests.len()];
            i += 1;
            let s = Instant::now();
            let r = advisor.decide(req.clone()).await?.into_inner();
            during.lat.push(s.elapsed());
            if r.policy.is_some_and(|p| p.config_hash == doc.hash) {
                visible.push(swapped.elapsed().as_secs_f64() * 1e3);
                break;
            }
            if swapped.elapsed() > Duration::from_secs(30) {
                bail!("the new document was not served within 30 s");
            }
        }
        // Keep asking for a while: freeing the old table must not stall calls either.
        for req in requests.iter().take(500) {
            let s = Instant::now();
            advisor.decide(req.clone()).await?;
            during.lat.push(s.elapsed());
        }
        let metrics = tokio::task::spawn_blocking(move || http_get(admin, "/metrics"))
            .await?
            .map(|response| response.body)
            .unwrap_or_default();
        if let Some(seconds) = metrics
            .lines()
            .find_map(|l| l.strip_prefix("rebound_sidecar_config_last_reload_duration_seconds "))
            .and_then(|v| v.trim().parse::<f64>().ok())
        {
            inside.push(seconds * 1e3);
        }
    }
    let summary = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let median = v.get(v.len() / 2).copied().unwrap_or(f64::NAN);
        format!(
            "median {median:.1} ms (min {:.1}, max {:.1})",
            v.first().copied().unwrap_or(f64::NAN),
            v.last().copied().unwrap_or(f64::NAN)
        )
    };
    println!();
    println!(
        "reload of {policies} policies, {reloads} kubelet swaps: inside the sidecar (read + parse + check + index + swap) {}; from the ..data swap to the first answer from the new table (inotify + 10 ms debounce included) {}",
        summary(&mut inside),
        summary(&mut visible)
    );
    println!(
        "Decide latency around the reloads: quiet p50 {:.1} µs / p99 {:.1} µs / max {:.1} µs; during p50 {:.1} µs / p99 {:.1} µs / max {:.1} µs ({} calls)",
        quiet.percentile(0.5),
        quiet.percentile(0.99),
        quiet.percentile(1.0),
        during.percentile(0.5),
        during.percentile(0.99),
        during.percentile(1.0),
        during.lat.len()
    );
    println!("RSS after the reload: {}", rss_detail(pid));
    Ok(())
}

/// Idle RSS of a sidecar holding a typical namespace (20 policies).
async fn small_idle(sidecar_bin: &std::path::Path) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("rebound-load-small-{}", std::process::id()));
    let writer = AtomicWriter::new(dir.join("policies"));
    writer.write(&[(
        "policies.json",
        testkit::document("bench", 20, 0).to_json().as_bytes(),
    )])?;
    let grpc = free_port()?;
    let started = Instant::now();
    let child = Command::new(sidecar_bin)
        .arg("--policies-dir")
        .arg(writer.dir())
        .args([
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &free_port()?.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let _sidecar = Spawned { child, dir };
    loop {
        if let Ok(channel) = client::tcp_channel(grpc).await
            && serving(channel).await
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the small sidecar did not report SERVING within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!(
        "start-up to SERVING with 20 policies: {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    println!("RSS idle with 20 policies: {}", rss_detail(pid));
    Ok(())
}

/// The shortest of `n` timings, in milliseconds.
fn best_of(n: usize, mut timed: impl FnMut() -> Duration) -> f64 {
    (0..n)
        .map(|_| timed())
        .min()
        .unwrap_or_default()
        .as_secs_f64()
        * 1e3
}

/// Where reload time goes, measured in this process on the same bytes (best of 5).
fn breakdown(bytes: &str, gzipped: Option<&[u8]>) {
    let timed = |f: &mut dyn FnMut()| {
        let s = Instant::now();
        f();
        s.elapsed()
    };
    let inflate = gzipped.map(|gz| {
        best_of(5, || {
            timed(&mut || {
                let mut json = Vec::new();
                let _ =
                    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz), &mut json);
                std::hint::black_box(json);
            })
        })
    });
    // What the sidecar runs: the table read straight from the bytes.
    let read = best_of(5, || {
        let s = Instant::now();
        let table = rebound_policy::PolicyTable::from_json(bytes.as_bytes()).ok();
        let took = s.elapsed();
        drop(table);
        took
    });
    // The two steps it replaced, for comparison (the copy between them is not timed).
    let mut doc = None;
    let parse = best_of(5, || {
        timed(&mut || doc = rebound_policy::CompiledDocument::from_json(bytes.as_bytes()).ok())
    });
    let Some(doc) = doc else { return };
    let index = best_of(5, || {
        let owned = doc.clone();
        let s = Instant::now();
        let table = rebound_policy::PolicyTable::from_document(owned);
        let took = s.elapsed();
        drop(table);
        took
    });
    let drop_table = best_of(5, || {
        let table = rebound_policy::PolicyTable::new(&doc);
        let s = Instant::now();
        drop(table);
        s.elapsed()
    });
    println!(
        "reload breakdown (this process, best of 5): {}PolicyTable::from_json (parse + hash + checks + index) {read:.1} ms; in two steps: CompiledDocument::from_json {parse:.1} ms + PolicyTable::from_document {index:.1} ms; dropping a table {drop_table:.1} ms",
        inflate.map_or(String::new(), |ms| format!("gunzip {ms:.1} ms; ")),
    );
}

#[derive(Clone, Copy)]
enum Call {
    Check,
    Decide,
}

#[derive(Default)]
struct Stats {
    lat: Vec<Duration>,
    wall: Duration,
    server_ns: u64,
}

impl Stats {
    fn add(&mut self, other: Stats) {
        self.lat.extend(other.lat);
        self.wall += other.wall;
    }

    /// In microseconds.
    fn percentile(&mut self, q: f64) -> f64 {
        if self.lat.is_empty() {
            return f64::NAN;
        }
        self.lat.sort_unstable();
        let i = ((self.lat.len() - 1) as f64 * q).round() as usize;
        self.lat[i.min(self.lat.len() - 1)].as_secs_f64() * 1e6
    }

    fn server_us_per_call(&self) -> f64 {
        self.server_ns as f64 / 1e3 / self.lat.len() as f64
    }

    fn throughput(&self) -> f64 {
        self.lat.len() as f64 / self.wall.as_secs_f64()
    }
}

async fn one(
    call: Call,
    advisor: &mut RetryAdvisorClient<Channel>,
    health: &mut HealthClient<Channel>,
    req: &pb::DecideRequest,
) -> Result<()> {
    match call {
        Call::Check => {
            health.check(HealthCheckRequest::default()).await?;
        }
        Call::Decide => {
            advisor.decide(req.clone()).await?;
        }
    }
    Ok(())
}

/// `calls` calls spread over `concurrency` tasks sharing one HTTP/2 connection.
async fn series(
    channel: &Channel,
    call: Call,
    requests: &Arc<Vec<pb::DecideRequest>>,
    calls: usize,
    concurrency: usize,
) -> Result<Stats> {
    let per_task = calls.div_ceil(concurrency);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..concurrency {
        let mut advisor = RetryAdvisorClient::new(channel.clone());
        let mut health = HealthClient::new(channel.clone());
        let requests = Arc::clone(requests);
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(per_task);
            for i in 0..per_task {
                let req = &requests[(t * per_task + i) % requests.len()];
                let s = Instant::now();
                one(call, &mut advisor, &mut health, req).await?;
                lat.push(s.elapsed());
            }
            Ok::<_, anyhow::Error>(lat)
        });
    }
    let mut stats = Stats::default();
    while let Some(done) = tasks.join_next().await {
        stats.lat.extend(done??);
    }
    stats.wall = started.elapsed();
    Ok(stats)
}

/// Requests over the whole table: attempts 1–12, job ids, some error classes; exact queue
/// names, or names only a glob pattern matches when `glob` is set.
fn make_requests(policies: usize, n: usize, glob: bool) -> Vec<pb::DecideRequest> {
    (0..n as u64)
        .map(|k| {
            let r = mix64(k);
            let i = (r % policies as u64) as usize;
            pb::DecideRequest {
                queue: if glob {
                    format!("g{i}.x")
                } else {
                    format!("q{i}")
                },
                attempt: 1 + ((r >> 8) % 12) as u32,
                job_id: format!("job-{}", r >> 40),
                error_class: if (r >> 20).is_multiple_of(10) {
                    "Timeout".to_owned()
                } else {
                    String::new()
                },
                ..Default::default()
            }
        })
        .collect()
}
