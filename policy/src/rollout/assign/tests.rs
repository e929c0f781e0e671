//! The assignment's properties: a job's arm is fixed by its first failure, the split
//! honours the weight, and a larger weight only adds jobs to the canary.

use proptest::prelude::*;

use super::*;
use crate::decide::SplitMix64;

const T0: u64 = 1_800_000_000_000;
const MINUTE: u64 = 60_000;

fn revision(n: u8) -> String {
    digest::sha256_id(&[n])
}

fn exposure(steps: &[(u32, u64)]) -> Exposure {
    Exposure::new(
        revision(1),
        steps
            .iter()
            .map(|&(weight, start_unix_ms)| Step {
                weight,
                start_unix_ms,
            })
            .collect(),
    )
    .expect("valid exposure")
}

/// Fixed-seed job ids of mixed shapes (UUID-like, numeric, non-ASCII).
fn ids(n: usize, seed: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|i| match i % 3 {
            0 => format!("{:016x}-{:08x}", rng.next_u64(), rng.below(1 << 32)),
            1 => rng.next_u64().to_string(),
            _ => format!("commande-é-{}-ジョブ", rng.below(1_000_000_000)),
        })
        .collect()
}

#[test]
fn no_job_id_is_stable() {
    let e = exposure(&[(99, T0)]);
    assert_eq!(arm(&e, None, Some(T0), T0), Arm::Stable);
    assert_eq!(arm(&e, Some(""), Some(T0), T0), Arm::Stable);
    assert_eq!(arm(&e, None, None, T0 + MINUTE), Arm::Stable);
}

#[test]
fn a_job_that_first_failed_before_the_first_step_is_stable() {
    let e = exposure(&[(99, T0)]);
    let all_canary_bucket = ids(2000, 7)
        .into_iter()
        .filter(|id| e.bucket(id) < 99)
        .collect::<Vec<_>>();
    assert!(all_canary_bucket.len() > 1900);
    for id in &all_canary_bucket {
        assert_eq!(arm(&e, Some(id), Some(T0 - 1), T0 + MINUTE), Arm::Stable);
        assert_eq!(arm(&e, Some(id), Some(T0), T0 + MINUTE), Arm::Canary);
        // Without a first failure, now decides.
        assert_eq!(arm(&e, Some(id), None, T0 - 1), Arm::Stable);
        assert_eq!(arm(&e, Some(id), None, T0), Arm::Canary);
    }
}

/// Later steps start after every job that already failed, so they never move one: each
/// attempt of a job gets the arm of its first failure, whatever `now` and however many
/// steps have started since.
#[test]
fn every_attempt_of_a_job_gets_the_arm_of_its_first_failure() {
    let schedule = [(5, T0), (20, T0 + 10 * MINUTE), (50, T0 + 40 * MINUTE)];
    for id in ids(3000, 11) {
        for (k, &(_, start)) in schedule.iter().enumerate() {
            let first = start + MINUTE;
            let when_first_failed = exposure(&schedule[..=k]);
            let expected = arm(&when_first_failed, Some(&id), Some(first), first);
            for later in k..schedule.len() {
                let e = exposure(&schedule[..=later]);
                for now in [first, first + MINUTE, T0 + 24 * 60 * MINUTE] {
                    assert_eq!(arm(&e, Some(&id), Some(first), now), expected, "{id}");
                }
            }
        }
    }
}

/// The canary at weight w is a subset of the canary at any w' > w (same revision, same
/// first failure): raising the weight only adds jobs. (A job's arm never changes at all
/// once it failed; this is what holds across the jobs of two steps.)
#[test]
fn a_larger_weight_only_adds_jobs_to_the_canary() {
    let jobs = ids(20_000, 13);
    for (low, high) in [(1, 2), (10, 50), (50, 99), (1, 99)] {
        let (a, b) = (exposure(&[(low, T0)]), exposure(&[(high, T0)]));
        let (mut in_low, mut in_high) = (0, 0);
        for id in &jobs {
            let (x, y) = (
                arm(&a, Some(id), Some(T0), T0),
                arm(&b, Some(id), Some(T0), T0),
            );
            assert!(
                !(x == Arm::Canary && y == Arm::Stable),
                "{id} left the canary when the weight rose from {low} to {high}"
            );
            in_low += usize::from(x == Arm::Canary);
            in_high += usize::from(y == Arm::Canary);
        }
        assert!(in_low < in_high, "{low}->{high}: {in_low} vs {in_high}");
    }
}

