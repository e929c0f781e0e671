use super::*;
use crate::{
    compiled::compiled_rollout,
    resolve::{ResolvedAnalysis, ResolvedStep, resolve},
    spec::RetryPolicySpec,
};

fn params(max_attempts: u32) -> ResolvedPolicy {
    let spec: RetryPolicySpec = serde_json::from_value(serde_json::json!({
        "queues": ["q"],
        "backoff": {"strategy": "exponential", "base": "1s", "cap": "1m"},
        "maxAttempts": max_attempts,
    }))
    .expect("spec");
    resolve(&spec).expect("valid")
}

fn rollout(pauses: &[Option<u64>], max: Option<u64>, on: OnInconclusive) -> ResolvedRollout {
    ResolvedRollout {
        steps: pauses
            .iter()
            .enumerate()
            .map(|(i, p)| ResolvedStep {
                weight: 10 + 40 * i as u32,
                pause_ms: *p,
                max_duration_ms: max,
            })
            .collect(),
        analysis: ResolvedAnalysis {
            min_failed_jobs: 100,
            on_inconclusive: on,
            ..ResolvedAnalysis::default()
        },
    }
}

fn manual() -> ResolvedRollout {
    rollout(&[None, None], None, OnInconclusive::Pause)
}

fn run(
    prev: Option<&RolloutStatus>,
    p: &ResolvedPolicy,
    r: &ResolvedRollout,
    evidence: &[StepCounts],
    now: u64,
    request: Option<&RolloutRequest>,
) -> Transition {
    run_with_lead(prev, p, r, evidence, now, request, 0)
}

fn run_with_lead(
    prev: Option<&RolloutStatus>,
    p: &ResolvedPolicy,
    r: &ResolvedRollout,
    evidence: &[StepCounts],
    now: u64,
    request: Option<&RolloutRequest>,
    lead: u64,
) -> Transition {
    step(Input {
        prev,
        params: p,
        rollout: r,
        evidence,
        now_unix_ms: now,
        step_lead_ms: lead,
        request,
    })
}

/// A rollout from maxAttempts 25 to `to`, at step 0 since t = 1000.
fn rolling(to: u32, r: &ResolvedRollout) -> (RolloutStatus, ResolvedPolicy) {
    let first = run(None, &params(25), r, &[], 0, None).status;
    let new = params(to);
    let t = run(Some(&first), &new, r, &[], 1000, None);
    (t.status, new)
}

/// Counts of a step where both revisions are equally bad (no harm), `n` failed jobs.
fn fine(weight: u32, n: u64) -> StepCounts {
    StepCounts {
        weight,
        failed_new: n * u64::from(weight) / 100,
        failed_all: n,
        bad_new: n * u64::from(weight) / 1000,
        bad_all: n / 10,
    }
}

fn request(action: RolloutAction, revision: &str, id: &str) -> RolloutRequest {
    RolloutRequest {
        step: None,
        action,
        revision: revision.to_owned(),
        id: id.to_owned(),
    }
}

#[test]
fn first_sight_is_healthy_at_once() {
    let p = params(25);
    let t = run(None, &p, &manual(), &[], 5, None);
    assert_eq!(t.status.phase, RolloutPhase::Healthy);
    assert_eq!(t.status.revision, revision_id(&p));
    assert_eq!(t.status.stable_revision, t.status.revision);
    assert_eq!(stable_params(&t.status), Some(p.clone()));
    assert!(t.happened.is_empty());
    assert_eq!(compiled_rollout(&t.status, &p), (p, None));
}

#[test]
fn a_new_revision_starts_at_step_zero_with_both_revisions_in_the_document() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    // A step without a pause waits for a person from its start.
    assert_eq!(status.phase, RolloutPhase::Paused);
    assert_eq!(status.revision, revision_id(&new));
    assert_eq!(status.stable_revision, revision_id(&params(25)));
    assert_eq!(
        status.steps,
        vec![StartedStep {
            weight: 10,
            start_unix_ms: 1000
        }]
    );
    let (stable, compiled) = compiled_rollout(&status, &new);
    assert_eq!(stable, params(25));
    let compiled = compiled.expect("in rollout");
    assert_eq!(compiled.canary, new);
    assert_eq!(compiled.revision, status.revision);
    assert!(compiled.exposure().is_ok());
}

