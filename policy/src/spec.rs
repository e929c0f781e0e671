//! The `RetryPolicy` custom resource (`rebound.dev/v1alpha1`), as users write it.
//!
//! Optional fields stay optional in storage: defaults are applied when a policy is
//! resolved (see [`crate::resolve`]), so what GitOps applied is what the API server stores.
//! Every cross-field rule is declared once in [`rules`] and used both as a CEL rule in the
//! CRD and by the Rust validator.

// `printcolumn(type_ = ...)` repeats keys by design; the lint misreads it as duplication.
#![allow(clippy::duplicated_attributes)]

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    duration::KubeDuration,
    limits,
    pattern::{MAX_NAME_LEN, NAME_PATTERN, PLAIN_NAME_PATTERN},
};

mod rollout;
mod rollout_status;
pub use rollout::{OnInconclusive, RolloutAnalysis, RolloutSpec, RolloutStep};
pub use rollout_status::{
    AnalysisStatus, AnalysisVerdict, EpochEvidence, EpochStep, MAX_EPOCHS, RETIRED_EPOCH,
    RolloutAction, RolloutPhase, RolloutRequest, RolloutStatus, StartedStep,
};

/// Declares how the jobs of some queues are retried and what happens when they stop.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "rebound.dev",
    version = "v1alpha1",
    kind = "RetryPolicy",
    namespaced,
    status = "RetryPolicyStatus",
    shortname = "rp",
    category = "rebound",
    doc = "Declares how failed jobs of some queues are retried and what happens when retries stop.",
    printcolumn(
        name = "Queues",
        type_ = "string",
        json_path = ".status.summary.queues",
        description = "Queues the policy serves"
    ),
    printcolumn(
        name = "Max-Attempts",
        type_ = "integer",
        json_path = ".status.summary.maxAttempts",
        description = "Runs allowed including the first"
    ),
    printcolumn(
        name = "Cap",
        type_ = "string",
        json_path = ".status.summary.cap",
        description = "Longest delay between two runs"
    ),
    printcolumn(
        name = "Give-Up-After",
        type_ = "string",
        json_path = ".status.summary.giveUpAfter.p99",
        description = "99th percentile of the time from first failure to giving up"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = "1",
        description = "Why Ready is what it is"
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].message",
        priority = "1"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicySpec {
    /// Queue names this policy governs: exact names or `*` globs.
    #[schemars(
        length(min = 1, max = limits::MAX_QUEUES),
        inner(length(max = MAX_NAME_LEN), regex(pattern = NAME_PATTERN))
    )]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub queues: Vec<String>,

    /// The delay curve between runs. Defaults: exponential, base 1s, multiplier 2, cap 10m,
    /// full jitter (none for constant and schedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,

    /// Runs allowed including the first; 5 means 4 retries. Default 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // The API server knows int32/int64 formats, not uint32.
    #[schemars(range(min = 1, max = limits::MAX_ATTEMPTS), with = "Option<i32>")]
    pub max_attempts: Option<u32>,

    /// Give up when the next run would start later than this after the first failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retry_duration: Option<KubeDuration>,

    /// Error classes (names or `*` globs) that end the job at once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = limits::MAX_ERROR_CLASSES),
        inner(length(max = MAX_NAME_LEN), regex(pattern = NAME_PATTERN))
    )]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub non_retryable_errors: Vec<String>,

    /// What happens when the policy gives up. Default: drop (the job library's own failed
    /// state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal: Option<Terminal>,

    /// Bounds how fast the sidecars serving this policy in its namespace schedule its
    /// retries, together (each books only its share of the slots): at most `burst` per
    /// slot of `1000 × burst / ratePerSecond` ms, counted at the time each retry is
    /// scheduled to run. A retry over budget is not dropped: its delay is stretched to the
    /// next slot with room. Default: no budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<RetryBudgetSpec>,

    /// How a change of this spec reaches the jobs: in steps of growing weight, promoted or
    /// rolled back on evidence. Absent: a change applies to every job at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
}

