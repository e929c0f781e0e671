use super::{
    power::{Outcome, Scenario, rate_lower_bound, rate_upper_bound, run},
    *,
};
use crate::{decide::SplitMix64, resolve::ResolvedAnalysis};

fn step(weight: u32, failed: (u64, u64), bad: (u64, u64)) -> StepCounts {
    StepCounts {
        weight,
        failed_new: failed.0,
        failed_all: failed.1,
        bad_new: bad.0,
        bad_all: bad.1,
    }
}

fn finite(e: &Evidence) -> bool {
    [e.e_value, e.log_e_value, e.threshold]
        .into_iter()
        .chain(e.bad_ratio_new)
        .chain(e.bad_ratio_stable)
        .all(f64::is_finite)
}

#[test]
fn no_evidence_is_no_verdict() {
    let config = ResolvedAnalysis::default();
    for steps in [&[][..], &[step(10, (0, 0), (0, 0))]] {
        let verdict = analyse(steps, &config);
        let Verdict::Continue {
            evidence,
            step_ready,
        } = verdict
        else {
            panic!("{verdict:?}");
        };
        assert_eq!((evidence.e_value, step_ready), (1.0, false));
        assert_eq!(
            (evidence.bad_ratio_new, evidence.bad_ratio_stable),
            (None, None)
        );
        assert_eq!(evidence.threshold, 20.0);
    }
}

#[test]
fn a_step_is_ready_at_its_minimum_sample_only() {
    let config = ResolvedAnalysis {
        min_failed_jobs: 200,
        ..ResolvedAnalysis::default()
    };
    let ready = |n: u64| match analyse(&[step(50, (n / 2, n), (n / 20, n / 10))], &config) {
        Verdict::Continue { step_ready, .. } => step_ready,
        other => panic!("{other:?}"),
    };
    assert!(!ready(198));
    assert!(ready(200));
    // Evidence of earlier steps does not count towards the current one's sample.
    let verdict = analyse(
        &[step(10, (100, 1000), (5, 50)), step(50, (10, 20), (0, 1))],
        &config,
    );
    assert!(
        matches!(verdict, Verdict::Continue { step_ready: false, evidence } if evidence.step_failed_jobs == 20),
        "{verdict:?}"
    );
}

#[test]
fn ratios_and_totals_are_per_revision_over_all_steps() {
    let verdict = analyse(
        &[
            step(10, (100, 1000), (5, 50)),
            step(50, (500, 1000), (30, 60)),
        ],
        &ResolvedAnalysis::default(),
    );
    let e = verdict.evidence();
    assert_eq!(
        e.failed_jobs,
        Arms {
            new: 600,
            stable: 1400
        }
    );
    assert_eq!(
        e.bad_jobs,
        Arms {
            new: 35,
            stable: 75
        }
    );
    assert_eq!(e.bad_ratio_new, Some(35.0 / 600.0));
    assert_eq!(e.bad_ratio_stable, Some(75.0 / 1400.0));
}

#[test]
fn extreme_and_inconsistent_counts_stay_finite() {
    let config = ResolvedAnalysis::default();
    let max = u64::MAX;
    for steps in [
        vec![step(10, (max / 10, max), (max, max))],
        vec![step(99, (max, max), (0, max))],
        vec![step(1, (0, max), (0, max)); 10],
        vec![
            step(50, (max, 0), (max, 0)),
            step(60, (max, max), (max, max)),
        ],
        vec![step(0, (5, 10), (5, 5)), step(100, (10, 10), (9, 9))],
    ] {
        let verdict = analyse(&steps, &config);
        assert!(finite(verdict.evidence()), "{steps:?}: {verdict:?}");
    }
    // Weights outside 1..=99 carry no evidence about the ratio.
    let skipped = analyse(&[step(100, (10, 10), (10, 10))], &config);
    assert_eq!(skipped.evidence().e_value, 1.0);
    // A configuration from outside validation does not poison the arithmetic.
    let nan = ResolvedAnalysis {
        alpha: f64::NAN,
        max_relative_increase: f64::INFINITY,
        min_failed_jobs: 0,
        ..config
    };
    let verdict = analyse(&[step(10, (10, 100), (10, 12))], &nan);
    assert!(finite(verdict.evidence()), "{verdict:?}");
    assert!(matches!(verdict, Verdict::Harm { .. }), "{verdict:?}");
}

