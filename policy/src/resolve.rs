//! Validation of a [`RetryPolicySpec`] and its resolution into [`ResolvedPolicy`], the
//! fully defaulted parameters the decision function runs on.
//!
//! The checks mirror the CRD exactly: schema bounds (lengths, ranges, patterns) and the
//! cross-field CEL rules in [`crate::spec::rules`]. Field paths use the API server's
//! notation (`spec.backoff.cap`, `spec.queues[2]`).

use serde::{Deserialize, Serialize};

use crate::{
    duration::{KubeDuration, format_millis},
    limits::{self, MAX_ATTEMPTS, MAX_ERROR_CLASSES, MAX_MULTIPLIER, MAX_QUEUES, MAX_SCHEDULE},
    pattern::{check_name, check_pattern},
    spec::{
        Backoff, JitterKind, RetryPolicySpec, Strategy, TerminalAction,
        rules::{self, CrossFieldRule},
    },
};

mod rollout;
pub use rollout::{
    ResolvedAnalysis, ResolvedRollout, ResolvedStep, defaults as rollout_defaults, resolve_rollout,
};

/// Documented defaults, applied when a field is absent.
pub mod defaults {
    use crate::spec::{JitterKind, Strategy};
    pub const STRATEGY: Strategy = Strategy::Exponential;
    pub const BASE_MS: u64 = 1_000;
    pub const MULTIPLIER: f64 = 2.0;
    /// The cap when none is given, raised to the base or longest schedule entry if those are longer.
    pub const CAP_MS: u64 = 600_000;
    /// For exponential and linear; constant and schedule default to no jitter.
    pub const JITTER: JitterKind = JitterKind::Full;
    pub const MAX_ATTEMPTS: u32 = 10;
}

/// One problem in a policy, named by the field that has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FieldError {
    /// API-server style path, e.g. `spec.backoff.cap`.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// What to do with a job the policy has given up on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "camelCase")]
pub enum Disposition {
    /// Leave the job to the library's own failed state.
    Drop,
    /// Move the job to this queue.
    #[serde(rename_all = "camelCase")]
    DeadLetter { dead_letter_queue: String },
}

impl std::fmt::Display for Disposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Disposition::Drop => f.write_str("drop"),
            Disposition::DeadLetter { dead_letter_queue } => {
                write!(f, "deadLetter:{dead_letter_queue}")
            }
        }
    }
}

/// Every parameter of a policy with defaults applied; what `decide` runs on and what the
/// compiled document carries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedPolicy {
    pub strategy: Strategy,
    pub base_ms: u64,
    pub multiplier: f64,
    pub cap_ms: u64,
    pub jitter: JitterKind,
    /// Only meaningful for proportional jitter; 0 otherwise.
    pub jitter_ratio: f64,
    /// Only for strategy schedule.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub schedule_ms: Vec<u64>,
    pub max_attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retry_duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub non_retryable_errors: Vec<String>,
    pub terminal: Disposition,
    /// Applied by the sidecar after `decide`, never by `decide` itself; absent when the
    /// policy has none, so documents and hashes of policies without one are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<RetryBudget>,
}

impl ResolvedPolicy {
    /// Human-readable cap, e.g. `10m`.
    pub fn cap(&self) -> String {
        format_millis(self.cap_ms)
    }

