//! How many sidecars share a namespace's retry budgets, from their Leases.
//!
//! Every sidecar in watch mode holds a Lease `rebound-sidecar-<pod>` in its namespace,
//! labelled with the ConfigMap it serves; the live ones are the members a budget is split
//! among (docs/sidecar.md). The operator only counts them, for the status summary: a
//! Lease is live while `renewTime + leaseDurationSeconds` is in the future, so an expired
//! one stops counting without any event, which is why the controller also looks again on
//! a timer ([`TICK`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
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

/// A sidecar Lease as the watch reads it: the API server stores Leases no typed client can
/// hold (a `renewTime` or a `managedFields` time in year 9999), and one such Lease must not
/// fail the list. So the metadata counting needs is taken field by field, the spec kept
/// untyped for [`Lenient`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RawLease {
    pub metadata: kube::api::ObjectMeta,
    pub spec: serde_json::Value,
}

impl<'de> serde::Deserialize<'de> for RawLease {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Raw {
            #[serde(default)]
            metadata: serde_json::Value,
            #[serde(default)]
            spec: serde_json::Value,
        }
        let raw = Raw::deserialize(deserializer)?;
        let text = |field: &str| raw.metadata.get(field)?.as_str().map(str::to_owned);
        let labels = raw
            .metadata
            .get("labels")
            .and_then(|l| serde_json::from_value(l.clone()).ok());
        Ok(RawLease {
            metadata: kube::api::ObjectMeta {
                name: text("name"),
                namespace: text("namespace"),
                resource_version: text("resourceVersion"),
                uid: text("uid"),
                labels,
                ..kube::api::ObjectMeta::default()
            },
            spec: raw.spec,
        })
    }
}

impl kube::Resource for RawLease {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Lease".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "coordination.k8s.io".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "leases".into()
    }
    fn meta(&self) -> &kube::api::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut kube::api::ObjectMeta {
        &mut self.metadata
    }
}

/// Turns the untyped Lease watch into typed events. A Lease that does not deserialize
/// keeps its metadata and the spec fields that do; a field that does not is dropped (a
/// Lease without `renewTime` counts as no member) with one warning per Lease, naming it.
#[derive(Default)]
pub struct Lenient {
    warned: HashSet<(String, String)>,
}

impl Lenient {
    pub fn typed(&mut self, event: Event<RawLease>) -> Event<Lease> {
        match event {
            Event::Init => Event::Init,
            Event::InitDone => Event::InitDone,
            Event::InitApply(o) => Event::InitApply(self.lease(o)),
            Event::Apply(o) => Event::Apply(self.lease(o)),
            Event::Delete(o) => {
                let key = (o.namespace().unwrap_or_default(), o.name_any());
                self.warned.remove(&key);
                Event::Delete(self.lease(o))
            }
        }
    }

    fn lease(&mut self, mut object: RawLease) -> Lease {
        let spec = std::mem::take(&mut object.spec);
        let parsed = serde_json::from_value::<LeaseSpec>(spec.clone());
        let spec = match parsed {
            Ok(spec) => spec,
            Err(error) => {
                let key = (object.namespace().unwrap_or_default(), object.name_any());
                if self.warned.insert(key.clone()) {
                    tracing::warn!(
                        namespace = %key.0,
                        lease = %key.1,
                        %error,
                        "skipping the fields of a sidecar Lease that cannot be read"
                    );
                }
                lenient_spec(&spec)
            }
        };
        Lease {
            metadata: object.metadata,
            spec: Some(spec),
        }
    }
}

