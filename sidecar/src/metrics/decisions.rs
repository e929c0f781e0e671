//! `decisions_total{policy, outcome, disposition, reason}` and the retry-delay histogram.
//!
//! Each loaded configuration gets one [`PolicyDecisions`] per policy holding the counter
//! handles of its label sets, so counting a decision is a map lookup by the policy's
//! identity and one atomic add: no label set is built on the request path. A reload keeps
//! the series of the policies it keeps (same label set, same counter) and removes those of
//! the policies, reasons or dispositions it drops, so the series stay bounded by the
//! policies loaded.

use std::{collections::HashMap, sync::OnceLock};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};
use rebound_policy::{CompiledDocument, CompiledPolicy, Disposition};

use super::LabelText;

/// Upper bounds of `delay_seconds`: one second to one day, as a backoff spreads.
pub const DELAY_BUCKETS: [f64; 15] = [
    1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 43200.0,
    86400.0,
];

/// Why a decision came out as it did: its `outcome` and `reason` labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A retry after the policy's own backoff.
    Backoff,
    /// A retry whose delay the caller's Retry-After decided.
    RetryAfter,
    /// A retry the retry budget moved to a later slot.
    BudgetStretched,
    MaxAttempts,
    Deadline,
    NonRetryable,
}

impl Reason {
    pub const ALL: [Reason; 6] = [
        Self::Backoff,
        Self::RetryAfter,
        Self::BudgetStretched,
        Self::MaxAttempts,
        Self::Deadline,
        Self::NonRetryable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Backoff => "backoff",
            Self::RetryAfter => "retry_after",
            Self::BudgetStretched => "budget_stretched",
            Self::MaxAttempts => "max_attempts",
            Self::Deadline => "deadline",
            Self::NonRetryable => "non_retryable",
        }
    }

    pub fn is_retry(self) -> bool {
        matches!(
            self,
            Self::Backoff | Self::RetryAfter | Self::BudgetStretched
        )
    }

    /// Whether `policy` can answer with this reason at all; only those series are created
    /// when the policy is loaded (the others appear if ever counted).
    fn reachable(self, policy: &CompiledPolicy) -> bool {
        let p = &policy.params;
        match self {
            Self::Backoff | Self::RetryAfter | Self::MaxAttempts => true,
            Self::BudgetStretched => p.retry_budget.is_some(),
            // A budget gives up past its booking horizon even without maxRetryDuration.
            Self::Deadline => p.max_retry_duration_ms.is_some() || p.retry_budget.is_some(),
            Self::NonRetryable => !p.non_retryable_errors.is_empty(),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The `disposition` label of a give-up under `terminal`.
fn disposition(terminal: &Disposition) -> &'static str {
    match terminal {
        Disposition::Drop => "drop",
        Disposition::DeadLetter { .. } => "dead_letter",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    policy: LabelText,
    outcome: &'static str,
    disposition: &'static str,
    reason: &'static str,
}

/// The registered families, shared by every configuration's [`Decisions`].
#[derive(Clone, Debug)]
pub struct DecisionFamily {
    counters: Family<DecisionLabels, Counter>,
    delay: Histogram,
}

impl DecisionFamily {
    /// Families registered nowhere: for answering without a store.
    pub fn detached() -> Self {
        Self {
            counters: Family::default(),
            delay: Histogram::new(DELAY_BUCKETS),
        }
    }

    pub fn register(registry: &mut Registry) -> Self {
        let f = Self::detached();
        registry.register(
            "decisions",
            "Decisions answered (each DecideBatch item once), by policy, outcome (retry, give_up), disposition (none, dead_letter, drop) and reason",
            f.counters.clone(),
        );
        registry.register(
            "delay_seconds",
            "Retry delays answered (after any retry budget)",
            f.delay.clone(),
        );
        f
    }

    /// The handles of `doc`'s policies. Series of `previous` that `doc` no longer has (a
    /// removed policy, a changed disposition, a reason no longer reachable) are removed.
    pub fn build(&self, doc: &CompiledDocument, previous: Option<&Decisions>) -> Decisions {
        let mut by_identity = HashMap::with_capacity(doc.policies.len());
        for p in &doc.policies {
            let series = PolicyDecisions {
                policy: LabelText(p.identity()),
                disposition: disposition(&p.params.terminal),
                family: self.clone(),
                counters: Default::default(),
            };
            for reason in Reason::ALL.into_iter().filter(|r| r.reachable(p)) {
                series.counter(reason);
            }
            by_identity.insert(series.policy.0.clone(), series);
        }
        let next = Decisions {
            by_identity,
            delay: self.delay.clone(),
        };
        for old in previous.iter().flat_map(|prev| prev.by_identity.values()) {
            let kept = next.by_identity.get(&old.policy.0);
            for reason in Reason::ALL {
                if old.counters[reason.index()].get().is_none() {
                    continue;
                }
                let labels = old.labels(reason);
                if kept.is_none_or(|k| {
                    k.counters[reason.index()].get().is_none() || k.labels(reason) != labels
                }) {
                    self.counters.remove(&labels);
                }
            }
        }
        next
    }
}

/// One policy's decision counters; a handle is made on first use (at load for the
/// reasons the policy can reach).
#[derive(Debug)]
pub struct PolicyDecisions {
    policy: LabelText,
    disposition: &'static str,
    family: DecisionFamily,
    counters: [OnceLock<Counter>; 6],
}

impl PolicyDecisions {
    fn labels(&self, reason: Reason) -> DecisionLabels {
        let (outcome, disposition) = if reason.is_retry() {
            ("retry", "none")
        } else {
            ("give_up", self.disposition)
        };
        DecisionLabels {
            policy: self.policy.clone(),
            outcome,
            disposition,
            reason: reason.as_str(),
        }
    }

    fn counter(&self, reason: Reason) -> &Counter {
        self.counters[reason.index()].get_or_init(|| {
            self.family
                .counters
                .get_or_create(&self.labels(reason))
                .clone()
        })
    }
}

/// The decision handles of one configuration, by policy identity (`namespace/name`).
#[derive(Debug)]
pub struct Decisions {
    by_identity: HashMap<String, PolicyDecisions>,
    delay: Histogram,
}

impl Decisions {
    /// Handles registered nowhere, for `doc`'s policies.
    pub fn detached(doc: &CompiledDocument) -> Self {
        DecisionFamily::detached().build(doc, None)
    }

    /// Counts one decision of `identity`'s policy; `delay_ms` is the retry delay answered.
    pub fn count(&self, identity: &str, reason: Reason, delay_ms: u64) {
        if let Some(policy) = self.by_identity.get(identity) {
            policy.counter(reason).inc();
        }
        if reason.is_retry() {
            self.delay.observe(delay_ms as f64 / 1e3);
        }
    }
}