#[test]
fn a_step_without_pause_waits_for_promote_and_promote_passes_it() {
    let r = manual();
    let first = run(None, &params(25), &r, &[], 0, None).status;
    let new = params(5);
    let t = run(Some(&first), &new, &r, &[], 1000, None);
    assert_eq!(t.status.phase, RolloutPhase::Paused);
    assert!(matches!(
        t.happened[..],
        [
            RolloutEvent::Started { .. },
            RolloutEvent::Paused { step: 0, .. }
        ]
    ));
    assert_eq!(t.next_check_ms, None);
    // Looking again changes nothing and says nothing.
    let again = run(Some(&t.status), &new, &r, &[], 3000, None);
    assert_eq!(again.status, t.status);
    assert!(again.happened.is_empty());

    let promote = request(RolloutAction::Promote, &t.status.revision, "a");
    let t = run(Some(&t.status), &new, &r, &[], 4000, Some(&promote));
    assert_eq!(t.status.step, Some(1));
    assert_eq!(t.status.steps[1].weight, 50);
    assert_eq!(t.status.steps[1].start_unix_ms, 4000);
    assert_eq!(t.status.handled_request.as_deref(), Some("a"));
    // The same request again is not acted on twice.
    let same = run(Some(&t.status), &new, &r, &[], 5000, Some(&promote));
    assert_eq!(same.status.step, Some(1));
    let promote = request(RolloutAction::Promote, &t.status.revision, "b");
    let t = run(Some(&same.status), &new, &r, &[], 6000, Some(&promote));
    assert_eq!(t.status.phase, RolloutPhase::Healthy);
    assert_eq!(t.status.stable_revision, revision_id(&new));
    assert!(matches!(t.happened[..], [RolloutEvent::Promoted { .. }]));
    assert_eq!(compiled_rollout(&t.status, &new), (new, None));
}

#[test]
fn a_step_takes_effect_only_after_the_lead_and_its_pause_runs_from_there() {
    // A sidecar that has not loaded the step yet answers a newly failing job with the
    // previous weight, one that has with the new weight: the job would mix revisions. So
    // a step starts `lead` after it is written, once every sidecar has it.
    let r = rollout(&[Some(60_000), Some(60_000)], None, OnInconclusive::Pause);
    let first = run_with_lead(None, &params(25), &r, &[], 0, None, 5_000).status;
    let new = params(5);
    let t = run_with_lead(Some(&first), &new, &r, &[], 1_000, None, 5_000);
    assert_eq!(t.status.steps[0].start_unix_ms, 6_000);
    // The pause runs from the start that takes effect.
    let t = run_with_lead(
        Some(&t.status),
        &new,
        &r,
        &[fine(10, 1000)],
        61_000,
        None,
        5_000,
    );
    assert_eq!(t.status.step, Some(0));
    assert_eq!(t.next_check_ms, Some(66_000));
    let t = run_with_lead(
        Some(&t.status),
        &new,
        &r,
        &[fine(10, 1000)],
        66_000,
        None,
        5_000,
    );
    assert_eq!(t.status.step, Some(1));
    assert_eq!(t.status.steps[1].start_unix_ms, 71_000);
    // A promote request too.
    let promote = request(RolloutAction::Promote, &t.status.revision, "p");
    let t = run_with_lead(
        Some(&t.status),
        &new,
        &r,
        &[],
        80_000,
        Some(&promote),
        5_000,
    );
    assert_eq!(t.status.phase, RolloutPhase::Healthy, "after the last step");
    let again = run_with_lead(Some(&first), &new, &r, &[], 90_000, None, 5_000);
    assert_eq!(again.status.steps[0].start_unix_ms, 95_000);
}

