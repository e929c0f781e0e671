//! Who the members of a fleet are, from its Leases as this sidecar observed them: pure, so
//! the rule is tested without an API server.
//!
//! Liveness follows Kubernetes' leader election: a Lease is live for
//! `leaseDurationSeconds` after this sidecar last *saw its record change* (holder, renewal
//! or duration), measured on the local monotonic clock. A remote timestamp is never
//! compared with the local clock, so a writer whose clock is off by any amount is counted
//! exactly while it renews.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;

use super::lease::SeenLease;
use rebound_policy::retry_budget::SlotShare;

/// Name prefix of a sidecar's Lease: `rebound-sidecar-<pod name>` (see [`lease_name`]).
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
/// The longest `leaseDurationSeconds` taken from a Lease (the admission policy's bound):
/// a longer one is skipped, so no Lease can stay counted for long after it stops renewing.
pub const MAX_LEASE_SECONDS: i64 = 3600;
/// Longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;

/// The Lease of the sidecar in Pod `pod_namespace/pod`, held in `lease_namespace` (the
/// ConfigMap's). Readable `rebound-sidecar-<pod>` when the Pod lives there and the name
/// fits; otherwise the Pod name cut to fit and a hash of `namespace/name`, so two Pods
/// never share a Lease and the name is always valid.
pub fn lease_name(pod_namespace: &str, pod: &str, lease_namespace: &str) -> String {
    let short = format!("{PREFIX}{pod}");
    if pod_namespace == lease_namespace && short.len() <= MAX_NAME {
        return short;
    }
    let hash = fnv1a64(format!("{pod_namespace}/{pod}").as_bytes());
    // prefix + head + '-' + 16 hex digits.
    let room = MAX_NAME - PREFIX.len() - 17;
    let head: String = pod.chars().take(room).collect();
    let head = head.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    if head.is_empty() {
        format!("{PREFIX}{hash:016x}")
    } else {
        format!("{PREFIX}{head}-{hash:016x}")
    }
}

/// FNV-1a, 64 bits: stable across versions and platforms (a name must not change when the
/// sidecar is upgraded).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The label selector of the Leases of the sidecars serving `configmap`.
pub fn selector(configmap: &str) -> String {
    let mut parts: Vec<String> = LABELS.iter().map(|(k, v)| format!("{k}={v}")).collect();
    parts.push(format!("{CONFIGMAP_LABEL}={configmap}"));
    parts.join(",")
}

/// What membership reads from a Lease, taken field by field from the object as the API
/// server stored it: a field no type could hold (`renewTime: 9999-12-31T23:59:59Z`) only
/// makes that one Lease unusable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// `holderIdentity`; empty when released.
    pub holder: String,
    /// `renewTime` as written (compared for change only, never with a clock).
    pub renewed: String,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
}

/// Why a Lease is not taken into account.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Skip {
    /// It serves another ConfigMap (or none): not an error.
    #[error("serves another ConfigMap")]
    OtherConfigMap,
    /// A field is missing or out of range.
    #[error("spec.{field}: {problem}")]
    Field {
        field: &'static str,
        problem: &'static str,
    },
}

/// The record of `lease` if it serves `configmap`.
pub fn record(lease: &SeenLease, configmap: &str) -> Result<Record, Skip> {
    let serves = lease
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CONFIGMAP_LABEL))
        .is_some_and(|c| c == configmap);
    if !serves {
        return Err(Skip::OtherConfigMap);
    }
    let spec = Some(&lease.spec);
    let field = |name: &str| spec.and_then(|s| s.get(name)).filter(|v| !v.is_null());
    let holder = match field("holderIdentity") {
        None => String::new(),
        Some(v) => v
            .as_str()
            .ok_or(Skip::Field {
                field: "holderIdentity",
                problem: "not a string",
            })?
            .to_owned(),
    };
    let renewed = match field("renewTime") {
        None => String::new(),
        Some(v) => {
            let text = v.as_str().ok_or(Skip::Field {
                field: "renewTime",
                problem: "not a string",
            })?;
            // Only compared for change; but a time no client type can hold marks a Lease
            // no Kubernetes component wrote, and breaks every typed reader of it.
            if text.parse::<Timestamp>().is_err() {
                return Err(Skip::Field {
                    field: "renewTime",
                    problem: "not a time within 0001-9999",
                });
            }
            text.to_owned()
        }
    };
    let seconds = field("leaseDurationSeconds")
        .ok_or(Skip::Field {
            field: "leaseDurationSeconds",
            problem: "missing",
        })?
        .as_i64()
        .ok_or(Skip::Field {
            field: "leaseDurationSeconds",
            problem: "not an integer",
        })?;
    if !(1..=MAX_LEASE_SECONDS).contains(&seconds) {
        return Err(Skip::Field {
            field: "leaseDurationSeconds",
            problem: "out of range (1 to 3600)",
        });
    }
    Ok(Record {
        holder,
        renewed,
        duration: Duration::from_secs(seconds.unsigned_abs()),
    })
}

