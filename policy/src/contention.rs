//! The contention model of AWS's "Exponential Backoff And Jitter": `clients` callers that
//! each must complete one write to the same resource, all starting at once, every retry
//! delay decided by [`decide_with`] itself.
//!
//! The model, exactly (times in milliseconds, integers):
//! - every client makes its first write at time 0; a write started at `t` reads the
//!   resource's version at `t` and commits at `t + write_ms`, when its caller learns the
//!   result;
//! - writes are ordered by start time, ties by client number; a write fails when another
//!   write committed after its read (in `(t, t + write_ms)`, or at `t + write_ms` ahead of
//!   it in that order), as with optimistic concurrency: of writes that overlap, the first
//!   wins, and a failed write changes nothing;
//! - a client whose write `n` failed asks the policy about attempt `n` (job id
//!   `contender-<i>`, draws from the seed, first failure at the first write's end, now at
//!   this write's end) and writes again after the delay, or gives up.
//!
//! Figures: `calls` (writes made, the work the resource saw) and `completion_ms` (when the
//! last client finished, having succeeded or given up).

use std::{cmp::Reverse, collections::BinaryHeap};

use serde::Serialize;

use crate::decide::{Context, Decision, Draws, Policy, Replay, decide_with, mix64};

/// Bounds on one run so no input can make it unbounded: clients, and writes in all.
pub const MAX_CLIENTS: u32 = 100_000;
pub const MAX_CALLS: u64 = 20_000_000;

/// One run of the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContentionRun {
    pub clients: u32,
    /// Writes made by all clients.
    pub calls: u64,
    /// When the last client finished (succeeded or gave up).
    pub completion_ms: u64,
    /// Clients that completed their write.
    pub succeeded: u32,
    /// Clients whose policy gave up before their write succeeded.
    pub gave_up: u32,
    /// True when the run stopped at [`MAX_CALLS`] writes; the figures are then lower bounds.
    pub truncated: bool,
}

/// Runs the model for `clients` (at most [`MAX_CLIENTS`]) with writes of `write_ms`
/// (at least 1). The same inputs give the same run.
pub fn simulate_contention(
    policy: &Policy,
    clients: u32,
    write_ms: u64,
    seed: u64,
) -> ContentionRun {
    run_model(policy, clients, write_ms, seed, MAX_CALLS)
}