#[test]
fn a_step_passes_on_its_pause_and_minimum_sample_only() {
    let r = rollout(&[Some(60_000), Some(60_000)], None, OnInconclusive::Pause);
    let (status, new) = rolling(5, &r);
    // Sample complete, pause not over: wait until the pause ends.
    let t = run(Some(&status), &new, &r, &[fine(10, 1000)], 30_000, None);
    assert_eq!(t.status.step, Some(0));
    assert_eq!(t.next_check_ms, Some(61_000));
    // Pause over, sample short: stays.
    let t = run(Some(&status), &new, &r, &[fine(10, 50)], 61_000, None);
    assert_eq!(t.status.step, Some(0));
    // Both: the next step starts.
    let t = run(Some(&status), &new, &r, &[fine(10, 1000)], 61_000, None);
    assert_eq!(t.status.step, Some(1));
    assert!(matches!(
        t.happened[..],
        [RolloutEvent::StepStarted {
            step: 1,
            weight: 50
        }]
    ));
    let t = run(
        Some(&t.status),
        &new,
        &r,
        &[fine(10, 1000), fine(50, 1000)],
        121_000,
        None,
    );
    assert_eq!(t.status.phase, RolloutPhase::Healthy);
}

#[test]
fn harm_rolls_back_and_degraded_serves_stable_until_spec_changes() {
    let r = manual();
    let (status, new) = rolling(2, &r);
    let harm = StepCounts {
        weight: 10,
        failed_new: 100,
        failed_all: 1000,
        bad_new: 90,
        bad_all: 180,
    };
    let t = run(Some(&status), &new, &r, &[harm], 2000, None);
    assert_eq!(t.status.phase, RolloutPhase::Degraded);
    assert!(matches!(t.happened[..], [RolloutEvent::RolledBack { .. }]));
    let analysis = t.status.analysis.expect("analysis");
    assert_eq!(analysis.verdict, AnalysisVerdict::Harm);
    assert_eq!((analysis.bad_new, analysis.bad_stable), (90, 90));
    assert_eq!(compiled_rollout(&t.status, &new), (params(25), None));
    // It stays so: another look, even with good evidence, changes nothing.
    let again = run(Some(&t.status), &new, &r, &[fine(10, 1000)], 9000, None);
    assert_eq!(again.status.phase, RolloutPhase::Degraded);
    assert!(again.happened.is_empty());
    // A new spec starts a new rollout from the same stable revision.
    let newer = params(7);
    let t = run(Some(&again.status), &newer, &r, &[], 10_000, None);
    assert_eq!(t.status.phase, RolloutPhase::Paused);
    assert_eq!(t.status.revision, revision_id(&newer));
    assert_eq!(t.status.stable_revision, revision_id(&params(25)));
}

#[test]
fn no_verdict_by_the_deadline_pauses_or_aborts_as_configured() {
    for (on, phase) in [
        (OnInconclusive::Pause, RolloutPhase::Paused),
        (OnInconclusive::Abort, RolloutPhase::Degraded),
    ] {
        let r = rollout(&[Some(10_000)], Some(20_000), on);
        let (status, new) = rolling(5, &r);
        let t = run(Some(&status), &new, &r, &[fine(10, 10)], 15_000, None);
        assert_eq!(t.status.phase, RolloutPhase::Progressing);
        assert_eq!(t.next_check_ms, Some(21_000));
        let t = run(Some(&status), &new, &r, &[fine(10, 10)], 21_000, None);
        assert_eq!(t.status.phase, phase, "{on:?}");
        // Paused after a deadline has no further deadline.
        assert_eq!(t.next_check_ms, None);
    }
}

#[test]
fn a_sample_ratio_mismatch_never_passes_a_step() {
    let r = rollout(&[Some(0)], None, OnInconclusive::Pause);
    let (status, new) = rolling(5, &r);
    let skewed = StepCounts {
        weight: 10,
        failed_new: 500,
        failed_all: 1000,
        bad_new: 50,
        bad_all: 100,
    };
    let t = run(Some(&status), &new, &r, &[skewed], 50_000, None);
    assert_eq!(t.status.phase, RolloutPhase::Progressing);
    assert_eq!(
        t.status.analysis.map(|a| a.verdict),
        Some(AnalysisVerdict::Inconclusive)
    );
}

