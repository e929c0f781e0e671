//! Requeue-on-error delays, computed by the policy crate's decision function with a policy
//! for the operator itself: the operator retries the way it tells workers to retry.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rebound_policy::{Context, Decision, PreparedPolicy, decide};
use rebound_runtime::watch_backoff::{OPERATOR_CAP, WatchBackoff, own_retry_policy};

/// The operator's own retry policy for failed reconciles: exponential from 500ms,
/// doubling, capped at 5m, full jitter, never giving up.
pub fn operator_policy() -> PreparedPolicy {
    own_retry_policy("rebound-system/rebound-operator", 500, 300_000)
}

/// Consecutive failures per key, turned into requeue delays.
pub struct Requeue {
    policy: PreparedPolicy,
    failures: Mutex<HashMap<String, u32>>,
}

impl Default for Requeue {
    fn default() -> Self {
        Self {
            policy: operator_policy(),
            failures: Mutex::new(HashMap::new()),
        }
    }
}

impl Requeue {
    /// Records a failure of `key` and returns how long to wait before the next try. The
    /// delay is deterministic per (key, failure count), like a worker's job id and attempt.
    pub fn failed(&self, key: &str) -> Duration {
        let attempt = {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            let n = failures.entry(key.to_owned()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        let ctx = Context {
            job_id: Some(key),
            ..Context::default()
        };
        let ms = match decide(&self.policy, attempt, &ctx) {
            Decision::Retry { delay_ms } => delay_ms,
            // Past the attempt limit: keep retrying at the cap.
            Decision::GiveUp { .. } => self.policy.params().cap_ms,
        };
        Duration::from_millis(ms)
    }

    /// Forgets the failures of `key` after a success.
    pub fn succeeded(&self, key: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(key);
    }
}

/// The backoff of the operator's watch named `name`: the one both binaries use, with the
/// operator's short cap (see [`rebound_runtime::watch_backoff`]).
pub fn watch_backoff(name: &str) -> WatchBackoff {
    WatchBackoff::new(&format!("operator/{name}"), OPERATOR_CAP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_within_the_cap_and_resets() {
        let r = Requeue::default();
        let first = r.failed("ns");
        assert!(first <= Duration::from_millis(500));
        for _ in 0..30 {
            assert!(r.failed("ns") <= Duration::from_secs(300));
        }
        r.succeeded("ns");
        assert!(r.failed("ns") <= Duration::from_millis(500));
    }

    #[test]
    fn watch_backoff_stays_under_the_operator_cap() {
        let mut b = watch_backoff("w");
        assert!(b.by_ref().take(50).all(|d| d <= OPERATOR_CAP));
    }

    #[test]
    fn same_key_and_attempt_give_the_same_delay() {
        let (a, b) = (Requeue::default(), Requeue::default());
        assert_eq!(a.failed("x"), b.failed("x"));
        assert!(operator_policy().params().check().is_ok());
    }
}
