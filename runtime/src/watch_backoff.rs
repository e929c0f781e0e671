//! The one backoff both binaries use to re-establish a watch of the API server.
//!
//! Exponential from 250 ms, doubling, capped, with full jitter (a uniform draw in
//! `[0, capped delay]`) computed by the policy crate's decision function: Rebound retries
//! its own watches the way it tells workers to retry. Every instance draws its own jitter
//! (the key carries a per-process random part), so thousands of sidecars that lost the same
//! API server spread their reconnects over the whole cap instead of arriving together. The
//! caller resets it as soon as a watch is established, so a later outage starts again from
//! the base delay, and a server's `Retry-After` is a floor under the next delay.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use rebound_policy::resolve::{Disposition, ResolvedPolicy};
use rebound_policy::spec::{JitterKind, Strategy};
use rebound_policy::{Context, Decision, PreparedPolicy, decide};

#[cfg(feature = "kube")]
mod stream;
#[cfg(feature = "kube")]
pub use stream::{RESET_AFTER, WatchBackoffExt, with_backoff};

/// The first retry waits at most this long.
pub const BASE: Duration = Duration::from_millis(250);

/// The sidecar's cap: with full jitter every sidecar is back within this long of the API
/// server's return, and N sidecars arrive spread over it (N / 4 s on average).
pub const SIDECAR_CAP: Duration = Duration::from_secs(4);

/// The operator's cap: one or two processes, which must compile within 2 s of the return.
pub const OPERATOR_CAP: Duration = Duration::from_secs(1);

/// A server's `Retry-After` is honoured up to this long (a bound on a hostile value).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// Delays between attempts to re-establish one watch.
#[derive(Clone, Debug)]
pub struct WatchBackoff {
    policy: PreparedPolicy,
    key: String,
    attempt: u32,
    floor: Duration,
}

impl WatchBackoff {
    /// A backoff for the watch named `name`, capped at `cap`, with a jitter of its own.
    pub fn new(name: &str, cap: Duration) -> Self {
        let nonce = RandomState::new().build_hasher().finish();
        Self::seeded(name, cap, nonce)
    }

    /// The same with a fixed seed, for tests and reproducible figures.
    pub fn seeded(name: &str, cap: Duration, seed: u64) -> Self {
        let cap_ms = u64::try_from(cap.as_millis())
            .unwrap_or(u64::MAX)
            .max(BASE.as_millis() as u64);
        Self {
            policy: watch_policy(name, cap_ms),
            key: format!("{name}#{seed:016x}"),
            attempt: 0,
            floor: Duration::ZERO,
        }
    }

    /// The next delay is at least `retry_after` (at most [`MAX_RETRY_AFTER`]): what a 429
    /// or 503 with `Retry-After` asked for.
    pub fn retry_after(&mut self, retry_after: Duration) {
        self.floor = self.floor.max(retry_after.min(MAX_RETRY_AFTER));
    }

    /// Consecutive failures since the last [`WatchBackoff::reset`].
    pub fn failures(&self) -> u32 {
        self.attempt
    }

    /// A watch was established: the next failure starts from the base delay again.
    pub fn reset(&mut self) {
        self.attempt = 0;
        self.floor = Duration::ZERO;
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.attempt = self.attempt.saturating_add(1);
        let ctx = Context {
            job_id: Some(&self.key),
            ..Context::default()
        };
        let ms = match decide(&self.policy, self.attempt, &ctx) {
            Decision::Retry { delay_ms } => delay_ms,
            // Past the attempt limit: keep retrying at the cap.
            Decision::GiveUp { .. } => self.policy.params().cap_ms,
        };
        let floor = std::mem::take(&mut self.floor);
        Some(Duration::from_millis(ms).max(floor))
    }
}

fn watch_policy(name: &str, cap_ms: u64) -> PreparedPolicy {
    own_retry_policy(
        &format!("rebound/watch/{name}"),
        BASE.as_millis() as u64,
        cap_ms,
    )
}

/// How Rebound's own processes retry (watches here, the operator's failed reconciles):
/// exponential from `base_ms`, doubling, capped at `cap_ms`, full jitter, never giving up —
/// decided by the policy crate, the way Rebound tells workers to retry.
pub fn own_retry_policy(identity: &str, base_ms: u64, cap_ms: u64) -> PreparedPolicy {
    PreparedPolicy::new(
        identity,
        ResolvedPolicy {
            strategy: Strategy::Exponential,
            base_ms,
            multiplier: 2.0,
            cap_ms,
            jitter: JitterKind::Full,
            jitter_ratio: 0.0,
            schedule_ms: Vec::new(),
            max_attempts: rebound_policy::limits::MAX_ATTEMPTS,
            max_retry_duration_ms: None,
            non_retryable_errors: Vec::new(),
            terminal: Disposition::Drop,
            retry_budget: None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_the_cap_however_long_the_outage() {
        let mut b = WatchBackoff::seeded("w", SIDECAR_CAP, 7);
        assert!(b.by_ref().take(500).all(|d| d <= SIDECAR_CAP));
        assert_eq!(b.failures(), 500);
        assert!(watch_policy("w", 4_000).params().check().is_ok());
    }

    #[test]
    fn a_reset_starts_again_from_the_base_delay() {
        let mut b = WatchBackoff::seeded("w", SIDECAR_CAP, 7);
        b.by_ref().take(40).for_each(drop);
        b.reset();
        assert_eq!(b.failures(), 0);
        assert!(b.next().is_some_and(|d| d <= BASE));
    }

    #[test]
    fn full_jitter_spreads_instances_over_the_cap() {
        // 1000 instances at their tenth failure: spread over [0, cap], not bunched.
        let delays: Vec<Duration> = (0..1000u64)
            .map(|seed| {
                let mut b = WatchBackoff::seeded("w", SIDECAR_CAP, seed);
                b.nth(9).unwrap_or_default()
            })
            .collect();
        let quarter = SIDECAR_CAP / 4;
        for q in 0..4u32 {
            let n = delays
                .iter()
                .filter(|d| **d >= quarter * q && **d < quarter * (q + 1))
                .count();
            assert!((150..=350).contains(&n), "quarter {q}: {n} of 1000");
        }
    }

    #[test]
    fn retry_after_is_a_floor_for_one_delay() {
        let mut b = WatchBackoff::seeded("w", SIDECAR_CAP, 7);
        b.retry_after(Duration::from_secs(10));
        assert_eq!(b.next(), Some(Duration::from_secs(10)));
        assert!(b.next().is_some_and(|d| d <= SIDECAR_CAP));
        b.retry_after(Duration::from_secs(100_000));
        assert_eq!(b.next(), Some(MAX_RETRY_AFTER));
    }
}
