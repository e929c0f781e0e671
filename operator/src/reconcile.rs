//! One namespace reconcile: compile every RetryPolicy of the namespace from the watch
//! cache, bring the ConfigMap to the compiled document, then write each policy's status if
//! (and only if) it differs from what the policy already shows.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use rebound_policy::spec::ScheduleSummary;
use rebound_policy::{PolicyOutcome, PolicySource, RetryPolicyStatus, compile};
use tracing::{debug, warn};

use crate::configmap::{self, Desired, Plan};
use crate::error::Error;
use crate::events::Events;
use crate::freshness::{Written, newest};
use crate::metrics::{Metrics, NamespaceFigures};
use crate::objects::{ConfigMapView, PolicyView};
use crate::status::{Blocked, Verdict};
use crate::writes::{write_configmap, write_statuses};
use crate::{Config, backoff::Requeue};

/// The watch caches a reconcile reads from (one per watched scope).
#[derive(Clone, Default)]
pub struct Stores {
    pub policies: Vec<Store<DynamicObject>>,
    pub configmaps: Vec<Store<ConfigMap>>,
}

impl Stores {
    fn policies_in(&self, namespace: &str) -> Vec<PolicyView> {
        self.policies
            .iter()
            .flat_map(|s| s.state_filter(|o| o.namespace().as_deref() == Some(namespace)))
            .filter_map(|o| PolicyView::from_dynamic(&o))
            .collect()
    }

    fn configmap(&self, namespace: &str, name: &str) -> Option<ConfigMapView> {
        let key = ObjectRef::<ConfigMap>::new(name).within(namespace);
        self.configmaps
            .iter()
            .find_map(|s| s.get(&key))
            .map(|cm| ConfigMapView::from_configmap(&cm))
    }
}

/// What a namespace's reconciles remember between runs: our own writes (until the watch
/// cache catches up) and the schedule summaries (one simulation per policy generation).
#[derive(Default)]
pub struct Memory {
    pub(crate) configmap: Option<Written<ConfigMapView>>,
    pub(crate) statuses: HashMap<String, Written<RetryPolicyStatus>>,
    pub(crate) summaries: HashMap<String, (i64, ScheduleSummary)>,
}

/// Everything a reconcile needs; shared by all of them.
pub struct Context {
    pub client: kube::Client,
    pub config: Arc<Config>,
    pub stores: Stores,
    pub memory: Mutex<HashMap<String, Memory>>,
    pub requeue: Requeue,
    pub metrics: Arc<Metrics>,
    pub events: Events,
}

impl Context {
    fn take_memory(&self, namespace: &str) -> Memory {
        let mut all = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        all.remove(namespace).unwrap_or_default()
    }

    fn put_memory(&self, namespace: &str, memory: Memory) {
        let mut all = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        all.insert(namespace.to_owned(), memory);
    }
}

/// The controller's reconcile function; the key is a namespace.
pub async fn reconcile(key: Arc<Namespace>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = key.name_any();
    let started = Instant::now();
    // The applier never runs two reconciles of one key at once, so taking the memory out
    // and putting it back cannot race.
    let mut memory = ctx.take_memory(&namespace);
    let result = reconcile_namespace(&namespace, &ctx, &mut memory).await;
    ctx.put_memory(&namespace, memory);
    ctx.metrics
        .reconciled(result.is_ok(), started.elapsed().as_secs_f64());
    result?;
    ctx.requeue.succeeded(&namespace);
    Ok(Action::requeue(ctx.config.resync))
}

/// The controller's error policy: requeue with backoff from the policy crate.
pub fn error_policy(key: Arc<Namespace>, error: &Error, ctx: Arc<Context>) -> Action {
    let namespace = key.name_any();
    let delay = ctx.requeue.failed(&namespace);
    warn!(%namespace, error = %error, kind = error.kind(), retry_in_ms = delay.as_millis() as u64, "reconcile failed");
    Action::requeue(delay)
}

