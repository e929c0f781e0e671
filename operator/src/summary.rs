//! The schedule summary shown by `kubectl get retrypolicies`, computed by simulating the
//! policy with the policy crate. A fixed seed keeps it identical from one reconcile to the
//! next, so an unchanged policy never gets a status write.

use rebound_policy::duration::format_approx;
use rebound_policy::spec::{GiveUpAfter, ScheduleSummary};
use rebound_policy::{PreparedPolicy, ResolvedPolicy, simulate};

/// Simulated jobs per summary when they are cheap: enough for a stable p99.
pub const SAMPLES: u32 = 1_000;
/// Decisions one summary may cost (about 2 ms). A policy with many attempts gets fewer
/// jobs: its give-up time is a sum of that many delays, so it varies little from job to
/// job and a small sample gives the same percentiles at the precision shown.
pub const DECISION_BUDGET: u64 = 100_000;
/// Fewest jobs simulated, however many attempts.
pub const MIN_SAMPLES: u32 = 20;
/// Fixed so the summary is a pure function of the spec.
pub const SEED: u64 = 0x5EB0_0D5E_ED00_0001;

/// Jobs simulated for a policy with `max_attempts`.
pub fn samples(max_attempts: u32) -> u32 {
    let retries = u64::from(max_attempts.saturating_sub(1)).max(1);
    let fit = u32::try_from(DECISION_BUDGET / retries).unwrap_or(u32::MAX);
    fit.clamp(MIN_SAMPLES, SAMPLES)
}

/// The summary of one policy, without `servingQueues` (that depends on the namespace).
/// CPU-bound (up to [`DECISION_BUDGET`] decisions): call it off the async workers.
pub fn summarize(identity: &str, params: &ResolvedPolicy) -> ScheduleSummary {
    let policy = PreparedPolicy::new(identity, params.clone());
    let sim = simulate(&policy, samples(params.max_attempts), SEED, false);
    ScheduleSummary {
        max_attempts: params.max_attempts,
        cap: params.cap(),
        give_up_after: GiveUpAfter {
            p50: format_approx(sim.give_up_after_ms.p50),
            p99: format_approx(sim.give_up_after_ms.p99),
            max: format_approx(sim.give_up_after_ms.max),
        },
        terminal: params.terminal.to_string(),
        serving_queues: Vec::new(),
        queues: String::new(),
        retry_budget: params.retry_budget.map(|b| b.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rebound_policy::RetryPolicySpec;

    fn params(yaml: serde_json::Value) -> ResolvedPolicy {
        let spec: RetryPolicySpec = serde_json::from_value(yaml).expect("spec");
        rebound_policy::resolve(&spec).expect("valid")
    }

    #[test]
    fn is_deterministic() {
        let p = params(serde_json::json!({"queues": ["a"], "maxAttempts": 6}));
        let a = summarize("ns/a", &p);
        assert_eq!(a, summarize("ns/a", &p));
        assert_eq!(a.max_attempts, 6);
        assert_eq!(a.cap, "10m");
        assert_eq!(a.terminal, "drop");
        assert_eq!(a.retry_budget, None);
    }

    #[test]
    fn names_the_retry_budget() {
        let with = |budget: serde_json::Value| {
            summarize(
                "ns/a",
                &params(serde_json::json!({"queues": ["a"], "retryBudget": budget})),
            )
            .retry_budget
        };
        assert_eq!(
            with(serde_json::json!({"ratePerSecond": 10})).as_deref(),
            Some("10/s, burst 1 (100ms slots)")
        );
        assert_eq!(
            with(serde_json::json!({"ratePerSecond": 3, "burst": 2})).as_deref(),
            Some("3/s, burst 2 (666.67ms slots)")
        );
    }

    #[test]
    fn sample_count_follows_the_budget() {
        assert_eq!(samples(1), SAMPLES);
        assert_eq!(samples(101), SAMPLES);
        assert_eq!(samples(1_001), 100);
        assert_eq!(samples(10_000), MIN_SAMPLES);
    }

    /// Milliseconds of a `format_approx` text such as `2h37m`, `6.00s`, `1d2h`.
    fn millis(text: &str) -> f64 {
        let mut total = 0.0;
        let mut number = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c.is_ascii_digit() || c == '.' {
                number.push(c);
                continue;
            }
            let unit = if c == 'm' && chars.peek() == Some(&'s') {
                chars.next();
                1.0
            } else {
                match c {
                    's' => 1e3,
                    'm' => 6e4,
                    'h' => 3.6e6,
                    'd' => 8.64e7,
                    other => panic!("unit {other} in {text}"),
                }
            };
            total += number.parse::<f64>().expect("number") * unit;
            number.clear();
        }
        total
    }

    /// The cheap summary shows what a large simulation shows: each percentile within 2 %
    /// of the one from 1,000 jobs (the policy crate's full sample), for policies with many
    /// attempts, every strategy.
    #[test]
    fn fewer_jobs_for_many_attempts_give_the_same_percentiles() {
        for spec in [
            serde_json::json!({"queues": ["a"], "maxAttempts": 10000,
                "backoff": {"base": "1s", "cap": "5m"}}),
            serde_json::json!({"queues": ["a"], "maxAttempts": 3000,
                "backoff": {"strategy": "linear", "base": "1s", "cap": "10m",
                            "jitter": {"kind": "equal"}}}),
            serde_json::json!({"queues": ["a"], "maxAttempts": 2000,
                "backoff": {"strategy": "constant", "base": "30s",
                            "jitter": {"kind": "proportional", "ratio": 0.5}}}),
        ] {
            let p = params(spec.clone());
            let cheap = summarize("ns/a", &p);
            let full = simulate(
                &PreparedPolicy::new("ns/a", p.clone()),
                SAMPLES,
                SEED,
                false,
            );
            let check = |shown: &str, reference: u64| {
                let ratio = millis(shown) / reference as f64;
                assert!(
                    (0.98..=1.02).contains(&ratio),
                    "{spec}: {shown} vs {reference} ms"
                );
            };
            check(&cheap.give_up_after.p50, full.give_up_after_ms.p50);
            check(&cheap.give_up_after.p99, full.give_up_after_ms.p99);
            check(&cheap.give_up_after.max, full.give_up_after_ms.max);
        }
    }

    #[test]
    fn constant_schedule_without_jitter_is_exact() {
        let p = params(serde_json::json!({
            "queues": ["a"], "maxAttempts": 4,
            "backoff": {"strategy": "constant", "base": "2s", "jitter": {"kind": "none"}}
        }));
        let s = summarize("ns/a", &p);
        assert_eq!(s.give_up_after.p50, "6.00s");
        assert_eq!(s.give_up_after.max, "6.00s");
    }
}
