//! Fleet membership for the retry budgets (docs/sidecar.md, "Fleet-wide retry budgets"):
//! in watch mode a sidecar holds the Lease `rebound-sidecar-<pod>` in the ConfigMap's
//! namespace (owned by its Pod, deleted on the way out), watches the Leases of the sidecars
//! serving the same ConfigMap (leniently, [`lease::SeenLease`]: one odd Lease is skipped,
//! not the list),
//! judges them by when it saw them change ([`membership::Observed`]), and publishes
//! its [`SlotShare`](rebound_policy::retry_budget::SlotShare) of every budget into
//! [`FleetShare`], which the request path reads from memory. All of it runs beside the
//! requests: renewals every `duration / 3`, Lease events, and a liveness tick (an expired
//! Lease sends no event). Each renewal also carries this sidecar's rollout evidence
//! ([`crate::rollout_evidence`]), which counts only while the Lease exists.

pub mod lease;
pub mod membership;

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ObjectMeta, Patch, PatchParams},
    runtime::watcher,
};
use tokio::{sync::watch, task::JoinHandle};

use crate::fleet_share::{BudgetScope, FleetShare};
use crate::store::Store;
use lease::SeenLease;
use membership::{CONFIG_HASH_ANNOTATION, CONFIGMAP_LABEL, LABELS, Observed, Skip, View};
use rebound_policy::rollout::evidence::EVIDENCE_ANNOTATION;
use rebound_runtime::watch_backoff::{SIDECAR_CAP, WatchBackoff, WatchBackoffExt};

/// The field manager of the sidecar's server-side applies of its Lease.
pub const FIELD_MANAGER: &str = "rebound-sidecar";

/// What a sidecar needs to be a member.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// Where the ConfigMap, and so the Leases, live.
    pub namespace: String,
    /// The ConfigMap served (the value of the `rebound.dev/configmap` label).
    pub configmap: String,
    /// This sidecar's Pod (the Lease's name and holder).
    pub pod: String,
    /// The Pod's namespace (part of the Lease's name when it differs from `namespace`).
    pub pod_namespace: String,
    /// The Pod's UID (downward API `metadata.uid`): the Lease's owner, so the garbage
    /// collector deletes it with the Pod. Without it the Lease outlives the Pod.
    pub pod_uid: Option<String>,
    /// `leaseDurationSeconds`: whole seconds, at least 1.
    pub lease_duration: Duration,
}

impl FleetConfig {
    /// How often the Lease is renewed: three tries within a duration.
    pub fn renew_every(&self) -> Duration {
        self.lease_duration / 3
    }

    /// How often liveness is judged again without an event: a tenth of the duration,
    /// between 100 ms and the operator's 1 s.
    pub fn tick(&self) -> Duration {
        (self.lease_duration / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX)
    }

    pub fn lease_name(&self) -> String {
        membership::lease_name(&self.pod_namespace, &self.pod, &self.namespace)
    }

    /// The Pod as the Lease's owner; none across namespaces (an owner must live in its
    /// dependent's namespace, or the garbage collector deletes the dependent at once).
    fn owner(&self) -> Option<Vec<OwnerReference>> {
        let uid = self.pod_uid.as_ref().filter(|u| !u.is_empty())?;
        (self.pod_namespace == self.namespace).then(|| {
            vec![OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Pod".to_owned(),
                name: self.pod.clone(),
                uid: uid.clone(),
                ..OwnerReference::default()
            }]
        })
    }

    /// The Lease as this sidecar applies it, renewed at `renewed`, with the hash of the
    /// configuration it serves (for `rebound check`) once one is loaded, and its rollout
    /// evidence while a policy rolls out (absent otherwise: the apply then removes it).
    fn lease(
        &self,
        renewed: Timestamp,
        acquired: Timestamp,
        hash: Option<&str>,
        evidence: Option<String>,
    ) -> Lease {
        let mut labels: BTreeMap<String, String> = LABELS
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.insert(CONFIGMAP_LABEL.to_owned(), self.configmap.clone());
        Lease {
            metadata: ObjectMeta {
                name: Some(self.lease_name()),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels),
                annotations: annotations(hash, evidence),
                owner_references: self.owner(),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.pod.clone()),
                lease_duration_seconds: Some(self.lease_seconds()),
                acquire_time: Some(MicroTime(acquired)),
                renew_time: Some(MicroTime(renewed)),
                ..LeaseSpec::default()
            }),
        }
    }

    /// Why this configuration cannot make a member, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        // A label value: at most 63 characters (a ConfigMap name may have 253).
        if self.configmap.len() > 63 {
            return Err(format!(
                "the ConfigMap name {:?} is longer than a label value may be (63)",
                self.configmap
            ));
        }
        if self.lease_duration < Duration::from_secs(1) || self.lease_duration.subsec_nanos() != 0 {
            return Err("the lease duration must be whole seconds, at least 1s".to_owned());
        }
        Ok(())
    }
}

