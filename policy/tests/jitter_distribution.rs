//! Statistical checks of the jitter distributions at fixed seeds (job ids), using the
//! one-sample Kolmogorov–Smirnov test against the documented uniform laws.

use rebound_policy::{
    Context, Decision, Disposition, PreparedPolicy, ResolvedPolicy, decide,
    spec::{JitterKind, Strategy},
};

const SAMPLES: usize = 20_000;
/// Critical value of the KS statistic at α = 0.001: 1.95 / √n.
fn ks_critical(n: usize) -> f64 {
    1.95 / (n as f64).sqrt()
}

fn policy(jitter: JitterKind, ratio: f64) -> PreparedPolicy {
    PreparedPolicy::new(
        "payments/charge",
        ResolvedPolicy {
            strategy: Strategy::Exponential,
            base_ms: 1_000,
            multiplier: 2.0,
            cap_ms: 3_600_000,
            jitter,
            jitter_ratio: ratio,
            schedule_ms: vec![],
            max_attempts: 100,
            max_retry_duration_ms: None,
            non_retryable_errors: vec![],
            terminal: Disposition::Drop,
            retry_budget: None,
        },
    )
}

fn draws(p: &PreparedPolicy, attempt: u32) -> Vec<f64> {
    (0..SAMPLES)
        .map(|i| {
            let id = format!("order-{i}");
            match decide(
                p,
                attempt,
                &Context {
                    job_id: Some(&id),
                    ..Context::default()
                },
            ) {
                Decision::Retry { delay_ms } => delay_ms as f64,
                other => panic!("{other:?}"),
            }
        })
        .collect()
}

/// KS distance between the sample and the uniform law on [low, high].
fn ks_uniform(mut sample: Vec<f64>, low: f64, high: f64) -> f64 {
    sample.sort_by(f64::total_cmp);
    let n = sample.len() as f64;
    sample
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let cdf = ((x - low) / (high - low)).clamp(0.0, 1.0);
            (cdf - i as f64 / n)
                .abs()
                .max(((i + 1) as f64 / n - cdf).abs())
        })
        .fold(0.0, f64::max)
}

#[test]
fn full_jitter_is_uniform_between_zero_and_the_capped_delay() {
    // Retry 10: 1s × 2⁹ = 512s, under the 1h cap.
    let d = ks_uniform(draws(&policy(JitterKind::Full, 0.0), 10), 0.0, 512_000.0);
    assert!(d < ks_critical(SAMPLES), "KS distance {d}");
}

#[test]
fn full_jitter_is_uniform_under_the_cap_once_capped() {
    // Retry 20: 1s × 2¹⁹ ≫ 1h, so the law is uniform on [0, 1h].
    let d = ks_uniform(draws(&policy(JitterKind::Full, 0.0), 20), 0.0, 3_600_000.0);
    assert!(d < ks_critical(SAMPLES), "KS distance {d}");
}

#[test]
fn equal_jitter_is_uniform_on_the_upper_half() {
    let d = ks_uniform(
        draws(&policy(JitterKind::Equal, 0.0), 10),
        256_000.0,
        512_000.0,
    );
    assert!(d < ks_critical(SAMPLES), "KS distance {d}");
}

#[test]
fn proportional_jitter_is_uniform_around_the_delay() {
    let d = ks_uniform(
        draws(&policy(JitterKind::Proportional, 0.2), 10),
        409_600.0,
        614_400.0,
    );
    assert!(d < ks_critical(SAMPLES), "KS distance {d}");
}

#[test]
fn the_test_detects_a_wrong_law() {
    // Equal-jitter draws are not uniform on [0, d]: the same statistic must reject them,
    // otherwise the checks above prove nothing.
    let d = ks_uniform(draws(&policy(JitterKind::Equal, 0.0), 10), 0.0, 512_000.0);
    assert!(d > ks_critical(SAMPLES), "KS distance {d} should reject");
}

#[test]
fn draws_without_job_id_are_uniform_too() {
    let p = policy(JitterKind::Full, 0.0);
    let sample: Vec<f64> = (0..SAMPLES)
        .map(|_| match decide(&p, 10, &Context::default()) {
            Decision::Retry { delay_ms } => delay_ms as f64,
            other => panic!("{other:?}"),
        })
        .collect();
    let d = ks_uniform(sample, 0.0, 512_000.0);
    // Not seeded, so use a looser bound (α ≈ 1e-6) to keep the test reliable.
    assert!(d < 2.7 / (SAMPLES as f64).sqrt(), "KS distance {d}");
}
