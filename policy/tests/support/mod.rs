//! Shared by the policy crate's integration tests that build tables by hand.

use rebound_policy::{
    Disposition, ResolvedPolicy,
    spec::{JitterKind, Strategy},
};

/// Exponential 1 s × 2, cap 10 min, full jitter, 10 attempts, dropped at the end: a
/// plain policy whose only varying part is the error classes a table indexes.
pub fn params_with_errors(non_retryable_errors: Vec<String>) -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: Strategy::Exponential,
        base_ms: 1_000,
        multiplier: 2.0,
        cap_ms: 600_000,
        jitter: JitterKind::Full,
        jitter_ratio: 0.0,
        schedule_ms: vec![],
        max_attempts: 10,
        max_retry_duration_ms: None,
        non_retryable_errors,
        terminal: Disposition::Drop,
        retry_budget: None,
    }
}