    /// Re-checks the invariants `resolve` guarantees; used when a compiled document is read
    /// from outside the process. Paths are relative to the resolved policy.
    pub fn check(&self) -> Result<(), FieldError> {
        let fail = |field: &str, message: &str| {
            Err(FieldError {
                field: field.to_owned(),
                message: message.to_owned(),
            })
        };
        let in_range = |ms: u64| {
            (crate::duration::MIN_DURATION_MS..=crate::duration::MAX_DURATION_MS).contains(&ms)
        };
        if !in_range(self.base_ms) {
            return fail("baseMs", "must be between 1ms and 8760h");
        }
        if !in_range(self.cap_ms) || self.cap_ms < self.base_ms {
            return fail("capMs", "must be between baseMs and 8760h");
        }
        if !(1.0..=MAX_MULTIPLIER).contains(&self.multiplier) {
            return fail("multiplier", "must be between 1 and 100");
        }
        if self.jitter == JitterKind::Proportional
            && !(self.jitter_ratio > 0.0 && self.jitter_ratio <= 1.0)
        {
            return fail("jitterRatio", "must be in (0, 1]");
        }
        if self.strategy == Strategy::Schedule
            && (self.schedule_ms.is_empty()
                || self.schedule_ms.len() > MAX_SCHEDULE
                || self
                    .schedule_ms
                    .iter()
                    .any(|&d| !in_range(d) || d > self.cap_ms))
        {
            return fail(
                "scheduleMs",
                "must list 1 to 100 delays, each between 1ms and capMs",
            );
        }
        if !(1..=MAX_ATTEMPTS).contains(&self.max_attempts) {
            return fail("maxAttempts", "must be between 1 and 10000");
        }
        if self.max_retry_duration_ms.is_some_and(|d| !in_range(d)) {
            return fail("maxRetryDurationMs", "must be between 1ms and 8760h");
        }
        if self.non_retryable_errors.len() > MAX_ERROR_CLASSES
            || self
                .non_retryable_errors
                .iter()
                .any(|p| check_pattern(p).is_err())
        {
            return fail("nonRetryableErrors", "must hold at most 64 valid patterns");
        }
        if let Disposition::DeadLetter { dead_letter_queue } = &self.terminal
            && check_name(dead_letter_queue).is_err()
        {
            return fail("terminal.deadLetterQueue", "must be a valid queue name");
        }
        if let Some(budget) = &self.retry_budget
            && let Err((field, message)) = budget.check()
        {
            return Err(FieldError {
                field: format!("retryBudget.{field}"),
                message,
            });
        }
        Ok(())
    }
}

/// A resolved `retryBudget`: at most `burst` retries per slot of `1000 × burst /
/// rate_per_second` ms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RetryBudget {
    pub rate_per_second: u32,
    pub burst: u32,
}

impl RetryBudget {
    /// Checks the bounds and cross-field rules; `Err` names the field (camelCase, relative
    /// to the budget) and the problem.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        use limits::*;
        if !(1..=MAX_RATE_PER_SECOND).contains(&self.rate_per_second) {
            return Err((
                "ratePerSecond",
                format!(
                    "must be between 1 and {MAX_RATE_PER_SECOND}, got {}",
                    self.rate_per_second
                ),
            ));
        }
        if !(1..=MAX_BURST).contains(&self.burst) {
            return Err((
                "burst",
                format!("must be between 1 and {MAX_BURST}, got {}", self.burst),
            ));
        }
        if u64::from(self.burst) * 1000 < u64::from(self.rate_per_second) {
            return Err(("burst", rules::BUDGET_SLOT_AT_LEAST_1MS.message.to_owned()));
        }
        if u64::from(self.burst) > u64::from(MAX_SLOT_SECONDS) * u64::from(self.rate_per_second) {
            return Err(("burst", rules::BUDGET_SLOT_AT_MOST_60S.message.to_owned()));
        }
        Ok(())
    }

    /// The slot holding time `t_ms`: `floor(t × rate / (1000 × burst))`.
    pub fn slot_of(&self, t_ms: u64) -> u64 {
        let k = u128::from(t_ms) * u128::from(self.rate_per_second)
            / (1000 * u128::from(self.burst.max(1)));
        u64::try_from(k).unwrap_or(u64::MAX)
    }

    /// The first whole millisecond of slot `k`: `ceil(k × 1000 × burst / rate)`. With a
    /// slot of at least 1 ms (validated), it lies inside slot `k`.
    pub fn slot_start(&self, k: u64) -> u64 {
        let num = u128::from(k) * 1000 * u128::from(self.burst);
        let rate = u128::from(self.rate_per_second.max(1));
        u64::try_from(num.div_ceil(rate)).unwrap_or(u64::MAX)
    }

    /// Slot length in milliseconds, for people (may be fractional).
    pub fn slot_ms(&self) -> f64 {
        1000.0 * f64::from(self.burst) / f64::from(self.rate_per_second.max(1))
    }
}