/// A retry budget as users write it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = crate::spec::rules::BUDGET_SLOT_AT_LEAST_1MS.to_rule(),
    validation = crate::spec::rules::BUDGET_SLOT_AT_MOST_60S.to_rule()
)]
pub struct RetryBudgetSpec {
    /// Retries per second this policy's queues may schedule, from all its sidecars
    /// together, 1 to 100000.
    #[schemars(range(min = 1, max = crate::limits::MAX_RATE_PER_SECOND), with = "i32")]
    pub rate_per_second: u32,
    /// Retries one slot admits, 1 to 100000; a slot lasts `1000 × burst / ratePerSecond`
    /// ms, between 1 ms and 60 s. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = crate::limits::MAX_BURST), with = "Option<i32>")]
    pub burst: Option<u32>,
}

/// The delay curve.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = crate::spec::rules::CAP_AT_LEAST_BASE.to_rule(),
    validation = crate::spec::rules::MULTIPLIER_ONLY_EXPONENTIAL.to_rule(),
    validation = crate::spec::rules::SCHEDULE_REQUIRED.to_rule(),
    validation = crate::spec::rules::SCHEDULE_ONLY_WITH_STRATEGY.to_rule(),
    validation = crate::spec::rules::NO_BASE_WITH_SCHEDULE.to_rule(),
    validation = crate::spec::rules::SCHEDULE_WITHIN_CAP.to_rule(),
    validation = crate::spec::rules::NO_JITTER_WITH_DECORRELATED.to_rule()
)]
pub struct Backoff {
    /// How the delay grows with each retry k: `exponential` (default) base × multiplier^(k−1);
    /// `linear` base × k; `constant` base every time; `decorrelated` min(cap, uniform(base,
    /// 3 × previous)); `schedule` the listed delays in order, the last one repeating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// First delay (exponential, decorrelated), step (linear) or the delay (constant). Default 1s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<KubeDuration>,
    /// Growth factor per retry; exponential only. Default 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1.0, max = limits::MAX_MULTIPLIER))]
    pub multiplier: Option<f64>,
    /// Longest delay before jitter. Default 10m, or the base / longest schedule entry if longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<KubeDuration>,
    /// Randomisation of each delay. Default full for exponential and linear, none for
    /// constant and schedule (their delays stay exactly as written); not allowed with
    /// decorrelated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter: Option<Jitter>,
    /// Explicit delays for strategy `schedule`; the last one repeats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = limits::MAX_SCHEDULE))]
    pub schedule: Option<Vec<KubeDuration>>,
}

// How the delay grows; described on the field that holds it, which `kubectl explain` shows
// (a description here would replace the field's).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum Strategy {
    /// `base × multiplier^(k−1)` for retry k.
    #[default]
    Exponential,
    /// `base × k` for retry k.
    Linear,
    /// `base` every time.
    Constant,
    /// `min(cap, uniform(base, 3 × previous))`, replayed from retry 1 (Brooker).
    Decorrelated,
    /// The listed delays in order; the last one repeats.
    Schedule,
}

/// Randomisation applied to the capped delay.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = crate::spec::rules::RATIO_ONLY_PROPORTIONAL.to_rule())]
pub struct Jitter {
    /// `none` the capped delay d exactly; `full` uniform(0, d); `equal` d/2 + uniform(0,
    /// d/2); `proportional` d × (1 ± ratio).
    pub kind: JitterKind,
    /// For `proportional`: the delay is drawn from `d × (1 ± ratio)`, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0), extend("exclusiveMinimum" = true))]
    pub ratio: Option<f64>,
}

// Jitter kinds, described on `Jitter::kind`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum JitterKind {
    /// The capped delay exactly.
    None,
    /// `uniform(0, d)`.
    #[default]
    Full,
    /// `d/2 + uniform(0, d/2)`.
    Equal,
    /// `d × (1 ± ratio)`.
    Proportional,
}

/// What happens when the policy gives up.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = crate::spec::rules::DEAD_LETTER_NEEDS_QUEUE.to_rule(),
    validation = crate::spec::rules::QUEUE_ONLY_FOR_DEAD_LETTER.to_rule()
)]
pub struct Terminal {
    /// `deadLetter` moves the job to `deadLetterQueue`; `drop` (default) leaves it to the job
    /// library's own failed state.
    pub action: TerminalAction,
    /// Where dead-lettered jobs go; required with `deadLetter`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_NAME_LEN), regex(pattern = PLAIN_NAME_PATTERN))]
    pub dead_letter_queue: Option<String>,
}