#[test]
fn requests_for_another_revision_or_phase_are_refused_once() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    let stale = request(RolloutAction::PromoteFull, &status.stable_revision, "x");
    let t = run(Some(&status), &new, &r, &[], 2000, Some(&stale));
    assert_ne!(t.status.phase, RolloutPhase::Healthy);
    assert_eq!(t.status.handled_request.as_deref(), Some("x"));
    assert!(
        t.happened
            .iter()
            .any(|e| matches!(e, RolloutEvent::RequestRefused { id, .. } if id == "x"))
    );
    let again = run(Some(&t.status), &new, &r, &[], 3000, Some(&stale));
    assert!(
        !again
            .happened
            .iter()
            .any(|e| matches!(e, RolloutEvent::RequestRefused { .. }))
    );
    // Retry only applies to a Degraded rollout.
    let retry = request(RolloutAction::Retry, &status.revision, "y");
    let t = run(Some(&again.status), &new, &r, &[], 4000, Some(&retry));
    assert!(matches!(
        t.happened[..],
        [RolloutEvent::RequestRefused { .. }]
    ));
}

#[test]
fn abort_then_retry_starts_again_at_step_zero_with_fresh_evidence() {
    let r = manual();
    let (mut status, new) = rolling(5, &r);
    status.evidence = vec![crate::spec::EpochEvidence {
        epoch: "0123456789abcdef".into(),
        steps: vec![crate::spec::EpochStep {
            step: 0,
            mature: [1, 2, 3, 4],
            seen: [1, 2, 3, 4],
        }],
        baseline: vec![],
    }];
    let abort = request(RolloutAction::Abort, &status.revision, "1");
    let t = run(Some(&status), &new, &r, &[], 2000, Some(&abort));
    assert_eq!(t.status.phase, RolloutPhase::Degraded);
    assert!(matches!(t.happened[..], [RolloutEvent::Aborted]));
    let retry = request(RolloutAction::Retry, &status.revision, "2");
    let t = run(Some(&t.status), &new, &r, &[], 3000, Some(&retry));
    assert_eq!(t.status.phase, RolloutPhase::Paused, "step 0 is manual");
    assert_eq!(t.status.steps[0].start_unix_ms, 3000);
    assert_eq!(t.status.evidence[0].baseline, t.status.evidence[0].steps);
    assert_eq!(t.status.handled_request.as_deref(), Some("2"));
}

#[test]
fn a_change_back_to_stable_ends_the_rollout() {
    let r = manual();
    let (status, _) = rolling(5, &r);
    let t = run(Some(&status), &params(25), &r, &[], 2000, None);
    assert_eq!(t.status.phase, RolloutPhase::Healthy);
    assert_eq!(t.status.revision, revision_id(&params(25)));
    assert!(t.status.steps.is_empty());
    assert_eq!(compiled_rollout(&t.status, &params(25)), (params(25), None));
}

#[test]
fn a_change_during_a_rollout_restarts_at_step_zero_from_the_last_promoted() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    let promote = request(RolloutAction::Promote, &status.revision, "p");
    let t = run(Some(&status), &new, &r, &[], 2000, Some(&promote));
    assert_eq!(t.status.step, Some(1));
    let newer = params(9);
    let t = run(Some(&t.status), &newer, &r, &[], 3000, None);
    assert_eq!(t.status.step, Some(0));
    assert_eq!(t.status.steps.len(), 1);
    assert_eq!(t.status.revision, revision_id(&newer));
    assert_eq!(t.status.stable_revision, revision_id(&params(25)));
    assert!(matches!(
        t.happened[..],
        [RolloutEvent::Started { .. }, RolloutEvent::Paused { .. }]
    ));
}

