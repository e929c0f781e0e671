//! What each sidecar counts of a rollout and publishes in its fleet Lease, and how a
//! report is read back. Counts are per job, cumulative since the sidecar process started
//! (its `epoch`), so a lost or repeated renewal changes nothing and a killed sidecar loses
//! only what it counted since its last report, never counted twice.
//!
//! A Lease is written by a Pod: a report is hostile input. [`EvidenceReport::parse`] bounds
//! its size and shape; counts are taken as they are (a Pod that can write Leases in the
//! namespace can sway the analysis, as it can the fleet budgets: see docs/policy.md).

use serde::{Deserialize, Serialize};

mod count;
mod horizon;
#[cfg(test)]
mod tests;

pub use count::{EvidenceBook, Observation, Recorded};
pub use horizon::{MATURITY_MARGIN_DIVISOR, MATURITY_MARGIN_MS, horizon_ms, maturity_ms};

use crate::{digest, limits::MAX_ROLLOUT_STEPS, rollout::analysis::StepCounts};

/// The Lease annotation that carries a sidecar's [`EvidenceReport`] as JSON.
pub const EVIDENCE_ANNOTATION: &str = "rebound.dev/rollout-evidence";

/// Largest report read (and written): a sidecar reports only policies in rollout.
pub const MAX_EVIDENCE_BYTES: usize = 64 * 1024;

/// Largest count a report may carry: the operator keeps counts in `status`, whose JSON
/// integers a Kubernetes API server reads exactly only up to 2^53 (beyond, it refuses
/// every status write of the policy). No sidecar counts that many jobs.
pub const MAX_EVIDENCE_COUNT: u64 = 1 << 53;

/// Most policies one report may name.
pub const MAX_EVIDENCE_POLICIES: usize = 128;

/// One sidecar process's counts for every policy in rollout it has answered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EvidenceReport {
    /// Random per process start, 16 lowercase hex digits: counts of one epoch only grow.
    pub epoch: String,
    pub policies: Vec<PolicyEvidence>,
}

/// The counts of one policy's rollout, for one new revision.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyEvidence {
    /// The policy's name (the namespace is the Lease's).
    pub policy: String,
    /// The new revision the counts are for; counts of another revision are not evidence.
    pub revision: String,
    /// One entry per step (index in the exposure) in which counted jobs first failed.
    pub steps: Vec<StepEvidence>,
}

/// Counts of the jobs whose first failure fell in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepEvidence {
    /// Index of the step in the rollout's started steps.
    pub step: u32,
    /// Jobs whose first failure is older than both revisions' give-up horizon: their fate
    /// is known, so the analysis reads only these.
    pub mature: StepCounts,
    /// Every job counted so far, mature or not (for the status message).
    pub seen: StepCounts,
}

/// Why a report cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EvidenceError {
    #[error("report of {0} bytes is over the {MAX_EVIDENCE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("not a report: {0}")]
    Malformed(String),
    #[error("{field}: {message}")]
    Field { field: String, message: String },
}

impl EvidenceReport {
    /// Reads a report from a Lease annotation, refusing anything over the limits.
    pub fn parse(text: &str) -> Result<Self, EvidenceError> {
        if text.len() > MAX_EVIDENCE_BYTES {
            return Err(EvidenceError::TooLarge(text.len()));
        }
        let report: Self =
            serde_json::from_str(text).map_err(|e| EvidenceError::Malformed(e.to_string()))?;
        report.check()?;
        Ok(report)
    }

    /// The shape every reader relies on: an epoch of 16 hex digits, at most
    /// [`MAX_EVIDENCE_POLICIES`] policies, revision ids, at most [`MAX_ROLLOUT_STEPS`]
    /// distinct steps each.
    pub fn check(&self) -> Result<(), EvidenceError> {
        let field = |field: String, message: &str| EvidenceError::Field {
            field,
            message: message.to_owned(),
        };
        if self.epoch.len() != 16 || !self.epoch.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(field("epoch".into(), "must be 16 hex digits"));
        }
        if self.policies.len() > MAX_EVIDENCE_POLICIES {
            return Err(field("policies".into(), "too many policies"));
        }
        for (i, p) in self.policies.iter().enumerate() {
            if p.policy.is_empty() || p.policy.len() > 253 {
                return Err(field(format!("policies[{i}].policy"), "must be a name"));
            }
            if !digest::is_sha256_id(&p.revision) {
                return Err(field(
                    format!("policies[{i}].revision"),
                    "must be a sha256 id",
                ));
            }
            if p.steps.len() > MAX_ROLLOUT_STEPS {
                return Err(field(format!("policies[{i}].steps"), "too many steps"));
            }
            for (j, s) in p.steps.iter().enumerate() {
                if s.step as usize >= MAX_ROLLOUT_STEPS
                    || p.steps[..j].iter().any(|t| t.step == s.step)
                {
                    return Err(field(
                        format!("policies[{i}].steps[{j}].step"),
                        "out of range or repeated",
                    ));
                }
                let counts = [s.mature, s.seen]
                    .into_iter()
                    .flat_map(|c| [c.failed_new, c.failed_all, c.bad_new, c.bad_all]);
                if counts.into_iter().any(|n| n > MAX_EVIDENCE_COUNT) {
                    return Err(field(
                        format!("policies[{i}].steps[{j}]"),
                        "a count is over 2^53",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The counts for one policy's revision, if this report has them.
    pub fn policy(&self, name: &str, revision: &str) -> Option<&PolicyEvidence> {
        self.policies
            .iter()
            .find(|p| p.policy == name && p.revision == revision)
    }
}

#[cfg(test)]
mod report_tests {
    use super::*;

    fn report() -> EvidenceReport {
        EvidenceReport {
            epoch: "0123456789abcdef".into(),
            policies: vec![PolicyEvidence {
                policy: "payments".into(),
                revision: digest::sha256_id(b"x"),
                steps: vec![StepEvidence {
                    step: 0,
                    ..StepEvidence::default()
                }],
            }],
        }
    }

    #[test]
    fn a_report_reads_back_what_was_written() {
        let text = serde_json::to_string(&report()).unwrap();
        assert_eq!(EvidenceReport::parse(&text), Ok(report()));
    }

    #[test]
    fn hostile_reports_are_refused_naming_the_field() {
        let mut r = report();
        let repeated = r.policies[0].steps[0];
        r.policies[0].steps.push(repeated);
        let text = serde_json::to_string(&r).unwrap();
        assert!(matches!(
            EvidenceReport::parse(&text),
            Err(EvidenceError::Field { field, .. }) if field == "policies[0].steps[1].step"
        ));
        let mut huge = report();
        huge.policies[0].steps[0].seen.failed_all = u64::MAX;
        let text = serde_json::to_string(&huge).unwrap();
        assert!(matches!(
            EvidenceReport::parse(&text),
            Err(EvidenceError::Field { field, .. }) if field == "policies[0].steps[0]"
        ));
        let big = "x".repeat(MAX_EVIDENCE_BYTES + 1);
        assert_eq!(
            EvidenceReport::parse(&big),
            Err(EvidenceError::TooLarge(MAX_EVIDENCE_BYTES + 1))
        );
        assert!(matches!(
            EvidenceReport::parse("{\"epoch\":1}"),
            Err(EvidenceError::Malformed(_))
        ));
    }
}