/// `10/s, burst 1 (100ms slots)`: the rate, the burst and the slot they make.
impl std::fmt::Display for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/s, burst {} (", self.rate_per_second, self.burst)?;
        let whole = 1000 * u64::from(self.burst);
        let rate = u64::from(self.rate_per_second.max(1));
        if whole.is_multiple_of(rate) {
            f.write_str(&crate::duration::format_millis(whole / rate))?;
        } else {
            write!(f, "{:.2}ms", self.slot_ms())?;
        }
        f.write_str(" slots)")
    }
}

/// Validates a spec and resolves its defaults. Reports every problem, not just the first.
pub fn resolve(spec: &RetryPolicySpec) -> Result<ResolvedPolicy, Vec<FieldError>> {
    let mut errors = Errors::default();

    check_list(&mut errors, "spec.queues", &spec.queues, 1, MAX_QUEUES);
    let max_attempts = spec.max_attempts.unwrap_or(defaults::MAX_ATTEMPTS);
    if !(1..=MAX_ATTEMPTS).contains(&max_attempts) {
        errors.push(
            "spec.maxAttempts",
            format!("must be between 1 and {MAX_ATTEMPTS}, got {max_attempts}"),
        );
    }
    let max_retry_duration_ms = spec
        .max_retry_duration
        .as_ref()
        .and_then(|d| errors.duration("spec.maxRetryDuration", d))
        .map(to_millis);
    check_list(
        &mut errors,
        "spec.nonRetryableErrors",
        &spec.non_retryable_errors,
        0,
        MAX_ERROR_CLASSES,
    );

    let terminal = match &spec.terminal {
        None => Some(Disposition::Drop),
        Some(t) => {
            let dlq_field = "spec.terminal.deadLetterQueue";
            errors.rule(
                "spec.terminal",
                &rules::DEAD_LETTER_NEEDS_QUEUE,
                t.action != TerminalAction::DeadLetter || t.dead_letter_queue.is_some(),
            );
            errors.rule(
                "spec.terminal",
                &rules::QUEUE_ONLY_FOR_DEAD_LETTER,
                t.action == TerminalAction::DeadLetter || t.dead_letter_queue.is_none(),
            );
            if let Some(queue) = &t.dead_letter_queue
                && let Err(e) = check_name(queue)
            {
                errors.push(dlq_field, e.to_string());
            }
            match (t.action, &t.dead_letter_queue) {
                (TerminalAction::Drop, None) => Some(Disposition::Drop),
                (TerminalAction::DeadLetter, Some(q)) => Some(Disposition::DeadLetter {
                    dead_letter_queue: q.clone(),
                }),
                _ => None,
            }
        }
    };

    let retry_budget = spec.retry_budget.as_ref().and_then(|b| {
        let budget = RetryBudget {
            rate_per_second: b.rate_per_second,
            burst: b.burst.unwrap_or(limits::DEFAULT_BURST),
        };
        match budget.check() {
            Ok(()) => Some(budget),
            Err((field, message)) => {
                errors.push(&format!("spec.retryBudget.{field}"), message);
                None
            }
        }
    });

    // Checked here so every path that validates a spec (admission's twin, `rebound
    // validate`, the operator) refuses a bad rollout; resolved apart by `resolve_rollout`.
    if let Some(r) = &spec.rollout {
        rollout::check(&mut errors, r);
    }

    let backoff = resolve_backoff(
        &mut errors,
        spec.backoff.as_ref().unwrap_or(&Backoff::default()),
    );

    match (errors.0.is_empty(), backoff, terminal) {
        (true, Some(b), Some(terminal)) => Ok(ResolvedPolicy {
            strategy: b.strategy,
            base_ms: b.base_ms,
            multiplier: b.multiplier,
            cap_ms: b.cap_ms,
            jitter: b.jitter,
            jitter_ratio: b.jitter_ratio,
            schedule_ms: b.schedule_ms,
            max_attempts,
            max_retry_duration_ms,
            non_retryable_errors: spec.non_retryable_errors.clone(),
            terminal,
            retry_budget,
        }),
        _ => Err(errors.0),
    }
}

