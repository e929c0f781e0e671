//! Cross-language vectors for the rollout assignment ([`crate::rollout::assign`]):
//! `policy/testdata/assign-vectors.json`, written by the same generator as the decide
//! vectors. A file of its own, not a section of `decide-vectors.json`: the adapters read
//! that file with strict parsers (unknown fields refused), and an assignment case has
//! none of a decide case's fields.

use serde::{Deserialize, Serialize};

use super::format::{opt_u64_string, u64_string};
use crate::{
    decide::SplitMix64,
    digest::sha256_id,
    rollout::assign::{Arm, Exposure, Step, arm},
};

/// The file's format identifier.
pub const FORMAT: &str = "rebound.dev/assign-vectors/v1";
/// The committed file, relative to the policy crate.
pub const PATH: &str = "testdata/assign-vectors.json";

/// The whole file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AssignFile {
    pub format: String,
    pub regenerate: String,
    pub cases: Vec<AssignCase>,
}

/// One job asked of one rollout, and the arm it gets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AssignCase {
    pub name: String,
    /// The new revision's id; salts the hash.
    pub revision: String,
    /// The started steps, as `GetPolicy` returns them.
    pub steps: Vec<WireStep>,
    /// Absent: the request had none (an empty string is asked as it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_u64_string"
    )]
    pub first_failure_unix_ms: Option<u64>,
    #[serde(with = "u64_string")]
    pub now_unix_ms: u64,
    pub expected: Expected,
}

/// `rebound.v1.RolloutStep` in proto3 JSON.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WireStep {
    pub weight: u32,
    #[serde(with = "u64_string")]
    pub start_unix_ms: u64,
}

/// The answer: the job's bucket (absent without a job id) and its arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Expected {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<u32>,
    pub arm: WireArm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireArm {
    #[serde(rename = "STABLE")]
    Stable,
    #[serde(rename = "CANARY")]
    Canary,
}

impl From<Arm> for WireArm {
    fn from(a: Arm) -> Self {
        match a {
            Arm::Stable => WireArm::Stable,
            Arm::Canary => WireArm::Canary,
        }
    }
}

impl AssignCase {
    /// What this build answers for the case.
    pub fn answer(&self) -> Result<Expected, crate::resolve::FieldError> {
        let steps = self
            .steps
            .iter()
            .map(|s| Step {
                weight: s.weight,
                start_unix_ms: s.start_unix_ms,
            })
            .collect();
        let exposure = Exposure::new(self.revision.clone(), steps)?;
        let job_id = self.job_id.as_deref();
        Ok(Expected {
            bucket: job_id
                .filter(|id| !id.is_empty())
                .map(|id| exposure.bucket(id)),
            arm: arm(
                &exposure,
                job_id,
                self.first_failure_unix_ms,
                self.now_unix_ms,
            )
            .into(),
        })
    }
}

impl AssignFile {
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// One case per line, like the decide vectors.
    pub fn to_json(&self) -> String {
        super::format::one_case_per_line(&self.format, &self.regenerate, &self.cases)
    }
}

/// When the first step of every rollout in the file starts (2027-01-15T08:00:00Z).
const T0: u64 = super::NOW_UNIX_MS;
const MINUTE: u64 = 60_000;

/// The revisions: opaque salts, the ids of three labels (the file does not change when
/// the resolved parameters gain a field).
fn revisions() -> Vec<(&'static str, String)> {
    ["r25", "r5", "r2"]
        .into_iter()
        .map(|label| {
            (
                label,
                sha256_id(format!("assign-vectors/{label}").as_bytes()),
            )
        })
        .collect()
}

/// The rollouts' started steps: weight 1 alone, two and three steps, 99, equal starts.
fn schedules() -> Vec<(&'static str, Vec<WireStep>)> {
    let s = |steps: &[(u32, u64)]| {
        steps
            .iter()
            .map(|&(weight, at)| WireStep {
                weight,
                start_unix_ms: T0 + at * MINUTE,
            })
            .collect()
    };
    vec![
        ("none-started", Vec::new()),
        ("w1", s(&[(1, 0)])),
        ("w10-w50", s(&[(10, 0), (50, 10)])),
        ("w10-w50-w99", s(&[(10, 0), (50, 10), (99, 40)])),
        ("w5-w20-same-start", s(&[(5, 0), (20, 0)])),
    ]
}

/// Fixed ids, non-ASCII among them, then for each revision the first `job-N` ids whose
/// buckets sit on the weights' edges (0, 1, 9, 10, 49, 50, 98, 99).
fn job_ids(revision: &str) -> Vec<Option<String>> {
    let mut ids: Vec<Option<String>> = vec![
        None,
        Some(String::new()),
        Some("job-1".into()),
        Some("7f9c2ba4-e88f-4c7d-9a1b-3f2e8d6c5b10".into()),
        Some("123456789".into()),
        Some("commande-é".into()),
        Some("ジョブ-42".into()),
        Some("🚀-rocket".into()),
    ];
    let probe = Exposure::new(revision.to_owned(), Vec::new())
        .unwrap_or_else(|e| panic!("vector revision: {e}"));
    let mut rng = SplitMix64::new(31);
    for edge in [0, 1, 9, 10, 49, 50, 98, 99] {
        let id = (0..)
            .map(|_| format!("job-{}", rng.below(1 << 40)))
            .find(|id| probe.bucket(id) == edge)
            .unwrap_or_default();
        ids.push(Some(id));
    }
    ids
}

/// Times at and just before every step boundary, before the first step and long after the last.
fn times(steps: &[WireStep]) -> Vec<u64> {
    let mut t = vec![T0 - MINUTE, T0 + 24 * 60 * MINUTE];
    for s in steps {
        t.extend([s.start_unix_ms - 1, s.start_unix_ms]);
    }
    t.sort_unstable();
    t.dedup();
    t
}

/// Every case of the file: the whole grid for the first revision; the other revisions
/// (other salts, so other edge ids) on the two-step rollout.
pub fn generate() -> AssignFile {
    let mut cases = Vec::new();
    for (r, (label, revision)) in revisions().into_iter().enumerate() {
        let ids = job_ids(&revision);
        for (schedule, steps) in schedules() {
            if r > 0 && schedule != "w10-w50" {
                continue;
            }
            let later = T0 + 24 * 60 * MINUTE;
            for (j, job_id) in ids.iter().enumerate() {
                for t in times(&steps) {
                    // The first failure at t, asked a day later; on the two-step rollout of
                    // the first revision also t as `now` without a first failure.
                    let mut asks = vec![("first", Some(t), later)];
                    if r == 0 && schedule == "w10-w50" {
                        asks.push(("now", None, t));
                    }
                    for (kind, first, now) in asks {
                        let offset = t as i64 - T0 as i64;
                        let mut case = AssignCase {
                            name: format!("{label}/{schedule}/job{j}/{kind}{offset:+}"),
                            revision: revision.clone(),
                            steps: steps.clone(),
                            job_id: job_id.clone(),
                            first_failure_unix_ms: first,
                            now_unix_ms: now,
                            expected: Expected {
                                bucket: None,
                                arm: WireArm::Stable,
                            },
                        };
                        case.expected = case
                            .answer()
                            .unwrap_or_else(|e| panic!("vector {}: {e}", case.name));
                        cases.push(case);
                    }
                }
            }
        }
    }
    AssignFile {
        format: FORMAT.to_owned(),
        regenerate: super::REGENERATE.to_owned(),
        cases,
    }
}
