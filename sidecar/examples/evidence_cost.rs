//! The cost of counting a rollout's evidence on the Decide path, in process (no transport:
//! the answer layer the gRPC service calls): p50 and mean per decision for a table without
//! rollouts, the same table in rollout without counting (file mode), and in rollout with
//! counting (watch mode with a fleet Lease), on 1 and 4 threads sharing one counter. Every
//! call is a new job's attempt 1 or its give-up, the calls that count. A program that
//! prints figures.
//!
//! cargo run --release -p rebound-sidecar --features testkit --example evidence_cost [-- --calls 200000]

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use prometheus_client::registry::Registry;
use rebound_sidecar::{
    answer::{Snapshot, decide_counted},
    pb::server as wire,
    rollout_evidence::RolloutEvidence,
    system_now_ms, testkit,
};

const POLICIES: usize = 1_000;

fn main() -> Result<()> {
    let calls: usize = match std::env::args().skip_while(|a| a != "--calls").nth(1) {
        Some(n) => n.parse()?,
        None => 200_000,
    };
    let now = system_now_ms();
    let plain = testkit::document("bench", POLICIES, 0);
    let rolling = Arc::new(Snapshot::new(&testkit::in_rollout(
        plain.clone(),
        now - 3_600_000,
    )));
    let plain = Arc::new(Snapshot::new(&plain));
    println!(
        "{POLICIES} policies, {calls} calls per series (new job ids: attempt 1, every third given up)"
    );
    println!(
        "{:<44} {:>8} {:>9} {:>9}",
        "series", "threads", "p50 ns", "mean ns"
    );
    let mut base = [0.0; 2];
    for (i, threads) in [1usize, 4].into_iter().enumerate() {
        let series: [(&str, &Arc<Snapshot>, bool); 3] = [
            ("no rollout", &plain, false),
            ("in rollout, not counted (file mode)", &rolling, false),
            ("in rollout, counted (fleet Lease)", &rolling, true),
        ];
        for (name, cfg, counted) in series {
            let evidence = Arc::new(RolloutEvidence::register(&mut Registry::default()));
            if counted {
                evidence.enable();
            }
            let (p50, mean) = run(cfg, &evidence, counted, threads, calls)?;
            if name == "no rollout" {
                base[i] = p50;
            }
            println!(
                "{name:<44} {threads:>8} {p50:>9.0} {mean:>9.0}   p50 ×{:.2}",
                p50 / base[i]
            );
        }
    }
    Ok(())
}

/// p50 and mean nanoseconds per decision over `threads` threads.
fn run(
    cfg: &Arc<Snapshot>,
    evidence: &Arc<RolloutEvidence>,
    counted: bool,
    threads: usize,
    calls: usize,
) -> Result<(f64, f64)> {
    let per_thread = calls / threads;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (cfg, evidence) = (Arc::clone(cfg), Arc::clone(evidence));
            std::thread::spawn(move || -> Result<Vec<Duration>> {
                let now = system_now_ms();
                let mut took = Vec::with_capacity(per_thread);
                for n in 0..per_thread {
                    let req = wire::DecideRequest {
                        queue: format!("q{}", n % POLICIES).into(),
                        attempt: if n % 3 == 0 { 25 } else { 1 },
                        job_id: format!("job-{t}-{n}").into(),
                        first_failure_unix_ms: now,
                        ..Default::default()
                    };
                    let start = Instant::now();
                    let answered = decide_counted(&cfg, &req, now, counted.then_some(&*evidence));
                    took.push(start.elapsed());
                    if answered.is_err() {
                        bail!("no answer for {req:?}");
                    }
                }
                Ok(took)
            })
        })
        .collect();
    let mut all = Vec::with_capacity(calls);
    for h in handles {
        match h.join() {
            Ok(took) => all.extend(took?),
            Err(_) => bail!("a thread panicked"),
        }
    }
    all.sort();
    let p50 = all[all.len() / 2].as_nanos() as f64;
    let mean = all.iter().map(Duration::as_nanos).sum::<u128>() as f64 / all.len() as f64;
    Ok((p50, mean))
}