#[test]
fn a_broken_assignment_is_inconclusive_not_a_verdict() {
    let config = ResolvedAnalysis::default();
    // 10 %: 100 ± 9.5 of 1000 expected; the boundary lies at 4.2 σ (S = 40).
    let at = |new: u64| analyse(&[step(10, (new, 1000), (0, 10))], &config);
    assert!(matches!(at(100), Verdict::Continue { .. }));
    assert!(matches!(at(139), Verdict::Continue { .. }));
    assert!(matches!(at(141), Verdict::Inconclusive { .. }));
    let verdict = at(150);
    assert_eq!(
        verdict,
        Verdict::Inconclusive {
            reason: InconclusiveReason::SampleRatioMismatch {
                step: 0,
                weight: 10,
                failed_new: 150,
                failed_all: 1000
            },
            evidence: *verdict.evidence()
        }
    );
    assert!(matches!(at(0), Verdict::Inconclusive { .. }));
    // Too few jobs to tell: two canary jobs out of two at 10 % is not a mismatch.
    assert!(matches!(
        analyse(&[step(10, (2, 2), (0, 0))], &config),
        Verdict::Continue { .. }
    ));
    // Mismatch wins over harm: the comparison itself is not sound.
    let verdict = analyse(&[step(10, (500, 1000), (500, 510))], &config);
    assert!(
        matches!(verdict, Verdict::Inconclusive { .. }),
        "{verdict:?}"
    );
}

#[test]
fn the_verdict_serialises_with_its_evidence() {
    let verdict = analyse(&[step(10, (1, 10), (1, 1))], &ResolvedAnalysis::default());
    let json = serde_json::to_value(verdict).expect("json");
    assert_eq!(json["verdict"], "continue");
    assert_eq!(json["stepReady"], false);
    assert_eq!(json["evidence"]["failedJobs"]["new"], 1);
}

fn scenario(weights: &[u32], p_stable: f64, theta: f64, jobs_per_step: u64) -> Scenario {
    Scenario {
        weights: weights.to_vec(),
        jobs_per_step,
        look_every: 10,
        p_stable,
        p_new: (p_stable * theta).min(1.0),
        config: ResolvedAnalysis::default(),
    }
}

/// Counts rollouts that ended in harm over `runs` rollouts of the scenario.
fn harms(s: &Scenario, runs: u64, seed: u64) -> (u64, Vec<Outcome>) {
    let mut rng = SplitMix64::new(seed);
    let outcomes: Vec<Outcome> = (0..runs).map(|_| run(s, &mut rng)).collect();
    (outcomes.iter().filter(|o| o.harm).count() as u64, outcomes)
}

/// At exactly the tolerated ratio (θ = r), looking after every 10 failed jobs through
/// two steps of 1000, the false-abort rate is at most α = 5 %: its one-sided 99.9 %
/// Clopper-Pearson upper bound from 1500 rollouts is below α.
#[test]
fn false_aborts_at_the_tolerated_ratio_stay_below_alpha_despite_peeking() {
    let r = 1.0 + ResolvedAnalysis::default().max_relative_increase;
    let s = scenario(&[10, 50], 0.05, r, 1000);
    let (aborted, outcomes) = harms(&s, 1500, 0x5eed_0001);
    let srm = outcomes.iter().filter(|o| o.inconclusive).count();
    let upper = rate_upper_bound(aborted, 1500, 1e-3);
    eprintln!("false aborts {aborted}/1500, upper bound {upper:.4}; SRM {srm}");
    assert!(
        upper <= s.config.alpha,
        "{aborted}/1500: upper bound {upper}"
    );
    // Assignment is correct here: the sample-ratio check rarely fires.
    assert!(
        rate_upper_bound(srm as u64, 1500, 1e-3) <= 0.02,
        "SRM {srm}/1500"
    );
}