/// The fields of `spec` that deserialize one by one.
fn lenient_spec(spec: &serde_json::Value) -> LeaseSpec {
    let field = |name: &str| -> serde_json::Value {
        let mut one = serde_json::Map::new();
        if let Some(v) = spec.get(name) {
            one.insert(name.to_owned(), v.clone());
        }
        serde_json::Value::Object(one)
    };
    let part = |name: &str| serde_json::from_value::<LeaseSpec>(field(name)).unwrap_or_default();
    LeaseSpec {
        holder_identity: part("holderIdentity").holder_identity,
        lease_duration_seconds: part("leaseDurationSeconds").lease_duration_seconds,
        renew_time: part("renewTime").renew_time,
        acquire_time: part("acquireTime").acquire_time,
        ..LeaseSpec::default()
    }
}

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

/// When `lease` stops being live (`renewTime + leaseDurationSeconds`), if it serves
/// `configmap`; `None` when it serves another or was never renewed.
pub fn expiry(lease: &Lease, configmap: &str) -> Option<Timestamp> {
    if lease.labels().get(CONFIGMAP_LABEL).map(String::as_str) != Some(configmap) {
        return None;
    }
    let spec = lease.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?.0;
    let seconds = spec.lease_duration_seconds?;
    renewed
        .checked_add(SignedDuration::from_secs(i64::from(seconds)))
        .ok()
}