// Terminal actions, described on `Terminal::action`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum TerminalAction {
    /// Move the job to `deadLetterQueue`.
    DeadLetter,
    /// Leave the job to the library's own failed state.
    #[default]
    Drop,
}

/// What the operator observed; written with server-side apply by the operator only.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicyStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<ScheduleSummary>,
    /// Present for a policy that declares `spec.rollout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
}

/// A condition in the standard Kubernetes shape.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The condition's type, CamelCase (`Ready`, `Reconciling`, `Stalled`).
    #[serde(rename = "type")]
    #[schemars(length(max = 316), regex(pattern = CONDITION_TYPE_PATTERN))]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    #[schemars(extend("enum" = ["True", "False", "Unknown"]))]
    pub status: String,
    /// A CamelCase word for why the condition is what it is.
    #[schemars(length(min = 1, max = 1024), regex(pattern = CONDITION_REASON_PATTERN))]
    pub reason: String,
    /// What a person should know, in a sentence.
    #[schemars(length(max = 32768))]
    pub message: String,
    /// The `.metadata.generation` the condition was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
    /// When `status` last flipped (RFC 3339).
    #[schemars(extend("format" = "date-time"))]
    pub last_transition_time: String,
}

/// `metav1.Condition`'s own patterns, so the schema is the standard one.
const CONDITION_TYPE_PATTERN: &str = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$";
const CONDITION_REASON_PATTERN: &str = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$";

/// The resolved schedule, for people reading `kubectl get`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScheduleSummary {
    #[schemars(with = "i32")]
    pub max_attempts: u32,
    pub cap: String,
    pub give_up_after: GiveUpAfter,
    /// `deadLetter:<queue>` or `drop`.
    pub terminal: String,
    /// Queues this policy actually serves after conflicts are resolved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub serving_queues: Vec<String>,
    /// The same, comma-separated, for the `kubectl get` column.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub queues: String,
    /// The retry budget as the fleet sees it, e.g. `10/s, burst 1 (100ms slots) for 3
    /// sidecars`; absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<String>,
}

/// Time from the first failure until the policy gives up, as duration strings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GiveUpAfter {
    pub p50: String,
    pub p99: String,
    pub max: String,
}

pub mod rules {
    //! Cross-field rules: one definition, used as CEL in the CRD and by the Rust validator.

    /// A CEL rule with the field it reports and the message users see.
    pub struct CrossFieldRule {
        /// Path of the reported field relative to the object the rule sits on (`.cap`).
        pub field: &'static str,
        pub cel: &'static str,
        pub message: &'static str,
    }

    impl CrossFieldRule {
        pub fn to_rule(&self) -> kube::core::Rule {
            kube::core::Rule::new(self.cel)
                .message(self.message)
                .field_path(self.field)
        }
    }

