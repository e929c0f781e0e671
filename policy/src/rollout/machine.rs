//! The rollout state machine the operator runs on every reconcile of a policy that
//! declares `spec.rollout`. Pure: the previous status, the spec, the evidence and the time
//! in; the next status, what happened (for Events) and when to look again out. Every rule
//! of the design (docs/operator.md "Rollouts") is here and nowhere else.
//!
//! The status is the only memory: an operator that restarts, or a new leader, continues
//! from it with the same step, the same start times and the same handled request.

use crate::{
    limits::MAX_ROLLOUT_STEPS,
    resolve::{ResolvedPolicy, ResolvedRollout},
    rollout::{
        analysis::{StepCounts, Verdict, analyse},
        assign::revision_id,
    },
    spec::{
        AnalysisStatus, AnalysisVerdict, OnInconclusive, RolloutAction, RolloutPhase,
        RolloutRequest, RolloutStatus, StartedStep,
    },
};

#[cfg(test)]
mod tests;

/// What the machine reads on one reconcile.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// `status.rollout` as the policy shows it (or as the operator last wrote it).
    pub prev: Option<&'a RolloutStatus>,
    /// `spec`'s resolved parameters: the newest revision.
    pub params: &'a ResolvedPolicy,
    pub rollout: &'a ResolvedRollout,
    /// Mature counts of `prev.revision`'s rollout per started step (index = step), summed
    /// over every sidecar; weights are taken from the started steps, not from here.
    pub evidence: &'a [StepCounts],
    pub now_unix_ms: u64,
    /// How long after it is written a step takes effect: time for every sidecar to load
    /// it. A job placed by a sidecar that has not loaded the step yet would get the old
    /// weight there and the new weight elsewhere, and mix revisions.
    pub step_lead_ms: u64,
    /// `status.rollout.request`, written by `kubectl rebound rollout`.
    pub request: Option<&'a RolloutRequest>,
}

impl Input<'_> {
    /// When a step written on this look takes effect.
    fn step_start(&self) -> u64 {
        self.now_unix_ms.saturating_add(self.step_lead_ms)
    }
}

/// The outcome of one look.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    /// The status to show (its `request` is never set: the operator does not own it).
    pub status: RolloutStatus,
    pub happened: Vec<RolloutEvent>,
    /// When the machine must look again even if nothing changes (a pause or a deadline
    /// ends), in Unix milliseconds.
    pub next_check_ms: Option<u64>,
}

/// Something that happened, one Event each.
#[derive(Clone, Debug, PartialEq)]
pub enum RolloutEvent {
    /// A new revision started at step 0 (also on `retry`).
    Started { revision: String },
    /// A later step started.
    StepStarted { step: u32, weight: u32 },
    /// The new revision serves every job.
    Promoted { revision: String },
    /// The rollout waits for a person; the text says why.
    Paused { step: u32, why: String },
    /// The evidence showed harm, or a deadline passed with `onInconclusive: Abort`.
    RolledBack { why: String },
    /// A person aborted it.
    Aborted,
    /// A request that could not be acted on (wrong revision, wrong phase).
    RequestRefused { id: String, why: String },
    /// `status.rollout` could not be read (written by someone else); the spec's revision
    /// was applied at once, as on first sight.
    StatusUnreadable { why: String },
}

impl RolloutEvent {
    /// Warnings are what a person should look at.
    pub fn is_warning(&self) -> bool {
        matches!(
            self,
            Self::RolledBack { .. }
                | Self::Aborted
                | Self::RequestRefused { .. }
                | Self::StatusUnreadable { .. }
        )
    }
}

/// The stable revision's parameters from a status, checked: `None` when absent,
/// unreadable, invalid, or not the revision `stable_revision` names.
pub fn stable_params(status: &RolloutStatus) -> Option<ResolvedPolicy> {
    let value = status.stable_params.clone()?;
    let params: ResolvedPolicy = serde_json::from_value(value).ok()?;
    params.check().ok()?;
    (revision_id(&params) == status.stable_revision).then_some(params)
}

