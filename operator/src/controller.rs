//! Wiring: watch caches for RetryPolicies and ConfigMaps, a count of live sidecars from
//! their Leases, a trigger stream keyed by namespace, and kube-runtime's `applier` (the
//! engine behind `Controller`) to run the reconciles. A tick re-evaluates Lease liveness,
//! since an expiry is no event.
//!
//! The reconcile key is a namespace because the output (one ConfigMap) is per namespace. The
//! applier needs a cache holding its keys, so it gets a small local `Store<Namespace>` that
//! this module fills with the namespaces it has seen policies or ConfigMaps in (the
//! Namespace API itself is never read). The applier then gives exactly the semantics
//! wanted: one reconcile per namespace at a time, triggers merged while one runs, requeue
//! after errors and periodic resync.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::{StreamExt, TryStreamExt, stream::BoxStream};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DynamicObject, ObjectMeta};
use kube::runtime::controller::{self, ReconcileReason, ReconcileRequest, applier};
use kube::runtime::reflector::{ObjectRef, store::Writer};
use kube::runtime::watcher;
use tracing::{debug, info, warn};

use crate::Flags;
use crate::backoff::{Requeue, watch_backoff};
use crate::burst::Bursts;
use crate::cache::Cache;
use crate::context::{Context, Stores};
use crate::events::Events;
use crate::flags::InitialList;
use crate::fleet::{self, Membership};
use crate::metrics::Metrics;
use crate::objects::{ConfigMapView, PolicyView, policy_resource, slim_configmap, slim_policy};
use crate::reconcile::{error_policy, reconcile};
use crate::triggers::Triggers;
use rebound_runtime::watch_backoff::WatchBackoffExt;

/// List page sizes with `--initial-list=pages`: an initial list of large objects (1 MiB
/// ConfigMaps of someone else, policies with 256 KiB annotations) is never decoded all at
/// once; only the slimmed objects stay. A streamed initial list (the default) decodes one
/// object at a time and needs no round trip per page: 100,000 policies in pages of 100
/// took 35 s of a 36 s start.
const POLICY_PAGE: u32 = 100;
const CONFIGMAP_PAGE: u32 = 8;
const LEASE_PAGE: u32 = 500;

/// A watcher configuration with the initial list the flags ask for.
fn initial(config: watcher::Config, how: InitialList, page: u32) -> watcher::Config {
    match how {
        InitialList::Stream => config.streaming_lists(),
        InitialList::Pages => config.page_size(page),
    }
}

/// The kinds of watch streams, for telling when every one has listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Policy,
    ConfigMap,
    Lease,
}

/// One item of the merged watch streams.
enum Incoming {
    Policy {
        stream: usize,
        scope: Option<String>,
        event: watcher::Event<DynamicObject>,
    },
    ConfigMap {
        stream: usize,
        event: watcher::Event<ConfigMap>,
    },
    Lease {
        stream: usize,
        scope: Option<String>,
        event: watcher::Event<Lease>,
    },
    /// Time to look at Lease liveness again.
    Tick,
    Error(watcher::Error),
}