/// A record and when this sidecar last saw it change.
#[derive(Clone, Debug)]
struct Seen {
    record: Record,
    changed: Instant,
}

impl Seen {
    /// Held (not released) and renewed at least once.
    fn holds(&self) -> bool {
        !self.record.holder.is_empty() && !self.record.renewed.is_empty()
    }

    fn deadline(&self) -> Instant {
        self.changed + self.record.duration
    }
}

/// The Leases serving the ConfigMap as observed here. `seen` has every such Lease the
/// API server lists (bounded by the Leases that exist: each is deleted with its Pod);
/// `live` only those that may still count, so judging liveness walks the live ones, not
/// every Lease ever seen.
#[derive(Debug, Default)]
pub struct Observed {
    seen: HashMap<String, Seen>,
    /// Name → deadline (local monotonic time) of the Leases not yet judged expired.
    live: BTreeMap<String, Instant>,
    /// A re-list in progress: what it listed so far.
    relisting: Option<HashMap<String, Record>>,
}

impl Observed {
    /// A Lease as seen by a watch event at `now`.
    pub fn apply(&mut self, name: &str, record: Record, now: Instant) {
        let seen = match self.seen.remove(name) {
            Some(old) if old.record == record => old,
            _ => Seen {
                record,
                changed: now,
            },
        };
        self.track(name, seen);
    }

    /// A Lease deleted, or changed so that it no longer serves the ConfigMap.
    pub fn remove(&mut self, name: &str) {
        self.seen.remove(name);
        self.live.remove(name);
    }

    /// A re-list begins: until it is done, what was known stays as it was.
    pub fn begin_relist(&mut self) {
        self.relisting = Some(HashMap::new());
    }

    pub fn relisted(&mut self, name: &str, record: Record) {
        if let Some(list) = self.relisting.as_mut() {
            list.insert(name.to_owned(), record);
        }
    }

    pub fn is_relisting(&self) -> bool {
        self.relisting.is_some()
    }

    /// The re-list is complete at `now`: it replaces what was known. An unchanged record
    /// keeps when it was last seen to change, unless this sidecar was `blind` (the watch
    /// had failed): renewals it could not see must not count against a Lease, so every
    /// listed Lease is then judged from `now`, as a Lease seen for the first time.
    pub fn end_relist(&mut self, now: Instant, blind: bool) {
        let Some(list) = self.relisting.take() else {
            return;
        };
        let mut old = std::mem::take(&mut self.seen);
        self.live.clear();
        for (name, record) in list {
            let seen = match old.remove(&name) {
                Some(seen) if seen.record == record && !blind => seen,
                _ => Seen {
                    record,
                    changed: now,
                },
            };
            self.track(&name, seen);
        }
    }

    /// This sidecar can observe again at `now` after a time it could not (its watch had
    /// failed and resumed without a re-list, or its own renewals failed): renewals it could
    /// not see must not count against a Lease, so every one still live when it last judged
    /// (before that time) is judged from `now`, as after a blind re-list. One already
    /// expired stays out.
    pub fn resume(&mut self, now: Instant) {
        let live: Vec<String> = self.live.keys().cloned().collect();
        for name in live {
            if let Some(mut s) = self.seen.remove(&name) {
                s.changed = now;
                self.track(&name, s);
            }
        }
    }

    fn track(&mut self, name: &str, seen: Seen) {
        if seen.holds() {
            self.live.insert(name.to_owned(), seen.deadline());
        } else {
            self.live.remove(name);
        }
        self.seen.insert(name.to_owned(), seen);
    }

