//! False-abort rate and power of the rollout analysis on simulated binomial evidence,
//! judged after every 10 failed jobs (peeking, as the operator does on each report).
//! Figures in docs/policy.md ("Rollouts"):
//! `cargo run --release -p rebound-policy --example rollout_power [ROLLOUTS]`.

use rebound_policy::{
    decide::SplitMix64,
    resolve::ResolvedAnalysis,
    rollout::analysis::power::{Outcome, Scenario, rate_lower_bound, rate_upper_bound, run},
};

const SEED: u64 = 0x0031_0ad5;

fn main() {
    let runs: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let config = ResolvedAnalysis::default();
    let r = 1.0 + config.max_relative_increase;
    println!(
        "defaults: maxRelativeIncrease {} (r = {r}), alpha {}, one look per 10 failed jobs, {runs} rollouts per row, seed {SEED:#x}",
        config.max_relative_increase, config.alpha
    );
    println!("bounds: one-sided Clopper-Pearson at 99 %\n");

    println!("## Without harm: aborts (rate ≤ alpha expected) and sample-ratio alarms");
    println!("| weight | p_stable | theta | failed jobs | aborted | upper bound | SRM alarms |");
    println!("|---|---|---|---|---|---|---|");
    for (w, p) in [
        (1, 0.05),
        (10, 0.01),
        (10, 0.05),
        (10, 0.2),
        (50, 0.05),
        (90, 0.05),
    ] {
        for theta in [1.0, r] {
            let out = simulate(&scenario(&[w], p, theta, 5000, config), runs);
            let aborted = count(&out, |o| o.harm);
            let srm = count(&out, |o| o.inconclusive);
            println!(
                "| {w} % | {p} | {theta} | 5000 | {aborted} ({:.2} %) | {:.2} % | {srm} |",
                pct(aborted, runs),
                100.0 * rate_upper_bound(aborted, runs, 0.01)
            );
        }
    }
    let two = simulate(&scenario(&[10, 50], 0.05, r, 2500, config), runs);
    let aborted = count(&two, |o| o.harm);
    println!(
        "| 10 % then 50 % | 0.05 | {r} | 2 × 2500 | {aborted} ({:.2} %) | {:.2} % | {} |\n",
        pct(aborted, runs),
        100.0 * rate_upper_bound(aborted, runs, 0.01),
        count(&two, |o| o.inconclusive)
    );

    println!("## With harm: power within one step and the sample it took");
    println!(
        "| weight | p_stable | theta / r | failed jobs | aborted | lower bound | median failed jobs at abort | median bad jobs on new at abort |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (w, p, jobs) in [
        (10, 0.05, 1000),
        (10, 0.05, 5000),
        (50, 0.05, 1000),
        (10, 0.01, 5000),
    ] {
        for m in [1.25, 1.5, 2.0, 5.0] {
            let out = simulate(&scenario(&[w], p, m * r, jobs, config), runs);
            let aborted = count(&out, |o| o.harm);
            let (failed, bad) = medians(&out);
            println!(
                "| {w} % | {p} | {m} | {jobs} | {aborted} ({:.1} %) | {:.1} % | {failed} | {bad} |",
                pct(aborted, runs),
                100.0 * rate_lower_bound(aborted, runs, 0.01)
            );
        }
    }

    println!("\n## A change that dead-letters every job it serves (test scenario 2)");
    println!(
        "| weight | p_stable | aborted before 200 failed jobs | median / max jobs on new at abort |"
    );
    println!("|---|---|---|---|");
    for (w, p) in [(10, 0.02), (10, 0.1), (1, 0.02), (50, 0.2)] {
        let out = simulate(&scenario(&[w], p, 1.0 / p, 200, config), runs);
        let early = count(&out, |o| o.harm && total(o) < 200);
        let mut new: Vec<u64> = out
            .iter()
            .filter(|o| o.harm)
            .map(|o| o.failed_jobs.new)
            .collect();
        new.sort_unstable();
        println!(
            "| {w} % | {p} | {early} / {runs} | {} / {} |",
            new.get(new.len() / 2).copied().unwrap_or(0),
            new.last().copied().unwrap_or(0)
        );
    }
}

fn scenario(
    weights: &[u32],
    p_stable: f64,
    theta: f64,
    jobs: u64,
    config: ResolvedAnalysis,
) -> Scenario {
    Scenario {
        weights: weights.to_vec(),
        jobs_per_step: jobs,
        look_every: 10,
        p_stable,
        p_new: (p_stable * theta).min(1.0),
        config,
    }
}

fn simulate(s: &Scenario, runs: u64) -> Vec<Outcome> {
    let mut rng = SplitMix64::new(SEED);
    (0..runs).map(|_| run(s, &mut rng)).collect()
}

fn count(out: &[Outcome], f: impl Fn(&Outcome) -> bool) -> u64 {
    out.iter().filter(|o| f(o)).count() as u64
}

fn total(o: &Outcome) -> u64 {
    o.failed_jobs.new + o.failed_jobs.stable
}

fn pct(k: u64, n: u64) -> f64 {
    100.0 * k as f64 / n.max(1) as f64
}

/// Medians of failed jobs (both revisions) and of bad jobs on the new revision at abort.
fn medians(out: &[Outcome]) -> (u64, u64) {
    let mut failed: Vec<u64> = out.iter().filter(|o| o.harm).map(total).collect();
    let mut bad: Vec<u64> = out
        .iter()
        .filter(|o| o.harm)
        .map(|o| o.bad_jobs.new)
        .collect();
    failed.sort_unstable();
    bad.sort_unstable();
    let mid = |v: &[u64]| v.get(v.len() / 2).copied().unwrap_or(0);
    (mid(&failed), mid(&bad))
}
