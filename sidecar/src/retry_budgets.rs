//! Per-policy retry-budget schedulers ([`rebound_policy::retry_budget`]), held next to the
//! loaded configuration and carried over when a reload leaves a policy's budget as it
//! was, so a reload in the middle of a storm does not forget the retries already booked.
//! Every scheduler books only this sidecar's share of the slots ([`FleetShare`]), read
//! from memory under the scheduler's lock on each booking.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use prometheus_client::metrics::{counter::Counter, histogram::Histogram};
use rebound_policy::{
    CompiledDocument, Decision, ResolvedPolicy,
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
    scheduler: Mutex<Scheduler>,
    series: BudgetSeries,
    fleet: Arc<FleetShare>,
}

impl PolicyBudget {
    fn new(budget: RetryBudget, series: BudgetSeries, fleet: Arc<FleetShare>) -> Self {
        let mut scheduler = Scheduler::new(budget);
        scheduler.set_share(fleet.share());
        Self {
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
    pub fn apply(&self, params: &ResolvedPolicy, decision: Decision, ask: &Ask<'_>) -> Budgeted {
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

/// The schedulers of one configuration, by policy identity (`namespace/name`).
#[derive(Debug, Default)]
pub struct Budgets {
    by_identity: HashMap<String, Arc<PolicyBudget>>,
}

impl Budgets {
    /// Schedulers for the budgeted policies of `doc`: a policy whose budget is unchanged
    /// from `previous` keeps its scheduler (bookings and memo); a new or changed budget
    /// starts empty. Metric series of policies that lost their budget are removed.
    pub fn build(doc: &CompiledDocument, previous: Option<&Budgets>, metrics: &Metrics) -> Self {
        let mut by_identity = HashMap::new();
        for p in &doc.policies {
            let Some(budget) = p.params.retry_budget else {
                continue;
            };
            let identity = p.identity();
            let kept = previous
                .and_then(|prev| prev.by_identity.get(&identity))
                .filter(|b| b.budget() == budget)
                .cloned();
            let entry = kept.unwrap_or_else(|| {
                Arc::new(PolicyBudget::new(
                    budget,
                    metrics.budget_series(&identity),
                    Arc::clone(metrics.fleet()),
                ))
            });
            by_identity.insert(identity, entry);
        }
        if let Some(prev) = previous {
            for identity in prev.by_identity.keys() {
                if !by_identity.contains_key(identity) {
                    metrics.remove_budget_series(identity);
                }
            }
        }
        Self { by_identity }
    }

    /// Schedulers with metric handles registered nowhere: for answering without a store
    /// (unit tests, the fuzz target).
    pub fn detached(doc: &CompiledDocument) -> Self {
        let fleet = Arc::new(FleetShare::default());
        let by_identity = doc
            .policies
            .iter()
            .filter_map(|p| {
                let budget = p.params.retry_budget?;
                let series = BudgetSeries {
                    admitted: Counter::default(),
                    stretched: Counter::default(),
                    deadline: Counter::default(),
                    repeats: Counter::default(),
                    added_delay: Histogram::new([0.0]),
                };
                let budget = PolicyBudget::new(budget, series, Arc::clone(&fleet));
                Some((p.identity(), Arc::new(budget)))
            })
            .collect();
        Self { by_identity }
    }

    pub fn get(&self, identity: &str) -> Option<&PolicyBudget> {
        self.by_identity.get(identity).map(Arc::as_ref)
    }

    /// Whether `identity`'s scheduler is the very one in `other` (kept across a reload).
    pub fn shares_with(&self, other: &Budgets, identity: &str) -> bool {
        match (
            self.by_identity.get(identity),
            other.by_identity.get(identity),
        ) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    pub fn len(&self) -> usize {
        self.by_identity.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_identity.is_empty()
    }
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
        let budgets = Budgets::build(&doc, None, &metrics);
        let policy = &doc.policies[0];
        let budget = budgets.get(&policy.identity()).unwrap();
        assert_eq!(budget.scope(), BudgetScope::Fleet(share));

        let resolved = &policy.params;
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
