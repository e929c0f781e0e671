//! Schedule statistics: what a policy does to many jobs that keep failing, computed by
//! running the decision function itself (never a second model of it).

use serde::Serialize;

use crate::{
    decide::{Context, Decision, Draws, GiveUpReason, PreparedPolicy, Replay, decide_with, mix64},
    resolve::Disposition,
};

/// Upper bound on simulated decisions (and stored delays), retries × samples, so a
/// 10,000-attempt policy cannot exhaust memory or time; samples are reduced to fit and the
/// result says how many were used.
const MAX_DECISIONS: usize = 2_000_000;

/// Percentiles of one quantity, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

/// Statistics of the delay before one retry.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RetryStats {
    pub retry: u32,
    pub min_ms: u64,
    pub p50_ms: u64,
    pub p99_ms: u64,
    pub max_ms: u64,
    pub mean_ms: f64,
    /// How many of the simulated jobs got this retry (the rest had given up).
    pub jobs: u32,
}

/// How often each give-up reason ended a simulated job.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GiveUpCounts {
    pub max_attempts: u32,
    pub deadline: u32,
}

/// The result of simulating a policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Simulation {
    pub samples: u32,
    pub seed: u64,
    pub max_attempts: u32,
    /// Empty unless retries were requested.
    pub retries: Vec<RetryStats>,
    /// Time from the first failure to the decision to give up, assuming runs take no time.
    pub give_up_after_ms: Spread,
    pub give_up_reasons: GiveUpCounts,
    pub terminal: Disposition,
}

/// The deterministic draws of simulated job `sample` under `seed`: [`simulate`],
/// [`fail_every_run`] and [`simulate_budget`] give job `sample` the same jitter.
pub fn sample_draws(seed: u64, sample: u32) -> Draws {
    Draws::from_seed(mix64(
        seed ^ u64::from(sample).wrapping_mul(0xA24B_AED4_963E_E407),
    ))
}

/// Runs simulated job `sample` that fails every run, first failure at 0 and runs taking no
/// time: `on_retry(attempt that failed, delay_ms)` for each retry; returns the time of the
/// decision to give up and its reason.
pub fn fail_every_run(
    policy: &PreparedPolicy,
    sample: u32,
    seed: u64,
    mut on_retry: impl FnMut(u32, u64),
) -> (u64, GiveUpReason) {
    let draws = sample_draws(seed, sample);
    let mut replay = Replay::default();
    let (mut elapsed, mut attempt) = (0u64, 1u32);
    loop {
        let ctx = Context {
            first_failure_ms: Some(0),
            now_ms: Some(elapsed),
            ..Context::default()
        };
        match decide_with(policy, attempt, &ctx, &draws, &mut replay) {
            Decision::Retry { delay_ms } => {
                on_retry(attempt, delay_ms);
                elapsed = elapsed.saturating_add(delay_ms);
                attempt += 1;
            }
            Decision::GiveUp { reason, .. } => return (elapsed, reason),
        }
    }
}

/// Simulates `samples` jobs that fail every run, each with its own deterministic draws
/// derived from `seed`. With `per_retry`, also collects statistics for every retry.
pub fn simulate(policy: &PreparedPolicy, samples: u32, seed: u64, per_retry: bool) -> Simulation {
    let params = policy.params();
    let retries = params.max_attempts.saturating_sub(1) as usize;
    let fit = MAX_DECISIONS / retries.max(1);
    let samples = samples.clamp(1, u32::try_from(fit).unwrap_or(u32::MAX));
    let mut delays: Vec<Vec<u64>> = if per_retry && retries > 0 {
        vec![Vec::with_capacity(samples as usize); retries]
    } else {
        Vec::new()
    };
    let mut give_up_after = Vec::with_capacity(samples as usize);
    let mut reasons = GiveUpCounts::default();

    for sample in 0..samples {
        let (elapsed, reason) = fail_every_run(policy, sample, seed, |attempt, delay_ms| {
            if let Some(slot) = delays.get_mut(attempt as usize - 1) {
                slot.push(delay_ms);
            }
        });
        match reason {
            GiveUpReason::Deadline { .. } => reasons.deadline += 1,
            _ => reasons.max_attempts += 1,
        }
        give_up_after.push(elapsed);
    }

    let retries = delays
        .into_iter()
        .enumerate()
        .take_while(|(_, d)| !d.is_empty())
        .map(|(i, mut d)| {
            d.sort_unstable();
            let sum: u128 = d.iter().map(|&x| u128::from(x)).sum();
            RetryStats {
                retry: i as u32 + 1,
                min_ms: d[0],
                p50_ms: quantile(&d, 0.50),
                p99_ms: quantile(&d, 0.99),
                max_ms: d[d.len() - 1],
                mean_ms: sum as f64 / d.len() as f64,
                jobs: d.len() as u32,
            }
        })
        .collect();
    give_up_after.sort_unstable();
    Simulation {
        samples,
        seed,
        max_attempts: params.max_attempts,
        retries,
        give_up_after_ms: Spread {
            p50: quantile(&give_up_after, 0.50),
            p99: quantile(&give_up_after, 0.99),
            max: give_up_after.last().copied().unwrap_or(0),
        },
        give_up_reasons: reasons,
        terminal: params.terminal.clone(),
    }
}

