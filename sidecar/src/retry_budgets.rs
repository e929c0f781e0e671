//! Per-policy retry-budget schedulers ([`rebound_policy::retry_budget`]), held next to the
//! loaded configuration and carried over when a reload leaves a policy's budget as it
//! was, so a reload in the middle of a storm does not forget the retries already booked.
//! Every scheduler books only this sidecar's share of the slots ([`FleetShare`]), read
//! from memory under the scheduler's lock on each booking. A request finds its policy's
//! scheduler by table position; only budgeted policies cost memory.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use prometheus_client::metrics::{counter::Counter, histogram::Histogram};
use rebound_policy::{
    Decision, PolicyTable,
    decide::Core,
    resolve::RetryBudget,
    retry_budget::{Ask, Budgeted, Scheduler},
};

use crate::{
    fleet_share::FleetShare,
    metrics::{BudgetSeries, Metrics},
};

/// One budgeted policy's scheduler and its metric handles.
#[derive(Debug)]
pub struct PolicyBudget {
    /// `namespace/name`: what a reload carries the scheduler over by.
    identity: Box<str>,
    scheduler: Mutex<Scheduler>,
    series: BudgetSeries,
    fleet: Arc<FleetShare>,
}

impl PolicyBudget {
    fn new(
        identity: &str,
        budget: RetryBudget,
        series: BudgetSeries,
        fleet: Arc<FleetShare>,
    ) -> Self {
        let mut scheduler = Scheduler::new(budget);
        scheduler.set_share(fleet.share());
        Self {
            identity: identity.into(),
            scheduler: Mutex::new(scheduler),
            series,
            fleet,
        }
    }

    pub fn budget(&self) -> RetryBudget {
        self.lock().budget()
    }

    /// Over what the budget is enforced now (what the next booking will use).
    pub fn scope(&self) -> crate::fleet_share::BudgetScope {
        self.fleet.scope()
    }

    /// Whether the membership behind [`Self::scope`] could not be refreshed.
    pub fn stale(&self) -> bool {
        self.fleet.stale()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Scheduler> {
        // A panic while holding the lock cannot leave the book half-written in a way that
        // breaks the bound (each booking is one map update), so keep going.
        self.scheduler.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies the budget to `decide`'s answer and counts what it did.
    pub fn apply<'p>(
        &self,
        params: impl Into<Core<'p>>,
        decision: Decision,
        ask: &Ask<'_>,
    ) -> Budgeted {
        let was_retry = matches!(decision, Decision::Retry { .. });
        let answer = {
            let mut scheduler = self.lock();
            // The share is read under the lock, so no booking uses one older than the
            // last the fleet task published before the booking began.
            let share = self.fleet.share();
            if scheduler.share() != share {
                scheduler.set_share(share);
            }
            scheduler.apply(params, decision, ask)
        };
        if !was_retry {
            return answer;
        }
        let s = &self.series;
        if answer.repeat {
            s.repeats.inc();
        } else if matches!(answer.decision, Decision::GiveUp { .. }) {
            s.deadline.inc();
        } else {
            s.admitted.inc();
            if answer.stretched {
                s.stretched.inc();
                s.added_delay.observe(answer.added_ms as f64 / 1e3);
            }
        }
        answer
    }
}

/// The schedulers of one table's budgeted policies, by entry position.
#[derive(Debug, Default)]
pub struct Budgets {
    /// Sorted by position.
    by_position: Box<[(usize, Arc<PolicyBudget>)]>,
}

impl Budgets {
    /// Schedulers for the budgeted policies of `table`: a policy whose budget is unchanged
    /// from `previous` keeps its scheduler (bookings and memo); a new or changed budget
    /// starts empty. Metric series of policies that lost their budget are removed.
    pub fn build(table: &PolicyTable, previous: Option<&Budgets>, metrics: &Metrics) -> Self {
        let mut before: HashMap<&str, &Arc<PolicyBudget>> = previous
            .map(|p| {
                p.by_position
                    .iter()
                    .map(|(_, b)| (&*b.identity, b))
                    .collect()
            })
            .unwrap_or_default();
        let by_position = budgeted(table)
            .map(|(position, identity, budget)| {
                let kept = before
                    .remove(identity)
                    .filter(|b| b.budget() == budget)
                    .cloned();
                let entry = kept.unwrap_or_else(|| {
                    Arc::new(PolicyBudget::new(
                        identity,
                        budget,
                        metrics.budget_series(identity),
                        Arc::clone(metrics.fleet()),
                    ))
                });
                (position, entry)
            })
            .collect();
        for identity in before.keys() {
            metrics.remove_budget_series(identity);
        }
        Self { by_position }
    }

