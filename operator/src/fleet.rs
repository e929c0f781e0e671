//! How many sidecars share a namespace's retry budgets, from their Leases.
//!
//! Every sidecar in watch mode holds a Lease `rebound-sidecar-<pod>` in its namespace,
//! labelled with the ConfigMap it serves; the live ones are the members a budget is split
//! among (docs/sidecar.md). The operator only counts them, for the status summary: a
//! Lease is live for `leaseDurationSeconds` after the operator saw it change
//! ([`Membership`]), so an expired one stops counting without any event, which is why the
//! controller also looks again on a timer ([`TICK`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::watcher::Event;
use rebound_policy::spec::ScheduleSummary;

mod lenient;
pub use lenient::{Lenient, RawLease};

/// The label selector of the operator's Lease watch: sidecar Leases only.
pub const SELECTOR: &str = "app.kubernetes.io/name=rebound,app.kubernetes.io/component=sidecar";
/// The label of a sidecar Lease naming the ConfigMap it serves.
pub const CONFIGMAP_LABEL: &str = "rebound.dev/configmap";
/// How often liveness is evaluated again: an expired Lease is counted out within this.
pub const TICK: Duration = Duration::from_secs(1);
/// A watch failed this long ago, and not since, is taken to be back (its retries come at
/// most a second apart, so one still down fails again well within it).
pub const RESUMED_AFTER: Duration = Duration::from_secs(5);

/// Keeps only what counting and rollouts need (name, namespace, labels, holder, renewal,
/// the evidence report): the rest of a Lease is dropped as it arrives.
pub fn slim_lease(lease: &mut Lease) {
    let meta = &mut lease.metadata;
    meta.managed_fields = None;
    // Of the annotations only a rollout evidence report stays (bounded when read: see
    // `lenient`), and only when present.
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| k == rebound_policy::rollout::evidence::EVIDENCE_ANNOTATION);
    }
    if meta.annotations.as_ref().is_some_and(|a| a.is_empty()) {
        meta.annotations = None;
    }
    meta.owner_references = None;
    if let Some(spec) = lease.spec.as_mut() {
        spec.acquire_time = None;
        spec.preferred_holder = None;
        spec.strategy = None;
    }
}

/// The longest `leaseDurationSeconds` taken from a Lease, as the sidecar's
/// `MAX_LEASE_SECONDS` and the admission policy: a longer one is no member, so no Lease
/// stays counted for long after it stops renewing.
pub const MAX_LEASE_SECONDS: i32 = 3600;

/// What liveness reads from a sidecar Lease; compared only for change, never with a clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// `holderIdentity`; empty when released.
    pub holder: String,
    /// `renewTime` as written by the sidecar's clock.
    pub renewed: Option<Timestamp>,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
}

impl Record {
    /// Held (not released) and renewed at least once.
    fn holds(&self) -> bool {
        !self.holder.is_empty() && self.renewed.is_some()
    }
}