struct ResolvedBackoff {
    strategy: Strategy,
    base_ms: u64,
    multiplier: f64,
    cap_ms: u64,
    jitter: JitterKind,
    jitter_ratio: f64,
    schedule_ms: Vec<u64>,
}

fn resolve_backoff(errors: &mut Errors, b: &Backoff) -> Option<ResolvedBackoff> {
    const AT: &str = "spec.backoff";
    let before = errors.0.len();
    let strategy = b.strategy.unwrap_or(defaults::STRATEGY);
    let is = |s: Strategy| b.strategy == Some(s);

    // Compared in nanoseconds, as CEL does; converted to milliseconds once valid.
    let base_ns = b
        .base
        .as_ref()
        .and_then(|d| errors.duration("spec.backoff.base", d));
    let cap_ns = b
        .cap
        .as_ref()
        .and_then(|d| errors.duration("spec.backoff.cap", d));
    let schedule_ns: Vec<u64> = match &b.schedule {
        None => Vec::new(),
        Some(list) => {
            if list.is_empty() || list.len() > MAX_SCHEDULE {
                errors.push(
                    "spec.backoff.schedule",
                    format!("must list between 1 and {MAX_SCHEDULE} delays"),
                );
                if list.len() > MAX_SCHEDULE {
                    // No per-entry work for an oversized list.
                    return None;
                }
            }
            list.iter()
                .enumerate()
                .filter_map(|(i, d)| errors.duration(&format!("spec.backoff.schedule[{i}]"), d))
                .collect()
        }
    };
    if let Some(m) = b.multiplier
        && !(1.0..=MAX_MULTIPLIER).contains(&m)
    {
        errors.push(
            "spec.backoff.multiplier",
            format!("must be between 1 and 100, got {m}"),
        );
    }
    if let Some(j) = &b.jitter {
        errors.rule(
            "spec.backoff.jitter",
            &rules::RATIO_ONLY_PROPORTIONAL,
            j.ratio.is_some() == (j.kind == JitterKind::Proportional),
        );
        if let Some(r) = j.ratio
            && !(r > 0.0 && r <= 1.0)
        {
            errors.push(
                "spec.backoff.jitter.ratio",
                format!("must be in (0, 1], got {r}"),
            );
        }
    }

    errors.rule(
        AT,
        &rules::CAP_AT_LEAST_BASE,
        match (cap_ns, base_ns) {
            (Some(c), Some(b)) => c >= b,
            _ => true,
        },
    );
    errors.rule(
        AT,
        &rules::MULTIPLIER_ONLY_EXPONENTIAL,
        b.multiplier.is_none() || b.strategy.is_none() || is(Strategy::Exponential),
    );
    errors.rule(
        AT,
        &rules::SCHEDULE_REQUIRED,
        !is(Strategy::Schedule) || b.schedule.is_some(),
    );
    errors.rule(
        AT,
        &rules::SCHEDULE_ONLY_WITH_STRATEGY,
        b.schedule.is_none() || is(Strategy::Schedule),
    );
    errors.rule(
        AT,
        &rules::NO_BASE_WITH_SCHEDULE,
        b.base.is_none() || !is(Strategy::Schedule),
    );
    errors.rule(
        AT,
        &rules::SCHEDULE_WITHIN_CAP,
        match cap_ns {
            Some(c) => schedule_ns.iter().all(|&d| d <= c),
            None => true,
        },
    );
    errors.rule(
        AT,
        &rules::NO_JITTER_WITH_DECORRELATED,
        b.jitter.is_none() || !is(Strategy::Decorrelated),
    );
    if errors.0.len() > before {
        return None;
    }
    let (base_ms, cap_ms) = (base_ns.map(to_millis), cap_ns.map(to_millis));
    let schedule_ms: Vec<u64> = schedule_ns.into_iter().map(to_millis).collect();

    // An absent base never exceeds an explicit cap; an absent cap never undercuts the base.
    let base_ms = base_ms.unwrap_or(cap_ms.map_or(defaults::BASE_MS, |c| c.min(defaults::BASE_MS)));
    let longest = schedule_ms.iter().copied().max().unwrap_or(0);
    let (jitter, jitter_ratio) = match (&b.jitter, strategy) {
        (_, Strategy::Decorrelated) => (JitterKind::None, 0.0),
        // Exact delays the user wrote stay exact.
        (None, Strategy::Constant | Strategy::Schedule) => (JitterKind::None, 0.0),
        (None, _) => (defaults::JITTER, 0.0),
        (Some(j), _) => (j.kind, j.ratio.unwrap_or(0.0)),
    };
    Some(ResolvedBackoff {
        strategy,
        base_ms: if strategy == Strategy::Schedule {
            schedule_ms.first().copied().unwrap_or(base_ms)
        } else {
            base_ms
        },
        multiplier: if strategy == Strategy::Exponential {
            b.multiplier.unwrap_or(defaults::MULTIPLIER)
        } else {
            1.0
        },
        cap_ms: cap_ms.unwrap_or(defaults::CAP_MS.max(base_ms).max(longest)),
        jitter,
        jitter_ratio,
        schedule_ms,
    })
}

