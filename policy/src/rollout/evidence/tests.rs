//! The sidecar's tally: horizons bound what `decide` does, each job counts once per kind
//! in its first failure's step, maturity follows the clock it is given, and no input grows
//! the book past its bounds.

use super::*;
use crate::{
    PreparedPolicy, decide,
    decide::{Context, Decision, SplitMix64},
    limits::{MAX_EVIDENCE_JOB_IDS, MAX_PENDING_BUCKETS},
    resolve::{Disposition, ResolvedPolicy, RetryBudget},
    rollout::assign::{Exposure, Step, arm},
    spec::{JitterKind, Strategy},
};

const T0: u64 = 1_800_000_000_000;
const MINUTE: u64 = 60_000;

fn policy(strategy: Strategy, jitter: JitterKind, max_attempts: u32) -> ResolvedPolicy {
    ResolvedPolicy {
        strategy,
        base_ms: 100,
        multiplier: 2.0,
        cap_ms: 1_000,
        jitter,
        jitter_ratio: 0.5,
        schedule_ms: vec![300, 50],
        max_attempts,
        max_retry_duration_ms: None,
        non_retryable_errors: Vec::new(),
        terminal: Disposition::Drop,
        retry_budget: None,
    }
}

fn exposure(steps: &[(u32, u64)]) -> Exposure {
    Exposure::new(
        digest::sha256_id(b"canary"),
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

/// Feeds one decision the way the sidecar does: arm by `assign::arm`, step by `Exposure::step_at`.
#[allow(clippy::too_many_arguments)]
fn observe(
    book: &mut EvidenceBook,
    e: &Exposure,
    job: &str,
    first_failure_ms: u64,
    attempt: u32,
    gives_up: bool,
    now_ms: u64,
    maturity: Option<u64>,
) -> Recorded {
    let Some((step, weight)) = e.step_at(first_failure_ms) else {
        return Recorded::default();
    };
    let o = Observation {
        policy: "payments",
        revision: e.revision(),
        arm: arm(e, Some(job), Some(first_failure_ms), now_ms),
        step,
        weight,
        first_failure_ms,
        job_id: job,
        first_attempt: attempt == 1,
        gives_up,
        now_ms,
    };
    book.record(&o, || maturity)
}

fn steps(book: &mut EvidenceBook, now_ms: u64) -> Vec<StepEvidence> {
    let report = book.report(now_ms);
    assert!(report.len() <= 1);
    report.into_iter().flat_map(|p| p.steps).collect()
}

#[test]
fn horizons_add_the_largest_delays_up_to_the_deadline() {
    use JitterKind::*;
    use Strategy::*;
    // 100, 200, 400, 800 ms before retries 1..4.
    assert_eq!(horizon_ms(&policy(Exponential, None, 5)), Some(1_500));
    assert_eq!(horizon_ms(&policy(Exponential, Full, 5)), Some(1_500));
    // ×1.5, the last one cut to the cap.
    assert_eq!(
        horizon_ms(&policy(Exponential, Proportional, 5)),
        Some(2_050)
    );
    assert_eq!(horizon_ms(&policy(Linear, None, 4)), Some(600));
    assert_eq!(horizon_ms(&policy(Constant, None, 4)), Some(300));
    assert_eq!(horizon_ms(&policy(Schedule, None, 4)), Some(400));
    // 300, 900, then the cap.
    assert_eq!(horizon_ms(&policy(Decorrelated, None, 4)), Some(2_200));
    assert_eq!(horizon_ms(&policy(Constant, None, 1)), Some(0));

    let mut p = policy(Exponential, None, 5);
    p.max_retry_duration_ms = Some(700);
    assert_eq!(horizon_ms(&p), Some(700));
    // A budget may push a retry up to the deadline.
    p.max_retry_duration_ms = Some(60_000);
    p.retry_budget = Some(RetryBudget {
        rate_per_second: 1,
        burst: 1,
    });
    assert_eq!(horizon_ms(&p), Some(60_000));

    let mut long = policy(Constant, None, crate::limits::MAX_ATTEMPTS);
    long.base_ms = crate::duration::MAX_DURATION_MS;
    long.cap_ms = crate::duration::MAX_DURATION_MS;
    assert_eq!(horizon_ms(&long), Option::None);
    assert_eq!(maturity_ms(&long, &policy(Constant, None, 2)), Option::None);
    // The longer horizon, a quarter more and the fixed margin.
    assert_eq!(
        maturity_ms(&policy(Exponential, None, 5), &policy(Constant, None, 4)),
        Some(1_500 + 375 + MATURITY_MARGIN_MS)
    );
}

#[test]
fn no_job_gives_up_after_its_horizon() {
    // Walks every job's schedule with `decide` itself, waiting each retry's delay.
    let mut rng = SplitMix64::new(31);
    for strategy in [
        Strategy::Exponential,
        Strategy::Linear,
        Strategy::Constant,
        Strategy::Schedule,
        Strategy::Decorrelated,
    ] {
        for jitter in [
            JitterKind::None,
            JitterKind::Full,
            JitterKind::Equal,
            JitterKind::Proportional,
        ] {
            let mut p = policy(strategy, jitter, 12);
            if rng.below(2) == 0 {
                p.max_retry_duration_ms = Some(3_000);
            }
            let horizon = horizon_ms(&p).expect("bounded");
            let prepared = PreparedPolicy::new("ns/payments", p);
            for _ in 0..50 {
                let job = rng.next_u64().to_string();
                let mut now = T0;
                for attempt in 1.. {
                    let ctx = Context {
                        job_id: Some(&job),
                        first_failure_ms: Some(T0),
                        now_ms: Some(now),
                        ..Context::default()
                    };
                    match decide(&prepared, attempt, &ctx) {
                        Decision::Retry { delay_ms } => now += delay_ms,
                        Decision::GiveUp { .. } => break,
                    }
                }
                assert!(
                    now - T0 <= horizon,
                    "{strategy:?}/{jitter:?}: {} > {horizon}",
                    now - T0
                );
            }
        }
    }
}

#[test]
fn replays_count_once_per_kind() {
    let e = exposure(&[(50, T0)]);
    let mut book = EvidenceBook::default();
    let first = observe(&mut book, &e, "job-1", T0, 1, false, T0, Some(1_000));
    assert_eq!(first.counted, 1);
    let replay = observe(&mut book, &e, "job-1", T0, 1, false, T0 + 5, Some(1_000));
    assert_eq!((replay.counted, replay.repeated), (0, 1));
    // Giving up is another kind: counted once, then a replay is not.
    assert_eq!(
        observe(&mut book, &e, "job-1", T0, 4, true, T0 + 9, None).counted,
        1
    );
    assert_eq!(
        observe(&mut book, &e, "job-1", T0, 4, true, T0 + 9, None).counted,
        0
    );
    // Retries in between are not counted at all.
    assert_eq!(
        observe(&mut book, &e, "job-1", T0, 2, false, T0 + 9, None),
        Recorded::default()
    );
    let s = steps(&mut book, T0 + 10);
    assert_eq!((s[0].seen.failed_all, s[0].seen.bad_all), (1, 1));
}

#[test]
fn a_bad_outcome_lands_in_the_step_of_the_first_failure() {
    let e = exposure(&[(10, T0), (50, T0 + 10 * MINUTE)]);
    let mut book = EvidenceBook::default();
    let ids: Vec<String> = (0..200).map(|i| format!("job-{i}")).collect();
    for id in &ids {
        observe(
            &mut book,
            &e,
            id,
            T0 + MINUTE,
            1,
            false,
            T0 + MINUTE,
            Some(MINUTE),
        );
    }
    // They give up in step 1's time: still step 0's evidence, at step 0's weight.
    for id in &ids {
        observe(
            &mut book,
            &e,
            id,
            T0 + MINUTE,
            5,
            true,
            T0 + 20 * MINUTE,
            Some(MINUTE),
        );
    }
    let s = steps(&mut book, T0 + 20 * MINUTE);
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].step, s[0].seen.weight), (0, 10));
    assert_eq!((s[0].seen.failed_all, s[0].seen.bad_all), (200, 200));
    let canary = ids.iter().filter(|id| e.bucket(id) < 10).count() as u64;
    assert_eq!((s[0].seen.failed_new, s[0].seen.bad_new), (canary, canary));
    assert!(canary > 0);
    // Before the first step there is no evidence.
    let early = observe(&mut book, &e, "early", T0 - 1, 1, false, T0, Some(MINUTE));
    assert_eq!(early, Recorded::default());
}

