//! Simulated rollouts of binomial evidence, looked at after every batch of reports as the
//! operator does, and exact binomial bounds to read the rates they give. Used by the
//! tests and by `cargo run --release -p rebound-policy --example rollout_power`.

use super::{Arms, StepCounts, Verdict, analyse};
use crate::{decide::SplitMix64, resolve::ResolvedAnalysis};

/// One kind of rollout: its steps, the true bad-job ratios and how often it is judged.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Step weights in percent.
    pub weights: Vec<u32>,
    /// Failed jobs each step sees before it passes.
    pub jobs_per_step: u64,
    /// Failed jobs between two looks (one report of the sidecars).
    pub look_every: u64,
    /// Bad jobs per failed job on each revision.
    pub p_stable: f64,
    pub p_new: f64,
    pub config: ResolvedAnalysis,
}

/// How one simulated rollout ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub harm: bool,
    pub inconclusive: bool,
    /// Step the verdict came in (the last step when none came).
    pub step: usize,
    /// Jobs and bad jobs on each revision when it ended.
    pub failed_jobs: Arms,
    pub bad_jobs: Arms,
}

/// Runs one rollout: every failed job lands on the new revision with the step's weight
/// and turns bad with its revision's ratio; the analysis looks every `look_every` jobs.
pub fn run(s: &Scenario, rng: &mut SplitMix64) -> Outcome {
    let mut steps: Vec<StepCounts> = Vec::with_capacity(s.weights.len());
    let look_every = s.look_every.max(1);
    for (k, &weight) in s.weights.iter().enumerate() {
        steps.push(StepCounts {
            weight,
            ..StepCounts::default()
        });
        let w = f64::from(weight) / 100.0;
        for i in 1..=s.jobs_per_step {
            let current = &mut steps[k];
            let new = uniform(rng) < w;
            let bad = uniform(rng) < if new { s.p_new } else { s.p_stable };
            current.failed_all += 1;
            current.failed_new += u64::from(new);
            current.bad_all += u64::from(bad);
            current.bad_new += u64::from(new && bad);
            if i % look_every == 0 || i == s.jobs_per_step {
                let verdict = analyse(&steps, &s.config);
                let e = verdict.evidence();
                let mut out = Outcome {
                    step: k,
                    failed_jobs: e.failed_jobs,
                    bad_jobs: e.bad_jobs,
                    ..Outcome::default()
                };
                match verdict {
                    Verdict::Harm { .. } => {
                        out.harm = true;
                        return out;
                    }
                    Verdict::Inconclusive { .. } => {
                        out.inconclusive = true;
                        return out;
                    }
                    Verdict::Continue { .. }
                        if k + 1 == s.weights.len() && i == s.jobs_per_step =>
                    {
                        return out;
                    }
                    Verdict::Continue { .. } => {}
                }
            }
        }
    }
    Outcome::default()
}

fn uniform(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// P(X ≤ k) for X ~ Binomial(n, p), summed in logs so no term underflows early.
pub fn binomial_cdf(k: u64, n: u64, p: f64) -> f64 {
    if k >= n || p <= 0.0 {
        return 1.0;
    }
    if p >= 1.0 {
        return 0.0;
    }
    let (lp, lq) = (p.ln(), (-p).ln_1p());
    let mut term = n as f64 * lq;
    let mut logs = Vec::with_capacity(k as usize + 1);
    logs.push(term);
    for i in 0..k {
        term += ((n - i) as f64).ln() - ((i + 1) as f64).ln() + lp - lq;
        logs.push(term);
    }
    let max = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logs.iter().map(|l| (l - max).exp()).sum();
    (max + sum.ln()).exp().min(1.0)
}

/// One-sided Clopper-Pearson upper bound on a rate seen `k` times in `n` trials: the rate
/// is above it with probability at most `delta`.
pub fn rate_upper_bound(k: u64, n: u64, delta: f64) -> f64 {
    if k >= n {
        return 1.0;
    }
    // P(X ≤ k; p) falls as p grows: the bound is where it reaches delta.
    bisect(|p| binomial_cdf(k, n, p) > delta)
}

/// One-sided Clopper-Pearson lower bound: the rate is below it with probability at most
/// `delta`.
pub fn rate_lower_bound(k: u64, n: u64, delta: f64) -> f64 {
    if k == 0 {
        return 0.0;
    }
    // P(X ≥ k; p) = 1 − P(X ≤ k − 1; p) grows with p.
    bisect(|p| 1.0 - binomial_cdf(k - 1, n, p) < delta)
}

/// The p in [0, 1] where `below(p)` turns false (it holds for small p).
fn bisect(below: impl Fn(f64) -> bool) -> f64 {
    let (mut lo, mut hi) = (0.0, 1.0);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if below(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}