/// |canary − n·w| within 5 standard deviations of the binomial, for 100,000 fixed-seed ids.
#[test]
fn weights_are_honoured_within_a_binomial_bound() {
    let jobs = ids(100_000, 17);
    let n = jobs.len() as f64;
    for weight in [1, 10, 33, 50, 90, 99] {
        let e = exposure(&[(weight, T0)]);
        let canary = jobs
            .iter()
            .filter(|id| arm(&e, Some(id), Some(T0), T0) == Arm::Canary)
            .count() as f64;
        let w = f64::from(weight) / 100.0;
        let bound = 5.0 * (n * w * (1.0 - w)).sqrt();
        assert!(
            (canary - n * w).abs() <= bound,
            "weight {weight}: {canary} canary jobs of {n}, expected {} ± {bound}",
            n * w
        );
    }
}

/// Each revision salts the hash: the canaries of two revisions at 50 % overlap like
/// independent halves (a quarter of the jobs), so no job is in every rollout's canary.
#[test]
fn revisions_draw_independent_canaries() {
    let jobs = ids(100_000, 19);
    let step = vec![Step {
        weight: 50,
        start_unix_ms: T0,
    }];
    let a = Exposure::new(revision(1), step.clone()).expect("valid");
    let b = Exposure::new(revision(2), step).expect("valid");
    let both = jobs
        .iter()
        .filter(|id| {
            arm(&a, Some(id), None, T0) == Arm::Canary && arm(&b, Some(id), None, T0) == Arm::Canary
        })
        .count() as f64;
    let (n, p) = (jobs.len() as f64, 0.25);
    assert!(
        (both - n * p).abs() <= 5.0 * (n * p * (1.0 - p)).sqrt(),
        "{both} of {n} in both canaries"
    );
}

#[test]
fn malformed_exposures_are_refused_naming_the_field() {
    let step = |weight, start_unix_ms| Step {
        weight,
        start_unix_ms,
    };
    let field = |revision: String, steps: Vec<Step>| {
        Exposure::new(revision, steps)
            .map(|_| ())
            .map_err(|e| e.field)
    };
    assert_eq!(field(revision(1), vec![]), Ok(()), "nothing started yet");
    assert_eq!(field("sha256:abc".into(), vec![]), Err("revision".into()));
    assert_eq!(
        field(revision(1).to_uppercase(), vec![]),
        Err("revision".into())
    );
    assert_eq!(
        field(revision(1), (1..=11).map(|w| step(w, T0)).collect()),
        Err("steps".into())
    );
    assert_eq!(
        field(revision(1), vec![step(0, T0)]),
        Err("steps[0].weight".into())
    );
    assert_eq!(
        field(revision(1), vec![step(10, T0), step(100, T0)]),
        Err("steps[1].weight".into())
    );
    assert_eq!(
        field(revision(1), vec![step(10, T0), step(10, T0 + 1)]),
        Err("steps[1].weight".into())
    );
    assert_eq!(
        field(revision(1), vec![step(10, T0), step(20, T0 - 1)]),
        Err("steps[1].startUnixMs".into())
    );
    assert_eq!(
        field(revision(1), vec![step(10, T0), step(20, T0)]),
        Ok(()),
        "equal starts: the later step is in effect"
    );
    assert_eq!(exposure(&[(10, T0), (20, T0)]).weight_at(T0), Some(20));
}

#[test]
fn a_revision_id_is_the_hash_of_the_params() {
    let spec = |json: serde_json::Value| -> ResolvedPolicy {
        let spec: crate::spec::RetryPolicySpec = serde_json::from_value(json).expect("spec");
        crate::resolve::resolve(&spec).expect("valid")
    };
    let a = spec(serde_json::json!({"queues": ["q"], "maxAttempts": 25}));
    let b = spec(serde_json::json!({"queues": ["other"], "maxAttempts": 25}));
    let c = spec(serde_json::json!({"queues": ["q"], "maxAttempts": 5}));
    let id = revision_id(&a);
    assert!(digest::is_sha256_id(&id), "{id}");
    assert_eq!(id, revision_id(&b), "queues are not part of a revision");
    assert_ne!(id, revision_id(&c));
    assert_eq!(
        id,
        digest::sha256_id(serde_json::to_string(&a).expect("json").as_bytes())
    );
}

proptest! {
    /// Any id, any times: the arm depends on the first failure only, not on `now`.
    #[test]
    fn the_arm_ignores_now_when_the_first_failure_is_known(
        id in ".{0,40}",
        first in T0 - 10 * MINUTE..T0 + 60 * MINUTE,
        now_a in any::<u64>(),
        now_b in any::<u64>(),
    ) {
        let e = exposure(&[(10, T0), (50, T0 + 20 * MINUTE)]);
        prop_assert_eq!(arm(&e, Some(&id), Some(first), now_a), arm(&e, Some(&id), Some(first), now_b));
    }
}
