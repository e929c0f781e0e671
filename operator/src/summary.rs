//! The schedule summary shown by `kubectl get retrypolicies`, computed by simulating the
//! policy with the policy crate. A fixed seed keeps it identical from one reconcile to the
//! next, so an unchanged policy never gets a status write.

use rebound_policy::duration::format_approx;
use rebound_policy::spec::{GiveUpAfter, ScheduleSummary};
use rebound_policy::{Policy, ResolvedPolicy, simulate};

/// Simulated jobs per summary: enough for a stable p99, cheap enough per generation.
pub const SAMPLES: u32 = 1_000;
/// Fixed so the summary is a pure function of the spec.
pub const SEED: u64 = 0x5EB0_0D5E_ED00_0001;

/// The summary of one policy, without `servingQueues` (that depends on the namespace).
pub fn summarize(identity: &str, params: &ResolvedPolicy) -> ScheduleSummary {
    let sim = simulate(&Policy::new(identity, params.clone()), SAMPLES, SEED, false);
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
