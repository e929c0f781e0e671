//! Fleet membership for the retry budgets (docs/sidecar.md, "Fleet-wide retry budgets"):
//! in watch mode a sidecar holds the Lease `rebound-sidecar-<pod>` in the ConfigMap's
//! namespace, watches the Leases of the sidecars serving the same ConfigMap, and publishes
//! its [`SlotShare`](rebound_policy::retry_budget::SlotShare) of every budget into
//! [`FleetShare`], which the request path reads from memory. All of it runs beside the
//! requests: renewals every `duration / 3`, Lease events, and a liveness tick (an expired
//! Lease sends no event).

pub mod membership;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::TryStreamExt;
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{ObjectMeta, Patch, PatchParams},
    runtime::watcher,
};
use tokio::{sync::watch, task::JoinHandle};

use crate::fleet_share::{BudgetScope, FleetShare};
use crate::store::Store;
use membership::{CONFIG_HASH_ANNOTATION, CONFIGMAP_LABEL, LABELS, View};
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

    fn lease_name(&self) -> String {
        membership::lease_name(&self.pod)
    }

    /// The Lease as this sidecar applies it, renewed at `renewed`, with the hash of the
    /// configuration it serves (for `rebound check`) once one is loaded.
    fn lease(&self, renewed: Timestamp, acquired: Timestamp, hash: Option<&str>) -> Lease {
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
                annotations: hash
                    .map(|h| BTreeMap::from([(CONFIG_HASH_ANNOTATION.to_owned(), h.to_owned())])),
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
        let api: Api<Lease> = Api::namespaced(client, &config.namespace);
        share.set(BudgetScope::Fleet(
            rebound_policy::retry_budget::SlotShare::WHOLE,
        ));
        share.set_stale(true);
        let (known_tx, mut known) = watch::channel(false);
        let member = Member {
            api: api.clone(),
            own: config.lease_name(),
            config: config.clone(),
            share,
            expiries: BTreeMap::new(),
            relisting: None,
            synced: false,
            watch_ok: false,
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

    /// Stops renewing and expires the Lease at once (a renewal dated one duration ago: the
    /// sidecar's RBAC grants no delete), so the others take over its share on their next
    /// event instead of after the lease duration.
    pub async fn release(self) {
        self.task.abort();
        let _ = self.task.await;
        let past = Timestamp::now()
            .checked_sub(self.config.lease_duration + Duration::from_secs(1))
            .unwrap_or(Timestamp::UNIX_EPOCH);
        let body = self.config.lease(past, past, None);
        let name = self.config.lease_name();
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
    config: FleetConfig,
    own: String,
    share: Arc<FleetShare>,
    /// Lease name → expiry (Unix ms) of the Leases serving the ConfigMap.
    expiries: BTreeMap<String, i64>,
    /// A re-list in progress.
    relisting: Option<BTreeMap<String, i64>>,
    /// A full list has arrived.
    synced: bool,
    /// The watch's last word was an event, not an error.
    watch_ok: bool,
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
            self.api.clone(),
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
                    Ok(Some(event)) => self.event(event),
                    Ok(None) => return,
                    Err(error) => self.watch_failed(&error),
                },
            }
            self.evaluate(Timestamp::now().as_millisecond());
        }
    }

    fn current_hash(&self) -> Option<String> {
        self.store.current().map(|loaded| loaded.hash().to_owned())
    }

    async fn renew(&mut self) {
        let now = Timestamp::now();
        let hash = self.current_hash();
        let body = self.config.lease(now, self.acquired, hash.as_deref());
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

    fn event(&mut self, event: watcher::Event<Lease>) {
        self.watch_ok = true;
        let configmap = &self.config.configmap;
        match event {
            watcher::Event::Init => self.relisting = Some(BTreeMap::new()),
            watcher::Event::InitApply(lease) => {
                if let (Some(list), Some(name), Some(expires)) = (
                    self.relisting.as_mut(),
                    lease.metadata.name.clone(),
                    membership::expiry_ms(&lease, configmap),
                ) {
                    list.insert(name, expires);
                }
            }
            watcher::Event::InitDone => {
                if let Some(list) = self.relisting.take() {
                    self.expiries = list;
                }
                self.synced = true;
            }
            watcher::Event::Apply(lease) => {
                if let Some(name) = lease.metadata.name.clone() {
                    match membership::expiry_ms(&lease, configmap) {
                        Some(expires) => self.expiries.insert(name, expires),
                        None => self.expiries.remove(&name),
                    };
                }
            }
            watcher::Event::Delete(lease) => {
                if let Some(name) = lease.metadata.name.as_deref() {
                    self.expiries.remove(name);
                }
            }
        }
    }

    fn watch_failed(&mut self, error: &watcher::Error) {
        if self.watch_ok || !self.watch_failed {
            tracing::warn!(namespace = %self.config.namespace, %error, "cannot watch the fleet's Leases");
        }
        self.watch_ok = false;
        self.watch_failed = true;
    }

    /// Publishes the membership at `now_ms`, or keeps the last one while the API cannot
    /// be read or this sidecar's Lease cannot be renewed: then expiries cannot be told
    /// from renewals that did not reach us, and a fleet cut off from the API as a whole
    /// keeps agreeing on the last membership it knew.
    fn evaluate(&mut self, now_ms: i64) {
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
            return;
        }
        let view = membership::members(&self.expiries, &self.own, now_ms);
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
