//! The contention model of AWS's "Exponential Backoff And Jitter": `clients` callers that
//! each must complete one write to the same resource, all starting at once, every retry
//! delay decided by [`decide_with`] itself and, for a policy with a `retryBudget`, moved
//! by the budget's [`Scheduler`] as the sidecars would.
//!
//! The model, exactly (times in milliseconds, integers):
//! - every client makes its first write at time 0; every write reaches the resource a
//!   uniform `0..=noise_ms` later (network noise, drawn from the seed; none by default);
//!   a write started at `t` reads the resource's version at `t` and commits at
//!   `t + write_ms`, when its caller learns the result;
//! - writes are ordered by start time, ties by client number; a write fails when another
//!   write committed after its read (in `(t, t + write_ms)`, or at `t + write_ms` ahead of
//!   it in that order), as with optimistic concurrency: of writes that overlap, the first
//!   wins, and a failed write changes nothing;
//! - a client whose write `n` failed asks the policy about attempt `n` (job id
//!   `contender-<i>`, draws from the seed, first failure at the first write's end, now at
//!   this write's end) and writes again after the delay, or gives up;
//! - with a budget, client `i` asks sidecar `i mod sidecars`; each sidecar books only the
//!   slots its [`SlotShare`] owns, so all of them together schedule at most `burst`
//!   retries per slot; a retry the budget would push past `maxRetryDuration` gives up.
//!
//! Without noise, identical delays (no jitter) keep the clients in lockstep: every round
//! all remaining clients collide and one wins, N² writes in all.
//!
//! Figures: `calls` (writes made, the work the resource saw) and `completion_ms` (when the
//! last client finished, having succeeded or given up).

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BinaryHeap},
};

use serde::Serialize;

use crate::{
    decide::{Context, Decision, Draws, PreparedPolicy, Replay, decide_with, mix64},
    retry_budget::{Ask, Scheduler, SlotShare},
};

/// Bounds on one run so no input can make it unbounded: clients, writes in all, sidecars.
pub const MAX_CLIENTS: u32 = 100_000;
pub const MAX_CALLS: u64 = 20_000_000;
pub const MAX_SIDECARS: u32 = 10_000;

/// The storm around the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Storm {
    /// At most [`MAX_CLIENTS`].
    pub clients: u32,
    /// How long a write holds the resource; at least 1.
    pub write_ms: u64,
    pub seed: u64,
    /// Each write reaches the resource a uniform `0..=noise_ms` later.
    pub noise_ms: u64,
    /// Sidecars the clients are spread over (at least 1, at most [`MAX_SIDECARS`]); a
    /// budget holds for all of them together.
    pub sidecars: u32,
}

impl Storm {
    /// No noise, one sidecar.
    pub fn new(clients: u32, write_ms: u64, seed: u64) -> Self {
        Self {
            clients,
            write_ms,
            seed,
            noise_ms: 0,
            sidecars: 1,
        }
    }
}

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
    /// Clients whose policy gave up before their write succeeded (the budget's give-ups
    /// included).
    pub gave_up: u32,
    /// True when the run stopped at [`MAX_CALLS`] writes; the figures are then lower bounds.
    pub truncated: bool,
    /// What the retry budget did; absent for a policy without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<StormBudget>,
}

/// The retry budget in a storm, over all sidecars.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StormBudget {
    pub rate_per_second: u32,
    pub burst: u32,
    pub sidecars: u32,
    /// Retries scheduled (each in a slot).
    pub retries: u64,
    /// Of those, how many the budget moved to a later slot.
    pub stretched: u64,
    /// Clients given up because the next free slot lay past `maxRetryDuration`.
    pub gave_up_deadline: u32,
    /// The most retries all sidecars together scheduled in one slot: at most `burst`.
    pub busiest_slot: u32,
}

/// Runs the model for `clients` (at most [`MAX_CLIENTS`]) with writes of `write_ms`
/// (at least 1), one sidecar and no noise. The same inputs give the same run.
pub fn simulate_contention(
    policy: &PreparedPolicy,
    clients: u32,
    write_ms: u64,
    seed: u64,
) -> ContentionRun {
    run_storm(policy, &Storm::new(clients, write_ms, seed))
}

/// Runs the model for `storm`. The same inputs give the same run.
pub fn run_storm(policy: &PreparedPolicy, storm: &Storm) -> ContentionRun {
    run_model(policy, storm, MAX_CALLS)
}