/// Runs the rules once. Total: any previous status (malformed ones included) gives a
/// status the operator can write.
pub fn step(input: Input<'_>) -> Transition {
    let now = input.now_unix_ms;
    let effective = input.step_start();
    let revision = revision_id(input.params);
    let mut out = Transition {
        status: RolloutStatus::default(),
        happened: Vec::new(),
        next_check_ms: None,
    };
    let Some(prev) = input.prev else {
        out.status = healthy(input.params, &revision);
        return out;
    };
    let mut status = RolloutStatus {
        request: None,
        ..prev.clone()
    };
    let rolling = matches!(
        prev.phase,
        RolloutPhase::Progressing | RolloutPhase::Paused | RolloutPhase::Degraded
    );
    // The stable revision is what serves outside the canary: without it readable there is
    // nothing to roll from (see `stable_params`).
    if (rolling || prev.stable_revision != revision) && stable_params(prev).is_none() {
        let why = "status.rollout.stableParams is missing, unreadable or not the stable \
                   revision; the spec's revision serves every job"
            .to_owned();
        out.status = healthy(input.params, &revision);
        out.status.handled_request = prev.handled_request.clone();
        out.happened.push(RolloutEvent::StatusUnreadable { why });
        return out;
    }
    if revision != prev.revision {
        if revision == prev.stable_revision {
            // Back to the stable revision: whatever ran ends; nothing to roll out.
            out.status = RolloutStatus {
                handled_request: prev.handled_request.clone(),
                stable_params: prev.stable_params.clone(),
                ..healthy_ids(&revision)
            };
            return out;
        }
        status = start(prev, &revision, input.rollout, effective);
        out.happened.push(RolloutEvent::Started {
            revision: revision.clone(),
        });
    } else if prev.phase == RolloutPhase::Healthy && prev.stable_revision != revision {
        // A Healthy status whose revision is not its stable one is not one we write.
        status = start(prev, &revision, input.rollout, effective);
        out.happened.push(RolloutEvent::Started {
            revision: revision.clone(),
        });
    }
    normalise_steps(&mut status, input.rollout, effective);

    if let Some(request) = input
        .request
        .filter(|r| status.handled_request.as_deref() != Some(r.id.as_str()))
    {
        status.handled_request = Some(request.id.clone());
        act(&mut status, &mut out, request, &input);
    }
    judge(&mut status, &mut out, &input, now);
    if matches!(status.phase, RolloutPhase::Healthy | RolloutPhase::Degraded) {
        status.step = None;
        status.steps.clear();
    }
    if status.phase == RolloutPhase::Healthy {
        status.evidence.clear();
    }
    status.message = message(&status, input.rollout);
    out.status = status;
    out
}

/// The status of a policy whose spec's revision serves every job.
fn healthy(params: &ResolvedPolicy, revision: &str) -> RolloutStatus {
    RolloutStatus {
        stable_params: serde_json::to_value(params).ok(),
        ..healthy_ids(revision)
    }
}

fn healthy_ids(revision: &str) -> RolloutStatus {
    RolloutStatus {
        phase: RolloutPhase::Healthy,
        revision: revision.to_owned(),
        stable_revision: revision.to_owned(),
        ..RolloutStatus::default()
    }
}

/// A rollout of `revision` at step 0 taking effect `at`, from the previous stable
/// revision, fresh evidence.
fn start(
    prev: &RolloutStatus,
    revision: &str,
    rollout: &ResolvedRollout,
    at: u64,
) -> RolloutStatus {
    let first = rollout.steps.first().map_or(1, |s| s.weight);
    RolloutStatus {
        phase: RolloutPhase::Progressing,
        revision: revision.to_owned(),
        stable_revision: prev.stable_revision.clone(),
        stable_params: prev.stable_params.clone(),
        step: Some(0),
        steps: vec![started(first, at)],
        handled_request: prev.handled_request.clone(),
        ..RolloutStatus::default()
    }
}

fn started(weight: u32, at: u64) -> StartedStep {
    StartedStep {
        weight: weight.min(99) as i32,
        start_unix_ms: at.min(i64::MAX as u64) as i64,
    }
}

/// Makes the started steps of a status from outside well formed (an exposure every
/// reader accepts): at least one, weights strictly increasing, times non-decreasing, at
/// most [`MAX_ROLLOUT_STEPS`]; `step` is the last one. A step beyond a shortened spec
/// waits for a promote.
fn normalise_steps(status: &mut RolloutStatus, rollout: &ResolvedRollout, at: u64) {
    if !matches!(
        status.phase,
        RolloutPhase::Progressing | RolloutPhase::Paused
    ) {
        return;
    }
    let mut kept: Vec<StartedStep> = Vec::new();
    for s in &status.steps {
        let ok = (1..=99).contains(&s.weight)
            && s.start_unix_ms >= 0
            && kept
                .last()
                .is_none_or(|l| s.weight > l.weight && s.start_unix_ms >= l.start_unix_ms);
        // Steps already started stay, even if `spec.rollout.steps` was shortened since:
        // dropping one would move the jobs it placed to the other revision.
        if !ok || kept.len() >= MAX_ROLLOUT_STEPS {
            break;
        }
        kept.push(*s);
    }
    if kept.is_empty() {
        kept.push(started(rollout.steps.first().map_or(1, |s| s.weight), at));
    }
    status.step = Some(kept.len() as u32 - 1);
    status.steps = kept;
}