#[test]
fn jobs_mature_after_the_maturity_on_the_given_clock() {
    let e = exposure(&[(50, T0)]);
    let maturity = Some(10_000);
    let mut book = EvidenceBook::default();
    for i in 0..100 {
        observe(
            &mut book,
            &e,
            &format!("j{i}"),
            T0 + 1_000,
            1,
            false,
            T0 + 1_000,
            maturity,
        );
    }
    let s = steps(&mut book, T0 + 5_000);
    assert_eq!((s[0].seen.failed_all, s[0].mature.failed_all), (100, 0));
    // A sixteenth of the maturity (625 ms) late at most.
    let s = steps(&mut book, T0 + 11_000 + 625);
    assert_eq!(s[0].mature, s[0].seen);
    // A job reported long after its first failure is mature at once.
    observe(
        &mut book,
        &e,
        "old",
        T0 + 1_000,
        1,
        false,
        T0 + 60_000,
        maturity,
    );
    let s = steps(&mut book, T0 + 60_000);
    assert_eq!(s[0].mature.failed_all, 101);
    // Without a bounded horizon nothing ever matures.
    let mut never = EvidenceBook::default();
    observe(&mut never, &e, "j", T0, 1, true, T0, None);
    let s = steps(&mut never, u64::MAX);
    assert_eq!((s[0].seen.bad_all, s[0].mature.bad_all), (1, 0));
}