async fn reconcile_namespace(
    namespace: &str,
    ctx: &Context,
    memory: &mut Memory,
) -> Result<(), Error> {
    let cm_name = ctx.config.configmap_name.as_str();
    let views: Vec<PolicyView> = ctx
        .stores
        .policies_in(namespace)
        .into_iter()
        .filter(|v| !v.deleting)
        .collect();

    let sources: Vec<PolicySource> = views
        .iter()
        .filter_map(|v| {
            let spec = v.spec.as_ref().ok()?.clone();
            Some(PolicySource {
                name: v.name.clone(),
                namespace: v.namespace.clone(),
                uid: v.uid.clone(),
                generation: v.generation,
                created: v.created,
                spec,
            })
        })
        .collect();
    let compilation = compile(namespace, sources);
    let desired = (!views.is_empty()).then(|| Desired {
        json: compilation.document.to_json(),
        hash: compilation.document.hash.clone(),
    });

    let cached = ctx.stores.configmap(namespace, cm_name);
    let current = newest(
        cached
            .as_ref()
            .map(|c| (c.resource_version.as_str(), Some(c))),
        memory.configmap.as_ref(),
    )
    .cloned();
    let plan = configmap::plan(cm_name, namespace, current.as_ref(), desired.as_ref());
    let mut blocked = match &plan {
        Plan::NotOwned => Some(Blocked::NotOwned {
            configmap: cm_name.to_owned(),
        }),
        Plan::TooLarge { bytes } => Some(Blocked::TooLarge {
            bytes: *bytes,
            limit: rebound_policy::compiled::MAX_DOCUMENT_BYTES,
        }),
        _ => None,
    };
    let mut failure = None;
    match write_configmap(ctx, namespace, cm_name, plan, memory).await {
        Ok(()) => {}
        Err(e @ Error::Conflict(_)) => return Err(e),
        Err(e) => {
            blocked = Some(Blocked::ApplyFailed {
                message: e.to_string(),
            });
            failure = Some(e);
        }
    }

    let hash = compilation.document.hash.as_str();
    let verdicts: Vec<(PolicyView, Verdict)> = views
        .into_iter()
        .map(|v| {
            let verdict = verdict(&v, &compilation, blocked.as_ref());
            (v, verdict)
        })
        .collect();
    refresh_summaries(memory, &compilation);
    let figures = NamespaceFigures {
        compiled: compilation.document.policies.len() as i64,
        not_ready: verdicts
            .iter()
            .filter(|(_, v)| !matches!(v, Verdict::Serving { .. }))
            .count() as i64,
        configmap_bytes: match (&blocked, &desired) {
            (None, Some(d)) => d.json.len() as i64,
            _ => current
                .as_ref()
                .filter(|c| c.managed)
                .and_then(|c| c.document.as_ref())
                .map_or(0, |d| d.len() as i64),
        },
    };

    let status_result = write_statuses(ctx, namespace, verdicts, memory).await;
    ctx.metrics.set_namespace(namespace, figures);
    debug!(%namespace, %hash, policies = figures.compiled, not_ready = figures.not_ready, "reconciled");
    match failure {
        Some(e) => Err(e),
        None => status_result,
    }
}

/// What compiling did to one policy, given whether the document could be written.
fn verdict(
    view: &PolicyView,
    compilation: &rebound_policy::Compilation,
    blocked: Option<&Blocked>,
) -> Verdict {
    let outcome = match &view.spec {
        Err(e) => return Verdict::Invalid(vec![e.clone()]),
        Ok(_) => compilation.outcome(&view.name),
    };
    match (outcome, blocked) {
        (Some(PolicyOutcome::Invalid(errors)), _) => Verdict::Invalid(errors.clone()),
        (Some(PolicyOutcome::Compiled { .. }), Some(blocked)) => Verdict::Blocked(blocked.clone()),
        (Some(PolicyOutcome::Compiled { serving, lost }), None) if lost.is_empty() => {
            Verdict::Serving {
                serving: serving.clone(),
            }
        }
        (Some(PolicyOutcome::Compiled { serving, lost }), None) => Verdict::Conflict {
            serving: serving.clone(),
            lost: lost.clone(),
        },
        // Every parsed policy has an outcome; an unparsed one returned above.
        (None, _) => Verdict::Invalid(Vec::new()),
    }
}

/// Simulates new policy generations and forgets policies that are gone.
fn refresh_summaries(memory: &mut Memory, compilation: &rebound_policy::Compilation) {
    let mut present = HashSet::new();
    for p in &compilation.document.policies {
        present.insert(p.uid.clone());
        let fresh = memory
            .summaries
            .get(&p.uid)
            .is_some_and(|(generation, _)| *generation == p.generation);
        if !fresh {
            let summary = crate::summary::summarize(&p.identity(), &p.params);
            memory
                .summaries
                .insert(p.uid.clone(), (p.generation, summary));
        }
    }
    memory.summaries.retain(|uid, _| present.contains(uid));
}