fn annotations(hash: Option<&str>, evidence: Option<String>) -> Option<BTreeMap<String, String>> {
    let mut map = BTreeMap::new();
    if let Some(h) = hash {
        map.insert(CONFIG_HASH_ANNOTATION.to_owned(), h.to_owned());
    }
    if let Some(e) = evidence {
        map.insert(EVIDENCE_ANNOTATION.to_owned(), e);
    }
    (!map.is_empty()).then_some(map)
}

/// The running membership; [`Fleet::release`] ends it.
pub struct Fleet {
    task: JoinHandle<()>,
    api: Api<Lease>,
    config: FleetConfig,
}

impl Fleet {
    /// Starts holding the Lease and following the fleet, and waits (up to one lease
    /// duration) until the first membership is known, so the first budgeted answers
    /// already book this sidecar's share. Until then, and if the wait times out, the
    /// share is the whole budget of a fleet of one, flagged stale.
    pub async fn start(
        client: Client,
        config: FleetConfig,
        share: Arc<FleetShare>,
        store: Arc<Store>,
    ) -> Self {
        let api: Api<Lease> = Api::namespaced(client.clone(), &config.namespace);
        // The Lease carries the rollout counts from its first renewal on.
        store.metrics().evidence().enable();
        let leases: Api<SeenLease> = Api::namespaced(client, &config.namespace);
        share.set(BudgetScope::Fleet(
            rebound_policy::retry_budget::SlotShare::WHOLE,
        ));
        share.set_stale(true);
        let (known_tx, mut known) = watch::channel(false);
        let member = Member {
            api: api.clone(),
            leases,
            own: config.lease_name(),
            config: config.clone(),
            share,
            observed: Observed::default(),
            skipped: HashSet::new(),
            synced: false,
            watch_ok: false,
            blind: false,
            renew_ok: false,
            renew_tried: false,
            watch_failed: false,
            acquired: Timestamp::now(),
            view: None,
            known: known_tx,
            store,
            published: None,
        };
        let task = tokio::spawn(member.run());
        if tokio::time::timeout(config.lease_duration, known.wait_for(|k| *k))
            .await
            .is_err()
        {
            tracing::warn!(
                lease = %config.lease_name(),
                namespace = %config.namespace,
                "fleet membership unknown after one lease duration; booking the whole budget until it is known"
            );
        }
        Fleet { task, api, config }
    }

