//! A retry storm against one sidecar (`--example storm`): starts the real `rebound-sidecar`
//! binary with two policies that share one backoff curve, one without and one with a
//! retry budget, fires `--jobs` first failures spread over one second through real gRPC
//! clients at each, and prints the retries per second the sidecar scheduled (by the
//! second of scheduled time, now + delay), the delay the budget added, and whether any
//! slot or second of the budgeted storm exceeded the budget. A program that prints
//! figures, not a test.
//!
//! cargo build --release -p rebound-sidecar --bins --example storm --features testkit \
//!   && target/release/examples/storm
//!
//! Scheduled times are taken on the client as (time the answer arrived + delay_ms): the
//! sidecar's clock read lies between sending and receiving, so a time is late by at most
//! the call's round trip (printed). A stretched retry sits at the start of its slot, so
//! with slots longer than the round trip its slot is found exactly.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use rebound_policy::resolve::RetryBudget;
use rebound_sidecar::{
    client,
    pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient},
    system_now_ms,
    testkit::process::{sidecar_binary, spawn_on_policies_file},
};
use rebound_test_support::free_port;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(name = "storm")]
struct Args {
    /// The sidecar binary; by default the one next to this program.
    #[arg(long)]
    sidecar: Option<std::path::PathBuf>,
    /// Jobs failing within the one second.
    #[arg(long, default_value_t = 10_000)]
    jobs: u32,
    /// The budgeted policy's ratePerSecond.
    #[arg(long, default_value_t = 500)]
    rate: u32,
    /// The budgeted policy's burst.
    #[arg(long, default_value_t = 50)]
    burst: u32,
    /// gRPC connections the jobs' calls are spread over.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Calls in flight at most: few enough that a call's round trip stays well under a
    /// slot, so each retry's slot can be told from the client's clock.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
}

/// One answer as the client saw it.
struct Answer {
    sent_ms: u64,
    received_ms: u64,
    delay_ms: u64,
    added_ms: u64,
    stretched: bool,
    retry: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args))
}

fn policies(rate: u32, burst: u32) -> String {
    // The curve of examples/policies/webhooks.yaml.
    let spec = "  backoff: {base: 2s, multiplier: 2, cap: 15m, jitter: {kind: full}}\n  maxAttempts: 25\n  maxRetryDuration: 24h\n";
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: storm-plain}}\nspec:\n  queues: [storm-plain]\n{spec}\
         ---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: storm-budget}}\nspec:\n  queues: [storm-budget]\n{spec}  retryBudget: {{ratePerSecond: {rate}, burst: {burst}}}\n"
    )
}

