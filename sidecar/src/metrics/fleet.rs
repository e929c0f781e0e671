//! The budget scope and fleet-membership gauges, set from [`FleetShare`] at each scrape.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    metrics::{family::Family, gauge::Gauge},
    registry::Registry,
};

use super::Label;
use crate::fleet_share::{BudgetScope, FleetShare};

/// The budget scope and the fleet membership behind it, set from [`FleetShare`] at each
/// scrape.
pub(super) struct FleetGauges {
    scope: Family<Label, Gauge>,
    members: Gauge,
    member: Gauge,
    stale: Gauge,
    renewed_at: Gauge<f64, AtomicU64>,
    changes: Gauge,
    leases: Family<Label, Gauge>,
}

impl FleetGauges {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let g = Self {
            scope: Family::default(),
            members: Gauge::default(),
            member: Gauge::default(),
            stale: Gauge::default(),
            renewed_at: Gauge::default(),
            changes: Gauge::default(),
            leases: Family::default(),
        };
        registry.register(
            "budget_scope",
            "1 for how retry budgets are enforced: pod (each sidecar the whole budget: file mode, or no Pod name) or fleet (split among the live sidecar Leases)",
            g.scope.clone(),
        );
        registry.register(
            "fleet_members",
            "Sidecars the retry budgets are split among (1 per Pod)",
            g.members.clone(),
        );
        registry.register(
            "fleet_member",
            "This sidecar's index among them (sorted by Lease name); it books slots s with s mod members = member",
            g.member.clone(),
        );
        registry.register(
            "fleet_membership_stale",
            "1 while the membership cannot be refreshed (API unreachable, own Lease not renewed): the last one is kept",
            g.stale.clone(),
        );
        registry.register(
            "fleet_lease_renewed_timestamp_seconds",
            "When this sidecar's Lease was last renewed, in Unix seconds (0: never)",
            g.renewed_at.clone(),
        );
        registry.register(
            "fleet_membership_changes",
            "Changes of the budget scope or membership since the start",
            g.changes.clone(),
        );
        registry.register(
            "fleet_leases",
            "Sidecar Leases of the ConfigMap this sidecar remembers (state=seen) and may still count (state=live): what judging membership walks",
            g.leases.clone(),
        );
        g
    }

    pub(super) fn set(&self, fleet: &FleetShare) {
        let scope = fleet.scope();
        for s in ["pod", "fleet"] {
            self.scope
                .get_or_create(&[("scope", s)])
                .set(i64::from(scope.as_str() == s));
        }
        let share = scope.share();
        self.members.set(i64::from(share.members));
        self.member.set(i64::from(share.member));
        self.stale
            .set(i64::from(fleet.stale() && scope != BudgetScope::PerPod));
        self.renewed_at.set(fleet.renewed_ms() as f64 / 1e3);
        self.changes
            .set(i64::try_from(fleet.changes()).unwrap_or(i64::MAX));
        let (seen, live) = fleet.leases();
        for (state, n) in [("seen", seen), ("live", live)] {
            self.leases
                .get_or_create(&[("state", state)])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}
