//! How many sidecars share a namespace's retry budgets, from their Leases.
//!
//! Every sidecar in watch mode holds a Lease `rebound-sidecar-<pod>` in its namespace,
//! labelled with the ConfigMap it serves; the live ones are the members a budget is split
//! among (docs/sidecar.md). The operator only counts them, for the status summary: a
//! Lease is live while `renewTime + leaseDurationSeconds` is in the future, so an expired
//! one stops counting without any event, which is why the controller also looks again on
//! a timer ([`TICK`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::runtime::watcher::Event;
use rebound_policy::spec::ScheduleSummary;

/// The label selector of the operator's Lease watch: sidecar Leases only.
pub const SELECTOR: &str = "app.kubernetes.io/name=rebound,app.kubernetes.io/component=sidecar";
/// The label of a sidecar Lease naming the ConfigMap it serves.
pub const CONFIGMAP_LABEL: &str = "rebound.dev/configmap";
/// How often liveness is evaluated again: an expired Lease is counted out within this.
pub const TICK: Duration = Duration::from_secs(1);

/// Keeps only what counting needs (name, namespace, labels, renewal), so a cache of many
/// Leases stays small.
pub fn slim_lease(lease: &mut Lease) {
    let meta = &mut lease.metadata;
    meta.managed_fields = None;
    meta.annotations = None;
    meta.owner_references = None;
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = None;
        spec.acquire_time = None;
        spec.preferred_holder = None;
        spec.strategy = None;
    }
}

/// Whether `lease` is live at `now` and serves `configmap`.
pub fn is_member(lease: &Lease, configmap: &str, now: Timestamp) -> bool {
    let serves = lease
        .labels()
        .get(CONFIGMAP_LABEL)
        .is_some_and(|c| c == configmap);
    let live =
        lease
            .spec
            .as_ref()
            .is_some_and(|s| match (&s.renew_time, s.lease_duration_seconds) {
                (Some(renewed), Some(seconds)) => renewed
                    .0
                    .checked_add(SignedDuration::from_secs(i64::from(seconds)))
                    .is_ok_and(|expires| expires > now),
                _ => false,
            });
    serves && live
}

/// Live sidecars serving `configmap`, per namespace.
pub fn count<'a>(
    leases: impl IntoIterator<Item = &'a Lease>,
    configmap: &str,
    now: Timestamp,
) -> BTreeMap<String, u32> {
    let mut counts = BTreeMap::new();
    for lease in leases {
        if is_member(lease, configmap, now)
            && let Some(ns) = lease.namespace()
        {
            *counts.entry(ns).or_insert(0) += 1;
        }
    }
    counts
}

/// The budget as the fleet sees it: `500/s, burst 50 (100ms slots) for 6 sidecars`, or
/// `… per sidecar (no sidecar Leases)` when no sidecar holds a Lease (file mode: each
/// sidecar enforces the whole budget on its own).
pub fn shared_budget(budget: &str, sidecars: u32) -> String {
    match sidecars {
        0 => format!("{budget} per sidecar (no sidecar Leases)"),
        1 => format!("{budget} for 1 sidecar"),
        n => format!("{budget} for {n} sidecars"),
    }
}

/// `summary` with its retry budget (if any) as shared by `sidecars`.
pub fn shared_summary(summary: &ScheduleSummary, sidecars: u32) -> ScheduleSummary {
    ScheduleSummary {
        retry_budget: summary
            .retry_budget
            .as_deref()
            .map(|b| shared_budget(b, sidecars)),
        ..summary.clone()
    }
}

/// Which namespaces' sidecar counts changed, from Lease events and ticks. Renewals change
/// no count and trigger nothing, so a fleet at rest costs no reconcile.
#[derive(Default)]
pub struct Membership {
    last: HashMap<String, u32>,
}

