//! Who the members of a fleet are, from its Leases and the time: pure, so the rule is
//! tested without an API server. The liveness rule is the operator's (its `fleet.rs`): a
//! Lease is live while `renewTime + leaseDurationSeconds` is in the future.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use rebound_policy::retry_budget::SlotShare;

/// Name prefix of a sidecar's Lease: `rebound-sidecar-<pod name>`.
pub const PREFIX: &str = "rebound-sidecar-";
/// The label of a sidecar Lease naming the ConfigMap it serves.
pub const CONFIGMAP_LABEL: &str = "rebound.dev/configmap";
/// The annotation of a sidecar Lease with the hash of the configuration it serves (the
/// operator's `rebound.dev/hash` of the ConfigMap, once loaded).
pub const CONFIG_HASH_ANNOTATION: &str = "rebound.dev/config-hash";
/// The labels every sidecar Lease carries, besides [`CONFIGMAP_LABEL`].
pub const LABELS: [(&str, &str); 2] = [
    ("app.kubernetes.io/name", "rebound"),
    ("app.kubernetes.io/component", "sidecar"),
];

/// The Lease of the sidecar in `pod`.
pub fn lease_name(pod: &str) -> String {
    format!("{PREFIX}{pod}")
}

/// The label selector of the Leases of the sidecars serving `configmap`.
pub fn selector(configmap: &str) -> String {
    let mut parts: Vec<String> = LABELS.iter().map(|(k, v)| format!("{k}={v}")).collect();
    parts.push(format!("{CONFIGMAP_LABEL}={configmap}"));
    parts.join(",")
}

/// When `lease` stops being live (Unix ms), if it serves `configmap`; `None` when it serves
/// another or was never renewed.
pub fn expiry_ms(lease: &Lease, configmap: &str) -> Option<i64> {
    let labels = lease.metadata.labels.as_ref()?;
    if labels.get(CONFIGMAP_LABEL).map(String::as_str) != Some(configmap) {
        return None;
    }
    let spec = lease.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?.0.as_millisecond();
    let seconds = spec.lease_duration_seconds?;
    renewed.checked_add(i64::from(seconds).checked_mul(1000)?)
}

/// The live members in their stable order (by Lease name) and this sidecar's place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// Lease names, sorted.
    pub members: Vec<String>,
    /// Index of this sidecar's own Lease in `members`.
    pub own: usize,
}

impl View {
    /// The slots this sidecar books: slot `s` belongs to member `s mod N`.
    pub fn share(&self) -> SlotShare {
        let members = u32::try_from(self.members.len()).unwrap_or(u32::MAX);
        let own = u32::try_from(self.own).unwrap_or(u32::MAX);
        SlotShare::new(own, members).unwrap_or(SlotShare::WHOLE)
    }
}

/// The members at `now_ms`: every Lease of `expiries` (name → expiry in Unix ms) live
/// then, and `own` whatever its Lease says (this sidecar is a member from its start,
/// before its Lease is seen, and while it renews it).
pub fn members(expiries: &BTreeMap<String, i64>, own: &str, now_ms: i64) -> View {
    let mut members: Vec<String> = expiries
        .iter()
        .filter(|(name, expires)| **expires > now_ms && name.as_str() != own)
        .map(|(name, _)| name.clone())
        .collect();
    let own_at = members.partition_point(|name| name.as_str() < own);
    members.insert(own_at, own.to_owned());
    View {
        members,
        own: own_at,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::jiff::Timestamp;
    use kube::api::ObjectMeta;

    use super::*;

    fn lease(configmap: &str, renewed_ms: Option<i64>, seconds: Option<i32>) -> Lease {
        let mut labels: BTreeMap<String, String> = LABELS
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.insert(CONFIGMAP_LABEL.to_owned(), configmap.to_owned());
        Lease {
            metadata: ObjectMeta {
                name: Some(lease_name("a")),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                renew_time: renewed_ms
                    .map(|ms| MicroTime(Timestamp::from_millisecond(ms).unwrap())),
                lease_duration_seconds: seconds,
                ..LeaseSpec::default()
            }),
        }
    }

    fn expiries(entries: &[(&str, i64)]) -> BTreeMap<String, i64> {
        entries.iter().map(|(n, e)| ((*n).to_owned(), *e)).collect()
    }

    #[test]
    fn expiry_is_renewal_plus_duration_for_the_same_configmap_only() {
        let t = 1_700_000_000_000;
        assert_eq!(
            expiry_ms(&lease("cm", Some(t), Some(15)), "cm"),
            Some(t + 15_000)
        );
        assert_eq!(expiry_ms(&lease("other", Some(t), Some(15)), "cm"), None);
        assert_eq!(expiry_ms(&lease("cm", None, Some(15)), "cm"), None);
        assert_eq!(expiry_ms(&lease("cm", Some(t), None), "cm"), None);
    }

    #[test]
    fn members_are_the_live_leases_sorted_with_the_own_one_always_in() {
        let leases = expiries(&[("c", 2_000), ("a", 2_000), ("b", 999), ("e", 1_000)]);
        // At 1_000: b and e have expired (expiry must lie in the future); d is us, unseen.
        let view = members(&leases, "d", 1_000);
        assert_eq!(view.members, ["a", "c", "d"]);
        assert_eq!(view.own, 2);
        assert_eq!(view.share(), SlotShare::new(2, 3).unwrap());
        // Our own Lease expired in the list (we could not renew): still a member.
        let view = members(&leases, "b", 1_500);
        assert_eq!(view.members, ["a", "b", "c"]);
        assert_eq!(view.own, 1);
        // Alone.
        let view = members(&BTreeMap::new(), "z", 0);
        assert_eq!(view.share(), SlotShare::WHOLE);
    }

    #[test]
    fn every_member_computes_a_different_index_of_the_same_count() {
        let names = [
            "rebound-sidecar-w-3",
            "rebound-sidecar-w-1",
            "rebound-sidecar-w-2",
        ];
        let leases = expiries(&names.map(|n| (n, 10_000)));
        let mut owners: Vec<u32> = names
            .iter()
            .map(|n| {
                let share = members(&leases, n, 0).share();
                assert_eq!(share.members, 3);
                share.member
            })
            .collect();
        owners.sort_unstable();
        assert_eq!(owners, [0, 1, 2]);
    }

    #[test]
    fn the_selector_names_the_labels_of_the_scheme() {
        assert_eq!(
            selector("rebound-policies"),
            "app.kubernetes.io/name=rebound,app.kubernetes.io/component=sidecar,rebound.dev/configmap=rebound-policies"
        );
    }
}
