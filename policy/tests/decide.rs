//! Properties of the decision function, checked over generated policies and inputs.

use proptest::prelude::*;
use rebound_policy::{
    Context, Decision, Disposition, GiveUpReason, PreparedPolicy, ResolvedPolicy, decide,
    spec::{JitterKind, Strategy},
};

fn policy(
    strategy: Strategy,
    jitter: JitterKind,
    base_ms: u64,
    multiplier: f64,
    cap_ms: u64,
) -> ResolvedPolicy {
    ResolvedPolicy {
        strategy,
        base_ms,
        multiplier: if strategy == Strategy::Exponential {
            multiplier
        } else {
            1.0
        },
        cap_ms: cap_ms.max(base_ms),
        jitter: if strategy == Strategy::Decorrelated {
            JitterKind::None
        } else {
            jitter
        },
        jitter_ratio: if jitter == JitterKind::Proportional {
            0.25
        } else {
            0.0
        },
        schedule_ms: if strategy == Strategy::Schedule {
            vec![base_ms, base_ms * 3, base_ms * 7]
        } else {
            vec![]
        },
        max_attempts: 10_000,
        max_retry_duration_ms: None,
        non_retryable_errors: vec![],
        terminal: Disposition::Drop,
        retry_budget: None,
    }
}

/// The delay before jitter, from the documented formulas (an oracle independent of the
/// implementation's arithmetic).
fn nominal(p: &ResolvedPolicy, k: u32) -> f64 {
    let cap = p.cap_ms as f64;
    let base = p.base_ms as f64;
    match p.strategy {
        Strategy::Exponential => (base * p.multiplier.powf(f64::from(k - 1))).min(cap),
        Strategy::Linear => (base * f64::from(k)).min(cap),
        Strategy::Constant => base.min(cap),
        Strategy::Schedule => {
            let i = ((k - 1) as usize).min(p.schedule_ms.len() - 1);
            (p.schedule_ms[i] as f64).min(cap)
        }
        Strategy::Decorrelated => cap,
    }
}

fn retry_delay(d: Decision) -> u64 {
    match d {
        Decision::Retry { delay_ms } => delay_ms,
        other => panic!("expected a retry, got {other:?}"),
    }
}

fn strategies() -> impl proptest::strategy::Strategy<Value = Strategy> {
    prop_oneof![
        Just(Strategy::Exponential),
        Just(Strategy::Linear),
        Just(Strategy::Constant),
        Just(Strategy::Decorrelated),
        Just(Strategy::Schedule),
    ]
}

