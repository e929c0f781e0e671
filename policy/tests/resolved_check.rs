//! `ResolvedPolicy::check`, the guard on a compiled document read from outside the process
//! (the sidecar reads what any writer of the ConfigMap put there): at each invariant's
//! edge a policy is accepted, one step past it refused, naming the field. Also the
//! bounds `resolve` itself keeps on a spec's work.

use rebound_policy::{
    Disposition, ResolvedPolicy, RetryBudget,
    limits::{MAX_ERROR_CLASSES, MAX_SCHEDULE},
    spec::{JitterKind, Strategy},
};

fn valid() -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: Strategy::Exponential,
        base_ms: 1_000,
        multiplier: 2.0,
        cap_ms: 60_000,
        jitter: JitterKind::Full,
        jitter_ratio: 0.0,
        schedule_ms: Vec::new(),
        max_attempts: 5,
        max_retry_duration_ms: None,
        non_retryable_errors: Vec::new(),
        terminal: Disposition::Drop,
        retry_budget: None,
    }
}

/// The field `check` names, or `None` when it accepts.
fn refused(p: &ResolvedPolicy) -> Option<String> {
    p.check().err().map(|e| e.field)
}

fn proportional(ratio: f64) -> ResolvedPolicy {
    ResolvedPolicy {
        jitter: JitterKind::Proportional,
        jitter_ratio: ratio,
        ..valid()
    }
}

fn schedule(delays: Vec<u64>) -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: Strategy::Schedule,
        multiplier: 1.0,
        schedule_ms: delays,
        ..valid()
    }
}

#[test]
fn the_jitter_ratio_is_in_zero_exclusive_to_one() {
    assert_eq!(refused(&proportional(1.0)), None);
    assert_eq!(refused(&proportional(f64::MIN_POSITIVE)), None);
    for bad in [0.0, -0.5, 1.0 + f64::EPSILON, f64::NAN, f64::INFINITY] {
        assert_eq!(
            refused(&proportional(bad)).as_deref(),
            Some("jitterRatio"),
            "{bad}"
        );
    }
    // The ratio means nothing without proportional jitter.
    let full = ResolvedPolicy {
        jitter_ratio: 7.0,
        ..valid()
    };
    assert_eq!(refused(&full), None);
}

#[test]
fn a_schedule_lists_one_to_the_limit_of_delays_within_the_cap() {
    let cap = valid().cap_ms;
    assert_eq!(refused(&schedule(vec![1])), None);
    assert_eq!(refused(&schedule(vec![cap])), None);
    assert_eq!(refused(&schedule(vec![cap; MAX_SCHEDULE])), None);
    for bad in [
        Vec::new(),
        vec![cap; MAX_SCHEDULE + 1],
        vec![cap + 1],
        vec![1, 0],
    ] {
        let len = bad.len();
        assert_eq!(
            refused(&schedule(bad)).as_deref(),
            Some("scheduleMs"),
            "{len} delays"
        );
    }
    // A schedule means nothing to another strategy.
    let ignored = ResolvedPolicy {
        schedule_ms: vec![cap + 1],
        ..valid()
    };
    assert_eq!(refused(&ignored), None);
}

#[test]
fn dispositions_and_caps_read_as_the_docs_write_them() {
    assert_eq!(Disposition::Drop.to_string(), "drop");
    let dead_letter = Disposition::DeadLetter {
        dead_letter_queue: "payments.dlq".to_owned(),
    };
    assert_eq!(dead_letter.to_string(), "deadLetter:payments.dlq");
    assert_eq!(valid().cap(), "1m");
}

#[test]
fn non_retryable_errors_hold_up_to_the_limit_of_valid_patterns() {
    let with = |patterns: Vec<String>| ResolvedPolicy {
        non_retryable_errors: patterns,
        ..valid()
    };
    let classes = |n: usize| (0..n).map(|i| format!("Error{i}")).collect::<Vec<_>>();
    assert_eq!(refused(&with(classes(MAX_ERROR_CLASSES))), None);
    assert_eq!(
        refused(&with(classes(MAX_ERROR_CLASSES + 1))).as_deref(),
        Some("nonRetryableErrors")
    );
    assert_eq!(
        refused(&with(vec![String::new()])).as_deref(),
        Some("nonRetryableErrors")
    );
}

#[test]
fn a_budget_reads_as_rate_burst_and_slot() {
    let budget = |rate_per_second, burst| RetryBudget {
        rate_per_second,
        burst,
    };
    assert_eq!(budget(10, 1).slot_ms(), 100.0);
    assert_eq!(budget(1000, 5).slot_ms(), 5.0);
    assert!((budget(3, 1).slot_ms() - 1000.0 / 3.0).abs() < 1e-9);
    assert_eq!(budget(10, 1).to_string(), "10/s, burst 1 (100ms slots)");
    assert_eq!(budget(3, 1).to_string(), "3/s, burst 1 (333.33ms slots)");
    assert_eq!(budget(1, 120).to_string(), "1/s, burst 120 (2m slots)");
}

/// The errors `resolve` reports for a spec of `schedule` delays, by field.
fn schedule_errors(delays: &[&str]) -> Vec<String> {
    let spec: rebound_policy::RetryPolicySpec = serde_json::from_value(serde_json::json!({
        "queues": ["q"],
        "backoff": {"strategy": "schedule", "schedule": delays, "cap": "1h"},
    }))
    .expect("a spec");
    match rebound_policy::resolve(&spec) {
        Ok(_) => Vec::new(),
        Err(errors) => errors.into_iter().map(|e| e.field).collect(),
    }
}

#[test]
fn an_oversized_schedule_is_one_error_without_per_entry_work() {
    assert_eq!(
        schedule_errors(&vec!["1s"; MAX_SCHEDULE]),
        Vec::<String>::new()
    );
    assert_eq!(
        schedule_errors(&vec!["not a duration"; MAX_SCHEDULE + 1]),
        ["spec.backoff.schedule"]
    );
    // Within the limit, each bad entry is named.
    assert_eq!(
        schedule_errors(&["1s", "soon"]),
        ["spec.backoff.schedule[1]"]
    );
}
