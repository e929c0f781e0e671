//! Validation and defaults of `spec.rollout`, kept apart from [`super::ResolvedPolicy`]:
//! the rollout says how a change is applied, not what decides a delay, so the resolved
//! parameters (and the revision ids and compiled documents hashed from them) never see it.

use serde::{Deserialize, Serialize};

use super::{Errors, FieldError, to_millis};
use crate::{
    limits::{
        MAX_ALPHA, MAX_MIN_FAILED_JOBS, MAX_RELATIVE_INCREASE, MAX_ROLLOUT_STEPS,
        MAX_ROLLOUT_WEIGHT, MIN_ALPHA, MIN_ROLLOUT_WEIGHT,
    },
    spec::{OnInconclusive, RolloutSpec, rules},
};

/// Documented defaults of `spec.rollout.analysis`.
pub mod defaults {
    use crate::spec::OnInconclusive;
    pub const MAX_RELATIVE_INCREASE: f64 = 0.2;
    pub const ALPHA: f64 = 0.05;
    pub const MIN_FAILED_JOBS: u64 = 200;
    pub const ON_INCONCLUSIVE: OnInconclusive = OnInconclusive::Pause;
}

/// A validated rollout: durations in milliseconds, defaults applied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedRollout {
    /// 1 to 10 steps, weights strictly increasing within 1..=99.
    pub steps: Vec<ResolvedStep>,
    pub analysis: ResolvedAnalysis,
}

/// One step: the new revision's share of jobs and how long the step may last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedStep {
    /// Percent of jobs on the new revision.
    pub weight: u32,
    /// `None`: the step waits for a manual promote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<u64>,
    /// `None`: no deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration_ms: Option<u64>,
}

/// The analysis settings with defaults applied.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedAnalysis {
    /// Harm means p_new / p_stable above `1 + max_relative_increase`.
    pub max_relative_increase: f64,
    /// False-abort bound; abort when the e-value reaches `1 / alpha`.
    pub alpha: f64,
    /// Failed jobs (both revisions) a step needs before it may pass.
    pub min_failed_jobs: u64,
    pub on_inconclusive: OnInconclusive,
}

impl Default for ResolvedAnalysis {
    fn default() -> Self {
        Self {
            max_relative_increase: defaults::MAX_RELATIVE_INCREASE,
            alpha: defaults::ALPHA,
            min_failed_jobs: defaults::MIN_FAILED_JOBS,
            on_inconclusive: defaults::ON_INCONCLUSIVE,
        }
    }
}

/// Validates `spec.rollout` and applies its defaults; every problem is reported, each
/// named by its path under `spec.rollout`.
pub fn resolve_rollout(rollout: &RolloutSpec) -> Result<ResolvedRollout, Vec<FieldError>> {
    let mut errors = Errors::default();
    match check(&mut errors, rollout) {
        Some(resolved) if errors.0.is_empty() => Ok(resolved),
        _ => Err(errors.0),
    }
}