fn jitters() -> impl proptest::strategy::Strategy<Value = JitterKind> {
    prop_oneof![
        Just(JitterKind::None),
        Just(JitterKind::Full),
        Just(JitterKind::Equal),
        Just(JitterKind::Proportional),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn delay_stays_inside_its_jitter_bounds_and_the_cap(
        strategy in strategies(),
        jitter in jitters(),
        base_ms in 1u64..60_000,
        multiplier in 1.0f64..10.0,
        cap_ms in 1u64..86_400_000,
        k in 1u32..9_999,
        job in proptest::option::of("[a-z0-9-]{1,20}"),
    ) {
        let params = policy(strategy, jitter, base_ms, multiplier, cap_ms);
        let p = PreparedPolicy::new("ns/p", params.clone());
        let ctx = Context { job_id: job.as_deref(), ..Context::default() };
        let delay = retry_delay(decide(&p, k, &ctx)) as f64;
        let cap = params.cap_ms as f64;
        let d = nominal(&params, k);
        prop_assert!(delay <= cap, "delay {delay} above cap {cap}");
        let (low, high) = match (strategy, params.jitter) {
            (Strategy::Decorrelated, _) => (params.base_ms as f64, cap),
            (_, JitterKind::None) => (d, d),
            (_, JitterKind::Full) => (0.0, d),
            (_, JitterKind::Equal) => (d / 2.0, d),
            (_, JitterKind::Proportional) => (d * 0.75, (d * 1.25).min(cap)),
        };
        // Delays are whole milliseconds, truncated.
        prop_assert!(delay >= low.floor() - 1.0 && delay <= high, "{strategy:?}/{jitter:?} k={k}: {delay} outside [{low}, {high}]");
    }

    #[test]
    fn gives_up_exactly_after_max_attempts(max in 1u32..=10_000, attempt in 1u32..=10_050) {
        let mut params = policy(Strategy::Exponential, JitterKind::Full, 100, 2.0, 60_000);
        params.max_attempts = max;
        let p = PreparedPolicy::new("ns/p", params);
        let decision = decide(&p, attempt, &Context::default());
        if attempt < max {
            let is_retry = matches!(decision, Decision::Retry { .. });
            prop_assert!(is_retry, "attempt {} of {}: {:?}", attempt, max, decision);
        } else {
            prop_assert_eq!(decision, Decision::GiveUp {
                disposition: Disposition::Drop,
                reason: GiveUpReason::MaxAttempts { max_attempts: max, attempt: attempt.max(1) },
            });
        }
    }

    #[test]
    fn same_job_same_answer(strategy in strategies(), jitter in jitters(), k in 1u32..200, job in "[a-z0-9]{1,30}") {
        let p = PreparedPolicy::new("ns/p", policy(strategy, jitter, 250, 2.0, 600_000));
        let ctx = Context { job_id: Some(&job), ..Context::default() };
        prop_assert_eq!(decide(&p, k, &ctx), decide(&p, k, &ctx));
    }

    #[test]
    fn never_panics_for_any_attempt(strategy in strategies(), jitter in jitters(), attempt in any::<u32>(), max in 1u32..=10_000) {
        let mut params = policy(strategy, jitter, 1, 100.0, 31_536_000_000);
        params.max_attempts = max;
        params.max_retry_duration_ms = Some(31_536_000_000);
        let p = PreparedPolicy::new("ns/p", params);
        let ctx = Context { job_id: Some("j"), first_failure_ms: Some(u64::MAX), now_ms: Some(0), retry_after_ms: Some(u64::MAX), ..Context::default() };
        let _ = decide(&p, attempt, &ctx);
    }
}

#[test]
fn huge_attempt_numbers_saturate_at_the_cap() {
    let mut params = policy(
        Strategy::Exponential,
        JitterKind::None,
        1_000,
        100.0,
        3_600_000,
    );
    params.max_attempts = 10_000;
    let p = PreparedPolicy::new("ns/p", params);
    assert_eq!(
        retry_delay(decide(&p, 9_999, &Context::default())),
        3_600_000
    );
    assert!(matches!(
        decide(&p, u32::MAX, &Context::default()),
        Decision::GiveUp { .. }
    ));
    assert_eq!(
        retry_delay(decide(&p, 0, &Context::default())),
        1_000,
        "attempt 0 reads as 1"
    );
}

#[test]
fn exponential_follows_base_times_multiplier_power() {
    let p = PreparedPolicy::new(
        "ns/p",
        policy(Strategy::Exponential, JitterKind::None, 500, 3.0, 120_000),
    );
    let delays: Vec<u64> = (1..=7)
        .map(|k| retry_delay(decide(&p, k, &Context::default())))
        .collect();
    assert_eq!(
        delays,
        [500, 1_500, 4_500, 13_500, 40_500, 120_000, 120_000]
    );
}

#[test]
fn different_job_ids_spread_out() {
    let p = PreparedPolicy::new(
        "ns/p",
        policy(Strategy::Exponential, JitterKind::Full, 1_000, 2.0, 600_000),
    );
    let mut delays: Vec<u64> = (0..1_000)
        .map(|i| {
            let id = format!("job-{i}");
            retry_delay(decide(
                &p,
                8,
                &Context {
                    job_id: Some(&id),
                    ..Context::default()
                },
            ))
        })
        .collect();
    delays.sort_unstable();
    delays.dedup();
    // 1,000 draws from 128,000 equally likely values: collisions are rare.
    assert!(delays.len() > 990, "only {} distinct delays", delays.len());
}

#[test]
fn policy_identity_changes_the_draw() {
    let params = policy(Strategy::Exponential, JitterKind::Full, 1_000, 2.0, 600_000);
    let ctx = Context {
        job_id: Some("job-1"),
        ..Context::default()
    };
    let (pa, pb) = (
        PreparedPolicy::new("ns/a", params.clone()),
        PreparedPolicy::new("ns/b", params),
    );
    assert_ne!(decide(&pa, 5, &ctx), decide(&pb, 5, &ctx));
    // The identity is also the policy's name to its callers (the sidecar keys each policy's
    // budget by it): two policies never answer to one name.
    assert_eq!([pa.identity(), pb.identity()], ["ns/a", "ns/b"]);
}

#[test]
fn decorrelated_replays_the_same_path_for_a_job() {
    let p = PreparedPolicy::new(
        "ns/p",
        policy(Strategy::Decorrelated, JitterKind::None, 100, 1.0, 60_000),
    );
    let ctx = Context {
        job_id: Some("job-42"),
        ..Context::default()
    };
    let path: Vec<u64> = (1..=30).map(|k| retry_delay(decide(&p, k, &ctx))).collect();
    // Each step is drawn from [base, 3 × previous], capped.
    let mut previous = 100u64;
    for (i, &d) in path.iter().enumerate() {
        assert!(
            d >= 100 && d <= (3 * previous).min(60_000),
            "retry {}: {d} after {previous}",
            i + 1
        );
        previous = d;
    }
    assert_eq!(
        path,
        (1..=30)
            .map(|k| retry_delay(decide(&p, k, &ctx)))
            .collect::<Vec<_>>()
    );
}

#[test]
fn non_retryable_error_gives_up_first() {
    let mut params = policy(Strategy::Exponential, JitterKind::Full, 100, 2.0, 1_000);
    params.non_retryable_errors = vec!["CardDeclined".into(), "stripe.*".into()];
    params.terminal = Disposition::DeadLetter {
        dead_letter_queue: "review".into(),
    };
    let p = PreparedPolicy::new("ns/p", params);
    for class in ["CardDeclined", "stripe.InvalidRequest"] {
        let d = decide(
            &p,
            1,
            &Context {
                error_class: Some(class),
                ..Context::default()
            },
        );
        match d {
            Decision::GiveUp {
                disposition,
                reason,
            } => {
                assert_eq!(
                    disposition,
                    Disposition::DeadLetter {
                        dead_letter_queue: "review".into()
                    }
                );
                assert_eq!(reason.code(), "NonRetryable");
                assert!(reason.to_string().contains(class));
            }
            other => panic!("{class}: {other:?}"),
        }
    }
    let d = decide(
        &p,
        1,
        &Context {
            error_class: Some("Timeout"),
            ..Context::default()
        },
    );
    assert!(matches!(d, Decision::Retry { .. }));
}

#[test]
fn deadline_gives_up_when_the_next_run_would_start_too_late() {
    let mut params = policy(Strategy::Constant, JitterKind::None, 60_000, 1.0, 60_000);
    params.max_retry_duration_ms = Some(300_000);
    let p = PreparedPolicy::new("ns/p", params);
    let at = |elapsed: u64| Context {
        first_failure_ms: Some(1_000_000),
        now_ms: Some(1_000_000 + elapsed),
        ..Context::default()
    };
    assert_eq!(
        retry_delay(decide(&p, 3, &at(240_000))),
        60_000,
        "starts exactly at the limit"
    );
    match decide(&p, 3, &at(240_001)) {
        Decision::GiveUp {
            reason:
                GiveUpReason::Deadline {
                    next_start_after_ms,
                    ..
                },
            ..
        } => {
            assert_eq!(next_start_after_ms, 300_001)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn retry_after_is_a_floor_honoured_above_the_cap() {
    let p = PreparedPolicy::new(
        "ns/p",
        policy(Strategy::Constant, JitterKind::None, 1_000, 1.0, 30_000),
    );
    let with = |ms| Context {
        retry_after_ms: Some(ms),
        ..Context::default()
    };
    assert_eq!(retry_delay(decide(&p, 1, &with(5_000))), 5_000);
    assert_eq!(retry_delay(decide(&p, 1, &with(500))), 1_000);
    // A 429 with Retry-After: 120s under cap 30s waits the 120 s the server asked for.
    assert_eq!(retry_delay(decide(&p, 1, &with(120_000))), 120_000);
    // Up to one day (or the cap, if longer).
    assert_eq!(
        retry_delay(decide(&p, 1, &with(7 * 86_400_000))),
        86_400_000
    );
    assert_eq!(retry_delay(decide(&p, 1, &with(u64::MAX))), 86_400_000);
}

#[test]
fn retry_after_past_the_deadline_gives_up() {
    let mut params = policy(Strategy::Constant, JitterKind::None, 1_000, 1.0, 30_000);
    params.max_retry_duration_ms = Some(600_000);
    let p = PreparedPolicy::new("ns/p", params);
    let ctx = |retry_after_ms| Context {
        first_failure_ms: Some(1_000_000),
        now_ms: Some(1_000_000 + 300_000),
        retry_after_ms: Some(retry_after_ms),
        ..Context::default()
    };
    assert_eq!(retry_delay(decide(&p, 2, &ctx(300_000))), 300_000);
    assert!(matches!(
        decide(&p, 2, &ctx(300_001)),
        Decision::GiveUp {
            reason: GiveUpReason::Deadline { .. },
            ..
        }
    ));
}

/// With 2 minutes left and a nominal 10-minute delay under full jitter, every job
/// retries within the 2 minutes; none gives up because of its draw.
#[test]
fn a_jittered_delay_is_drawn_within_the_time_left() {
    for jitter in [
        JitterKind::Full,
        JitterKind::Equal,
        JitterKind::Proportional,
    ] {
        let mut params = policy(Strategy::Exponential, jitter, 600_000, 2.0, 600_000);
        params.max_retry_duration_ms = Some(1_800_000);
        let p = PreparedPolicy::new("ns/p", params);
        let mut delays = Vec::new();
        for i in 0..1_000 {
            let id = format!("job-{i}");
            let ctx = Context {
                job_id: Some(&id),
                first_failure_ms: Some(1_000_000),
                now_ms: Some(1_000_000 + 1_680_000),
                ..Context::default()
            };
            match decide(&p, 3, &ctx) {
                Decision::Retry { delay_ms } => delays.push(delay_ms),
                other => panic!("{jitter:?} {id}: {other:?}"),
            }
        }
        assert!(delays.iter().all(|&d| d <= 120_000), "{jitter:?}");
        delays.sort_unstable();
        delays.dedup();
        assert!(
            // Proportional clips its upper half at the window.
            delays.len() > 300,
            "{jitter:?}: still random within the window"
        );
    }
    // Decorrelated too.
    let mut params = policy(
        Strategy::Decorrelated,
        JitterKind::None,
        60_000,
        1.0,
        600_000,
    );
    params.max_retry_duration_ms = Some(1_800_000);
    let p = PreparedPolicy::new("ns/p", params);
    for i in 0..200 {
        let id = format!("job-{i}");
        let ctx = Context {
            job_id: Some(&id),
            first_failure_ms: Some(0),
            now_ms: Some(1_680_000),
            ..Context::default()
        };
        assert!(retry_delay(decide(&p, 5, &ctx)) <= 120_000);
    }
}

#[test]
fn walking_a_schedule_gives_the_same_answers_as_fresh_decisions() {
    use rebound_policy::decide::{Draws, Replay, decide_with};
    for strategy in [Strategy::Decorrelated, Strategy::Exponential] {
        let p = PreparedPolicy::new("ns/p", policy(strategy, JitterKind::Full, 100, 2.0, 60_000));
        let ctx = Context::default();
        let draws = Draws::from_seed(7);
        let mut walking = Replay::default();
        for k in 1..=70 {
            let walked = decide_with(&p, k, &ctx, &draws, &mut walking);
            let fresh = decide_with(&p, k, &ctx, &draws, &mut Replay::default());
            assert_eq!(walked, fresh, "{strategy:?} retry {k}");
        }
        // And backwards, as a hook asked about an older attempt again would.
        for k in (1..=70).rev() {
            let walked = decide_with(&p, k, &ctx, &draws, &mut walking);
            let fresh = decide_with(&p, k, &ctx, &draws, &mut Replay::default());
            assert_eq!(walked, fresh, "{strategy:?} retry {k} (backwards)");
        }
    }
}

/// The give-up message names the attempt that really failed.
#[test]
fn max_attempts_reason_names_the_failed_attempt() {
    let mut params = policy(Strategy::Constant, JitterKind::None, 100, 1.0, 100);
    params.max_attempts = 25;
    let p = PreparedPolicy::new("ns/p", params);
    match decide(&p, 30, &Context::default()) {
        Decision::GiveUp {
            reason:
                GiveUpReason::MaxAttempts {
                    max_attempts,
                    attempt,
                },
            ..
        } => assert_eq!((max_attempts, attempt), (25, 30)),
        other => panic!("{other:?}"),
    }
    match decide(&p, 25, &Context::default()) {
        Decision::GiveUp {
            reason:
                GiveUpReason::MaxAttempts {
                    max_attempts,
                    attempt,
                },
            ..
        } => assert_eq!((max_attempts, attempt), (25, 25)),
        other => panic!("{other:?}"),
    }
}