/// The record of `lease` if it serves `configmap` with a duration in range.
pub fn record(lease: &Lease, configmap: &str) -> Option<Record> {
    if lease.labels().get(CONFIGMAP_LABEL).map(String::as_str) != Some(configmap) {
        return None;
    }
    let spec = lease.spec.as_ref()?;
    let seconds = spec
        .lease_duration_seconds
        .filter(|s| (1..=MAX_LEASE_SECONDS).contains(s))?;
    Some(Record {
        holder: spec.holder_identity.clone().unwrap_or_default(),
        renewed: spec.renew_time.as_ref().map(|t| t.0),
        duration: Duration::from_secs(u64::from(seconds.unsigned_abs())),
    })
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

/// The live sidecars per namespace as [`Membership`] last counted them, for reconciles to
/// read: the one count that triggers them is the one they show.
#[derive(Clone, Debug, Default)]
pub struct Counts(Arc<Mutex<HashMap<String, u32>>>);

impl Counts {
    /// Live sidecars in `namespace` (0 when none).
    pub fn get(&self, namespace: &str) -> u32 {
        let counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        counts.get(namespace).copied().unwrap_or(0)
    }

    fn set(&self, namespace: &str, n: u32) {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if n == 0 {
            counts.remove(namespace);
        } else {
            counts.insert(namespace.to_owned(), n);
        }
    }
}

/// A record and when the operator last saw it change (local monotonic time).
#[derive(Clone, Debug)]
struct Seen {
    record: Record,
    changed: Instant,
}

impl Seen {
    fn live(&self, now: Instant) -> bool {
        self.record.holds() && self.changed + self.record.duration > now
    }
}

/// Seen records per Lease name, per namespace.
type Observed = HashMap<String, HashMap<String, Seen>>;
/// Records of a re-list in progress, per namespace.
type Listed = HashMap<String, HashMap<String, Record>>;

/// Which namespaces' sidecar counts changed, from Lease events and ticks.
///
/// Liveness follows Kubernetes' leader election, as the sidecars judge each other
/// (`sidecar/src/fleet/membership.rs`, `Observed`): a Lease is live for
/// `leaseDurationSeconds` after the operator last *saw its record change* (holder,
/// renewal or duration), on the local monotonic clock; a released or deleted Lease is out
/// at once. A remote `renewTime` is never compared with the local clock, so a sidecar on a
/// node whose clock is off by any amount counts exactly while it renews. An expiry is no
/// event: [`TICK`] looks again. Renewals change no count and trigger nothing: a fleet at
/// rest costs no reconcile.
/// When a watch failed first and last in a blind time.
#[derive(Clone, Copy, Debug)]
struct Blind {
    since: Instant,
    last: Instant,
}

#[derive(Default)]
pub struct Membership {
    configmap: String,
    seen: Observed,
    /// Re-list in progress, per watch stream.
    relisting: HashMap<usize, Listed>,
    /// A watch failed, and is not seen back yet: renewals made meanwhile were not seen,
    /// and no expiry is judged.
    blind: Option<Blind>,
    counts: Counts,
}

impl Membership {
    /// Counts the sidecars serving `configmap` into `counts`.
    pub fn new(configmap: &str, counts: Counts) -> Self {
        Membership {
            configmap: configmap.to_owned(),
            counts,
            ..Membership::default()
        }
    }

    /// A watch failed at `now`: no expiry is judged until it is back, and then every Lease
    /// counts from that time, as seen for the first time (sidecars could not renew through
    /// an outage either). Back means a re-list, an event, or [`RESUMED_AFTER`] without
    /// another failure (a watch that resumed quietly: retries fail at least every second).
    pub fn watch_failed(&mut self, now: Instant) {
        let since = self.blind.map_or(now, |b| b.since);
        self.blind = Some(Blind { since, last: now });
    }

    /// A Lease event of watch stream `stream`, which covers `scope` (`None`: all), at `now`.
    pub fn event(
        &mut self,
        stream: usize,
        scope: Option<&str>,
        event: &Event<Lease>,
        now: Instant,
    ) -> Vec<String> {
        match event {
            Event::Apply(lease) | Event::Delete(lease) => {
                if let Some(blind) = self.blind.take() {
                    self.forgive(blind.since, now);
                }
                let (Some(ns), Some(name)) = (lease.namespace(), lease.metadata.name.clone())
                else {
                    return Vec::new();
                };
                let record = match event {
                    Event::Delete(_) => None,
                    _ => record(lease, &self.configmap),
                };
                let leases = self.seen.entry(ns.clone()).or_default();
                match record {
                    Some(record) => {
                        let changed = match leases.remove(&name) {
                            Some(old) if old.record == record => old.changed,
                            _ => now,
                        };
                        leases.insert(name, Seen { record, changed });
                    }
                    None => {
                        leases.remove(&name);
                    }
                }
                self.changed(now, Some(&ns))
            }
            Event::Init => {
                self.relisting.insert(stream, Listed::new());
                Vec::new()
            }
            Event::InitApply(lease) => {
                if let (Some(ns), Some(name), Some(record)) = (
                    lease.namespace(),
                    lease.metadata.name.clone(),
                    record(lease, &self.configmap),
                ) {
                    let listed = self.relisting.entry(stream).or_default();
                    listed.entry(ns).or_default().insert(name, record);
                }
                Vec::new()
            }
            Event::InitDone => {
                let listed = self.relisting.remove(&stream).unwrap_or_default();
                let blind = self.blind.take().is_some();
                let mut old = std::mem::take(&mut self.seen);
                self.seen = old
                    .extract_if(|ns, _| scope.is_some_and(|s| s != ns.as_str()))
                    .collect();
                for (ns, leases) in listed {
                    let mut before = old.remove(&ns).unwrap_or_default();
                    let seen = leases.into_iter().map(|(name, record)| {
                        let changed = match before.remove(&name) {
                            Some(s) if s.record == record && !blind => s.changed,
                            _ => now,
                        };
                        (name, Seen { record, changed })
                    });
                    self.seen.entry(ns).or_default().extend(seen);
                }
                self.changed(now, None)
            }
        }
    }

    /// The namespaces whose count changed since the last look, at `now` (an expiry is no
    /// event).
    pub fn tick(&mut self, now: Instant) -> Vec<String> {
        match self.blind {
            Some(b) if now.saturating_duration_since(b.last) < RESUMED_AFTER => {
                return Vec::new();
            }
            Some(b) => {
                self.blind = None;
                self.forgive(b.since, now);
            }
            None => {}
        }
        self.changed(now, None)
    }

    /// Every Lease still live when the blind time began counts from `now`, as after a
    /// blind re-list; one already expired stays out.
    fn forgive(&mut self, since: Instant, now: Instant) {
        for seen in self
            .seen
            .values_mut()
            .flat_map(|leases| leases.values_mut())
        {
            if seen.live(since) {
                seen.changed = now;
            }
        }
    }

    /// Compares the counts of `scope` (`None`: every namespace) with the last ones.
    fn changed(&mut self, now: Instant, scope: Option<&str>) -> Vec<String> {
        let in_scope = |ns: &str| scope.is_none_or(|s| s == ns);
        self.seen.retain(|_, leases| !leases.is_empty());
        let mut changed = Vec::new();
        for (ns, leases) in self.seen.iter().filter(|(ns, _)| in_scope(ns)) {
            let n = leases.values().filter(|s| s.live(now)).count() as u32;
            if n != self.counts.get(ns) {
                changed.push(ns.clone());
                self.counts.set(ns, n);
            }
        }
        let mut counts = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
        counts.retain(|ns, _| {
            let gone = in_scope(ns) && !self.seen.contains_key(ns);
            if gone {
                changed.push(ns.clone());
            }
            !gone
        });
        drop(counts);
        changed.sort();
        changed
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    /// A sidecar Lease stamped `renewed` seconds from an arbitrary remote epoch: only its
    /// changes matter.
    fn lease(ns: &str, pod: &str, configmap: &str, renewed: i64, seconds: i32) -> Lease {
        let mut l = Lease::default();
        l.metadata.name = Some(format!("rebound-sidecar-{pod}"));
        l.metadata.namespace = Some(ns.to_owned());
        l.metadata.labels = Some(BTreeMap::from([(
            CONFIGMAP_LABEL.to_owned(),
            configmap.to_owned(),
        )]));
        l.spec = Some(LeaseSpec {
            holder_identity: Some(pod.to_owned()),
            renew_time: Timestamp::from_second(1_800_000_000 + renewed)
                .ok()
                .map(MicroTime),
            lease_duration_seconds: Some(seconds),
            ..LeaseSpec::default()
        });
        l
    }

    fn clock() -> impl Fn(u64) -> Instant {
        let t0 = Instant::now();
        move |s| t0 + Duration::from_secs(s)
    }

    fn apply(m: &mut Membership, l: Lease, now: Instant) -> Vec<String> {
        m.event(0, None, &Event::Apply(l), now)
    }

    #[test]
    fn records_need_the_configmap_and_a_duration_in_range() {
        let l = lease("a", "p", "cm", 0, 15);
        let r = record(&l, "cm").expect("record");
        assert!(r.holds());
        assert_eq!(r.duration, Duration::from_secs(15));
        assert_eq!(record(&l, "other"), None, "serves another ConfigMap");
        for seconds in [0, -1, MAX_LEASE_SECONDS + 1] {
            assert_eq!(record(&lease("a", "p", "cm", 0, seconds), "cm"), None);
        }
        let mut never = l.clone();
        never.spec = Some(LeaseSpec {
            holder_identity: Some("p".to_owned()),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        });
        assert!(!record(&never, "cm").expect("record").holds());
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
        let t = clock();
        let counts = Counts::default();
        let mut m = Membership::new("cm", counts.clone());
        assert_eq!(apply(&mut m, lease("a", "1", "cm", 0, 15), t(1)), ["a"]);
        assert_eq!(apply(&mut m, lease("a", "2", "cm", 0, 15), t(1)), ["a"]);
        assert_eq!(counts.get("a"), 2);
        assert!(
            apply(&mut m, lease("b", "1", "x", 0, 15), t(1)).is_empty(),
            "other ConfigMap"
        );
        // A renewal changes no count; neither does a tick before anything expires.
        assert!(apply(&mut m, lease("a", "1", "cm", 5, 15), t(5)).is_empty());
        assert!(m.tick(t(15)).is_empty());
        // a/2 was last seen to change at 1: out at 16, with no event; a/1 at 20.
        assert_eq!(m.tick(t(16)), ["a"]);
        assert_eq!(counts.get("a"), 1);
        assert!(m.tick(t(17)).is_empty());
        assert_eq!(m.tick(t(20)), ["a"], "the last one expired: none");
        assert_eq!(counts.get("a"), 0);
        assert!(m.tick(t(21)).is_empty());
    }

    #[test]
    fn live_while_renewed_whatever_the_remote_clock_says() {
        let t = clock();
        let counts = Counts::default();
        let mut m = Membership::new("cm", counts.clone());
        // Stamped a minute behind and a minute ahead of any clock: only changes count.
        let behind = |at: i64| lease("a", "behind", "cm", at - 60, 10);
        let ahead = |at: i64| lease("a", "ahead", "cm", at + 60, 10);
        for s in 0..30 {
            apply(&mut m, behind(s), t(s as u64));
            apply(&mut m, ahead(s), t(s as u64));
            m.tick(t(s as u64));
            assert_eq!(counts.get("a"), 2, "at {s} s");
        }
        // The last renewals were seen at 29 s: both out at 39 s, not 60 s later.
        assert!(m.tick(t(38)).is_empty());
        assert_eq!(m.tick(t(39)), ["a"]);
        assert_eq!(counts.get("a"), 0);
        // The same record seen again is no renewal.
        assert!(apply(&mut m, ahead(29), t(40)).is_empty());
        // Released (no holder): out at once.
        assert_eq!(apply(&mut m, behind(41), t(41)), ["a"]);
        let mut released = behind(42);
        if let Some(spec) = released.spec.as_mut() {
            spec.holder_identity = None;
        }
        assert_eq!(apply(&mut m, released, t(42)), ["a"]);
        assert_eq!(counts.get("a"), 0);
    }

    #[test]
    fn a_relist_replaces_what_was_known_and_forgives_blind_time() {
        let t = clock();
        let counts = Counts::default();
        let mut m = Membership::new("cm", counts.clone());
        apply(&mut m, lease("a", "1", "cm", 0, 15), t(1));
        apply(&mut m, lease("b", "1", "cm", 0, 15), t(1));
        // After a watch gap: b's Lease was deleted meanwhile, c got one.
        assert!(m.event(0, None, &Event::Init, t(2)).is_empty());
        for l in [lease("a", "1", "cm", 0, 15), lease("c", "1", "cm", 0, 15)] {
            assert!(m.event(0, None, &Event::InitApply(l), t(2)).is_empty());
        }
        assert_eq!(m.event(0, None, &Event::InitDone, t(2)), ["b", "c"]);
        // a's record did not change: still judged from 1 s.
        assert_eq!(m.tick(t(16)), ["a"]);
        assert_eq!(m.tick(t(17)), ["c"]);
        // After a failed watch, an unchanged record counts from the relist.
        m.watch_failed(t(18));
        m.event(0, None, &Event::Init, t(20));
        m.event(
            0,
            None,
            &Event::InitApply(lease("a", "1", "cm", 0, 15)),
            t(20),
        );
        assert_eq!(m.event(0, None, &Event::InitDone, t(20)), ["a"]);
        assert_eq!(counts.get("a"), 1);
        assert_eq!(
            m.event(0, None, &Event::Delete(lease("a", "1", "cm", 0, 15)), t(21)),
            ["a"]
        );
        assert_eq!(counts.get("a"), 0);
    }

    #[test]
    fn a_watch_resumed_without_a_relist_forgives_blind_time() {
        let t = clock();
        let counts = Counts::default();
        let mut m = Membership::new("cm", counts.clone());
        apply(&mut m, lease("a", "1", "cm", 0, 15), t(1));
        apply(&mut m, lease("a", "2", "cm", 0, 15), t(1));
        // An outage longer than the duration, its retries failing every second: nothing
        // is judged meanwhile.
        for s in 2..30 {
            m.watch_failed(t(s));
            assert!(m.tick(t(s)).is_empty(), "at {s} s");
        }
        assert_eq!(counts.get("a"), 2);
        // The watch resumes; its first event is one sidecar's renewal: both still count,
        // the other from now, and it is out a duration later unless it renews.
        assert!(apply(&mut m, lease("a", "1", "cm", 31, 15), t(31)).is_empty());
        assert_eq!(counts.get("a"), 2);
        assert!(apply(&mut m, lease("a", "1", "cm", 40, 15), t(40)).is_empty());
        assert!(m.tick(t(45)).is_empty());
        assert_eq!(m.tick(t(46)), ["a"]);
        assert_eq!(counts.get("a"), 1);
        // One failure, then a watch back without a word: judged again after RESUMED_AFTER,
        // every Lease from then.
        m.watch_failed(t(50));
        assert!(m.tick(t(54)).is_empty());
        assert!(m.tick(t(55)).is_empty(), "forgiven, not expired");
        assert_eq!(counts.get("a"), 1);
        assert_eq!(m.tick(t(70)), ["a"]);
        assert_eq!(counts.get("a"), 0);
    }
}