    /// Stops renewing and deletes the Lease, so the others take over its share on their
    /// next event instead of after the lease duration. Where delete is not granted, the
    /// Lease is released instead (no holder), which readers count out just as fast.
    pub async fn release(self) {
        self.task.abort();
        let _ = self.task.await;
        let name = self.config.lease_name();
        let params = DeleteParams::default();
        let deleted = self.api.delete(&name, &params);
        let error = match tokio::time::timeout(Duration::from_secs(2), deleted).await {
            Ok(Ok(_)) => {
                tracing::info!(lease = %name, "fleet Lease deleted");
                return;
            }
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => return,
            Ok(Err(error)) => error.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        tracing::warn!(lease = %name, %error, "cannot delete the fleet Lease; releasing it");
        let now = Timestamp::now();
        let mut body = self.config.lease(now, now, None, None);
        if let Some(spec) = body.spec.as_mut() {
            spec.holder_identity = Some(String::new());
            spec.lease_duration_seconds = Some(1);
        }
        let (params, body) = (
            PatchParams::apply(FIELD_MANAGER).force(),
            Patch::Apply(&body),
        );
        let patch = self.api.patch(&name, &params, &body);
        match tokio::time::timeout(Duration::from_secs(2), patch).await {
            Ok(Ok(_)) => tracing::info!(lease = %name, "fleet Lease released"),
            Ok(Err(error)) => {
                tracing::warn!(lease = %name, %error, "cannot release the fleet Lease; it expires by itself")
            }
            Err(_) => {
                tracing::warn!(lease = %name, "releasing the fleet Lease timed out; it expires by itself")
            }
        }
    }
}

/// The membership task's state.
struct Member {
    api: Api<Lease>,
    /// The same Leases, read untyped: a Lease no typed struct can hold is skipped alone.
    leases: Api<SeenLease>,
    config: FleetConfig,
    own: String,
    share: Arc<FleetShare>,
    /// The Leases serving the ConfigMap, as seen changing.
    observed: Observed,
    /// Leases skipped for a bad field (warned about once each).
    skipped: HashSet<String>,
    /// A full list has arrived.
    synced: bool,
    /// The watch's last word was an event, not an error, and no relist after an error is
    /// under way.
    watch_ok: bool,
    /// Membership could not be observed since it was last judged (the watch failed, or
    /// this sidecar's own renewals did): renewals may have been missed.
    blind: bool,
    /// The last renewal succeeded.
    renew_ok: bool,
    /// A renewal was tried / the watch failed before (log transitions only).
    renew_tried: bool,
    watch_failed: bool,
    acquired: Timestamp,
    view: Option<View>,
    known: watch::Sender<bool>,
    /// The configuration served, whose hash the Lease carries.
    store: Arc<Store>,
    /// The hash in the Lease as last renewed.
    published: Option<String>,
}

impl Member {
    async fn run(mut self) {
        let selector = membership::selector(&self.config.configmap);
        let mut events = watcher(
            self.leases.clone(),
            watcher::Config::default().labels(&selector),
        )
        .with_watch_backoff(WatchBackoff::new("sidecar/fleet", SIDECAR_CAP));
        let mut renew = tokio::time::interval(self.config.renew_every());
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tick = tokio::time::interval(self.config.tick());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = renew.tick() => self.renew().await,
                _ = tick.tick() => {
                    // A new configuration shows in the Lease within a tick, not a renewal.
                    if self.renew_ok && self.current_hash() != self.published {
                        self.renew().await;
                    }
                }
                event = events.try_next() => match event {
                    Ok(Some(event)) => self.event(event, Instant::now()),
                    Ok(None) => return,
                    Err(error) => self.watch_failed(&error),
                },
            }
            self.evaluate(Instant::now());
        }
    }

    fn current_hash(&self) -> Option<String> {
        self.store.current().map(|loaded| loaded.hash().to_owned())
    }

    async fn renew(&mut self) {
        let now = Timestamp::now();
        let current = self.store.current();
        let hash = current.as_ref().map(|loaded| loaded.hash().to_owned());
        let now_ms = u64::try_from(now.as_millisecond()).unwrap_or(0);
        let evidence = self
            .store
            .metrics()
            .evidence()
            .report(current.as_ref().map(|l| &l.snapshot.table), now_ms);
        drop(current);
        let body = self
            .config
            .lease(now, self.acquired, hash.as_deref(), evidence);
        let (params, body) = (
            PatchParams::apply(FIELD_MANAGER).force(),
            Patch::Apply(&body),
        );
        let patch = self.api.patch(&self.own, &params, &body);
        let result = match tokio::time::timeout(self.config.renew_every(), patch).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("timed out".to_owned()),
        };
        match result {
            Ok(()) => {
                self.published = hash;
                self.share
                    .set_renewed_ms(u64::try_from(now.as_millisecond()).unwrap_or(0));
                if !self.renew_ok {
                    tracing::info!(lease = %self.own, namespace = %self.config.namespace, "fleet Lease renewed");
                }
                self.renew_ok = true;
            }
            Err(error) => {
                if self.renew_ok || !self.renew_tried {
                    tracing::warn!(lease = %self.own, namespace = %self.config.namespace, %error, "cannot renew the fleet Lease");
                }
                self.renew_ok = false;
            }
        }
        self.renew_tried = true;
    }

    /// The record of `lease`, or why it does not count; a bad field is warned about once
    /// per Lease, naming it.
    fn record(&mut self, lease: &SeenLease) -> Option<(String, membership::Record)> {
        let name = lease.metadata.name.clone()?;
        match membership::record(lease, &self.config.configmap) {
            Ok(record) => {
                self.skipped.remove(&name);
                Some((name, record))
            }
            Err(Skip::OtherConfigMap) => None,
            Err(skip) => {
                if self.skipped.insert(name.clone()) {
                    tracing::warn!(
                        lease = %name,
                        namespace = %self.config.namespace,
                        reason = %skip,
                        "skipping a sidecar Lease that cannot count as a member"
                    );
                }
                None
            }
        }
    }

    fn event(&mut self, event: watcher::Event<SeenLease>, now: Instant) {
        match event {
            watcher::Event::Init => self.observed.begin_relist(),
            watcher::Event::InitApply(lease) => {
                if let Some((name, record)) = self.record(&lease) {
                    self.observed.relisted(&name, record);
                }
            }
            watcher::Event::InitDone => {
                self.observed.end_relist(now, self.blind);
                self.blind = false;
                self.synced = true;
                self.watch_ok = true;
            }
            watcher::Event::Apply(lease) => {
                self.watch_ok = true;
                match self.record(&lease) {
                    Some((name, record)) => self.observed.apply(&name, record, now),
                    None => {
                        if let Some(name) = lease.metadata.name.as_deref() {
                            self.observed.remove(name);
                        }
                    }
                }
            }
            watcher::Event::Delete(lease) => {
                self.watch_ok = true;
                if let Some(name) = lease.metadata.name.as_deref() {
                    self.observed.remove(name);
                    self.skipped.remove(name);
                }
            }
        }
    }

    fn watch_failed(&mut self, error: &watcher::Error) {
        if self.watch_ok || !self.watch_failed {
            tracing::warn!(namespace = %self.config.namespace, %error, "cannot watch the fleet's Leases");
        }
        self.watch_ok = false;
        self.blind = true;
        self.watch_failed = true;
    }

    /// Publishes the membership at `now`, or keeps the last one while the API cannot
    /// be read, a re-list is under way, or this sidecar's Lease cannot be renewed: then
    /// expiries cannot be told from renewals that did not reach us, and a fleet cut off
    /// from the API as a whole keeps agreeing on the last membership it knew.
    fn evaluate(&mut self, now: Instant) {
        let fresh = self.synced && self.watch_ok && self.renew_ok;
        if self.share.set_stale(!fresh) {
            let members = self.share.scope().members();
            if fresh {
                tracing::info!(namespace = %self.config.namespace, members, "fleet membership current again");
            } else {
                tracing::warn!(
                    namespace = %self.config.namespace,
                    members,
                    watch_ok = self.watch_ok,
                    renew_ok = self.renew_ok,
                    "fleet membership stale: keeping the last one until the API answers"
                );
            }
        }
        if !fresh {
            // Renewals that happen meanwhile may never reach this sidecar.
            self.blind = true;
            return;
        }
        if self.observed.is_relisting() {
            return;
        }
        if std::mem::take(&mut self.blind) {
            self.observed.resume(now);
        }
        let view = self.observed.members(&self.own, now);
        let (seen, live) = self.observed.sizes();
        self.share.set_leases(seen as u64, live as u64);
        if self.view.as_ref() != Some(&view) {
            let share = view.share();
            tracing::info!(
                namespace = %self.config.namespace,
                members = share.members,
                member = share.member,
                "fleet membership changed"
            );
            self.share.set(BudgetScope::Fleet(share));
            self.view = Some(view);
        }
        self.known.send_replace(true);
    }
}
