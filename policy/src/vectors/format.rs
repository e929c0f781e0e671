//! The vector file's format: the policies, questions and answers in the wire vocabulary of
//! `proto/rebound/v1/advisor.proto`, and their conversions to and from the policy types.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{
    decide::{Context, Decision, GiveUpReason, PreparedPolicy, decide},
    resolve::{Disposition, ResolvedPolicy},
    spec::{JitterKind, Strategy},
};

/// The file's format identifier.
pub const FORMAT: &str = "rebound.dev/decide-vectors/v1";
/// How to regenerate the committed file.
pub const REGENERATE: &str = "cargo run -p rebound-policy --example gen-vectors";
/// Namespace of every policy identity in the file.
pub const NAMESPACE: &str = "vectors";
/// The time every case with times is asked at (2027-01-15T08:00:00Z).
pub const NOW_UNIX_MS: u64 = 1_800_000_000_000;

/// The whole file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VectorFile {
    pub format: String,
    pub regenerate: String,
    pub cases: Vec<Case>,
}

/// One question and its answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Case {
    /// Unique, human-readable label.
    pub name: String,
    /// `namespace/name` of the policy; seeds the jitter.
    pub identity: String,
    /// The policy as `rebound.v1.ResolvedPolicy` in proto3 JSON, every field present.
    pub policy: WirePolicy,
    /// The 1-based number of the run that just failed (0 reads as 1 in `decide`; the
    /// sidecar refuses it with INVALID_ARGUMENT).
    pub attempt: u32,
    pub context: WireContext,
    pub expected: WireAnswer,
}

/// `rebound.v1.ResolvedPolicy` in proto3 JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WirePolicy {
    pub strategy: WireStrategy,
    pub base_ms: u64,
    pub multiplier: f64,
    pub cap_ms: u64,
    pub jitter: WireJitter,
    pub jitter_ratio: f64,
    pub schedule_ms: Vec<u64>,
    pub max_attempts: u32,
    /// 0 = no limit.
    pub max_retry_duration_ms: u64,
    pub non_retryable_errors: Vec<String>,
    pub terminal: WireDisposition,
    pub dead_letter_queue: String,
}

/// What the caller knows; absent fields are omitted. Times and the pushback are `u64`s
/// that may exceed 2^53, so they are decimal strings (as proto3 JSON writes them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WireContext {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_u64_string"
    )]
    pub first_failure_unix_ms: Option<u64>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_u64_string"
    )]
    pub now_unix_ms: Option<u64>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_u64_string"
    )]
    pub retry_after_ms: Option<u64>,
}

