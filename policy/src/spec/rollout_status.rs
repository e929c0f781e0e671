//! `status.rollout`: where a policy's rollout stands. The operator writes it (server-side
//! apply, its own fields); `kubectl rebound rollout promote|abort|retry` writes only
//! `request` (a merge patch of the status subresource, another field manager). `spec` is
//! never written: the GitOps engine stays the source of truth.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The state of a policy that declares `spec.rollout`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    pub phase: RolloutPhase,
    /// The revision of `spec` at `observedGeneration` (`sha256:…` of its resolved
    /// parameters): the one being rolled out, or the stable one when none is.
    #[schemars(length(max = 71))]
    pub revision: String,
    /// The revision serving the jobs outside the canary; equal to `revision` once promoted.
    #[schemars(length(max = 71))]
    pub stable_revision: String,
    /// The stable revision's resolved parameters, as the compiled document carries them:
    /// `spec` holds only the new revision, so this is what keeps the stable one serving
    /// across operator restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub stable_params: Option<serde_json::Value>,
    /// Index in `spec.rollout.steps` of the current step while Progressing or Paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 9), with = "Option<i32>")]
    pub step: Option<u32>,
    /// The steps started so far for `revision`, as the compiled document carries them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10), extend("x-kubernetes-list-type" = "atomic"))]
    pub steps: Vec<StartedStep>,
    /// Why the rollout is where it is, in a sentence: step, weight, samples, the two ratios.
    #[serde(default)]
    #[schemars(length(max = 4096))]
    pub message: String,
    /// The last analysis of the evidence (`rollout::analysis::Evidence`'s fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analysis: Option<AnalysisStatus>,
    /// A person's request, written by `kubectl rebound rollout`; acted on once per `id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RolloutRequest>,
    /// The `id` of the last request acted on (or refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub handled_request: Option<String>,
    /// The last report of each sidecar process (epoch) for `revision`, kept so that an
    /// operator restart or a leader change loses nothing beyond the last report. At most
    /// 64 entries (`MAX_EPOCHS`): past it, the entries of sidecars no longer reporting merge
    /// into one `retired` entry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 65), extend("x-kubernetes-list-type" = "atomic"))]
    pub evidence: Vec<EpochEvidence>,
}

/// Most sidecar epochs `status.rollout.evidence` holds one by one (plus `retired`).
pub const MAX_EPOCHS: usize = 64;

/// The epoch of the entry that sums the epochs merged past [`MAX_EPOCHS`].
pub const RETIRED_EPOCH: &str = "retired";

/// One sidecar process's last report for the rollout's revision.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EpochEvidence {
    /// The sidecar's epoch (16 hex digits), or `retired`.
    #[schemars(length(max = 16))]
    pub epoch: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10), extend("x-kubernetes-list-type" = "atomic"))]
    pub steps: Vec<EpochStep>,
    /// The counts this epoch had when `retry` started the revision again: subtracted, so
    /// a retried rollout judges fresh evidence only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10), extend("x-kubernetes-list-type" = "atomic"))]
    pub baseline: Vec<EpochStep>,
}

/// Counts of one step in one epoch (`rollout::evidence::StepEvidence`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EpochStep {
    #[schemars(range(min = 0, max = 9))]
    pub step: u32,
    /// `[failedNew, failedAll, badNew, badAll]` of the mature jobs.
    pub mature: [u64; 4],
    /// The same for every job seen.
    pub seen: [u64; 4],
}

/// An object the API server stores as written; its reader checks it.
fn free_form_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// Where a rollout is, in Argo Rollouts' words.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RolloutPhase {
    /// No change is pending: `revision` serves every job.
    #[default]
    Healthy,
    /// A step is running; it passes on its pause and evidence.
    Progressing,
    /// A step waits for `promote` (no pause, or no verdict by `maxDuration` with
    /// `onInconclusive: Pause`).
    Paused,
    /// Rolled back (harm, `onInconclusive: Abort`, or `abort`): the stable revision serves
    /// every job until `spec` changes or `retry`.
    Degraded,
}

/// One started step.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StartedStep {
    #[schemars(range(min = 1, max = 99))]
    pub weight: i32,
    /// Milliseconds since the Unix epoch.
    #[schemars(range(min = 0))]
    pub start_unix_ms: i64,
}

/// The figures of the last analysis, for `kubectl` and the status message.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AnalysisStatus {
    /// `Continue`, `Harm` or `Inconclusive`.
    #[serde(default)]
    pub verdict: AnalysisVerdict,
    pub e_value: f64,
    pub threshold: f64,
    pub failed_new: i64,
    pub failed_stable: i64,
    pub bad_new: i64,
    pub bad_stable: i64,
    /// Failed jobs of the current step (both revisions) against the minimum it needs.
    pub step_failed_jobs: i64,
    pub min_failed_jobs: i64,
}

// The verdict named in `AnalysisStatus::verdict`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AnalysisVerdict {
    #[default]
    Continue,
    Harm,
    Inconclusive,
}

/// What a person asks of a rollout.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutRequest {
    pub action: RolloutAction,
    /// The revision the person saw: a request for another revision is refused, so a
    /// promote typed before a new commit landed cannot promote the new commit.
    #[schemars(length(max = 71))]
    pub revision: String,
    /// The step the person saw (`status.rollout.step`): a request made at another step is
    /// refused, so a `promote` that crosses a step passing on its own passes no second one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 9), with = "Option<i32>")]
    pub step: Option<u32>,
    /// Unique per request (the plugin writes a random one), so each is acted on once.
    #[schemars(length(min = 1, max = 64))]
    pub id: String,
}

// Actions of `RolloutRequest::action`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutAction {
    /// Pass the current step now (`--full`: the plugin sends `PromoteFull`).
    Promote,
    /// Promote to 100 % at once, skipping the remaining steps and analysis.
    PromoteFull,
    /// Roll back to the stable revision now.
    Abort,
    /// Start the aborted revision again at step 0.
    Retry,
}