async fn run(args: Args) -> Result<()> {
    let budget = RetryBudget {
        rate_per_second: args.rate,
        burst: args.burst,
    };
    if let Err((field, message)) = budget.check() {
        bail!("retryBudget.{field}: {message}");
    }
    let sidecar_bin = sidecar_binary(args.sidecar.clone())?;
    let dir = std::env::temp_dir().join(format!("rebound-storm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("policies.yaml");
    std::fs::write(&file, policies(args.rate, args.burst))?;
    let (grpc, admin) = (free_port()?, free_port()?);
    let _sidecar = spawn_on_policies_file(&sidecar_bin, &file, grpc, admin, dir)?;

    let mut channels = Vec::new();
    let started = Instant::now();
    for _ in 0..args.connections.max(1) {
        loop {
            match client::tcp_channel(grpc).await {
                Ok(c) => {
                    channels.push(RetryAdvisorClient::new(c));
                    break;
                }
                Err(_) if started.elapsed() < Duration::from_secs(30) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => bail!("the sidecar did not accept connections within 30 s: {e}"),
            }
        }
    }
    let mut probe = channels[0].clone();
    while probe.decide(request("storm-plain", "probe")).await.is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the sidecar did not answer within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    println!(
        "{} jobs failing within 1 s against one sidecar; backoff exponential 2s x 2, cap 15m, full jitter; budget {budget}\n",
        args.jobs
    );
    let plain = storm(&channels, "storm-plain", args.jobs, args.in_flight).await?;
    let budgeted = storm(&channels, "storm-budget", args.jobs, args.in_flight).await?;
    report(&plain, &budgeted, budget);
    Ok(())
}

fn request(queue: &str, job: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        queue: queue.to_owned(),
        attempt: 1,
        job_id: job.to_owned(),
        first_failure_unix_ms: system_now_ms(),
        ..Default::default()
    }
}

/// Fires `jobs` first failures evenly over one second, each its own call.
async fn storm(
    channels: &[RetryAdvisorClient<Channel>],
    queue: &str,
    jobs: u32,
    in_flight: usize,
) -> Result<Vec<Answer>> {
    let start = tokio::time::Instant::now();
    // Bounds the calls in flight if the sidecar falls behind.
    let in_flight = Arc::new(Semaphore::new(in_flight.max(1)));
    let mut tasks = Vec::with_capacity(jobs as usize);
    for i in 0..jobs {
        let at = start + Duration::from_micros(u64::from(i) * 1_000_000 / u64::from(jobs.max(1)));
        tokio::time::sleep_until(at).await;
        let permit = Arc::clone(&in_flight).acquire_owned().await?;
        let mut client = channels[i as usize % channels.len()].clone();
        let req = request(queue, &format!("{queue}-{i}"));
        tasks.push(tokio::spawn(async move {
            let sent_ms = system_now_ms();
            let r = client.decide(req).await.map(|r| r.into_inner());
            let received_ms = system_now_ms();
            drop(permit);
            r.map(|r| Answer {
                sent_ms,
                received_ms,
                delay_ms: r.delay_ms,
                added_ms: r.budget_delay_ms,
                stretched: r.budget_stretched,
                retry: r.decision() == pb::Decision::Retry,
            })
        }));
    }
    let mut answers = Vec::with_capacity(tasks.len());
    for t in tasks {
        answers.push(t.await?.context("Decide failed")?);
    }
    Ok(answers)
}

/// Where an answer's retry may have been scheduled, given that the sidecar read its clock
/// between `sent_ms` and `received_ms`: the candidate slots (one when the round trip
/// leaves no doubt).
struct Placed {
    slots: Vec<u64>,
}

fn place(a: &Answer, budget: RetryBudget) -> Placed {
    let (lo, hi) = (a.sent_ms + a.delay_ms, a.received_ms + a.delay_ms);
    if a.stretched {
        // A stretched retry runs at the first millisecond of its slot.
        let slots: Vec<u64> = (budget.slot_of(lo)..=budget.slot_of(hi))
            .filter(|&k| (lo..=hi).contains(&budget.slot_start(k)))
            .collect();
        Placed { slots }
    } else {
        Placed {
            slots: (budget.slot_of(lo)..=budget.slot_of(hi)).collect(),
        }
    }
}

/// Retries per second of scheduled time, counted from the second the storm began.
fn per_second(answers: &[Answer], shown: impl Fn(&Answer) -> u64) -> BTreeMap<u64, u64> {
    let first = answers.iter().map(|a| a.sent_ms).min().unwrap_or(0) / 1000;
    let mut out = BTreeMap::new();
    for a in answers.iter().filter(|a| a.retry) {
        *out.entry(shown(a) / 1000 - first).or_default() += 1;
    }
    out
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Per-slot counts of the budgeted retries: each placed exactly where the client's
/// clock tells its slot, and the rest (a call whose round trip straddles a slot boundary)
/// each in the earliest of its possible slots that still has room, taken in order of
/// their latest possible slot (the greedy that finds a placement within `burst` whenever
/// one exists). Returns the counts and how many retries found no room.
fn placement(placed: &[Placed], burst: u32) -> (BTreeMap<u64, u32>, usize) {
    let mut counts: BTreeMap<u64, u32> = BTreeMap::new();
    let mut unsure: Vec<&Placed> = Vec::new();
    for p in placed {
        match p.slots.as_slice() {
            [k] => *counts.entry(*k).or_default() += 1,
            _ => unsure.push(p),
        }
    }
    unsure.sort_by_key(|p| p.slots.last().copied().unwrap_or(0));
    let mut homeless = 0;
    for p in unsure {
        match p
            .slots
            .iter()
            .find(|k| counts.get(k).copied().unwrap_or(0) < burst)
        {
            Some(&k) => *counts.entry(k).or_default() += 1,
            None => homeless += 1,
        }
    }
    (counts, homeless)
}

fn report(plain: &[Answer], budgeted: &[Answer], budget: RetryBudget) {
    let without = per_second(plain, |a| a.sent_ms + a.delay_ms);
    let retries: Vec<&Answer> = budgeted.iter().filter(|a| a.retry).collect();
    let placed: Vec<Placed> = retries.iter().map(|a| place(a, budget)).collect();
    let (per_slot, homeless) = placement(&placed, budget.burst);
    // The budgeted column counts each retry in the second of the slot it was placed in.
    let first = budgeted.iter().map(|a| a.sent_ms).min().unwrap_or(0) / 1000;
    let mut with: BTreeMap<u64, u64> = BTreeMap::new();
    for (&k, &n) in &per_slot {
        *with
            .entry((budget.slot_start(k) / 1000).saturating_sub(first))
            .or_default() += u64::from(n);
    }
    let last = without
        .keys()
        .chain(with.keys())
        .copied()
        .max()
        .unwrap_or(0);
    println!("| second of scheduled time | retries without budget | retries with budget |");
    println!("|---:|---:|---:|");
    for s in 0..=last {
        let (a, b) = (without.get(&s), with.get(&s));
        if a.is_none() && b.is_none() {
            continue;
        }
        println!(
            "| {s} | {} | {} |",
            a.copied().unwrap_or(0),
            b.copied().unwrap_or(0)
        );
    }

    let mut added: Vec<u64> = budgeted.iter().map(|a| a.added_ms).collect();
    added.sort_unstable();
    let mut rtt: Vec<u64> = plain
        .iter()
        .chain(budgeted)
        .map(|a| a.received_ms - a.sent_ms)
        .collect();
    rtt.sort_unstable();
    let stretched = budgeted.iter().filter(|a| a.stretched).count();
    let unsure = placed.iter().filter(|p| p.slots.len() != 1).count();
    let max_slot = per_slot.values().copied().max().unwrap_or(0);
    let max_second = with.values().copied().max().unwrap_or(0);
    println!();
    println!(
        "without budget: {} retries, peak {} in one second, last in second {}",
        plain.iter().filter(|a| a.retry).count(),
        without.values().copied().max().unwrap_or(0),
        without.keys().last().copied().unwrap_or(0)
    );
    println!(
        "with budget:    {} retries, {stretched} stretched; added delay p50 {} ms, p99 {} ms, max {} ms; last in second {}",
        retries.len(),
        quantile(&added, 0.50),
        quantile(&added, 0.99),
        added.last().copied().unwrap_or(0),
        with.keys().last().copied().unwrap_or(0)
    );
    let within = homeless == 0
        && max_slot <= budget.burst
        && max_second <= u64::from(budget.rate_per_second);
    println!(
        "budget check:   most in one slot {max_slot} (burst {}), most in one second {max_second} (rate {}); \
         {unsure} retries whose slot the client's clock cannot tell placed where there was room, {homeless} without: {}",
        budget.burst,
        budget.rate_per_second,
        if within { "never exceeded" } else { "EXCEEDED" }
    );
    let fired = |answers: &[Answer]| {
        answers.iter().map(|a| a.sent_ms).max().unwrap_or(0)
            - answers.iter().map(|a| a.sent_ms).min().unwrap_or(0)
    };
    println!(
        "calls sent over {} ms (without budget) and {} ms (with budget)",
        fired(plain),
        fired(budgeted)
    );
    println!(
        "call round trip: p50 {} ms, p99 {} ms, max {} ms",
        quantile(&rtt, 0.50),
        quantile(&rtt, 0.99),
        rtt.last().copied().unwrap_or(0)
    );
}
