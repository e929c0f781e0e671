//! Per-policy retry-budget series.

use prometheus_client::{
    metrics::{
        counter::Counter,
        family::Family,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use super::Labels;

/// Per-policy retry-budget series, labelled `policy="namespace/name"`.
pub(super) struct BudgetFamilies {
    pub(super) admitted: Family<Labels, Counter>,
    pub(super) stretched: Family<Labels, Counter>,
    pub(super) deadline: Family<Labels, Counter>,
    pub(super) repeats: Family<Labels, Counter>,
    pub(super) added_delay: Family<Labels, Histogram>,
}

impl BudgetFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let f = Self {
            admitted: Family::default(),
            stretched: Family::default(),
            deadline: Family::default(),
            repeats: Family::default(),
            // 10 ms to about 12 h: a stretch is at least part of a slot (1 ms to 60 s) and
            // grows with the backlog.
            added_delay: Family::new_with_constructor(
                (|| Histogram::new(exponential_buckets(0.01, 4.0, 12))) as fn() -> Histogram,
            ),
        };
        registry.register(
            "retry_budget_admitted",
            "Retries booked into a retry-budget slot, by policy (repeated questions excluded)",
            f.admitted.clone(),
        );
        registry.register(
            "retry_budget_stretched",
            "Admitted retries whose delay the budget stretched to a later slot, by policy",
            f.stretched.clone(),
        );
        registry.register(
            "retry_budget_deadline",
            "Retries given up (DEADLINE) because the budget's next free slot lay past the deadline, by policy",
            f.deadline.clone(),
        );
        registry.register(
            "retry_budget_repeats",
            "Repeated questions answered from the budget's memo without taking a slot, by policy",
            f.repeats.clone(),
        );
        registry.register(
            "retry_budget_added_delay_seconds",
            "Delay the budget added to stretched retries, by policy",
            f.added_delay.clone(),
        );
        f
    }
}

/// One policy's handles into [`BudgetFamilies`].
#[derive(Clone, Debug)]
pub struct BudgetSeries {
    pub admitted: Counter,
    pub stretched: Counter,
    pub deadline: Counter,
    pub repeats: Counter,
    pub added_delay: Histogram,
}
