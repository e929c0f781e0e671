//! `decisions_total{policy, outcome, disposition, reason}` and the retry-delay histogram.
//!
//! Each loaded table gets one slot per policy, at the policy's entry position, filled on
//! the policy's first decision with its label text and counter handles: counting a
//! decision is an index and one atomic add (no hash of the identity per call), and a
//! table of 10,000 policies costs one pointer each until they decide. Series are created
//! on first use rather than at load: a namespace of 10,000 policies would otherwise scrape
//! as 40,000 zeros. A reload keeps the series of the policies it keeps (same label set,
//! same counter) and removes those of the policies it drops or whose disposition changed,
//! so the series stay bounded by the policies loaded (at most six each).

use std::{collections::HashMap, sync::OnceLock};

use once_cell::race::OnceBox;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};
use rebound_policy::{Disposition, PolicyTable, compiled::TableEntry};

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

    /// Empty slots for `table`'s policies, one allocation in all.
    pub fn build(&self, table: &PolicyTable) -> Decisions {
        Decisions {
            policies: (0..table.len()).map(|_| OnceBox::new()).collect(),
            family: self.clone(),
        }
    }

    /// Hands `old`'s series over to `new` (built from `table`): a policy `table` keeps,
    /// with the same disposition, passes its counter handles on, so the reload that drops
    /// it later still finds them; the series of the others are removed. Called once
    /// requests have let go of `old`: one still answering from it could otherwise create a
    /// removed series again.
    pub fn retire(&self, old: &Decisions, new: &Decisions, table: &PolicyTable) {
        // Only the policies that decided: usually few, and none costs a lookup otherwise.
        let mut counted: HashMap<&str, &PolicyDecisions> = old
            .policies
            .iter()
            .filter_map(OnceBox::get)
            .map(|p| (&*p.policy.0, p))
            .collect();
        if counted.is_empty() {
            return;
        }
        for (position, entry) in table.entries().iter().enumerate() {
            let identity = entry.identity();
            if let Some(&policy) = counted.get(identity)
                && policy.disposition == disposition_of(entry)
            {
                counted.remove(identity);
                if let Some(slot) = new.policies.get(position) {
                    slot.get_or_init(|| Box::new(PolicyDecisions::of(entry)))
                        .take_over(policy);
                }
            }
        }
        for policy in counted.into_values() {
            for reason in Reason::ALL {
                if policy.counters[reason.index()].get().is_some() {
                    self.counters.remove(&policy.labels(reason));
                }
            }
        }
    }
}

/// The `disposition` label of `entry`'s give-ups (its stable revision's, as in rollout).
fn disposition_of(entry: &TableEntry) -> &'static str {
    disposition(entry.terminal())
}

/// One policy's decision counters, each made on the policy's first decision of its kind.
#[derive(Debug)]
struct PolicyDecisions {
    policy: LabelText,
    disposition: &'static str,
    counters: [OnceLock<Counter>; 6],
}

impl PolicyDecisions {
    fn of(entry: &TableEntry) -> Self {
        Self {
            policy: LabelText(entry.identity().into()),
            disposition: disposition_of(entry),
            counters: Default::default(),
        }
    }

    /// Takes the handles `old` (the same policy in the table before) made.
    fn take_over(&self, old: &PolicyDecisions) {
        for (mine, theirs) in self.counters.iter().zip(&old.counters) {
            if let Some(counter) = theirs.get() {
                mine.get_or_init(|| counter.clone());
            }
        }
    }

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

/// The decision handles of one table, by entry position.
#[derive(Debug)]
pub struct Decisions {
    /// Filled on the policy's first decision.
    policies: Box<[OnceBox<PolicyDecisions>]>,
    family: DecisionFamily,
}

impl Decisions {
    /// Handles registered nowhere, for `table`'s policies.
    pub fn detached(table: &PolicyTable) -> Self {
        DecisionFamily::detached().build(table)
    }

    /// Policies counted: those of the table built from.
    pub fn len(&self) -> usize {
        self.policies.len()
    }

    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// Counts one decision of `entry`, the policy at `position` in the table built from;
    /// `delay_ms` is the retry delay answered.
    pub fn count(&self, position: usize, entry: &TableEntry, reason: Reason, delay_ms: u64) {
        if let Some(slot) = self.policies.get(position) {
            let policy = slot.get_or_init(|| Box::new(PolicyDecisions::of(entry)));
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
