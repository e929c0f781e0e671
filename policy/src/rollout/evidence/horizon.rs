//! When a job's fate is known: the longest time from its first failure to its give-up
//! decision under a revision, and the maturity after which the evidence counts a job.

use crate::{
    limits::{MAX_ATTEMPTS, MAX_BOOK_AHEAD_MS},
    resolve::ResolvedPolicy,
    spec::{JitterKind, Strategy},
};

/// Added to the longer horizon for the job's own run times and the reports' lag:
/// `horizon / MATURITY_MARGIN_DIVISOR + MATURITY_MARGIN_MS`.
pub const MATURITY_MARGIN_MS: u64 = 5_000;
pub const MATURITY_MARGIN_DIVISOR: u64 = 4;

/// The longest time from a job's first failure to the decision that gives it up: the sum
/// of the largest possible delays over `maxAttempts` (jitter's upper bound included),
/// no more than `maxRetryDuration`. `None` when that is over [`MAX_BOOK_AHEAD_MS`]
/// (a year: no rollout waits for it).
///
/// Not included: a caller's `Retry-After` pushback (per request, not the policy's), and
/// without `maxRetryDuration` the delay a retry budget adds under contention. With
/// `maxRetryDuration` and a budget the horizon is `maxRetryDuration` itself, since a
/// budget may push a retry up to the deadline.
pub fn horizon_ms(p: &ResolvedPolicy) -> Option<u64> {
    let limit = p.max_retry_duration_ms.map(|l| l as f64);
    if let (Some(limit), Some(_)) = (limit, p.retry_budget) {
        return within_a_year(limit);
    }
    let retries = p.max_attempts.saturating_sub(1).min(MAX_ATTEMPTS);
    let stop = limit
        .unwrap_or(f64::INFINITY)
        .min(MAX_BOOK_AHEAD_MS as f64 + 1.0);
    let mut sum = 0.0;
    for k in 1..=retries {
        sum += largest_delay(p, k);
        if sum >= stop {
            break;
        }
    }
    within_a_year(limit.map_or(sum, |l| sum.min(l)))
}

fn within_a_year(ms: f64) -> Option<u64> {
    // f64 -> u64 saturates; the comparison rules out NaN.
    (ms <= MAX_BOOK_AHEAD_MS as f64).then_some(ms as u64)
}

/// The largest delay `decide` can give before retry `k`: the capped delay, times
/// proportional jitter's upper bound, never above the cap.
fn largest_delay(p: &ResolvedPolicy, k: u32) -> f64 {
    let cap = p.cap_ms as f64;
    let base = p.base_ms as f64;
    let steps = i32::try_from(k.saturating_sub(1)).unwrap_or(i32::MAX);
    let capped = match p.strategy {
        Strategy::Exponential => (base * p.multiplier.powi(steps)).min(cap),
        Strategy::Linear => (base * f64::from(k)).min(cap),
        Strategy::Constant => base.min(cap),
        Strategy::Schedule => {
            let index = (k as usize - 1).min(p.schedule_ms.len().saturating_sub(1));
            (p.schedule_ms.get(index).copied().unwrap_or(p.base_ms) as f64).min(cap)
        }
        // Each delay is at most three times the one before, starting from base.
        Strategy::Decorrelated => return (base * 3f64.powi(steps.saturating_add(1))).min(cap),
    };
    match p.jitter {
        JitterKind::Proportional => (capped * (1.0 + p.jitter_ratio)).min(cap),
        JitterKind::None | JitterKind::Full | JitterKind::Equal => capped,
    }
}

/// How long after a job's first failure its fate is known under either revision: the
/// longer horizon plus [`MATURITY_MARGIN_MS`] and a quarter of it. `None` when either
/// horizon is unbounded: then no job matures and a step ends Inconclusive at its
/// `maxDuration`.
pub fn maturity_ms(stable: &ResolvedPolicy, canary: &ResolvedPolicy) -> Option<u64> {
    let longer = horizon_ms(stable)?.max(horizon_ms(canary)?);
    Some(
        longer
            .saturating_add(longer / MATURITY_MARGIN_DIVISOR)
            .saturating_add(MATURITY_MARGIN_MS),
    )
}
