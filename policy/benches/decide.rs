//! Cost of one decision. Run: `cargo bench -p rebound-policy --bench decide`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use rebound_policy::{
    Context, Disposition, PreparedPolicy, ResolvedPolicy, decide,
    spec::{JitterKind, Strategy},
};

fn policy(strategy: Strategy, jitter: JitterKind) -> PreparedPolicy {
    PreparedPolicy::new(
        "shop/webhooks",
        ResolvedPolicy {
            strategy,
            base_ms: 1_000,
            multiplier: 2.0,
            cap_ms: 900_000,
            jitter,
            jitter_ratio: 0.0,
            schedule_ms: vec![],
            max_attempts: 100,
            max_retry_duration_ms: Some(86_400_000),
            non_retryable_errors: vec!["InvalidEndpoint".into()],
            terminal: Disposition::Drop,
            retry_budget: None,
        },
    )
}

fn bench(c: &mut Criterion) {
    let exponential = policy(Strategy::Exponential, JitterKind::Full);
    let decorrelated = policy(Strategy::Decorrelated, JitterKind::None);
    let with_job = Context {
        job_id: Some("bull:webhooks:1849223"),
        error_class: Some("Timeout"),
        first_failure_ms: Some(1_764_000_000_000),
        now_ms: Some(1_764_000_060_000),
        retry_after_ms: None,
    };
    let without_job = Context {
        job_id: None,
        ..with_job
    };

    c.bench_function("exponential_full_jitter/job_id", |b| {
        b.iter(|| decide(black_box(&exponential), black_box(7), black_box(&with_job)))
    });
    c.bench_function("exponential_full_jitter/no_job_id", |b| {
        b.iter(|| {
            decide(
                black_box(&exponential),
                black_box(7),
                black_box(&without_job),
            )
        })
    });
    c.bench_function("decorrelated/attempt_50/job_id", |b| {
        b.iter(|| {
            decide(
                black_box(&decorrelated),
                black_box(50),
                black_box(&with_job),
            )
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