#[test]
fn an_unreadable_status_from_outside_applies_the_spec_and_says_so() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    let mut broken = status.clone();
    broken.stable_params = Some(serde_json::json!({"maxAttempts": "many"}));
    let t = run(Some(&broken), &new, &r, &[], 2000, None);
    assert_eq!(t.status.phase, RolloutPhase::Healthy);
    assert_eq!(t.status.revision, revision_id(&new));
    assert!(matches!(
        t.happened[..],
        [RolloutEvent::StatusUnreadable { .. }]
    ));
    assert_eq!(compiled_rollout(&broken, &new), (new.clone(), None));
    // Params that read but are another revision than stableRevision are as unreadable.
    let mut other = status.clone();
    other.stable_params = serde_json::to_value(params(3)).ok();
    assert!(stable_params(&other).is_none());
    // Malformed steps are made well formed, never a panic or a refused document.
    let mut steps = status;
    steps.steps = vec![
        StartedStep {
            weight: 50,
            start_unix_ms: 10,
        },
        StartedStep {
            weight: 20,
            start_unix_ms: 5,
        },
    ];
    let t = run(Some(&steps), &new, &r, &[], 3000, None);
    assert_eq!(t.status.steps.len(), 1);
    let (_, compiled) = compiled_rollout(&t.status, &new);
    assert!(compiled.expect("in rollout").exposure().is_ok());
    steps.steps.clear();
    let t = run(Some(&steps), &new, &r, &[], 3000, None);
    assert_eq!(t.status.steps.len(), 1);
}

#[test]
fn a_full_promote_of_a_rolled_back_revision_is_refused() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    let abort = request(RolloutAction::Abort, &status.revision, "a");
    let degraded = run(Some(&status), &new, &r, &[], 2000, Some(&abort)).status;
    assert_eq!(degraded.phase, RolloutPhase::Degraded);
    let full = request(RolloutAction::PromoteFull, &degraded.revision, "b");
    let t = run(Some(&degraded), &new, &r, &[], 3000, Some(&full));
    assert_eq!(t.status.phase, RolloutPhase::Degraded);
    assert!(matches!(
        t.happened[..],
        [RolloutEvent::RequestRefused { .. }]
    ));
}

#[test]
fn shortening_the_spec_mid_rollout_keeps_the_started_steps() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    let promote = request(RolloutAction::Promote, &status.revision, "a");
    let two = run(Some(&status), &new, &r, &[], 2000, Some(&promote)).status;
    assert_eq!(two.steps.len(), 2);
    // A commit leaves one step: the 50 % step already placed jobs, so it stays, paused.
    let one = rollout(&[None], None, OnInconclusive::Pause);
    let t = run(Some(&two), &new, &one, &[], 3000, None);
    assert_eq!(t.status.steps, two.steps);
    assert_eq!(t.status.phase, RolloutPhase::Paused);
    let promote = request(RolloutAction::Promote, &t.status.revision, "b");
    let t = run(Some(&t.status), &new, &one, &[], 4000, Some(&promote));
    assert_eq!(t.status.phase, RolloutPhase::Healthy);
}

#[test]
fn a_promote_made_at_a_step_that_has_passed_is_refused() {
    let r = manual();
    let (status, new) = rolling(5, &r);
    // A person saw step 0; meanwhile another promote passed it.
    let first = request(RolloutAction::Promote, &status.revision, "a");
    let at_one = run(Some(&status), &new, &r, &[], 2000, Some(&first)).status;
    assert_eq!(at_one.step, Some(1));
    let late = RolloutRequest {
        step: Some(0),
        ..request(RolloutAction::Promote, &status.revision, "b")
    };
    let t = run(Some(&at_one), &new, &r, &[], 3000, Some(&late));
    assert_eq!(t.status.step, Some(1), "step 1 is not passed unseen");
    assert!(matches!(
        t.happened[..],
        [RolloutEvent::RequestRefused { .. }]
    ));
    assert_eq!(t.status.handled_request.as_deref(), Some("b"));
}