/// At θ = 5r and weight 10 % with a bad-job ratio of 5 % on the stable revision, the
/// test aborts in the first step (1000 failed jobs) in at least 95 % of rollouts (lower
/// Clopper-Pearson bound at 99.9 %).
#[test]
fn a_fivefold_harm_is_caught_in_the_first_step() {
    let r = 1.0 + ResolvedAnalysis::default().max_relative_increase;
    let s = scenario(&[10], 0.05, 5.0 * r, 1000);
    let (aborted, outcomes) = harms(&s, 400, 0x5eed_0002);
    let lower = rate_lower_bound(aborted, 400, 1e-3);
    let mut bad_new: Vec<u64> = outcomes
        .iter()
        .filter(|o| o.harm)
        .map(|o| o.bad_jobs.new)
        .collect();
    bad_new.sort_unstable();
    eprintln!(
        "aborted {aborted}/400, lower bound {lower:.3}, median new bad jobs at abort {}",
        bad_new.get(bad_new.len() / 2).copied().unwrap_or(0)
    );
    assert!(lower >= 0.95, "{aborted}/400: lower bound {lower}");
}

/// Test scenario 2: weight 10 %, the stable revision dead-letters 2 % of failed jobs, the
/// new one every job. Every rollout aborts after a handful of bad jobs, before the
/// minimum sample of 200, so fewer jobs than the step's weight of the sample (20) saw
/// the new revision.
#[test]
fn a_change_that_dead_letters_every_job_aborts_within_a_few_bad_jobs() {
    let s = scenario(&[10, 50], 0.02, 50.0, 200);
    let (aborted, outcomes) = harms(&s, 400, 0x5eed_0003);
    assert_eq!(aborted, 400);
    let worst = outcomes
        .iter()
        .map(|o| o.failed_jobs.new)
        .max()
        .unwrap_or(0);
    assert!(
        outcomes
            .iter()
            .all(|o| o.step == 0 && o.failed_jobs.new + o.failed_jobs.stable < 200)
    );
    eprintln!("jobs on the new revision at abort: at most {worst}");
    assert!(worst <= 8, "{worst} jobs saw the bad revision");
}

#[test]
fn clopper_pearson_bounds_bracket_the_rate() {
    // 0 of 100: the 95 % upper bound is 1 − 0.05^(1/100) ≈ 0.0295 (the rule of three).
    assert!((rate_upper_bound(0, 100, 0.05) - (1.0 - 0.05f64.powf(0.01))).abs() < 1e-9);
    assert!((rate_lower_bound(100, 100, 0.05) - 0.05f64.powf(0.01)).abs() < 1e-9);
    let (lo, hi) = (
        rate_lower_bound(50, 1000, 1e-3),
        rate_upper_bound(50, 1000, 1e-3),
    );
    assert!(lo < 0.05 && 0.05 < hi && hi - lo < 0.05, "{lo} {hi}");
}

#[test]
fn the_evidence_reads_as_one_line() {
    let verdict = analyse(
        &[step(10, (300, 3000), (12, 66))],
        &ResolvedAnalysis::default(),
    );
    let line = verdict.evidence().to_string();
    let e = verdict.evidence().e_value;
    assert_eq!(
        line,
        format!(
            "bad jobs: new 4.0 % (12/300), stable 2.0 % (54/2700); e-value {e:.2} of 20; step sample 3000 of 200"
        )
    );
    let empty = analyse(&[], &ResolvedAnalysis::default());
    assert_eq!(
        empty.evidence().to_string(),
        "bad jobs: new no failed jobs, stable no failed jobs; e-value 1.00 of 20; step sample 0 of 200"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    /// No counts, weights or configuration make the numbers non-finite or panic.
    #[test]
    fn any_counts_give_finite_numbers(
        counts in proptest::collection::vec(
            (0u32..=120, proptest::num::u64::ANY, proptest::num::u64::ANY,
             proptest::num::u64::ANY, proptest::num::u64::ANY),
            0..12,
        ),
        x in proptest::num::f64::ANY,
        alpha in proptest::num::f64::ANY,
        min in proptest::num::u64::ANY,
    ) {
        let steps: Vec<StepCounts> = counts
            .into_iter()
            .map(|(weight, failed_new, failed_all, bad_new, bad_all)| StepCounts {
                weight, failed_new, failed_all, bad_new, bad_all,
            })
            .collect();
        let config = ResolvedAnalysis {
            max_relative_increase: x,
            alpha,
            min_failed_jobs: min,
            ..ResolvedAnalysis::default()
        };
        let verdict = analyse(&steps, &config);
        proptest::prop_assert!(finite(verdict.evidence()), "{:?}", verdict);
        proptest::prop_assert!(verdict.evidence().e_value >= 0.0);
    }
}