fn run_model(
    policy: &Policy,
    clients: u32,
    write_ms: u64,
    seed: u64,
    max_calls: u64,
) -> ContentionRun {
    let clients = clients.min(MAX_CLIENTS);
    let write_ms = write_ms.max(1);
    struct Contender {
        draws: Draws,
        replay: Replay,
        attempt: u32,
        job_id: String,
    }
    let mut contenders: Vec<Contender> = (0..clients)
        .map(|i| Contender {
            draws: Draws::from_seed(mix64(
                seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            )),
            replay: Replay::default(),
            attempt: 1,
            job_id: format!("contender-{i}"),
        })
        .collect();
    // Pending writes as (start, client), earliest first.
    let mut pending: BinaryHeap<Reverse<(u64, u32)>> =
        (0..clients).map(|i| Reverse((0, i))).collect();
    let mut run = ContentionRun {
        clients,
        calls: 0,
        completion_ms: 0,
        succeeded: 0,
        gave_up: 0,
        truncated: false,
    };
    let mut last_commit = 0u64;
    while let Some(Reverse((start, client))) = pending.pop() {
        if run.calls == max_calls {
            run.truncated = true;
            break;
        }
        run.calls += 1;
        let end = start.saturating_add(write_ms);
        // The last commit was after this write's read.
        let failed = start < last_commit;
        if !failed {
            last_commit = end;
            run.succeeded += 1;
            run.completion_ms = run.completion_ms.max(end);
            continue;
        }
        let c = &mut contenders[client as usize];
        let ctx = Context {
            job_id: Some(&c.job_id),
            first_failure_ms: Some(write_ms),
            now_ms: Some(end),
            ..Context::default()
        };
        match decide_with(policy, c.attempt, &ctx, &c.draws, &mut c.replay) {
            Decision::Retry { delay_ms } => {
                c.attempt += 1;
                pending.push(Reverse((end.saturating_add(delay_ms), client)));
            }
            Decision::GiveUp { .. } => {
                run.gave_up += 1;
                run.completion_ms = run.completion_ms.max(end);
            }
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{resolve, spec::RetryPolicySpec};

    fn policy(backoff: serde_json::Value, max_attempts: u32) -> Policy {
        let spec: RetryPolicySpec = serde_json::from_value(serde_json::json!({
            "queues": ["q"],
            "backoff": backoff,
            "maxAttempts": max_attempts,
        }))
        .expect("a valid spec");
        Policy::new("ns/p", resolve(&spec).expect("resolves"))
    }

    fn exponential(jitter: &str) -> Policy {
        policy(
            serde_json::json!({"strategy": "exponential", "base": "10ms", "cap": "10m", "jitter": {"kind": jitter}}),
            10_000,
        )
    }

    /// Mean calls and completion over `seeds` runs.
    fn mean(policy: &Policy, clients: u32, seeds: u64) -> (f64, f64) {
        let runs: Vec<_> = (0..seeds)
            .map(|s| simulate_contention(policy, clients, 10, s))
            .collect();
        let n = runs.len() as f64;
        (
            runs.iter().map(|r| r.calls as f64).sum::<f64>() / n,
            runs.iter().map(|r| r.completion_ms as f64).sum::<f64>() / n,
        )
    }

    #[test]
    fn without_backoff_one_client_wins_each_round() {
        // The same 1 ms delay for all: every round is a burst, the first client in it wins;
        // a round takes the write (10 ms) and the delay.
        let p = policy(
            serde_json::json!({"strategy": "constant", "base": "1ms"}),
            10_000,
        );
        let run = simulate_contention(&p, 20, 10, 1);
        assert_eq!(run.succeeded, 20);
        assert_eq!(run.calls, (1..=20).sum::<u64>(), "N + (N-1) + … + 1 writes");
        assert_eq!(run.completion_ms, 19 * 11 + 10);
    }

    #[test]
    fn a_single_client_writes_once() {
        let run = simulate_contention(&exponential("full"), 1, 10, 7);
        assert_eq!((run.calls, run.completion_ms, run.succeeded), (1, 10, 1));
    }

    #[test]
    fn the_same_inputs_give_the_same_run_and_the_seed_matters() {
        let p = exponential("full");
        assert_eq!(
            simulate_contention(&p, 50, 10, 3),
            simulate_contention(&p, 50, 10, 3)
        );
        assert_ne!(
            simulate_contention(&p, 50, 10, 3),
            simulate_contention(&p, 50, 10, 4)
        );
    }

    #[test]
    fn max_attempts_ends_clients_that_never_win() {
        let p = policy(
            serde_json::json!({"strategy": "constant", "base": "1ms"}),
            3,
        );
        let run = simulate_contention(&p, 10, 10, 1);
        // Rounds of 10, 9, 8 writers; after three failures the rest give up.
        assert_eq!(run.succeeded, 3);
        assert_eq!(run.gave_up, 7);
        assert_eq!(run.calls, 10 + 9 + 8);
    }

    #[test]
    fn the_articles_shapes_hold() {
        // Over 8 seeds: exponential without jitter costs far more calls and time than full
        // jitter as N grows; equal jitter sits between; decorrelated stays near full.
        let seeds = 8;
        let none = exponential("none");
        let full = exponential("full");
        let equal = exponential("equal");
        let decorrelated = policy(
            serde_json::json!({"strategy": "decorrelated", "base": "10ms", "cap": "10m"}),
            10_000,
        );
        let (none_10, _) = mean(&none, 10, seeds);
        let (none_100, none_time) = mean(&none, 100, seeds);
        let (full_10, _) = mean(&full, 10, seeds);
        let (full_100, full_time) = mean(&full, 100, seeds);
        let (equal_100, equal_time) = mean(&equal, 100, seeds);
        let (decor_100, decor_time) = mean(&decorrelated, 100, seeds);
        assert!(
            none_100 / none_10 > 2.0 * (full_100 / full_10),
            "calls grow faster without jitter: none {none_10}→{none_100}, full {full_10}→{full_100}"
        );
        assert!(
            none_100 > 3.0 * full_100,
            "calls at 100: none {none_100}, full {full_100}"
        );
        assert!(
            none_time > full_time,
            "completion: none {none_time}, full {full_time}"
        );
        // Equal jitter does about the work of full jitter but takes longer (its delays are
        // never below half the nominal one), and still far less than no jitter.
        assert!(
            equal_100 < none_100 / 3.0 && (equal_100 / full_100 - 1.0).abs() < 0.25,
            "equal near full in calls: full {full_100}, equal {equal_100}, none {none_100}"
        );
        assert!(
            full_time < equal_time && equal_time < none_time,
            "equal between in completion: full {full_time}, equal {equal_time}, none {none_time}"
        );
        assert!(
            decor_100 < 1.5 * full_100 && decor_time < 2.0 * full_time,
            "decorrelated near full: calls {decor_100} vs {full_100}, time {decor_time} vs {full_time}"
        );
    }

    #[test]
    fn runs_are_bounded() {
        let p = policy(
            serde_json::json!({"strategy": "constant", "base": "1ms"}),
            10_000,
        );
        let run = run_model(&p, u32::MAX, 10, 1, 1_000);
        assert_eq!(run.clients, MAX_CLIENTS);
        assert!(run.truncated);
        assert_eq!(run.calls, 1_000);
    }
}
