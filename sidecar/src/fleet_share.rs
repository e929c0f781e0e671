//! Which share of every retry budget this sidecar may book, held in memory for the request
//! path: [`crate::fleet`] writes it beside the requests (from the namespace's sidecar
//! Leases), a budgeted `Decide` only loads it (one atomic read, no network hop).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rebound_policy::retry_budget::SlotShare;

/// Over what a budget is enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetScope {
    /// Each sidecar enforces the whole budget on its own: file mode, or watch mode without
    /// a Pod name (no Lease).
    PerPod,
    /// The sidecars serving the ConfigMap in the namespace split the slots among them.
    Fleet(SlotShare),
}

impl BudgetScope {
    /// The slots this sidecar may book.
    pub fn share(self) -> SlotShare {
        match self {
            BudgetScope::PerPod => SlotShare::WHOLE,
            BudgetScope::Fleet(share) => share,
        }
    }

    /// How many sidecars the budget is split among (1 per Pod).
    pub fn members(self) -> u32 {
        self.share().members
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BudgetScope::PerPod => "pod",
            BudgetScope::Fleet(_) => "fleet",
        }
    }
}

impl std::fmt::Display for BudgetScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BudgetScope::PerPod => f.write_str("per Pod"),
            BudgetScope::Fleet(s) if s.members == 1 => f.write_str("fleet of 1 sidecar"),
            BudgetScope::Fleet(s) => write!(f, "fleet of {} sidecars", s.members),
        }
    }
}

/// The current scope, and whether the membership behind it is current. Shared by the
/// fleet task (writer), the schedulers, `GetPolicy` and the metrics (readers).
#[derive(Debug)]
pub struct FleetShare {
    /// `members << 32 | member`; `members == 0` means [`BudgetScope::PerPod`].
    packed: AtomicU64,
    /// The membership could not be refreshed (API unreachable): the last one is kept.
    stale: AtomicBool,
    /// Unix ms of the last successful renewal of this sidecar's Lease (0: never).
    renewed_ms: AtomicU64,
    /// Membership changes seen since the start.
    changes: AtomicU64,
    /// Sidecar Leases remembered / still counted by the fleet task.
    leases_seen: AtomicU64,
    leases_live: AtomicU64,
}

impl Default for FleetShare {
    fn default() -> Self {
        Self {
            packed: AtomicU64::new(0),
            stale: AtomicBool::new(false),
            renewed_ms: AtomicU64::new(0),
            changes: AtomicU64::new(0),
            leases_seen: AtomicU64::new(0),
            leases_live: AtomicU64::new(0),
        }
    }
}

impl FleetShare {
    pub fn scope(&self) -> BudgetScope {
        let packed = self.packed.load(Ordering::Acquire);
        let members = (packed >> 32) as u32;
        let member = packed as u32;
        match SlotShare::new(member, members) {
            Some(share) => BudgetScope::Fleet(share),
            None => BudgetScope::PerPod,
        }
    }

    /// The slots new bookings may take.
    pub fn share(&self) -> SlotShare {
        self.scope().share()
    }

    /// Sets the scope; returns whether it changed.
    pub fn set(&self, scope: BudgetScope) -> bool {
        let packed = match scope {
            BudgetScope::PerPod => 0,
            BudgetScope::Fleet(s) => (u64::from(s.members) << 32) | u64::from(s.member),
        };
        let changed = self.packed.swap(packed, Ordering::AcqRel) != packed;
        if changed {
            self.changes.fetch_add(1, Ordering::Relaxed);
        }
        changed
    }

    pub fn stale(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    /// Sets staleness; returns whether it changed.
    pub fn set_stale(&self, stale: bool) -> bool {
        self.stale.swap(stale, Ordering::Relaxed) != stale
    }

    pub fn renewed_ms(&self) -> u64 {
        self.renewed_ms.load(Ordering::Relaxed)
    }

    pub fn set_renewed_ms(&self, at_ms: u64) {
        self.renewed_ms.store(at_ms, Ordering::Relaxed);
    }

    /// Sidecar Leases remembered and still counted (the cost of judging membership).
    pub fn leases(&self) -> (u64, u64) {
        (
            self.leases_seen.load(Ordering::Relaxed),
            self.leases_live.load(Ordering::Relaxed),
        )
    }

    pub fn set_leases(&self, seen: u64, live: u64) {
        self.leases_seen.store(seen, Ordering::Relaxed);
        self.leases_live.store(live, Ordering::Relaxed);
    }

    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_pod_until_set_and_round_trips_a_share() {
        let fleet = FleetShare::default();
        assert_eq!(fleet.scope(), BudgetScope::PerPod);
        assert_eq!(fleet.share(), SlotShare::WHOLE);
        let share = SlotShare::new(4, 6).unwrap();
        assert!(fleet.set(BudgetScope::Fleet(share)));
        assert!(!fleet.set(BudgetScope::Fleet(share)));
        assert_eq!(fleet.scope(), BudgetScope::Fleet(share));
        assert_eq!(fleet.scope().members(), 6);
        assert_eq!(fleet.changes(), 1);
        assert!(fleet.set(BudgetScope::PerPod));
        assert_eq!(fleet.share(), SlotShare::WHOLE);
    }
}