/// Nearest-rank quantile of sorted data; 0 for empty data.
fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What a policy's retry budget does to a storm: `jobs` jobs failing at the same instant,
/// every run failing again, all asking one sidecar.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetSimulation {
    pub rate_per_second: u32,
    pub burst: u32,
    /// Slot length, `1000 × burst / ratePerSecond`.
    pub slot_ms: f64,
    pub jobs: u32,
    pub seed: u64,
    /// Retries the budget admitted (each in a slot).
    pub retries: u64,
    /// Of those, how many it moved to a later slot.
    pub stretched: u64,
    /// Delay added to the stretched retries.
    pub added_delay_ms: Spread,
    /// Retries given up because the next free slot lay past the deadline.
    pub gave_up_deadline: u64,
    /// When the last retry runs, from the storm's start.
    pub last_retry_at_ms: u64,
}

/// Runs the storm through [`crate::retry_budget::Scheduler`] in time order (each job's next
/// failure is asked when its retry runs), with each job's draws derived from `seed` as in
/// [`simulate`]. `None` when the policy has no budget. At most [`MAX_DECISIONS`] decisions:
/// `jobs` is reduced to fit.
pub fn simulate_budget(policy: &PreparedPolicy, jobs: u32, seed: u64) -> Option<BudgetSimulation> {
    use std::{cmp::Reverse, collections::BinaryHeap};

    use crate::retry_budget::{Ask, Scheduler};

    let params = policy.params();
    let budget = params.retry_budget?;
    let retries_per_job = params.max_attempts.saturating_sub(1) as usize;
    let fit = MAX_DECISIONS / retries_per_job.max(1);
    let jobs = jobs.clamp(1, u32::try_from(fit).unwrap_or(u32::MAX));
    let draws: Vec<Draws> = (0..jobs).map(|j| sample_draws(seed, j)).collect();
    let mut replays: Vec<Replay> = (0..jobs).map(|_| Replay::default()).collect();
    let mut scheduler = Scheduler::new(budget);
    // (time the failed run happened, job, attempt that failed), earliest first; the job
    // number breaks ties so the order is a function of the seed alone.
    let mut failures: BinaryHeap<Reverse<(u64, u32, u32)>> =
        (0..jobs).map(|j| Reverse((0, j, 1))).collect();
    let (mut retries, mut stretched, mut gave_up_deadline, mut last) = (0u64, 0u64, 0u64, 0u64);
    let mut added = Vec::new();
    while let Some(Reverse((now, job, attempt))) = failures.pop() {
        let j = job as usize;
        let ctx = Context {
            first_failure_ms: Some(0),
            now_ms: Some(now),
            ..Context::default()
        };
        let decision = decide_with(policy, attempt, &ctx, &draws[j], &mut replays[j]);
        let ask = Ask {
            queue: "",
            job_id: None,
            attempt,
            now_ms: now,
            first_failure_ms: Some(0),
        };
        let answer = scheduler.apply(params, decision, &ask);
        match answer.decision {
            Decision::Retry { delay_ms } => {
                retries += 1;
                if answer.stretched {
                    stretched += 1;
                    added.push(answer.added_ms);
                }
                let at = now.saturating_add(delay_ms);
                last = last.max(at);
                failures.push(Reverse((at, job, attempt + 1)));
            }
            Decision::GiveUp { .. } if answer.stretched => gave_up_deadline += 1,
            Decision::GiveUp { .. } => {}
        }
    }
    added.sort_unstable();
    Some(BudgetSimulation {
        rate_per_second: budget.rate_per_second,
        burst: budget.burst,
        slot_ms: budget.slot_ms(),
        jobs,
        seed,
        retries,
        stretched,
        added_delay_ms: Spread {
            p50: quantile(&added, 0.50),
            p99: quantile(&added, 0.99),
            max: added.last().copied().unwrap_or(0),
        },
        gave_up_deadline,
        last_retry_at_ms: last,
    })
}
