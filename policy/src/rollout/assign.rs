//! Which revision of a policy in rollout answers a job.
//!
//! A job is assigned by a hash of its id salted with the new revision's id, against the
//! weight in effect at the job's FIRST failure. So every attempt of a job gets the same
//! revision from any sidecar, across restarts and step changes, with no state anywhere;
//! and the fallback of every adapter, which ports these few lines, agrees bit for bit
//! (`policy/testdata/assign-vectors.json`, described in `policy/testdata/README.md`).

use serde::{Deserialize, Serialize};

use crate::{
    decide::{hash_bytes, mix64},
    digest,
    limits::{MAX_ROLLOUT_STEPS, MAX_ROLLOUT_WEIGHT},
    resolve::{FieldError, ResolvedPolicy},
};

/// The revision that answers a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arm {
    /// The revision that served before the rollout (the compiled document's `params`).
    Stable,
    /// The revision being rolled out.
    Canary,
}

/// One started step: from `start_unix_ms` on, `weight` percent of newly failing jobs get
/// the canary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// Integer percent, 1..=99.
    pub weight: u32,
    /// Milliseconds since the Unix epoch.
    pub start_unix_ms: u64,
}

/// What a rollout exposes: the new revision (the hash salt) and the steps started so far.
/// Built only through [`Exposure::new`], so its steps are always well formed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exposure {
    revision: String,
    /// `hash_bytes(revision)`, computed once.
    salt: u64,
    steps: Vec<Step>,
}

impl Exposure {
    /// Checks a revision and its started steps: the id as [`revision_id`] writes it, at most
    /// [`MAX_ROLLOUT_STEPS`] steps, weights in 1..=99 strictly increasing, start times
    /// non-decreasing. Errors name the field relative to the rollout (`steps[1].weight`).
    pub fn new(revision: impl Into<String>, steps: Vec<Step>) -> Result<Self, FieldError> {
        let revision = revision.into();
        let fail = |field: String, message: String| Err(FieldError { field, message });
        if !digest::is_sha256_id(&revision) {
            return fail(
                "revision".to_owned(),
                "must be sha256: followed by 64 lowercase hex digits".to_owned(),
            );
        }
        if steps.len() > MAX_ROLLOUT_STEPS {
            return fail(
                "steps".to_owned(),
                format!(
                    "holds {} steps; at most {MAX_ROLLOUT_STEPS} are allowed",
                    steps.len()
                ),
            );
        }
        for (i, step) in steps.iter().enumerate() {
            if !(1..=MAX_ROLLOUT_WEIGHT).contains(&step.weight) {
                return fail(
                    format!("steps[{i}].weight"),
                    format!(
                        "must be between 1 and {MAX_ROLLOUT_WEIGHT}, got {}",
                        step.weight
                    ),
                );
            }
            if let Some(before) = i.checked_sub(1).map(|j| steps[j]) {
                if step.weight <= before.weight {
                    return fail(
                        format!("steps[{i}].weight"),
                        format!(
                            "must be above the previous step's {}, got {}",
                            before.weight, step.weight
                        ),
                    );
                }
                if step.start_unix_ms < before.start_unix_ms {
                    return fail(
                        format!("steps[{i}].startUnixMs"),
                        format!(
                            "must not be before the previous step's {}, got {}",
                            before.start_unix_ms, step.start_unix_ms
                        ),
                    );
                }
            }
        }
        Ok(Self {
            salt: hash_bytes(revision.as_bytes()),
            revision,
            steps,
        })
    }

    /// The new revision's id.
    pub fn revision(&self) -> &str {
        &self.revision
    }

    /// The started steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// The weight in effect at `t`: that of the last step started at or before `t`; `None`
    /// before the first step.
    pub fn weight_at(&self, t_unix_ms: u64) -> Option<u32> {
        self.step_at(t_unix_ms).map(|(_, weight)| weight)
    }

    /// The step in effect at `t`, as (index, weight): the last started at or before `t`;
    /// `None` before the first step.
    pub fn step_at(&self, t_unix_ms: u64) -> Option<(usize, u32)> {
        // Start times are non-decreasing, so the steps started by `t` are a prefix.
        let started = self.steps.partition_point(|s| s.start_unix_ms <= t_unix_ms);
        let i = started.checked_sub(1)?;
        Some((i, self.steps[i].weight))
    }

    /// A job id's bucket in 0..100 for this revision.
    pub fn bucket(&self, job_id: &str) -> u32 {
        (mix64(hash_bytes(job_id.as_bytes()) ^ self.salt) % 100) as u32
    }
}

/// The revision that answers a job: Stable without a job id (`None` or empty) or before
/// the first step; else Canary iff the job's bucket is below the weight in effect at its
/// first failure (at `now_unix_ms` when that is unknown).
pub fn arm(
    exposure: &Exposure,
    job_id: Option<&str>,
    first_failure_unix_ms: Option<u64>,
    now_unix_ms: u64,
) -> Arm {
    let Some(job_id) = job_id.filter(|id| !id.is_empty()) else {
        return Arm::Stable;
    };
    let t = first_failure_unix_ms.unwrap_or(now_unix_ms);
    match exposure.weight_at(t) {
        Some(weight) if exposure.bucket(job_id) < weight => Arm::Canary,
        _ => Arm::Stable,
    }
}

/// The id of a revision: [`digest::sha256_id`] of the resolved parameters' JSON, as the
/// compiled document writes them (fields in declaration order, absent options left out),
/// so equal parameters always give equal ids.
pub fn revision_id(params: &ResolvedPolicy) -> String {
    // Serialising plain data with string keys cannot fail.
    digest::sha256_id(&serde_json::to_vec(params).unwrap_or_default())
}

#[cfg(test)]
mod tests;