/// The network noise of client `client`'s write `write` (1-based).
fn noise(storm: &Storm, client: u32, write: u32) -> u64 {
    if storm.noise_ms == 0 {
        return 0;
    }
    let key = (u64::from(client) << 32) | u64::from(write);
    mix64(storm.seed ^ 0x6E6F_6973_6521_0000 ^ mix64(key)) % (storm.noise_ms + 1)
}

fn run_model(policy: &PreparedPolicy, storm: &Storm, max_calls: u64) -> ContentionRun {
    let clients = storm.clients.min(MAX_CLIENTS);
    let write_ms = storm.write_ms.max(1);
    let sidecars = storm.sidecars.clamp(1, MAX_SIDECARS);
    let seed = storm.seed;
    struct Contender {
        draws: Draws,
        replay: Replay,
        attempt: u32,
        job_id: String,
        first_failure_ms: u64,
    }
    let mut contenders: Vec<Contender> = (0..clients)
        .map(|i| Contender {
            draws: Draws::from_seed(mix64(
                seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            )),
            replay: Replay::default(),
            attempt: 1,
            job_id: format!("contender-{i}"),
            first_failure_ms: write_ms,
        })
        .collect();
    let params = policy.params();
    let budget = params.retry_budget;
    let mut schedulers: Vec<Scheduler> = match budget {
        Some(b) => (0..sidecars)
            .map(|member| {
                let mut scheduler = Scheduler::new(b);
                scheduler.set_share(SlotShare {
                    member,
                    members: sidecars,
                });
                scheduler
            })
            .collect(),
        None => Vec::new(),
    };
    // Retries scheduled per slot, all sidecars together; slots before the current write's
    // are forgotten (no later ask can book them).
    let mut per_slot: BTreeMap<u64, u32> = BTreeMap::new();
    let mut budget_run = budget.map(|b| StormBudget {
        rate_per_second: b.rate_per_second,
        burst: b.burst,
        sidecars,
        retries: 0,
        stretched: 0,
        gave_up_deadline: 0,
        busiest_slot: 0,
    });
    // Pending writes as (start, client), earliest first.
    let mut pending: BinaryHeap<Reverse<(u64, u32)>> = (0..clients)
        .map(|i| Reverse((noise(storm, i, 1), i)))
        .collect();
    let mut run = ContentionRun {
        clients,
        calls: 0,
        completion_ms: 0,
        succeeded: 0,
        gave_up: 0,
        truncated: false,
        budget: None,
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
        if c.attempt == 1 {
            c.first_failure_ms = end;
        }
        let ctx = Context {
            job_id: Some(&c.job_id),
            first_failure_ms: Some(c.first_failure_ms),
            now_ms: Some(end),
            ..Context::default()
        };
        let mut decision = decide_with(policy, c.attempt, &ctx, &c.draws, &mut c.replay);
        if let (Some(b), Some(figures)) = (budget, budget_run.as_mut()) {
            let ask = Ask {
                queue: "",
                job_id: None,
                attempt: c.attempt,
                now_ms: end,
                first_failure_ms: Some(c.first_failure_ms),
            };
            let sidecar = &mut schedulers[(client % sidecars) as usize];
            let answer = sidecar.apply(params, decision, &ask);
            decision = answer.decision;
            match decision {
                Decision::Retry { delay_ms } => {
                    figures.retries += 1;
                    figures.stretched += u64::from(answer.stretched);
                    let now_slot = b.slot_of(start);
                    while per_slot
                        .first_key_value()
                        .is_some_and(|(&k, _)| k < now_slot)
                    {
                        per_slot.pop_first();
                    }
                    let at = end.saturating_add(delay_ms);
                    let count = per_slot.entry(b.slot_of(at)).or_default();
                    *count += 1;
                    figures.busiest_slot = figures.busiest_slot.max(*count);
                }
                Decision::GiveUp { .. } if answer.stretched => figures.gave_up_deadline += 1,
                Decision::GiveUp { .. } => {}
            }
        }
        match decision {
            Decision::Retry { delay_ms } => {
                c.attempt += 1;
                let at = end
                    .saturating_add(delay_ms)
                    .saturating_add(noise(storm, client, c.attempt));
                pending.push(Reverse((at, client)));
            }
            Decision::GiveUp { .. } => {
                run.gave_up += 1;
                run.completion_ms = run.completion_ms.max(end);
            }
        }
    }
    run.budget = budget_run;
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{resolve, spec::RetryPolicySpec};

    fn policy(backoff: serde_json::Value, max_attempts: u32) -> PreparedPolicy {
        let spec: RetryPolicySpec = serde_json::from_value(serde_json::json!({
            "queues": ["q"],
            "backoff": backoff,
            "maxAttempts": max_attempts,
        }))
        .expect("a valid spec");
        PreparedPolicy::new("ns/p", resolve(&spec).expect("resolves"))
    }

    fn budgeted(budget: Option<serde_json::Value>) -> PreparedPolicy {
        let mut spec = serde_json::json!({
            "queues": ["q"],
            "backoff": {"strategy": "exponential", "base": "10ms", "cap": "10m"},
            "maxAttempts": 10_000,
        });
        if let Some(b) = budget {
            spec["retryBudget"] = b;
        }
        let spec: RetryPolicySpec = serde_json::from_value(spec).expect("a valid spec");
        PreparedPolicy::new("ns/p", resolve(&spec).expect("resolves"))
    }

    fn exponential(jitter: &str) -> PreparedPolicy {
        policy(
            serde_json::json!({"strategy": "exponential", "base": "10ms", "cap": "10m", "jitter": {"kind": jitter}}),
            10_000,
        )
    }

    /// Mean calls and completion over `seeds` runs.
    fn mean(policy: &PreparedPolicy, clients: u32, seeds: u64) -> (f64, f64) {
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
        let run = run_model(&p, &Storm::new(u32::MAX, 10, 1), 1_000);
        assert_eq!(run.clients, MAX_CLIENTS);
        assert!(run.truncated);
        assert_eq!(run.calls, 1_000);
    }

    #[test]
    fn a_budget_changes_the_storm() {
        let free = simulate_contention(&budgeted(None), 200, 10, 1);
        let held = simulate_contention(
            &budgeted(Some(serde_json::json!({"ratePerSecond": 100, "burst": 10}))),
            200,
            10,
            1,
        );
        assert_eq!(free.budget, None);
        let budget = held.budget.as_ref().expect("budget figures");
        assert!(budget.stretched > 0, "{budget:?}");
        assert_ne!(
            (free.calls, free.completion_ms),
            (held.calls, held.completion_ms)
        );
    }

    #[test]
    fn the_budget_holds_per_slot_for_all_sidecars_together() {
        let policy = budgeted(Some(serde_json::json!({"ratePerSecond": 100, "burst": 10})));
        for sidecars in [1, 4, 7] {
            let storm = Storm {
                sidecars,
                ..Storm::new(300, 10, 2)
            };
            let run = run_storm(&policy, &storm);
            let budget = run.budget.expect("budget figures");
            assert_eq!(budget.sidecars, sidecars);
            assert!(
                budget.busiest_slot <= 10,
                "{sidecars} sidecars booked {} in one slot",
                budget.busiest_slot
            );
            assert!(budget.stretched > 0, "the storm saturates the budget");
        }
        // One sidecar fills its slots: the bound is met, not only respected.
        let one = run_storm(&policy, &Storm::new(300, 10, 2));
        assert_eq!(one.budget.map(|b| b.busiest_slot), Some(10));
    }

    #[test]
    fn noise_breaks_the_lockstep_of_identical_delays() {
        let none = exponential("none");
        let quiet = simulate_contention(&none, 100, 10, 1);
        let noisy = Storm {
            noise_ms: 5,
            ..Storm::new(100, 10, 1)
        };
        let noisy_run = run_storm(&none, &noisy);
        assert_eq!(
            quiet.calls,
            (1..=100).sum::<u64>(),
            "lockstep: N + (N-1) + … + 1"
        );
        assert!(
            noisy_run.calls * 2 < quiet.calls,
            "noise: {} calls, quiet {}",
            noisy_run.calls,
            quiet.calls
        );
        assert_eq!(
            noisy_run,
            run_storm(&none, &noisy),
            "the seed decides the noise"
        );
        let zero = Storm {
            noise_ms: 0,
            ..noisy
        };
        assert_eq!(run_storm(&none, &zero), quiet);
    }
}