impl Membership {
    /// The namespaces whose count differs from the last one seen, given the counts now
    /// (namespaces absent from `now` have none). Only `scope` (`None`: all) is compared,
    /// so that a Lease event of one namespace costs one namespace.
    pub fn changed(&mut self, now: &BTreeMap<String, u32>, scope: Option<&str>) -> Vec<String> {
        let in_scope = |ns: &str| scope.is_none_or(|s| s == ns);
        let mut changed = Vec::new();
        for (ns, n) in now.iter().filter(|(ns, _)| in_scope(ns)) {
            if self.last.insert(ns.clone(), *n) != Some(*n) {
                changed.push(ns.clone());
            }
        }
        let gone: Vec<String> = self
            .last
            .keys()
            .filter(|ns| in_scope(ns) && !now.contains_key(*ns))
            .cloned()
            .collect();
        for ns in gone {
            self.last.remove(&ns);
            changed.push(ns);
        }
        changed.sort();
        changed
    }
}

/// The namespace a Lease event concerns (`None`: every namespace, after a re-list).
pub fn scope_of(event: &Event<Lease>) -> Option<Option<String>> {
    match event {
        Event::Apply(l) | Event::Delete(l) => Some(l.namespace()),
        Event::InitDone => Some(None),
        Event::Init | Event::InitApply(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + second).expect("time")
    }

    fn lease(ns: &str, pod: &str, configmap: &str, renewed: i64, seconds: i32) -> Lease {
        let mut l = Lease::default();
        l.metadata.name = Some(format!("rebound-sidecar-{pod}"));
        l.metadata.namespace = Some(ns.to_owned());
        l.metadata.labels = Some(BTreeMap::from([(
            CONFIGMAP_LABEL.to_owned(),
            configmap.to_owned(),
        )]));
        l.spec = Some(LeaseSpec {
            renew_time: Some(MicroTime(at(renewed))),
            lease_duration_seconds: Some(seconds),
            ..LeaseSpec::default()
        });
        l
    }

    #[test]
    fn live_means_renewed_within_its_duration() {
        let l = lease("a", "p", "cm", 0, 15);
        assert!(is_member(&l, "cm", at(14)));
        assert!(
            !is_member(&l, "cm", at(15)),
            "expires at renewTime + duration"
        );
        assert!(!is_member(&l, "other", at(1)), "serves another ConfigMap");
        let mut never = l.clone();
        never.spec = Some(LeaseSpec::default());
        assert!(!is_member(&never, "cm", at(1)));
    }

    #[test]
    fn counts_per_namespace() {
        let leases = [
            lease("a", "1", "cm", 0, 15),
            lease("a", "2", "cm", 0, 15),
            lease("a", "3", "cm", -20, 15),
            lease("b", "1", "cm", 0, 15),
            lease("b", "2", "x", 0, 15),
        ];
        let counts = count(&leases, "cm", at(1));
        assert_eq!(
            counts,
            BTreeMap::from([("a".to_owned(), 2), ("b".to_owned(), 1)])
        );
    }

    #[test]
    fn the_budget_as_the_fleet_sees_it() {
        assert_eq!(shared_budget("500/s", 6), "500/s for 6 sidecars");
        assert_eq!(shared_budget("500/s", 1), "500/s for 1 sidecar");
        assert_eq!(
            shared_budget("500/s", 0),
            "500/s per sidecar (no sidecar Leases)"
        );
    }

    #[test]
    fn only_changed_counts_trigger() {
        let mut m = Membership::default();
        let counts = |pairs: &[(&str, u32)]| -> BTreeMap<String, u32> {
            pairs.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
        };
        assert_eq!(m.changed(&counts(&[("a", 3), ("b", 1)]), None), ["a", "b"]);
        // A renewal: same counts.
        assert!(m.changed(&counts(&[("a", 3), ("b", 1)]), None).is_empty());
        // One of a's expired; b is out of scope of an event of a.
        assert_eq!(m.changed(&counts(&[("a", 2)]), Some("a")), ["a"]);
        // b's last one went away.
        assert_eq!(m.changed(&counts(&[("a", 2)]), None), ["b"]);
        assert!(m.changed(&counts(&[("a", 2)]), None).is_empty());
    }
}
