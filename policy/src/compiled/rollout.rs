//! A policy in rollout as the document carries it and as the table answers with it: two
//! revisions, and the one assignment function choosing between them per job.

use serde::{Deserialize, Serialize};

use crate::{
    decide::{Context, Decision, PolicyView, PreparedPolicy, decide},
    digest,
    resolve::{FieldError, ResolvedPolicy},
    rollout::assign::{Arm, Exposure, Step, arm},
    spec::{RolloutPhase, RolloutStatus},
};

/// The `rollout` field of a compiled policy: the new revision, the stable one (whose
/// parameters are the policy's `params`) and the steps started so far.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompiledRollout {
    /// The new revision's id, `rollout::assign::revision_id(&canary)` as the operator
    /// wrote it; it salts the assignment.
    pub revision: String,
    pub stable_revision: String,
    /// The new revision's parameters.
    pub canary: ResolvedPolicy,
    /// Only the steps already started, in order.
    #[serde(default)]
    pub steps: Vec<Step>,
}

impl CompiledRollout {
    /// Checks the field and builds the exposure it describes. Errors name the field from
    /// the policy down (`rollout.steps[1].weight`, `rollout.canary.capMs`).
    ///
    /// The ids are checked for form, not recomputed from the parameters: a reader older
    /// or newer than the writer may encode the parameters differently, and the id only
    /// has to be the same string in every reader.
    pub fn exposure(&self) -> Result<Exposure, FieldError> {
        let under = |prefix: &str, e: FieldError| FieldError {
            field: format!("{prefix}{}", e.field),
            message: e.message,
        };
        if !digest::is_sha256_id(&self.stable_revision) {
            return Err(FieldError {
                field: "rollout.stableRevision".to_owned(),
                message: "must be sha256: followed by 64 lowercase hex digits".to_owned(),
            });
        }
        self.canary
            .check()
            .map_err(|e| under("rollout.canary.", e))?;
        Exposure::new(self.revision.clone(), self.steps.clone()).map_err(|e| under("rollout.", e))
    }
}

/// What the compiled document carries for a policy with `status.rollout`: the parameters
/// that serve outside the canary (`params`) and the rollout while one runs. Healthy: the
/// spec's parameters alone; Progressing or Paused: the stable revision's, with the spec's
/// as the canary over the started steps; Degraded: the stable revision's alone. A status
/// whose stable parameters cannot be read serves the spec's (the machine then makes it
/// Healthy: `rollout::machine::stable_params`).
pub fn compiled_rollout(
    status: &RolloutStatus,
    params: &ResolvedPolicy,
) -> (ResolvedPolicy, Option<CompiledRollout>) {
    let stable = crate::rollout::machine::stable_params(status);
    match (status.phase, stable) {
        (RolloutPhase::Progressing | RolloutPhase::Paused, Some(stable)) => {
            let rollout = CompiledRollout {
                revision: status.revision.clone(),
                stable_revision: status.stable_revision.clone(),
                canary: params.clone(),
                steps: status
                    .steps
                    .iter()
                    .map(|s| Step {
                        weight: s.weight.clamp(0, 100) as u32,
                        start_unix_ms: s.start_unix_ms.max(0) as u64,
                    })
                    .collect(),
            };
            // Never a document a reader refuses: a malformed exposure serves stable alone.
            let rollout = rollout.exposure().is_ok().then_some(rollout);
            (stable, rollout)
        }
        (RolloutPhase::Degraded, Some(stable)) => (stable, None),
        _ => (params.clone(), None),
    }
}

/// What a table entry holds for a policy in rollout; boxed in the entry so that policies
/// without one pay a pointer.
#[derive(Debug)]
pub struct RolloutEntry {
    /// The new revision, under the policy's identity (the same jitter seed as the stable
    /// one, so the revisions differ only by their parameters).
    pub canary: PreparedPolicy,
    pub exposure: Exposure,
    pub stable_revision: String,
}

impl RolloutEntry {
    /// `None` when the rollout is malformed: documents read with
    /// [`super::CompiledDocument::from_json`] never are, and a policy built in the process
    /// with a bad one is served by its stable revision alone.
    pub fn new(identity: &str, rollout: CompiledRollout) -> Option<Box<Self>> {
        let exposure = rollout.exposure().ok()?;
        Some(Self::checked(identity, rollout, exposure))
    }

    /// With the exposure [`CompiledRollout::exposure`] already built from `rollout`.
    pub(super) fn checked(
        identity: &str,
        rollout: CompiledRollout,
        exposure: Exposure,
    ) -> Box<Self> {
        Box::new(Self {
            canary: PreparedPolicy::new(identity, rollout.canary),
            exposure,
            stable_revision: rollout.stable_revision,
        })
    }
}

/// The revision that answers a request.
#[derive(Clone, Copy, Debug)]
pub struct Selected<'a> {
    pub policy: &'a dyn PolicyView,
    pub arm: Arm,
    /// The answering revision's id; `""` for a policy not in rollout.
    pub revision: &'a str,
}

impl super::TableEntry {
    /// The revision that answers a job, by [`arm`]: the stable one without a rollout,
    /// without a job id or before the first step. A context without `now_ms` and without
    /// `first_failure_ms` has no time to place the job, so it gets the stable revision.
    pub fn select(&self, ctx: &Context<'_>) -> Selected<'_> {
        let Some(rollout) = &self.rollout else {
            return Selected {
                policy: self,
                arm: Arm::Stable,
                revision: "",
            };
        };
        let now = ctx.now_ms.unwrap_or(0);
        match arm(&rollout.exposure, ctx.job_id, ctx.first_failure_ms, now) {
            Arm::Stable => Selected {
                policy: self,
                arm: Arm::Stable,
                revision: &rollout.stable_revision,
            },
            Arm::Canary => Selected {
                policy: &rollout.canary as &dyn PolicyView,
                arm: Arm::Canary,
                revision: rollout.exposure.revision(),
            },
        }
    }

    /// Decides with the revision that answers the job, and says which one did.
    pub fn decide(&self, attempt: u32, ctx: &Context<'_>) -> (Decision, Selected<'_>) {
        let selected = self.select(ctx);
        (decide(selected.policy, attempt, ctx), selected)
    }
}
