//! The schedule summary shown by `kubectl get retrypolicies`, computed by simulating the
//! policy with the policy crate. A fixed seed keeps it identical from one reconcile to the
//! next, so an unchanged policy never gets a status write.
//!
//! The simulation draws from the fixed seed, never from the policy's identity, so a
//! summary is a function of the resolved parameters alone: [`Summaries`] computes it once
//! per distinct parameters and shares it between every policy that has them (policies
//! generated from one template, one per tenant or queue, differ only in their queues).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

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

/// The summary of policies with `params`, without `servingQueues` (that depends on the
/// namespace). CPU-bound (up to [`DECISION_BUDGET`] decisions): call it off the async
/// workers.
pub fn summarize(params: &ResolvedPolicy) -> ScheduleSummary {
    // No job ids are simulated, so the identity seeds nothing.
    let policy = PreparedPolicy::new(String::new(), params.clone());
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

/// Summaries shared by every policy with the same resolved parameters, for as long as
/// one of them holds it.
#[derive(Default)]
pub struct Summaries {
    inner: Mutex<SharedSummaries>,
}

#[derive(Default)]
struct SharedSummaries {
    /// By the JSON of the parameters (exact: no two parameter sets share a key).
    by_params: HashMap<String, Weak<ScheduleSummary>>,
    /// Entries to hold before the next sweep of dropped summaries.
    sweep_at: usize,
}

/// Fewest entries before dropped summaries are swept out.
const MIN_SWEEP: usize = 64;

impl Summaries {
    /// The summary of `params`, simulated only if no policy holds one for them.
    /// CPU-bound on a miss: call it off the async workers.
    pub fn get(&self, params: &ResolvedPolicy) -> Arc<ScheduleSummary> {
        let key = serde_json::to_string(params).unwrap_or_default();
        if let Some(shared) = self.lock().by_params.get(&key).and_then(Weak::upgrade) {
            return shared;
        }
        // Simulated outside the lock; two callers racing on one key both simulate and the
        // second's copy replaces the first's (equal, as the summary is deterministic).
        let summary = Arc::new(summarize(params));
        let mut inner = self.lock();
        inner.by_params.insert(key, Arc::downgrade(&summary));
        if inner.by_params.len() >= inner.sweep_at {
            inner.by_params.retain(|_, s| s.strong_count() > 0);
            inner.sweep_at = (2 * inner.by_params.len()).max(MIN_SWEEP);
        }
        summary
    }

    /// Parameter sets with a summary some policy holds.
    pub fn len(&self) -> usize {
        self.lock()
            .by_params
            .values()
            .filter(|s| s.strong_count() > 0)
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SharedSummaries> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rebound_policy::RetryPolicySpec;

    #[test]
    fn policies_with_equal_parameters_share_one_summary() {
        let summaries = Summaries::default();
        let a = params(serde_json::json!({"queues": ["a"], "maxAttempts": 6}));
        let b = params(serde_json::json!({"queues": ["b"], "maxAttempts": 6}));
        let c = params(serde_json::json!({"queues": ["a"], "maxAttempts": 7}));
        let (sa, sb, sc) = (summaries.get(&a), summaries.get(&b), summaries.get(&c));
        assert!(Arc::ptr_eq(&sa, &sb), "queues are not parameters");
        assert!(!Arc::ptr_eq(&sa, &sc));
        assert_eq!(*sa, summarize(&a));
        assert_eq!(sc.max_attempts, 7);
        assert_eq!(summaries.len(), 2);
        // Once no policy holds a summary it is dropped, and computed again on demand.
        drop((sa, sb));
        assert_eq!(summaries.len(), 1);
        assert_eq!(*summaries.get(&a), summarize(&a));
    }

    /// What makes sharing sound: the simulation draws nothing from the policy's identity.
    #[test]
    fn the_simulation_does_not_depend_on_the_identity() {
        for backoff in [
            serde_json::json!({"strategy": "decorrelated", "base": "1s", "cap": "1m"}),
            serde_json::json!({"base": "1s", "cap": "1m", "jitter": {"kind": "full"}}),
        ] {
            let p =
                params(serde_json::json!({"queues": ["a"], "maxAttempts": 8, "backoff": backoff}));
            let run = |identity: &str| {
                simulate(&PreparedPolicy::new(identity, p.clone()), 200, SEED, true)
            };
            assert_eq!(run("ns/a"), run("other/b"), "{backoff}");
        }
    }

    #[test]
    fn dropped_summaries_are_swept_out() {
        let summaries = Summaries::default();
        for attempts in 1..=1_000 {
            let p = params(serde_json::json!({"queues": ["a"], "maxAttempts": attempts}));
            drop(summaries.get(&p));
        }
        let held = summaries.lock().by_params.len();
        assert!(
            held < 2 * MIN_SWEEP,
            "{held} entries kept for dropped summaries"
        );
    }

    fn params(yaml: serde_json::Value) -> ResolvedPolicy {
        let spec: RetryPolicySpec = serde_json::from_value(yaml).expect("spec");
        rebound_policy::resolve(&spec).expect("valid")
    }

    #[test]
    fn is_deterministic() {
        let p = params(serde_json::json!({"queues": ["a"], "maxAttempts": 6}));
        let a = summarize(&p);
        assert_eq!(a, summarize(&p));
        assert_eq!(a.max_attempts, 6);
        assert_eq!(a.cap, "10m");
        assert_eq!(a.terminal, "drop");
        assert_eq!(a.retry_budget, None);
    }

    #[test]
    fn names_the_retry_budget() {
        let with = |budget: serde_json::Value| {
            summarize(&params(
                serde_json::json!({"queues": ["a"], "retryBudget": budget}),
            ))
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
            let cheap = summarize(&p);
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
        let s = summarize(&p);
        assert_eq!(s.give_up_after.p50, "6.00s");
        assert_eq!(s.give_up_after.max, "6.00s");
    }
}