/// Whether `lease` is live at `now` and serves `configmap`.
pub fn is_member(lease: &Lease, configmap: &str, now: Timestamp) -> bool {
    expiry(lease, configmap).is_some_and(|expires| expires > now)
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

/// Expiry per Lease name, per namespace.
type Expiries = HashMap<String, HashMap<String, Timestamp>>;

/// Which namespaces' sidecar counts changed, from Lease events and ticks. It keeps the
/// expiry of every Lease serving the ConfigMap by namespace, so an event costs its
/// namespace and a tick one pass over the expiries. Renewals change no count and trigger
/// nothing: a fleet at rest costs no reconcile.
#[derive(Default)]
pub struct Membership {
    configmap: String,
    expiries: Expiries,
    /// Re-list in progress, per watch stream.
    relisting: HashMap<usize, Expiries>,
    last: HashMap<String, u32>,
}

impl Membership {
    pub fn new(configmap: &str) -> Self {
        Membership {
            configmap: configmap.to_owned(),
            ..Membership::default()
        }
    }

    /// A Lease event of watch stream `stream`, which covers `scope` (`None`: all).
    pub fn event(
        &mut self,
        stream: usize,
        scope: Option<&str>,
        event: &Event<Lease>,
        now: Timestamp,
    ) -> Vec<String> {
        match event {
            Event::Apply(lease) | Event::Delete(lease) => {
                let (Some(ns), Some(name)) = (lease.namespace(), lease.metadata.name.clone())
                else {
                    return Vec::new();
                };
                let expires = match event {
                    Event::Delete(_) => None,
                    _ => expiry(lease, &self.configmap),
                };
                let leases = self.expiries.entry(ns.clone()).or_default();
                match expires {
                    Some(at) => leases.insert(name, at),
                    None => leases.remove(&name),
                };
                self.changed(now, Some(&ns))
            }
            Event::Init => {
                self.relisting.insert(stream, Expiries::new());
                Vec::new()
            }
            Event::InitApply(lease) => {
                if let (Some(ns), Some(name), Some(at)) = (
                    lease.namespace(),
                    lease.metadata.name.clone(),
                    expiry(lease, &self.configmap),
                ) {
                    let fresh = self.relisting.entry(stream).or_default();
                    fresh.entry(ns).or_default().insert(name, at);
                }
                Vec::new()
            }
            Event::InitDone => {
                let fresh = self.relisting.remove(&stream).unwrap_or_default();
                self.expiries
                    .retain(|ns, _| scope.is_some_and(|s| s != ns.as_str()));
                self.expiries.extend(fresh);
                self.changed(now, None)
            }
        }
    }

    /// The namespaces whose count changed since the last look, at `now` (an expiry is no
    /// event).
    pub fn tick(&mut self, now: Timestamp) -> Vec<String> {
        self.changed(now, None)
    }

    /// Compares the counts of `scope` (`None`: every namespace) with the last ones seen.
    fn changed(&mut self, now: Timestamp, scope: Option<&str>) -> Vec<String> {
        let in_scope = |ns: &str| scope.is_none_or(|s| s == ns);
        self.expiries.retain(|_, leases| !leases.is_empty());
        let mut changed = Vec::new();
        for (ns, leases) in self.expiries.iter().filter(|(ns, _)| in_scope(ns)) {
            let n = leases.values().filter(|at| **at > now).count() as u32;
            if n != self.last.get(ns).copied().unwrap_or(0) {
                changed.push(ns.clone());
            }
            if n == 0 {
                self.last.remove(ns);
            } else {
                self.last.insert(ns.clone(), n);
            }
        }
        let gone: Vec<String> = self
            .last
            .keys()
            .filter(|ns| in_scope(ns) && !self.expiries.contains_key(*ns))
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
        let mut m = Membership::new("cm");
        let apply =
            |m: &mut Membership, l: Lease, now: i64| m.event(0, None, &Event::Apply(l), at(now));
        assert_eq!(apply(&mut m, lease("a", "1", "cm", 0, 15), 1), ["a"]);
        assert_eq!(apply(&mut m, lease("a", "2", "cm", 0, 15), 1), ["a"]);
        assert!(
            apply(&mut m, lease("b", "1", "x", 0, 15), 1).is_empty(),
            "other ConfigMap"
        );
        // A renewal changes no count; neither does a tick before anything expires.
        assert!(apply(&mut m, lease("a", "1", "cm", 5, 15), 5).is_empty());
        assert!(m.tick(at(14)).is_empty());
        // a/2 expires at 15 with no event; a/1 (renewed at 5) lives until 20.
        assert_eq!(m.tick(at(15)), ["a"]);
        assert!(m.tick(at(16)).is_empty());
        assert_eq!(m.tick(at(20)), ["a"], "the last one expired: none");
        assert!(m.tick(at(21)).is_empty());
    }

    #[test]
    fn a_lease_no_type_can_hold_is_read_without_its_bad_fields() {
        let object: RawLease = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "rebound-sidecar-x", "namespace": "a",
                         "labels": {CONFIGMAP_LABEL: "cm"},
                         "managedFields": [{"manager": "m", "time": "9999-12-31T23:59:59Z"}]},
            "spec": {"holderIdentity": "x", "leaseDurationSeconds": 15,
                     "renewTime": "9999-12-31T23:59:59.000000Z"},
        }))
        .expect("object");
        let mut lenient = Lenient::default();
        let Event::Apply(lease) = lenient.typed(Event::Apply(object.clone())) else {
            panic!("not an Apply");
        };
        let spec = lease.spec.expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("x"));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.renew_time, None);
        assert!(!is_member(
            &Lease {
                spec: Some(spec),
                ..lease
            },
            "cm",
            at(0)
        ));
        // Warned once per Lease.
        lenient.typed(Event::Apply(object));
        assert_eq!(lenient.warned.len(), 1);
    }

    #[test]
    fn a_relist_replaces_what_was_known() {
        let mut m = Membership::new("cm");
        m.event(0, None, &Event::Apply(lease("a", "1", "cm", 0, 15)), at(1));
        m.event(0, None, &Event::Apply(lease("b", "1", "cm", 0, 15)), at(1));
        // After a watch gap: b's Lease was deleted meanwhile, c got one.
        assert!(m.event(0, None, &Event::Init, at(2)).is_empty());
        for l in [lease("a", "1", "cm", 0, 15), lease("c", "1", "cm", 0, 15)] {
            assert!(m.event(0, None, &Event::InitApply(l), at(2)).is_empty());
        }
        assert_eq!(m.event(0, None, &Event::InitDone, at(2)), ["b", "c"]);
        assert_eq!(
            m.event(0, None, &Event::Delete(lease("a", "1", "cm", 0, 15)), at(3)),
            ["a"]
        );
    }
}