/// Acts on a person's request (already marked handled).
fn act(
    status: &mut RolloutStatus,
    out: &mut Transition,
    request: &RolloutRequest,
    input: &Input<'_>,
) {
    let refuse = |out: &mut Transition, why: String| {
        out.happened.push(RolloutEvent::RequestRefused {
            id: request.id.clone(),
            why,
        })
    };
    if request.revision != status.revision {
        return refuse(
            out,
            format!(
                "request for revision {} but the rollout is at {}",
                request.revision, status.revision
            ),
        );
    }
    if request.step.is_some_and(|seen| status.step != Some(seen)) {
        return refuse(
            out,
            format!(
                "request made at step {:?} but the rollout is at step {:?}",
                request.step, status.step
            ),
        );
    }
    let in_rollout = matches!(
        status.phase,
        RolloutPhase::Progressing | RolloutPhase::Paused
    );
    match (request.action, status.phase) {
        (RolloutAction::Promote, _) if in_rollout => advance(status, out, input),
        // Not from Degraded: a revision rolled back for harm is retried, not promoted.
        (RolloutAction::PromoteFull, _) if in_rollout => promote(status, out, input.params),
        (RolloutAction::Abort, _) if in_rollout => {
            status.phase = RolloutPhase::Degraded;
            out.happened.push(RolloutEvent::Aborted);
        }
        (RolloutAction::Retry, RolloutPhase::Degraded) => {
            let prev = status.clone();
            *status = start(&prev, &prev.revision, input.rollout, input.step_start());
            status.handled_request = prev.handled_request;
            // The sidecars' counts of this revision keep growing per epoch: what they
            // counted so far is subtracted from now on (an epoch whose counter started
            // again meanwhile drops its baseline: operator/src/rollout/evidence.rs).
            status.evidence = prev.evidence;
            for e in &mut status.evidence {
                e.baseline = e.steps.clone();
            }
            out.happened.push(RolloutEvent::Started {
                revision: status.revision.clone(),
            });
        }
        (action, phase) => refuse(
            out,
            format!("{action:?} does not apply to a {phase:?} rollout"),
        ),
    }
}

/// Passes the current step: the next one starts, or after the last the new revision is
/// promoted. A next step whose weight is not above the started ones (the spec's steps
/// were edited mid-rollout) is skipped.
fn advance(status: &mut RolloutStatus, out: &mut Transition, input: &Input<'_>) {
    let current = status.steps.len();
    let last = status.steps.last().copied();
    let floor = last.map_or(0, |s| s.weight);
    let effective = input.step_start();
    let at = last.map_or(effective, |s| effective.max(s.start_unix_ms.max(0) as u64));
    let next = input
        .rollout
        .steps
        .iter()
        .enumerate()
        .skip(current)
        .find(|(_, s)| s.weight as i32 > floor);
    match next {
        Some((_, s)) => {
            status.steps.push(started(s.weight, at));
            status.step = Some(status.steps.len() as u32 - 1);
            status.phase = RolloutPhase::Progressing;
            out.happened.push(RolloutEvent::StepStarted {
                step: status.steps.len() as u32 - 1,
                weight: s.weight,
            });
        }
        None => promote(status, out, input.params),
    }
}

fn promote(status: &mut RolloutStatus, out: &mut Transition, params: &ResolvedPolicy) {
    status.phase = RolloutPhase::Healthy;
    status.stable_revision = status.revision.clone();
    status.stable_params = serde_json::to_value(params).ok();
    out.happened.push(RolloutEvent::Promoted {
        revision: status.revision.clone(),
    });
}

