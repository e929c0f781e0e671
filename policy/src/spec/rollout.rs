//! `spec.rollout`: how a change of the policy reaches the jobs, in Argo Rollouts'
//! vocabulary. It says how a change is applied, not what decides a delay, so it never
//! enters the resolved parameters (nor the revision id hashed from them).

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{duration::KubeDuration, limits};

/// A change of `spec` serves a growing share of jobs (by hash of the job id) while the
/// previous revision serves the rest, and is promoted or rolled back on evidence.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = crate::spec::rules::WEIGHTS_INCREASE.to_rule())]
pub struct RolloutSpec {
    /// Exposure steps in order; after the last, the new revision serves every job.
    #[schemars(length(min = 1, max = limits::MAX_ROLLOUT_STEPS))]
    pub steps: Vec<RolloutStep>,
    /// When the evidence aborts or lets a step pass. Every field has a default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analysis: Option<RolloutAnalysis>,
}

/// One exposure step (Argo's `setWeight` followed by `pause`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = crate::spec::rules::MAX_DURATION_AT_LEAST_PAUSE.to_rule())]
pub struct RolloutStep {
    /// Percent of jobs (by job-id hash) the new revision serves, 1 to 99, above the
    /// previous step's.
    #[schemars(range(min = limits::MIN_ROLLOUT_WEIGHT, max = limits::MAX_ROLLOUT_WEIGHT), with = "i32")]
    pub weight: u32,
    /// Shortest time the step lasts: it passes once this is over and the analysis has its
    /// minimum sample without harm. Absent: wait for a manual promote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<KubeDuration>,
    /// Longest the step may run without a verdict; then `analysis.onInconclusive`
    /// applies. Absent: no deadline. At least `pause`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration: Option<KubeDuration>,
}

/// The test that compares the bad-job ratio (dead letters and drops per job that failed
/// at least once) of the new revision with the stable one's.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutAnalysis {
    /// Tolerated relative increase x of the bad-job ratio: harm means new/stable above
    /// 1 + x. 0 to 10, default 0.2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = limits::MAX_RELATIVE_INCREASE))]
    pub max_relative_increase: Option<f64>,
    /// Bound on the chance of rolling back a change that does no harm, however often the
    /// evidence is looked at. 0.001 to 0.2, default 0.05.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // The rule repeats the minimum: the API server admitted an integer `alpha: 0` under
    // `minimum: 0.001` (tests/tests/admission_differential.rs).
    #[schemars(
        range(min = limits::MIN_ALPHA, max = limits::MAX_ALPHA),
        extend("x-kubernetes-validations" = [{"rule": "self >= 0.001", "message": "must be at least 0.001"}])
    )]
    pub alpha: Option<f64>,
    /// Jobs that failed at least once during a step (both revisions) before it may pass,
    /// 1 to 10000000, default 200: no data is never a verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = limits::MAX_MIN_FAILED_JOBS), with = "Option<i32>")]
    pub min_failed_jobs: Option<u32>,
    /// What a step with no verdict by its `maxDuration` does. Default `Pause`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_inconclusive: Option<OnInconclusive>,
}

// What to do without a verdict; described on `RolloutAnalysis::on_inconclusive`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnInconclusive {
    /// Hold the step until someone promotes or aborts.
    #[default]
    Pause,
    /// Roll back to the stable revision.
    Abort,
}
