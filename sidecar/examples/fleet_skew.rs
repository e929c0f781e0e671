//! Per-slot bound of a fleet whose nodes' clocks differ (`--example fleet_skew`): two
//! members split one budget (100/s, burst 10, 100 ms slots) slot by slot, each with the
//! scheduler the sidecar runs, one clock `skew` ms ahead of the other. A storm of first
//! failures (1,000/s on each) is booked; every retry time is converted back to the true
//! time and counted per true 100 ms slot. Prints, per skew, the fullest true slot and
//! 1 s window and the factor over `burst`. Deterministic; a program that prints figures,
//! not a test.
//!
//! cargo run --release -p rebound-sidecar --example fleet_skew

use std::{collections::BTreeMap, path::PathBuf};

use anyhow::{Context, Result};
use rebound_policy::{
    Decision,
    retry_budget::{Ask, Scheduler, SlotShare},
};

const RATE: u64 = 100;
const BURST: u64 = 10;
const SLOT_MS: u64 = 1_000 * BURST / RATE;
/// A fixed true start time, so every run books the same slots.
const T0_MS: u64 = 1_800_000_000_000;
const JOBS: u64 = 4_000;

fn main() -> Result<()> {
    let yaml = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: q}}\nspec:\n  queues: [q]\n  backoff: {{strategy: constant, base: 1s, jitter: {{kind: none}}}}\n  maxAttempts: 100\n  maxRetryDuration: 10m\n  retryBudget: {{ratePerSecond: {RATE}, burst: {BURST}}}\n"
    );
    let doc = rebound_sidecar::store::compile_manifests(&[(PathBuf::from("q.yaml"), yaml)], "ns")?;
    let policy = doc.policies.first().context("one policy")?;
    let budget = policy.params.retry_budget.context("a budget")?;
    println!(
        "| skew between the two clocks | fullest true 100 ms slot | fullest true 1 s window | factor over burst |"
    );
    println!("|---|---|---|---|");
    for skew in [0, 10, 50, 100, 150] {
        let mut members: Vec<(Scheduler, u64)> = (0..2)
            .map(|m| {
                let mut s = Scheduler::new(budget);
                s.set_share(SlotShare::new(m, 2).expect("share"));
                (s, if m == 1 { skew } else { 0 })
            })
            .collect();
        let mut per_slot: BTreeMap<u64, u64> = BTreeMap::new();
        for job in 0..JOBS {
            let true_now = T0_MS + job / 2;
            let (scheduler, ahead) = &mut members[(job % 2) as usize];
            let id = format!("job-{job}");
            let ask = Ask {
                queue: "q",
                job_id: Some(&id),
                attempt: 1,
                now_ms: true_now + *ahead,
                first_failure_ms: None,
            };
            let answer = scheduler.apply(&policy.params, Decision::Retry { delay_ms: 1_000 }, &ask);
            if let Decision::Retry { delay_ms } = answer.decision {
                let true_at = true_now + delay_ms;
                *per_slot.entry(true_at / SLOT_MS).or_default() += 1;
            }
        }
        let first = per_slot.keys().next().copied().unwrap_or(0);
        let last = per_slot.keys().next_back().copied().unwrap_or(0);
        let counts: Vec<u64> = (first..=last)
            .map(|s| per_slot.get(&s).copied().unwrap_or(0))
            .collect();
        let slot = counts.iter().copied().max().unwrap_or(0);
        let window = counts
            .windows(10.min(counts.len()).max(1))
            .map(|w| w.iter().sum::<u64>())
            .max()
            .unwrap_or(0);
        println!(
            "| {skew} ms | {slot} | {window} | {:.2} |",
            slot as f64 / BURST as f64
        );
    }
    Ok(())
}