    pub const CAP_AT_LEAST_BASE: CrossFieldRule = CrossFieldRule {
        field: ".cap",
        cel: "!has(self.cap) || !has(self.base) || duration(self.cap) >= duration(self.base)",
        message: "cap must be at least base",
    };
    pub const MULTIPLIER_ONLY_EXPONENTIAL: CrossFieldRule = CrossFieldRule {
        field: ".multiplier",
        cel: "!has(self.multiplier) || !has(self.strategy) || self.strategy == 'exponential'",
        message: "multiplier applies only to strategy exponential",
    };
    pub const SCHEDULE_REQUIRED: CrossFieldRule = CrossFieldRule {
        field: ".schedule",
        cel: "!has(self.strategy) || self.strategy != 'schedule' || has(self.schedule)",
        message: "schedule must list at least one delay when strategy is schedule",
    };
    pub const SCHEDULE_ONLY_WITH_STRATEGY: CrossFieldRule = CrossFieldRule {
        field: ".schedule",
        cel: "!has(self.schedule) || (has(self.strategy) && self.strategy == 'schedule')",
        message: "schedule applies only to strategy schedule",
    };
    pub const NO_BASE_WITH_SCHEDULE: CrossFieldRule = CrossFieldRule {
        field: ".base",
        cel: "!has(self.base) || !has(self.strategy) || self.strategy != 'schedule'",
        message: "base does not apply to strategy schedule (the schedule lists every delay)",
    };
    pub const SCHEDULE_WITHIN_CAP: CrossFieldRule = CrossFieldRule {
        field: ".schedule",
        cel: "!has(self.schedule) || !has(self.cap) || self.schedule.all(d, duration(d) <= duration(self.cap))",
        message: "every schedule entry must be at most cap",
    };
    pub const NO_JITTER_WITH_DECORRELATED: CrossFieldRule = CrossFieldRule {
        field: ".jitter",
        cel: "!has(self.jitter) || !has(self.strategy) || self.strategy != 'decorrelated'",
        message: "jitter does not apply to strategy decorrelated (it is its own jitter)",
    };
    pub const RATIO_ONLY_PROPORTIONAL: CrossFieldRule = CrossFieldRule {
        field: ".ratio",
        cel: "has(self.ratio) == (self.kind == 'proportional')",
        message: "ratio is required with kind proportional and not allowed with other kinds",
    };
    pub const DEAD_LETTER_NEEDS_QUEUE: CrossFieldRule = CrossFieldRule {
        field: ".deadLetterQueue",
        cel: "self.action != 'deadLetter' || has(self.deadLetterQueue)",
        message: "deadLetterQueue is required when action is deadLetter",
    };
    pub const BUDGET_SLOT_AT_LEAST_1MS: CrossFieldRule = CrossFieldRule {
        field: ".burst",
        cel: "(has(self.burst) ? self.burst : 1) * 1000 >= self.ratePerSecond",
        message: "burst must be at least ratePerSecond / 1000 (a slot of 1000 × burst / ratePerSecond ms lasts at least 1ms)",
    };
    pub const BUDGET_SLOT_AT_MOST_60S: CrossFieldRule = CrossFieldRule {
        field: ".burst",
        cel: "!has(self.burst) || self.burst <= 60 * self.ratePerSecond",
        message: "burst must be at most 60 × ratePerSecond (a slot of 1000 × burst / ratePerSecond ms lasts at most 60s)",
    };
    /// Unrolled over the ten possible neighbours: CEL has no index range, and a rule on
    /// one step cannot see the previous one.
    pub const WEIGHTS_INCREASE: CrossFieldRule = CrossFieldRule {
        field: ".steps",
        cel: "(size(self.steps) < 2 || self.steps[0].weight < self.steps[1].weight) && (size(self.steps) < 3 || self.steps[1].weight < self.steps[2].weight) && (size(self.steps) < 4 || self.steps[2].weight < self.steps[3].weight) && (size(self.steps) < 5 || self.steps[3].weight < self.steps[4].weight) && (size(self.steps) < 6 || self.steps[4].weight < self.steps[5].weight) && (size(self.steps) < 7 || self.steps[5].weight < self.steps[6].weight) && (size(self.steps) < 8 || self.steps[6].weight < self.steps[7].weight) && (size(self.steps) < 9 || self.steps[7].weight < self.steps[8].weight) && (size(self.steps) < 10 || self.steps[8].weight < self.steps[9].weight)",
        message: "step weights must increase strictly from one step to the next",
    };
    pub const MAX_DURATION_AT_LEAST_PAUSE: CrossFieldRule = CrossFieldRule {
        field: ".maxDuration",
        cel: "!has(self.maxDuration) || !has(self.pause) || duration(self.maxDuration) >= duration(self.pause)",
        message: "maxDuration must be at least pause",
    };
    pub const QUEUE_ONLY_FOR_DEAD_LETTER: CrossFieldRule = CrossFieldRule {
        field: ".deadLetterQueue",
        cel: "self.action == 'deadLetter' || !has(self.deadLetterQueue)",
        message: "deadLetterQueue applies only to action deadLetter",
    };
}