fn to_millis(nanos: u64) -> u64 {
    nanos / 1_000_000
}

/// Checks a list's length first and each item only when the length is valid, so an
/// oversized list costs one error, not work (and errors) per item; duplicates are found
/// with a set, never by comparing every pair.
fn check_list(errors: &mut Errors, field: &str, items: &[String], min: usize, max: usize) {
    if items.len() < min || items.len() > max {
        let what = if min > 0 {
            format!("between {min} and {max}")
        } else {
            format!("at most {max}")
        };
        errors.push(
            field,
            format!("must list {what} entries, got {}", items.len()),
        );
        return;
    }
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if let Err(e) = check_pattern(item) {
            errors.push(&format!("{field}[{i}]"), format!("{e}: {item:?}"));
        }
        // Exact repeats only, as the CRD's `x-kubernetes-list-type: set` compares them:
        // equivalent spellings (`a*`, `a**`) are one pattern written twice, which the API
        // server accepts and the compiler serves once, so they are accepted here too.
        if !seen.insert(item.as_str()) {
            errors.push(
                &format!("{field}[{i}]"),
                format!("duplicate entry {item:?}"),
            );
        }
    }
}

#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    fn push(&mut self, field: &str, message: impl Into<String>) {
        self.0.push(FieldError {
            field: field.to_owned(),
            message: message.into(),
        });
    }

    /// Records a cross-field rule violation at `at` + the rule's field path.
    fn rule(&mut self, at: &str, rule: &CrossFieldRule, holds: bool) {
        if !holds {
            self.push(&format!("{at}{}", rule.field), rule.message);
        }
    }

    /// The exact value in nanoseconds, or an error recorded for `field`.
    fn duration(&mut self, field: &str, d: &KubeDuration) -> Option<u64> {
        match d.check() {
            Ok(nanos) => Some(nanos),
            Err(e) => {
                self.push(field, format!("{e}, got {:?}", d.as_str()));
                None
            }
        }
    }
}