/// Reads the evidence and the clock for a running rollout: harm rolls back, a ready step
/// passes at the end of its pause, a step without a pause waits for a person, a deadline
/// applies `onInconclusive`.
fn judge(status: &mut RolloutStatus, out: &mut Transition, input: &Input<'_>, now: u64) {
    if !matches!(
        status.phase,
        RolloutPhase::Progressing | RolloutPhase::Paused
    ) {
        return;
    }
    let counts: Vec<StepCounts> = status
        .steps
        .iter()
        .enumerate()
        .map(|(k, s)| StepCounts {
            weight: s.weight as u32,
            ..input.evidence.get(k).copied().unwrap_or_default()
        })
        .collect();
    let verdict = analyse(&counts, &input.rollout.analysis);
    status.analysis = Some(analysis_status(&verdict));
    let index = status.steps.len() - 1;
    let spec_step = input.rollout.steps.get(index).copied();
    let start = status.steps[index].start_unix_ms.max(0) as u64;
    match verdict {
        Verdict::Harm { evidence } => {
            status.phase = RolloutPhase::Degraded;
            out.happened.push(RolloutEvent::RolledBack {
                why: evidence.to_string(),
            });
            return;
        }
        _ if status.phase == RolloutPhase::Paused => return,
        Verdict::Continue { step_ready, .. } => {
            let Some(pause) = spec_step.and_then(|s| s.pause_ms) else {
                status.phase = RolloutPhase::Paused;
                out.happened.push(RolloutEvent::Paused {
                    step: index as u32,
                    why: "the step has no pause: waiting for promote".to_owned(),
                });
                return;
            };
            let ends = start.saturating_add(pause);
            if step_ready && now >= ends {
                advance(status, out, input);
                if status.phase == RolloutPhase::Progressing {
                    // The next step may itself be due (a pause of 0); one step per look.
                    out.next_check_ms = Some(now);
                }
                return;
            }
            if now < ends {
                out.next_check_ms = Some(ends);
            }
        }
        Verdict::Inconclusive { .. } => {}
    }
    let Some(deadline) = spec_step
        .and_then(|s| s.max_duration_ms)
        .map(|d| start.saturating_add(d))
    else {
        return;
    };
    if now < deadline {
        out.next_check_ms = Some(out.next_check_ms.map_or(deadline, |t| t.min(deadline)));
        return;
    }
    let why = format!(
        "no verdict by the step's maxDuration: {}",
        verdict.evidence()
    );
    match input.rollout.analysis.on_inconclusive {
        OnInconclusive::Pause => {
            status.phase = RolloutPhase::Paused;
            out.happened.push(RolloutEvent::Paused {
                step: index as u32,
                why,
            });
        }
        OnInconclusive::Abort => {
            status.phase = RolloutPhase::Degraded;
            out.happened.push(RolloutEvent::RolledBack { why });
        }
    }
}

fn analysis_status(verdict: &Verdict) -> AnalysisStatus {
    let e = verdict.evidence();
    // Capped where an API server still reads JSON integers exactly.
    let int = |n: u64| n.min(crate::rollout::evidence::MAX_EVIDENCE_COUNT) as i64;
    AnalysisStatus {
        verdict: match verdict {
            Verdict::Continue { .. } => AnalysisVerdict::Continue,
            Verdict::Harm { .. } => AnalysisVerdict::Harm,
            Verdict::Inconclusive { .. } => AnalysisVerdict::Inconclusive,
        },
        e_value: e.e_value,
        threshold: e.threshold,
        failed_new: int(e.failed_jobs.new),
        failed_stable: int(e.failed_jobs.stable),
        bad_new: int(e.bad_jobs.new),
        bad_stable: int(e.bad_jobs.stable),
        step_failed_jobs: int(e.step_failed_jobs),
        min_failed_jobs: int(e.min_failed_jobs),
    }
}

/// The one-line message: phase, step, weight, samples and the two ratios.
fn message(status: &RolloutStatus, rollout: &ResolvedRollout) -> String {
    let figures = status.analysis.as_ref().map(|a| {
        let ratio = |bad: i64, failed: i64| {
            if failed > 0 {
                format!(
                    "{:.1} % ({bad}/{failed})",
                    100.0 * bad as f64 / failed as f64
                )
            } else {
                "no failed jobs".to_owned()
            }
        };
        format!(
            "bad jobs: new {}, stable {}; e-value {:.2} of {:.0}; step sample {} of {}",
            ratio(a.bad_new, a.failed_new),
            ratio(a.bad_stable, a.failed_stable),
            a.e_value,
            a.threshold,
            a.step_failed_jobs,
            a.min_failed_jobs
        )
    });
    let figures = figures.map_or_else(String::new, |f| format!("; {f}"));
    let at = |s: &RolloutStatus| {
        let step = s.step.unwrap_or(0);
        let weight = s.steps.last().map_or(0, |x| x.weight);
        format!("step {} of {} at {weight} %", step + 1, rollout.steps.len())
    };
    match status.phase {
        RolloutPhase::Healthy => format!("revision {} serves every job", status.revision),
        RolloutPhase::Progressing => format!("{}{figures}", at(status)),
        RolloutPhase::Paused => format!("{}, paused: waiting for promote{figures}", at(status)),
        RolloutPhase::Degraded => format!(
            "rolled back to {}{figures}; revert the change in Git or `kubectl rebound rollout \
             retry`",
            status.stable_revision
        ),
    }
}