/// The checks, recording into `errors`; `None` when anything is wrong.
pub(super) fn check(errors: &mut Errors, rollout: &RolloutSpec) -> Option<ResolvedRollout> {
    const AT: &str = "spec.rollout";
    let before = errors.0.len();
    let steps = &rollout.steps;
    if steps.is_empty() || steps.len() > MAX_ROLLOUT_STEPS {
        errors.push(
            "spec.rollout.steps",
            format!(
                "must list between 1 and {MAX_ROLLOUT_STEPS} steps, got {}",
                steps.len()
            ),
        );
        // No per-step work for an oversized list.
        return None;
    }
    let mut resolved = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let at = format!("{AT}.steps[{i}]");
        if !(MIN_ROLLOUT_WEIGHT..=MAX_ROLLOUT_WEIGHT).contains(&step.weight) {
            errors.push(
                &format!("{at}.weight"),
                format!(
                    "must be between {MIN_ROLLOUT_WEIGHT} and {MAX_ROLLOUT_WEIGHT} (percent), got {}",
                    step.weight
                ),
            );
        }
        let pause_ns = step
            .pause
            .as_ref()
            .and_then(|d| errors.duration(&format!("{at}.pause"), d));
        let max_ns = step
            .max_duration
            .as_ref()
            .and_then(|d| errors.duration(&format!("{at}.maxDuration"), d));
        errors.rule(
            &at,
            &rules::MAX_DURATION_AT_LEAST_PAUSE,
            match (max_ns, pause_ns) {
                (Some(m), Some(p)) => m >= p,
                _ => true,
            },
        );
        resolved.push(ResolvedStep {
            weight: step.weight,
            pause_ms: pause_ns.map(to_millis),
            max_duration_ms: max_ns.map(to_millis),
        });
    }
    if let Some(i) = (1..steps.len()).find(|&i| steps[i].weight <= steps[i - 1].weight) {
        errors.push(
            &format!("{AT}{}", rules::WEIGHTS_INCREASE.field),
            format!(
                "{}: steps[{i}].weight {} is not above steps[{}].weight {}",
                rules::WEIGHTS_INCREASE.message,
                steps[i].weight,
                i - 1,
                steps[i - 1].weight
            ),
        );
    }
    let analysis = rollout.analysis.clone().unwrap_or_default();
    let resolved_analysis = ResolvedAnalysis {
        max_relative_increase: analysis
            .max_relative_increase
            .unwrap_or(defaults::MAX_RELATIVE_INCREASE),
        alpha: analysis.alpha.unwrap_or(defaults::ALPHA),
        min_failed_jobs: analysis
            .min_failed_jobs
            .map_or(defaults::MIN_FAILED_JOBS, u64::from),
        on_inconclusive: analysis
            .on_inconclusive
            .unwrap_or(defaults::ON_INCONCLUSIVE),
    };
    let a = &resolved_analysis;
    // `contains` is false for NaN, which YAML (`.nan`) can spell.
    if !(0.0..=MAX_RELATIVE_INCREASE).contains(&a.max_relative_increase) {
        errors.push(
            "spec.rollout.analysis.maxRelativeIncrease",
            format!(
                "must be between 0 and {MAX_RELATIVE_INCREASE}, got {}",
                a.max_relative_increase
            ),
        );
    }
    if !(MIN_ALPHA..=MAX_ALPHA).contains(&a.alpha) {
        errors.push(
            "spec.rollout.analysis.alpha",
            format!(
                "must be between {MIN_ALPHA} and {MAX_ALPHA}, got {}",
                a.alpha
            ),
        );
    }
    if !(1..=u64::from(MAX_MIN_FAILED_JOBS)).contains(&a.min_failed_jobs) {
        errors.push(
            "spec.rollout.analysis.minFailedJobs",
            format!(
                "must be between 1 and {MAX_MIN_FAILED_JOBS}, got {}",
                a.min_failed_jobs
            ),
        );
    }
    (errors.0.len() == before).then_some(ResolvedRollout {
        steps: resolved,
        analysis: resolved_analysis,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        duration::KubeDuration,
        resolve,
        spec::{RetryPolicySpec, RolloutAnalysis, RolloutStep},
    };

    fn step(weight: u32, pause: Option<&str>, max: Option<&str>) -> RolloutStep {
        // Deserialized, as from a manifest: bad text is kept for validation to name.
        let d = |s: &str| -> KubeDuration {
            serde_json::from_value(serde_json::Value::from(s)).expect("a string")
        };
        RolloutStep {
            weight,
            pause: pause.map(d),
            max_duration: max.map(d),
        }
    }

    #[test]
    fn defaults_apply_and_durations_are_in_milliseconds() {
        let spec = RolloutSpec {
            steps: vec![step(10, Some("10m"), Some("1h")), step(50, None, None)],
            analysis: None,
        };
        let r = resolve_rollout(&spec).expect("valid");
        assert_eq!(
            r.steps,
            [
                ResolvedStep {
                    weight: 10,
                    pause_ms: Some(600_000),
                    max_duration_ms: Some(3_600_000)
                },
                ResolvedStep {
                    weight: 50,
                    pause_ms: None,
                    max_duration_ms: None
                }
            ]
        );
        assert_eq!(r.analysis, ResolvedAnalysis::default());
        assert_eq!((r.analysis.alpha, r.analysis.min_failed_jobs), (0.05, 200));
    }

    /// The rollout never reaches the resolved parameters: a spec with one resolves to the
    /// same params, byte for byte in canonical JSON, so revision ids and compiled
    /// documents of policies are unchanged by adding or editing `rollout`.
    #[test]
    fn a_rollout_does_not_change_the_resolved_parameters() {
        let mut spec = RetryPolicySpec {
            queues: vec!["q".into()],
            backoff: None,
            max_attempts: Some(5),
            max_retry_duration: None,
            non_retryable_errors: vec![],
            terminal: None,
            retry_budget: None,
            rollout: None,
        };
        let without = serde_json::to_string(&resolve(&spec).expect("valid")).expect("json");
        spec.rollout = Some(RolloutSpec {
            steps: vec![step(10, Some("10m"), None)],
            analysis: Some(RolloutAnalysis {
                alpha: Some(0.01),
                ..RolloutAnalysis::default()
            }),
        });
        let with = serde_json::to_string(&resolve(&spec).expect("valid")).expect("json");
        assert_eq!(without, with);
    }

    #[test]
    fn every_problem_is_named_by_its_field() {
        let spec = RolloutSpec {
            steps: vec![
                step(0, Some("1h"), Some("30m")),
                step(50, Some("1x"), None),
                step(50, None, None),
            ],
            analysis: Some(RolloutAnalysis {
                max_relative_increase: Some(f64::NAN),
                alpha: Some(0.0),
                min_failed_jobs: Some(0),
                on_inconclusive: None,
            }),
        };
        let errors = resolve_rollout(&spec).expect_err("invalid");
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.rollout.steps[0].weight",
                "spec.rollout.steps[0].maxDuration",
                "spec.rollout.steps[1].pause",
                "spec.rollout.steps",
                "spec.rollout.analysis.maxRelativeIncrease",
                "spec.rollout.analysis.alpha",
                "spec.rollout.analysis.minFailedJobs",
            ]
        );
        assert!(
            errors[3].message.contains("steps[2].weight 50"),
            "{errors:?}"
        );
    }

    /// An oversized list costs one error and no per-step work.
    #[test]
    fn too_many_steps_is_one_error() {
        let spec = RolloutSpec {
            steps: vec![step(0, Some("bad"), None); 100_000],
            analysis: None,
        };
        let errors = resolve_rollout(&spec).expect_err("invalid");
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].field, "spec.rollout.steps");
    }
}