    /// How many Leases are remembered (every listed one) and how many may still count.
    pub fn sizes(&self) -> (usize, usize) {
        (self.seen.len(), self.live.len())
    }

    /// The members at `now`: the Leases seen to change within their duration, and `own`
    /// whatever its Lease says (this sidecar is a member from its start, before its Lease
    /// is seen, and while it renews it). Expired ones leave `live` for good, until their
    /// record changes again.
    pub fn members(&mut self, own: &str, now: Instant) -> View {
        self.live.retain(|_, deadline| *deadline > now);
        let mut members: Vec<String> = self
            .live
            .keys()
            .filter(|name| name.as_str() != own)
            .cloned()
            .collect();
        let own_at = members.partition_point(|name| name.as_str() < own);
        members.insert(own_at, own.to_owned());
        View {
            members,
            own: own_at,
        }
    }
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn lease(name: &str, configmap: &str, spec: serde_json::Value) -> SeenLease {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {CONFIGMAP_LABEL: configmap}},
            "spec": spec,
        }))
        .unwrap()
    }

    fn rec(holder: &str, renewed: &str, seconds: u64) -> Record {
        Record {
            holder: holder.to_owned(),
            renewed: renewed.to_owned(),
            duration: Duration::from_secs(seconds),
        }
    }

    #[test]
    fn any_field_the_api_server_accepts_is_read_or_skipped_by_name() {
        let ok = lease(
            "a",
            "cm",
            json!({"holderIdentity": "p", "renewTime": "2100-12-31T23:59:59.000000Z", "leaseDurationSeconds": 15}),
        );
        assert_eq!(
            record(&ok, "cm"),
            Ok(rec("p", "2100-12-31T23:59:59.000000Z", 15))
        );
        assert_eq!(record(&ok, "other"), Err(Skip::OtherConfigMap));
        for (spec, field) in [
            (
                json!({"renewTime": "2026-01-01T00:00:00Z", "leaseDurationSeconds": 2_147_483_647}),
                "leaseDurationSeconds",
            ),
            (
                json!({"renewTime": "2026-01-01T00:00:00Z", "leaseDurationSeconds": 0}),
                "leaseDurationSeconds",
            ),
            (
                json!({"renewTime": "2026-01-01T00:00:00Z"}),
                "leaseDurationSeconds",
            ),
            (
                json!({"renewTime": 5, "leaseDurationSeconds": 15}),
                "renewTime",
            ),
            (
                json!({"renewTime": "9999-12-31T23:59:59.000000Z", "leaseDurationSeconds": 15}),
                "renewTime",
            ),
        ] {
            let Err(Skip::Field { field: got, .. }) = record(&lease("a", "cm", spec), "cm") else {
                panic!("{field} accepted");
            };
            assert_eq!(got, field);
        }
    }

    #[test]
    fn live_for_the_duration_after_a_change_is_seen_whatever_the_remote_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut o = Observed::default();
        // Stamped far in the past and far in the future: only the change counts.
        o.apply("a", rec("a", "1970-01-01T00:00:00Z", 10), t0);
        o.apply("b", rec("b", "9999-12-31T23:59:59Z", 10), t0);
        assert_eq!(o.members("c", t0 + s(9)).members, ["a", "b", "c"]);
        // Renewed (a new renewTime) at 5 s: live until 15 s. The same record again is no
        // renewal.
        o.apply("a", rec("a", "1970-01-01T00:00:05Z", 10), t0 + s(5));
        o.apply("b", rec("b", "9999-12-31T23:59:59Z", 10), t0 + s(5));
        assert_eq!(o.members("c", t0 + s(10)).members, ["a", "c"]);
        assert_eq!(o.members("c", t0 + s(15)).members, ["c"]);
        assert_eq!(o.sizes(), (2, 0), "remembered, not walked");
        // Released (no holder): out at once.
        o.apply("a", rec("a", "1", 10), t0 + s(20));
        o.apply("a", rec("", "2", 10), t0 + s(21));
        assert_eq!(o.members("c", t0 + s(21)).members, ["c"]);
        o.remove("a");
        assert_eq!(o.sizes(), (1, 0));
    }

    #[test]
    fn a_relist_keeps_the_view_until_done_and_forgives_blind_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut o = Observed::default();
        o.apply("a", rec("a", "1", 10), t0);
        o.apply("b", rec("b", "1", 10), t0);
        // A routine relist: unchanged records keep their time; a gone Lease leaves.
        o.begin_relist();
        o.relisted("a", rec("a", "1", 10));
        assert_eq!(o.members("z", t0 + s(1)).members, ["a", "b", "z"]);
        o.end_relist(t0 + s(2), false);
        assert_eq!(o.members("z", t0 + s(9)).members, ["a", "z"]);
        assert_eq!(o.members("z", t0 + s(10)).members, ["z"]);
        // After an outage (blind): an unchanged record counts from the relist.
        o.begin_relist();
        o.relisted("a", rec("a", "1", 10));
        o.end_relist(t0 + s(30), true);
        assert_eq!(o.members("z", t0 + s(39)).members, ["a", "z"]);
    }

    #[test]
    fn resuming_after_a_blind_time_judges_every_lease_from_then() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut o = Observed::default();
        o.apply("x", rec("x", "1", 10), t0);
        o.apply("a", rec("a", "1", 10), t0 + s(5));
        o.apply("b", rec("b", "1", 10), t0 + s(5));
        o.apply("r", rec("", "1", 10), t0 + s(5));
        // Judged at 12 s (x expired), then 18 s unable to observe; then the watch resumes
        // without a re-list.
        assert_eq!(o.members("z", t0 + s(12)).members, ["a", "b", "z"]);
        o.resume(t0 + s(30));
        assert_eq!(o.members("z", t0 + s(30)).members, ["a", "b", "z"]);
        assert_eq!(o.sizes(), (4, 2), "expired and released Leases stay out");
        // Renewals resume for one of them only: the other is out a duration later.
        o.apply("a", rec("a", "2", 10), t0 + s(35));
        assert_eq!(o.members("z", t0 + s(39)).members, ["a", "b", "z"]);
        assert_eq!(o.members("z", t0 + s(40)).members, ["a", "z"]);
    }

    #[test]
    fn every_member_computes_a_different_index_of_the_same_count() {
        let t0 = Instant::now();
        let names = ["w-3", "w-1", "w-2"];
        let mut o = Observed::default();
        for n in names {
            o.apply(n, rec(n, "1", 10), t0);
        }
        let mut owners: Vec<u32> = names
            .iter()
            .map(|n| {
                let share = o.members(n, t0).share();
                assert_eq!(share.members, 3);
                share.member
            })
            .collect();
        owners.sort_unstable();
        assert_eq!(owners, [0, 1, 2]);
        assert_eq!(o.members("w-0", t0).own, 0, "unseen own Lease is a member");
    }

    #[test]
    fn names_are_unique_per_pod_and_namespace_and_always_valid() {
        assert_eq!(lease_name("ns", "w-0", "ns"), "rebound-sidecar-w-0");
        let a = lease_name("team-a", "w-0", "shared");
        let b = lease_name("team-b", "w-0", "shared");
        assert_ne!(a, b);
        assert!(a.starts_with("rebound-sidecar-w-0-"), "{a}");
        let long = format!("{}.x", "a".repeat(250));
        let name = lease_name("ns", &long, "ns");
        assert_eq!(name.len(), 253, "{name}");
        assert_ne!(
            name,
            lease_name("ns", &format!("{}.y", "a".repeat(250)), "ns")
        );
        let dotted = format!("{}.{}", "b".repeat(219), "c".repeat(40));
        let name = lease_name("ns", &dotted, "ns");
        assert!(name.len() <= 253);
        let last_of_head = name.len() - 18;
        assert!(
            name.as_bytes()[last_of_head].is_ascii_alphanumeric(),
            "{name}"
        );
        // Stable: the same Pod always gets the same name.
        assert_eq!(lease_name("ns", &long, "ns"), lease_name("ns", &long, "ns"));
    }

    #[test]
    fn the_selector_names_the_labels_of_the_scheme() {
        assert_eq!(
            selector("rebound-policies"),
            "app.kubernetes.io/name=rebound,app.kubernetes.io/component=sidecar,rebound.dev/configmap=rebound-policies"
        );
    }
}