/// The answer as the fields of `rebound.v1.DecideResponse`, every one present.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WireAnswer {
    pub decision: WireDecision,
    /// 0 on give-up.
    pub delay_ms: u64,
    pub disposition: WireDisposition,
    pub dead_letter_queue: String,
    pub reason: WireReason,
    /// The reason for people ("" on retry); ports write it exactly too.
    pub reason_message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireStrategy {
    #[serde(rename = "STRATEGY_EXPONENTIAL")]
    Exponential,
    #[serde(rename = "STRATEGY_LINEAR")]
    Linear,
    #[serde(rename = "STRATEGY_CONSTANT")]
    Constant,
    #[serde(rename = "STRATEGY_DECORRELATED")]
    Decorrelated,
    #[serde(rename = "STRATEGY_SCHEDULE")]
    Schedule,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireJitter {
    #[serde(rename = "JITTER_NONE")]
    None,
    #[serde(rename = "JITTER_FULL")]
    Full,
    #[serde(rename = "JITTER_EQUAL")]
    Equal,
    #[serde(rename = "JITTER_PROPORTIONAL")]
    Proportional,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDisposition {
    #[serde(rename = "DISPOSITION_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "DISPOSITION_DROP")]
    Drop,
    #[serde(rename = "DISPOSITION_DEAD_LETTER")]
    DeadLetter,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDecision {
    #[serde(rename = "DECISION_RETRY")]
    Retry,
    #[serde(rename = "DECISION_GIVE_UP")]
    GiveUp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireReason {
    #[serde(rename = "GIVE_UP_REASON_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "GIVE_UP_REASON_MAX_ATTEMPTS")]
    MaxAttempts,
    #[serde(rename = "GIVE_UP_REASON_DEADLINE")]
    Deadline,
    #[serde(rename = "GIVE_UP_REASON_NON_RETRYABLE")]
    NonRetryable,
}

/// A case whose policy is not a valid resolved policy.
#[derive(Debug, thiserror::Error)]
#[error("case {case}: policy {field}: {message}")]
pub struct CaseError {
    pub case: String,
    pub field: String,
    pub message: String,
}

impl From<&ResolvedPolicy> for WirePolicy {
    fn from(p: &ResolvedPolicy) -> Self {
        let (terminal, dead_letter_queue) = match &p.terminal {
            Disposition::Drop => (WireDisposition::Drop, String::new()),
            Disposition::DeadLetter { dead_letter_queue } => {
                (WireDisposition::DeadLetter, dead_letter_queue.clone())
            }
        };
        Self {
            strategy: match p.strategy {
                Strategy::Exponential => WireStrategy::Exponential,
                Strategy::Linear => WireStrategy::Linear,
                Strategy::Constant => WireStrategy::Constant,
                Strategy::Decorrelated => WireStrategy::Decorrelated,
                Strategy::Schedule => WireStrategy::Schedule,
            },
            base_ms: p.base_ms,
            multiplier: p.multiplier,
            cap_ms: p.cap_ms,
            jitter: match p.jitter {
                JitterKind::None => WireJitter::None,
                JitterKind::Full => WireJitter::Full,
                JitterKind::Equal => WireJitter::Equal,
                JitterKind::Proportional => WireJitter::Proportional,
            },
            jitter_ratio: p.jitter_ratio,
            schedule_ms: p.schedule_ms.clone(),
            max_attempts: p.max_attempts,
            max_retry_duration_ms: p.max_retry_duration_ms.unwrap_or(0),
            non_retryable_errors: p.non_retryable_errors.clone(),
            terminal,
            dead_letter_queue,
        }
    }
}

impl WirePolicy {
    /// The resolved policy, checked as a compiled document's policies are.
    pub fn to_resolved(&self) -> Result<ResolvedPolicy, crate::FieldError> {
        let terminal = match self.terminal {
            WireDisposition::DeadLetter => Disposition::DeadLetter {
                dead_letter_queue: self.dead_letter_queue.clone(),
            },
            WireDisposition::Drop => Disposition::Drop,
            WireDisposition::Unspecified => {
                return Err(crate::FieldError {
                    field: "terminal".to_owned(),
                    message: "must be DISPOSITION_DROP or DISPOSITION_DEAD_LETTER".to_owned(),
                });
            }
        };
        let resolved = ResolvedPolicy {
            strategy: match self.strategy {
                WireStrategy::Exponential => Strategy::Exponential,
                WireStrategy::Linear => Strategy::Linear,
                WireStrategy::Constant => Strategy::Constant,
                WireStrategy::Decorrelated => Strategy::Decorrelated,
                WireStrategy::Schedule => Strategy::Schedule,
            },
            base_ms: self.base_ms,
            multiplier: self.multiplier,
            cap_ms: self.cap_ms,
            jitter: match self.jitter {
                WireJitter::None => JitterKind::None,
                WireJitter::Full => JitterKind::Full,
                WireJitter::Equal => JitterKind::Equal,
                WireJitter::Proportional => JitterKind::Proportional,
            },
            jitter_ratio: self.jitter_ratio,
            schedule_ms: self.schedule_ms.clone(),
            max_attempts: self.max_attempts,
            max_retry_duration_ms: (self.max_retry_duration_ms != 0)
                .then_some(self.max_retry_duration_ms),
            non_retryable_errors: self.non_retryable_errors.clone(),
            terminal,
            retry_budget: None,
        };
        resolved.check()?;
        Ok(resolved)
    }
}

impl WireContext {
    pub fn to_context(&self) -> Context<'_> {
        Context {
            job_id: self.job_id.as_deref(),
            error_class: self.error_class.as_deref(),
            first_failure_ms: self.first_failure_unix_ms,
            now_ms: self.now_unix_ms,
            retry_after_ms: self.retry_after_ms,
        }
    }
}

impl WireAnswer {
    pub fn of(decision: &Decision) -> Self {
        match decision {
            Decision::Retry { delay_ms } => Self {
                decision: WireDecision::Retry,
                delay_ms: *delay_ms,
                disposition: WireDisposition::Unspecified,
                dead_letter_queue: String::new(),
                reason: WireReason::Unspecified,
                reason_message: String::new(),
            },
            Decision::GiveUp {
                disposition,
                reason,
            } => {
                let (disposition, dead_letter_queue) = match disposition {
                    Disposition::Drop => (WireDisposition::Drop, String::new()),
                    Disposition::DeadLetter { dead_letter_queue } => {
                        (WireDisposition::DeadLetter, dead_letter_queue.clone())
                    }
                };
                Self {
                    decision: WireDecision::GiveUp,
                    delay_ms: 0,
                    disposition,
                    dead_letter_queue,
                    reason: match reason {
                        GiveUpReason::MaxAttempts { .. } => WireReason::MaxAttempts,
                        GiveUpReason::Deadline { .. } => WireReason::Deadline,
                        GiveUpReason::NonRetryable { .. } => WireReason::NonRetryable,
                    },
                    reason_message: reason.to_string(),
                }
            }
        }
    }
}

impl Case {
    /// The policy bound to its identity, ready for [`decide`].
    pub fn bound_policy(&self) -> Result<PreparedPolicy, CaseError> {
        let resolved = self.policy.to_resolved().map_err(|e| CaseError {
            case: self.name.clone(),
            field: e.field,
            message: e.message,
        })?;
        Ok(PreparedPolicy::new(self.identity.clone(), resolved))
    }

    /// `decide`'s answer to this case's question, in wire terms.
    pub fn answer(&self) -> Result<WireAnswer, CaseError> {
        let policy = self.bound_policy()?;
        Ok(WireAnswer::of(&decide(
            &policy,
            self.attempt,
            &self.context.to_context(),
        )))
    }
}

impl VectorFile {
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Pretty enough to review and diff: one case per line.
    pub fn to_json(&self) -> String {
        one_case_per_line(&self.format, &self.regenerate, &self.cases)
    }
}

/// An optional `u64` as a decimal string (proto3 JSON), for fields that may pass 2^53.
pub(super) mod opt_u64_string {
    use super::*;

    pub fn serialize<S: Serializer>(value: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => s.serialize_str(&v.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| t.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A `u64` as a decimal string (proto3 JSON).
pub(super) mod u64_string {
    use super::*;

    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&value.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A vector file's JSON with its header fields first and one case per line, so that a
/// regenerated file reviews and diffs line by line.
pub(crate) fn one_case_per_line<C: Serialize>(
    format: &str,
    regenerate: &str,
    cases: &[C],
) -> String {
    let head = serde_json::json!({"format": format, "regenerate": regenerate});
    let mut out = String::from("{\n");
    for (key, value) in head.as_object().into_iter().flatten() {
        out.push_str(&format!("  {}: {},\n", serde_json::json!(key), value));
    }
    out.push_str("  \"cases\": [\n");
    let lines: Vec<String> = cases
        .iter()
        .map(|c| format!("    {}", serde_json::to_string(c).unwrap_or_default()))
        .collect();
    out.push_str(&lines.join(",\n"));
    out.push_str("\n  ]\n}\n");
    out
}