#[test]
fn a_new_revision_starts_from_zero() {
    let e = exposure(&[(50, T0)]);
    let mut book = EvidenceBook::default();
    observe(&mut book, &e, "a", T0, 1, false, T0, Some(1));
    let other = Exposure::new(digest::sha256_id(b"other"), e.steps().to_vec()).expect("valid");
    observe(&mut book, &other, "b", T0, 1, false, T0, Some(1));
    let report = book.report(T0);
    assert_eq!(report.len(), 1);
    assert_eq!(report[0].revision, other.revision());
    assert_eq!(report[0].steps[0].seen.failed_all, 1);
    book.retain(|_, revision| revision != other.revision());
    assert!(book.report(T0).is_empty());
}

#[test]
fn hostile_input_cannot_grow_the_book() {
    let e = exposure(&[(50, T0)]);
    let mut book = EvidenceBook::default();
    let mut rng = SplitMix64::new(7);
    let mut counted = 0u64;
    for i in 0..1_000_000u64 {
        // Distinct ids, first failures anywhere in time, a clock that jumps around.
        let id = format!("{i:x}");
        let first = T0.wrapping_add(rng.next_u64() % (u64::MAX - T0));
        let now = T0 + rng.below(1_000) * MINUTE;
        let r = observe(
            &mut book,
            &e,
            &id,
            first.max(T0),
            1,
            true,
            now,
            Some(MINUTE),
        );
        counted += u64::from(r.counted);
        if i % 100_000 == 0 {
            assert!(book.remembered_ids() <= MAX_EVIDENCE_JOB_IDS);
            assert!(book.pending_buckets() <= MAX_PENDING_BUCKETS);
        }
    }
    assert!(book.remembered_ids() <= MAX_EVIDENCE_JOB_IDS);
    assert!(book.pending_buckets() <= MAX_PENDING_BUCKETS);
    assert!(book.ids_capacity() <= 2 * MAX_EVIDENCE_JOB_IDS);
    // Counting went on as ids aged out, and every count is in the report.
    assert!(counted > MAX_EVIDENCE_JOB_IDS as u64);
    let s = steps(&mut book, T0);
    assert_eq!(s[0].seen.failed_all + s[0].seen.bad_all, counted);

    // All at one instant: past the bound, new jobs are refused, not remembered.
    let mut full = EvidenceBook::default();
    let mut refused = 0u64;
    for i in 0..(MAX_EVIDENCE_JOB_IDS + 1_000) {
        refused +=
            u64::from(observe(&mut full, &e, &i.to_string(), T0, 1, false, T0, None).refused);
    }
    assert_eq!(refused, 1_000);
    assert_eq!(full.remembered_ids(), MAX_EVIDENCE_JOB_IDS);
}

#[test]
fn counts_match_the_assignment_computed_independently() {
    // Three steps; a fixed-seed stream of jobs failing across them, a third giving up.
    let e = exposure(&[(5, T0), (25, T0 + 10 * MINUTE), (60, T0 + 20 * MINUTE)]);
    let mut rng = SplitMix64::new(2031);
    let mut book = EvidenceBook::default();
    let mut want = [[0u64; 4]; 3];
    for i in 0..30_000 {
        let id = format!("{:016x}-{i}", rng.next_u64());
        let first = T0 + rng.below(30 * MINUTE);
        let bad = rng.below(3) == 0;
        observe(&mut book, &e, &id, first, 1, false, first, Some(MINUTE));
        if bad {
            observe(
                &mut book,
                &e,
                &id,
                first,
                7,
                true,
                first + 5_000,
                Some(MINUTE),
            );
        }
        let step = usize::from(first >= T0 + 10 * MINUTE) + usize::from(first >= T0 + 20 * MINUTE);
        let weight = [5, 25, 60][step];
        let canary = e.bucket(&id) < weight;
        let w = &mut want[step];
        w[0] += u64::from(canary);
        w[1] += 1;
        w[2] += u64::from(canary && bad);
        w[3] += u64::from(bad);
    }
    let s = steps(&mut book, T0 + 40 * MINUTE);
    assert_eq!(s.len(), 3);
    for (k, step) in s.iter().enumerate() {
        let c = step.seen;
        assert_eq!(step.step as usize, k);
        assert_eq!(
            [c.failed_new, c.failed_all, c.bad_new, c.bad_all],
            want[k],
            "step {k}"
        );
        assert_eq!(step.mature, step.seen);
    }
}
