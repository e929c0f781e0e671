//! `decisions_total{policy, outcome, disposition, reason}` and the retry-delay histogram.
//!
//! Each loaded configuration gets one [`PolicyDecisions`] per policy holding the counter
//! handles of its label sets, at the policy's position in the document (the table's
//! entry order), so counting a decision is an index and one atomic add: no hash of the
//! identity per call, and a label set is built once per policy and reason, on the first
//! such decision. Series are created on first use rather than at
//! load: a namespace of 10,000 policies would otherwise scrape as 40,000 zeros. A reload
//! keeps the series of the policies it keeps (same label set, same counter) and removes
//! those of the policies it drops or whose disposition changed, so the series stay bounded
//! by the policies loaded (at most six each).

use std::{collections::HashMap, sync::Arc, sync::OnceLock};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};
use rebound_policy::{CompiledDocument, Disposition};

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

    /// The handles of `doc`'s policies; a policy kept from the configuration before
    /// finds its series (same label set) and keeps counting.
    pub fn build(&self, doc: &CompiledDocument) -> Decisions {
        let policies: Box<[PolicyDecisions]> = doc
            .policies
            .iter()
            .map(|p| PolicyDecisions {
                policy: LabelText(p.identity().into()),
                disposition: disposition(&p.params.terminal),
                counters: Default::default(),
            })
            .collect();
        let by_identity = policies
            .iter()
            .enumerate()
            .map(|(i, p)| (Arc::clone(&p.policy.0), i))
            .collect();
        Decisions {
            policies,
            by_identity,
            family: self.clone(),
        }
    }

    /// Removes the series of `old` whose policy `new` does not have, or has with another
    /// disposition. Called once requests have let go of `old`: one still answering from it
    /// could otherwise create a removed series again.
    pub fn retire(&self, old: &Decisions, new: &Decisions) {
        for policy in &old.policies {
            let kept = new.get(&policy.policy.0);
            if kept.is_some_and(|k| k.disposition == policy.disposition) {
                continue;
            }
            for reason in Reason::ALL {
                if policy.counters[reason.index()].get().is_some() {
                    self.counters.remove(&policy.labels(reason));
                }
            }
        }
    }
}

/// One policy's decision counters, each made on the policy's first decision of its kind.
#[derive(Debug)]
pub struct PolicyDecisions {
    policy: LabelText,
    disposition: &'static str,
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
}

/// The decision handles of one configuration, in the document's policy order.
#[derive(Debug)]
pub struct Decisions {
    policies: Box<[PolicyDecisions]>,
    /// Positions by identity (`namespace/name`), for a reload to find the series it keeps.
    by_identity: HashMap<Arc<str>, usize>,
    family: DecisionFamily,
}

impl Decisions {
    /// Handles registered nowhere, for `doc`'s policies.
    pub fn detached(doc: &CompiledDocument) -> Self {
        DecisionFamily::detached().build(doc)
    }

    /// Policies counted: those of the document built from.
    pub fn len(&self) -> usize {
        self.policies.len()
    }

    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    fn get(&self, identity: &str) -> Option<&PolicyDecisions> {
        let &i = self.by_identity.get(identity)?;
        self.policies.get(i)
    }

    /// Counts one decision of the policy at `position` in the document (its table entry's
    /// position); `delay_ms` is the retry delay answered.
    pub fn count(&self, position: usize, reason: Reason, delay_ms: u64) {
        if let Some(policy) = self.policies.get(position) {
            policy.counters[reason.index()]
                .get_or_init(|| {
                    self.family
                        .counters
                        .get_or_create(&policy.labels(reason))
                        .clone()
                })
                .inc();
        }
        if reason.is_retry() {
            self.family.delay.observe(delay_ms as f64 / 1e3);
        }
    }
}