    /// Schedulers with metric handles registered nowhere: for answering without a store
    /// (unit tests, the fuzz target).
    pub fn detached(table: &PolicyTable) -> Self {
        let fleet = Arc::new(FleetShare::default());
        let by_position = budgeted(table)
            .map(|(position, identity, budget)| {
                let series = BudgetSeries {
                    admitted: Counter::default(),
                    stretched: Counter::default(),
                    deadline: Counter::default(),
                    repeats: Counter::default(),
                    added_delay: Histogram::new([0.0]),
                };
                let budget = PolicyBudget::new(identity, budget, series, Arc::clone(&fleet));
                (position, Arc::new(budget))
            })
            .collect();
        Self { by_position }
    }

    /// The scheduler of the policy at `position` in the table built from, if budgeted.
    pub fn get(&self, position: usize) -> Option<&PolicyBudget> {
        let i = self
            .by_position
            .binary_search_by_key(&position, |(p, _)| *p)
            .ok()?;
        self.by_position.get(i).map(|(_, b)| b.as_ref())
    }

    fn by_identity(&self, identity: &str) -> Option<&Arc<PolicyBudget>> {
        self.by_position
            .iter()
            .map(|(_, b)| b)
            .find(|b| &*b.identity == identity)
    }

    /// Whether `identity`'s scheduler is the very one in `other` (kept across a reload).
    pub fn shares_with(&self, other: &Budgets, identity: &str) -> bool {
        match (self.by_identity(identity), other.by_identity(identity)) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    pub fn len(&self) -> usize {
        self.by_position.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_position.is_empty()
    }
}

/// `table`'s budgeted policies: position, identity and budget, in position order. The
/// stable revision's budget paces the queue also while a change rolls out.
fn budgeted(table: &PolicyTable) -> impl Iterator<Item = (usize, &str, RetryBudget)> {
    table.entries().iter().enumerate().filter_map(|(i, e)| {
        let budget = e.retry_budget()?;
        Some((i, e.identity(), budget))
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use rebound_policy::retry_budget::SlotShare;

    use super::*;
    use crate::fleet_share::BudgetScope;

    const YAML: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: orders}\nspec:\n  queues: [orders]\n  backoff: {strategy: constant, base: 1s, jitter: {kind: none}}\n  maxAttempts: 9\n  retryBudget: {ratePerSecond: 10, burst: 1}\n";

    #[test]
    fn schedulers_book_the_fleet_share_also_when_built_after_it_changed() {
        let doc =
            crate::store::compile_manifests(&[(PathBuf::from("a.yaml"), YAML.to_owned())], "ns")
                .unwrap();
        let metrics = Metrics::default();
        let share = SlotShare::new(1, 3).unwrap();
        metrics.fleet().set(BudgetScope::Fleet(share));
        let resolved = doc.policies[0].params.clone();
        let table = PolicyTable::from_document(doc);
        let budgets = Budgets::build(&table, None, &metrics);
        let budget = budgets.get(0).unwrap();
        assert_eq!(budget.scope(), BudgetScope::Fleet(share));

        let resolved = &resolved;
        let slot_of = |now: u64, delay: u64| (now + delay) / 100;
        let mut slots = Vec::new();
        for job in 0..6 {
            let id = format!("job-{job}");
            let ask = Ask {
                queue: "orders",
                job_id: Some(&id),
                attempt: 1,
                now_ms: 10_000,
                first_failure_ms: None,
            };
            let answer = budget.apply(resolved, Decision::Retry { delay_ms: 1_000 }, &ask);
            let Decision::Retry { delay_ms } = answer.decision else {
                panic!("{answer:?}");
            };
            slots.push(slot_of(10_000, delay_ms));
        }
        // Slots 110.. owned by member 1 of 3: 112, 115, 118, ...
        assert_eq!(slots, [112, 115, 118, 121, 124, 127]);

        // A change reaches the existing scheduler on its next booking.
        metrics.fleet().set(BudgetScope::PerPod);
        let ask = Ask {
            queue: "orders",
            job_id: Some("job-x"),
            attempt: 1,
            now_ms: 10_000,
            first_failure_ms: None,
        };
        let answer = budget.apply(resolved, Decision::Retry { delay_ms: 1_000 }, &ask);
        let Decision::Retry { delay_ms } = answer.decision else {
            panic!("{answer:?}");
        };
        // Whole budget again, past this member's furthest booking (127).
        assert_eq!(slot_of(10_000, delay_ms), 128);
    }
}