/// Runs the controller until `stop` completes, then lets running reconciles finish.
pub async fn run(
    client: kube::Client,
    flags: Arc<Flags>,
    metrics: Arc<Metrics>,
    events: Events,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let scopes: Vec<Option<String>> = match flags.scope() {
        None => vec![None],
        Some(list) => list.into_iter().map(Some).collect(),
    };
    let mut stores = Stores::default();
    let mut streams: Vec<BoxStream<'static, Incoming>> = Vec::new();
    let resource = policy_resource();
    let cm_selector = format!("metadata.name={}", flags.configmap_name);
    for (stream, scope) in scopes.iter().enumerate() {
        let policies: Api<DynamicObject> = match scope {
            None => Api::all_with(client.clone(), &resource),
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        };
        let cache = Cache::default();
        stores.policies.push(cache.clone());
        let scope_name = scope.clone();
        streams.push(
            watcher(
                policies,
                initial(watcher::Config::default(), flags.initial_list, POLICY_PAGE),
            )
            .with_watch_backoff(watch_backoff(&format!("policies/{stream}")))
            .map_ok(move |e| {
                let e = e.modify(slim_policy);
                cache.apply(&e, PolicyView::keyed);
                e
            })
            .map(move |r| match r {
                Ok(event) => Incoming::Policy {
                    stream,
                    scope: scope_name.clone(),
                    event,
                },
                Err(e) => Incoming::Error(e),
            })
            .boxed(),
        );

        let configmaps: Api<ConfigMap> = match scope {
            None => Api::all(client.clone()),
            Some(ns) => Api::namespaced(client.clone(), ns),
        };
        let cache = Cache::default();
        stores.configmaps.push(cache.clone());
        streams.push(
            watcher(
                configmaps,
                initial(
                    watcher::Config::default().fields(&cm_selector),
                    flags.initial_list,
                    CONFIGMAP_PAGE,
                ),
            )
            .with_watch_backoff(watch_backoff(&format!("configmaps/{stream}")))
            .map_ok(move |e| {
                cache.apply(&e, ConfigMapView::keyed);
                e.modify(slim_configmap)
            })
            .map(move |r| match r {
                Ok(event) => Incoming::ConfigMap { stream, event },
                Err(e) => Incoming::Error(e),
            })
            .boxed(),
        );

        let leases: Api<fleet::RawLease> = match scope {
            None => Api::all(client.clone()),
            Some(ns) => Api::namespaced(client.clone(), ns),
        };
        let mut lenient = fleet::Lenient::default();
        let scope_name = scope.clone();
        streams.push(
            watcher(
                leases,
                initial(
                    watcher::Config::default().labels(fleet::SELECTOR),
                    flags.initial_list,
                    LEASE_PAGE,
                ),
            )
            .with_watch_backoff(watch_backoff(&format!("leases/{stream}")))
            .map_ok(move |e| lenient.typed(e).modify(fleet::slim_lease))
            .map(move |r| match r {
                Ok(event) => Incoming::Lease {
                    stream,
                    scope: scope_name.clone(),
                    event,
                },
                Err(e) => Incoming::Error(e),
            })
            .boxed(),
        );
    }
    let watch_streams = streams.len();
    let mut ticks = tokio::time::interval(fleet::TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    streams.push(
        futures::stream::unfold(ticks, |mut ticks| async move {
            ticks.tick().await;
            Some((Incoming::Tick, ticks))
        })
        .boxed(),
    );

    let bursts = Arc::new(Bursts::default());
    let mut keys = Writer::<Namespace>::new(());
    let key_store = keys.as_reader();
    let mut router = Router {
        triggers: Triggers::default(),
        synced: HashSet::new(),
        streams: watch_streams,
        ready: false,
        keys: HashSet::new(),
        failing: false,
        metrics: metrics.clone(),
        membership: Membership::new(&flags.configmap_name, stores.sidecars.clone()),
        reports: stores.reports.clone(),
        bursts: bursts.clone(),
    };
    let queue = futures::stream::select_all(streams)
        .flat_map(move |incoming| {
            let requests = router.route(incoming, &mut keys);
            futures::stream::iter(requests.into_iter().map(Ok::<_, Infallible>))
        })
        .take_until(stop);

    let ctx = Arc::new(Context {
        client,
        flags: flags.clone(),
        stores,
        memory: Mutex::default(),
        requeue: Requeue::default(),
        metrics,
        events,
        summaries: Arc::default(),
        bursts,
        status_writes: Arc::new(tokio::sync::Semaphore::new(
            crate::writes::STATUS_WRITES_IN_FLIGHT,
        )),
    });
    let settings = controller::Config::default().concurrency(flags.concurrency);
    applier(
        |key, ctx| Box::pin(reconcile(key, ctx)),
        error_policy,
        ctx,
        key_store,
        queue,
        settings,
    )
    .for_each(|result| async move {
        match result {
            Ok((key, _)) => debug!(namespace = %key.name, "reconcile done"),
            Err(controller::Error::ReconcilerFailed(..)) => {} // logged by the error policy
            Err(e) => warn!(error = %e, "controller"),
        }
    })
    .await;
    info!("controller stopped");
}

/// Turns watch events into reconcile requests and keeps the key cache.
struct Router {
    triggers: Triggers,
    /// Watch streams that finished their first list.
    synced: HashSet<(Kind, usize)>,
    streams: usize,
    ready: bool,
    keys: HashSet<String>,
    metrics: Arc<Metrics>,
    membership: Membership,
    /// The sidecars' rollout evidence, read from the same Lease events.
    reports: crate::rollout::Reports,
    /// A watch failed and no event has arrived since: one log line per failing streak.
    failing: bool,
    /// Where policy events come in bursts.
    bursts: Arc<Bursts>,
}

impl Router {
    fn route(
        &mut self,
        incoming: Incoming,
        keys: &mut Writer<Namespace>,
    ) -> Vec<ReconcileRequest<Namespace>> {
        let event_arrived = !matches!(incoming, Incoming::Error(_) | Incoming::Tick);
        if event_arrived && std::mem::take(&mut self.failing) {
            info!("watches delivering events again");
        }
        let (namespaces, why) = match incoming {
            Incoming::Policy {
                stream,
                scope,
                event,
            } => {
                if matches!(event, watcher::Event::InitDone) {
                    self.synced.insert((Kind::Policy, stream));
                }
                let touched = self.triggers.policy(stream, scope.as_deref(), &event);
                if matches!(event, watcher::Event::Apply(_) | watcher::Event::Delete(_)) {
                    let now = std::time::Instant::now();
                    for ns in &touched {
                        self.bursts.event(ns, now);
                    }
                }
                (touched, "RetryPolicy changed")
            }
            Incoming::ConfigMap { stream, event } => {
                if matches!(event, watcher::Event::InitDone) {
                    self.synced.insert((Kind::ConfigMap, stream));
                }
                (self.triggers.configmap(&event), "ConfigMap changed")
            }
            Incoming::Lease {
                stream,
                scope,
                event,
            } => {
                if matches!(event, watcher::Event::InitDone) {
                    self.synced.insert((Kind::Lease, stream));
                }
                let now = std::time::Instant::now();
                let mut touched = self.membership.event(stream, scope.as_deref(), &event, now);
                for ns in self.reports.event(&event) {
                    // Many sidecars reporting: one compile a second, as for a burst of
                    // policy changes; a lone report is not delayed.
                    self.bursts.event(&ns, now);
                    if !touched.contains(&ns) {
                        touched.push(ns);
                    }
                }
                (touched, "sidecars or their rollout evidence changed")
            }
            Incoming::Tick => (
                self.membership.tick(std::time::Instant::now()),
                "a sidecar Lease expired",
            ),
            Incoming::Error(e) => {
                self.metrics.watch_error();
                self.membership.watch_failed(std::time::Instant::now());
                let code = crate::error::watch_status_code(&e);
                if std::mem::replace(&mut self.failing, true) {
                    debug!(error = %e, code, "watch failed again; retrying with backoff");
                } else {
                    warn!(error = %e, code, "watch failed; retrying with backoff");
                }
                (Vec::new(), "")
            }
        };
        for ns in &namespaces {
            if self.keys.insert(ns.clone()) && self.ready {
                keys.apply_watcher_event(&watcher::Event::Apply(key(ns)));
            }
        }
        if !self.ready && self.synced.len() == self.streams {
            // Every cache holds a full list: only now may reconciles run, or a namespace
            // could be compiled from half its policies.
            self.ready = true;
            keys.apply_watcher_event(&watcher::Event::Init);
            for ns in &self.keys {
                keys.apply_watcher_event(&watcher::Event::InitApply(key(ns)));
            }
            keys.apply_watcher_event(&watcher::Event::InitDone);
            self.metrics.set_ready(true);
            info!(namespaces = self.keys.len(), "watch caches synced");
        }
        namespaces
            .into_iter()
            .map(|ns| ReconcileRequest {
                obj_ref: ObjectRef::new(&ns),
                reason: ReconcileReason::Custom {
                    reason: why.to_owned(),
                },
            })
            .collect()
    }
}

fn key(namespace: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}
