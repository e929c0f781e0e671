//! One namespace reconcile: compile every RetryPolicy of the namespace from the watch
//! cache, bring the ConfigMap to the compiled document, then write each policy's status if
//! (and only if) it differs from what the policy already shows.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use rebound_policy::{PolicyOutcome, PolicySource};
use tracing::{debug, warn};

use crate::configmap::{self, Plan};
use crate::context::{Context, Memory};
use crate::error::Error;
use crate::fit::{Fitted, Served, fit_all, fit_within};
use crate::freshness::{Written, compare};
use crate::metrics::{HeldConfig, NamespaceFigures};
use crate::objects::{ConfigMapView, PolicyView};
use crate::status::{Blocked, Verdict};
use crate::summary::Summaries;
use crate::writes::{write_configmap, write_statuses};

/// The controller's reconcile function; the key is a namespace.
pub async fn reconcile(key: Arc<Namespace>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = key.name_any();
    // Within a burst of changes, compile once it pauses (see `burst`).
    if let Some(wait) = ctx.bursts.defer(&namespace, Instant::now()) {
        debug!(%namespace, wait_ms = wait.as_millis() as u64, "in a burst: compiled once it pauses");
        return Ok(Action::requeue(wait));
    }
    let started = Instant::now();
    // The applier never runs two reconciles of one key at once, so taking the memory out
    // and putting it back cannot race.
    let mut memory = ctx.take_memory(&namespace);
    let result = reconcile_namespace(&namespace, &ctx, &mut memory).await;
    let unconfirmed = memory.has_unconfirmed_writes();
    let rollout_check = memory.next_rollout_check_ms;
    // A namespace's memory at its default is not kept: a deleted namespace leaves nothing.
    ctx.put_memory(&namespace, memory);
    ctx.metrics
        .reconciled(result.is_ok(), started.elapsed().as_secs_f64());
    let holds_ours = result?;
    ctx.requeue.succeeded(&namespace);
    if !holds_ours && !unconfirmed {
        // No policy and no ConfigMap: nothing to resync. Any that appears is a watch
        // event, which triggers a reconcile; so a deleted namespace is not requeued forever.
        return Ok(Action::await_change());
    }
    // Our own status writes trigger nothing, so without this the writes remembered for a
    // namespace would stay in memory until its next resync (five minutes by default): with
    // 100,000 policies that is the largest thing the operator holds. A reconcile soon
    // after, which writes nothing once the cache has caught up, lets them go.
    let next = if unconfirmed {
        SETTLE.min(ctx.flags.resync)
    } else {
        ctx.flags.resync
    };
    // A rollout's pause or deadline ends: look then (a little after, so the time has come).
    let next = match rollout_check {
        Some(at) => {
            let wait = at.saturating_sub(crate::rollout::now_unix_ms()) + 50;
            next.min(std::time::Duration::from_millis(wait))
        }
        None => next,
    };
    Ok(Action::requeue(next))
}

/// When a namespace with writes the watch cache has not confirmed yet is looked at again.
const SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

/// The controller's error policy: requeue with backoff from the policy crate.
pub fn error_policy(key: Arc<Namespace>, error: &Error, ctx: Arc<Context>) -> Action {
    let namespace = key.name_any();
    let delay = ctx.requeue.failed(&namespace);
    warn!(%namespace, error = %error, kind = error.kind(), code = error.code(), retry_in_ms = delay.as_millis() as u64, "reconcile failed");
    Action::requeue(delay)
}

/// How long ConfigMap writes must keep failing before the policies say `ApplyFailed`.
/// Until then a failed write only requeues the namespace with backoff and leaves every
/// status as it is, so one refused write costs one retry, not two status writes and
/// events per policy (there and back).
pub const APPLY_FAILED_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// Reconciles one namespace; `Ok(false)` when it holds nothing of ours (no RetryPolicy,
/// no ConfigMap).
async fn reconcile_namespace(
    namespace: &str,
    ctx: &Context,
    memory: &mut Memory,
) -> Result<bool, Error> {
    let cm_name = ctx.flags.configmap_name.as_str();
    let views: Vec<Arc<PolicyView>> = ctx
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
    let has_policies = !views.is_empty();
    let plans = Arc::new(plan_rollouts(ctx, namespace, &views, memory));
    // Compiling, compressing and fitting are CPU work (a large namespace takes tens of
    // milliseconds): on the blocking pool, like the summaries.
    let (ns, mut last) = (namespace.to_owned(), memory.compressed.take());
    let in_blocking = Arc::clone(&plans);
    let (first, last) = blocking(namespace, move || {
        let first = fit_all(&ns, sources, &in_blocking, has_policies, &mut last);
        (first, last)
    })
    .await?;
    memory.compressed = last;
    let Fitted {
        compilation,
        desired,
        left_out,
    } = match first {
        Ok(fitted) => fitted,
        Err(over) => {
            // Rare: only a namespace over a limit asks the server what it serves now.
            let served = served_now(ctx, namespace, cm_name).await?;
            let (ns, mut last) = (namespace.to_owned(), memory.compressed.take());
            let in_blocking = Arc::clone(&plans);
            let (fitted, last) = blocking(namespace, move || {
                let fitted = fit_within(&ns, over, &served, &in_blocking, has_policies, &mut last);
                (fitted, last)
            })
            .await?;
            memory.compressed = last;
            fitted
        }
    };

    let cached = ctx.stores.configmap(namespace, cm_name);
    let current = match seen_configmap(cached, &mut memory.configmap) {
        Seen::Known(view) => view,
        Seen::AskServer => {
            let live = live_configmap(ctx, namespace, cm_name).await?;
            // Gone: nothing of our write is left. Present: it stands in until the cache has it.
            memory.configmap = live.clone().map(|v| Written {
                resource_version: v.resource_version.clone(),
                value: v,
            });
            live
        }
    };
    let plan = configmap::plan(cm_name, namespace, current.as_ref(), &desired);
    // After a successful write the ConfigMap exists unless there was none and none is wanted.
    let exists = current.is_some() || desired.has_policies;
    let mut blocked = match &plan {
        Plan::NotOwned => Some(Blocked::NotOwned {
            configmap: cm_name.to_owned(),
        }),
        _ => None,
    };
    let mut failure = None;
    match write_configmap(ctx, namespace, cm_name, plan, memory).await {
        Ok(()) => {
            memory.apply_failing_since = None;
            remember_served(&views, &plans, memory);
        }
        Err(e @ Error::Conflict(_)) => return Err(e),
        Err(e) => {
            let since = *memory.apply_failing_since.get_or_insert_with(Instant::now);
            if since.elapsed() < APPLY_FAILED_AFTER {
                return Err(e);
            }
            blocked = Some(Blocked::ApplyFailed {
                message: e.to_string(),
            });
            failure = Some(e);
        }
    }

    let hash = compilation.document.hash.as_str();
    let outcomes: HashMap<&str, &PolicyOutcome> = compilation
        .outcomes
        .iter()
        .map(|(name, outcome)| (name.as_str(), outcome))
        .collect();
    let verdicts: Vec<(Arc<PolicyView>, Verdict)> = views
        .into_iter()
        .map(|v| {
            let outcome = outcomes.get(v.name.as_str()).copied();
            let verdict = match left_out.get(&v.name) {
                Some(too_large) if blocked.is_none() && v.spec.is_ok() => {
                    Verdict::Blocked(too_large.clone())
                }
                _ => verdict(&v, outcome, blocked.as_ref()),
            };
            (v, verdict)
        })
        .collect();
    drop(outcomes);
    let held = match (&failure, &blocked) {
        // The write failed: the ConfigMap still holds what was held before.
        (Some(_), _) => HeldConfig::Keep,
        (None, Some(Blocked::NotOwned { .. })) => HeldConfig::Nothing,
        (None, _) if desired.has_policies => HeldConfig::Holds(desired.hash.as_str()),
        (None, _) => HeldConfig::Nothing,
    };
    let readiness: Vec<(String, bool)> = verdicts
        .iter()
        .map(|(v, verdict)| (v.name.clone(), matches!(verdict, Verdict::Serving { .. })))
        .collect();
    refresh_summaries(memory, &compilation, &ctx.summaries).await;
    let figures = NamespaceFigures {
        compiled: compilation.document.policies.len() as i64,
        not_ready: verdicts
            .iter()
            .filter(|(_, v)| !matches!(v, Verdict::Serving { .. }))
            .count() as i64,
        configmap_bytes: match (&blocked, exists) {
            (None, true) => desired.content().bytes as i64,
            _ => current
                .as_ref()
                .filter(|c| c.managed)
                .map_or(0, |c| c.content.bytes as i64),
        },
    };

    let sidecars = ctx.stores.sidecars_in(namespace);
    let status_result = write_statuses(ctx, namespace, verdicts, sidecars, &plans, memory).await;
    ctx.metrics.set_namespace(namespace, figures);
    ctx.metrics
        .set_namespace_config(namespace, held, &readiness);
    debug!(%namespace, %hash, policies = figures.compiled, not_ready = figures.not_ready, "reconciled");
    match failure {
        Some(e) => Err(e),
        None => status_result.map(|()| exists),
    }
}

/// Runs the rollout machine of every policy with `spec.rollout` (none: nothing to do) and
/// remembers when the namespace must be looked at again.
fn plan_rollouts(
    ctx: &Context,
    namespace: &str,
    views: &[Arc<PolicyView>],
    memory: &mut Memory,
) -> crate::rollout::Plans {
    let any = views
        .iter()
        .any(|v| v.spec.as_ref().is_ok_and(|s| s.rollout.is_some()));
    if !any {
        memory.rollouts.clear();
        memory.served_rollouts.clear();
        memory.next_rollout_check_ms = None;
        return crate::rollout::Plans::new();
    }
    let reports = ctx.stores.reports.in_namespace(namespace);
    let plans = crate::rollout::plan(
        views,
        &memory.rollouts,
        &memory.served_rollouts,
        &reports,
        crate::rollout::now_unix_ms(),
        ctx.flags.rollout_step_lead.as_millis() as u64,
    );
    memory.next_rollout_check_ms = crate::rollout::next_check(&plans);
    plans
}

/// After a successful ConfigMap write: the rollout statuses it serves, until their status
/// writes succeed (`writes::write_statuses` forgets them then).
fn remember_served(views: &[Arc<PolicyView>], plans: &crate::rollout::Plans, memory: &mut Memory) {
    for view in views {
        if let Some(plan) = plans.get(&view.name) {
            memory.served_rollouts.insert(
                view.uid.clone(),
                (
                    view.resource_version.clone(),
                    plan.transition.status.clone(),
                ),
            );
        }
    }
}

/// Runs CPU work on the blocking pool; a panic there is a panic here.
async fn blocking<T: Send + 'static>(
    namespace: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Error> {
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => Ok(value),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::Internal(format!("compiling {namespace}: {e}"))),
    }
}

/// What the namespace's ConfigMap serves now, read from the server (a ConfigMap that is
/// not ours, or holds no readable document, serves nothing of ours).
async fn served_now(ctx: &Context, namespace: &str, name: &str) -> Result<Served, Error> {
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), namespace);
    let found = api
        .get_opt(name)
        .await
        .map_err(|e| Error::api(format!("reading ConfigMap {namespace}/{name}"), e))?;
    let Some(cm) = found.filter(|cm| ConfigMapView::from_configmap(cm).managed) else {
        return Ok(Served::new());
    };
    match configmap::served(&cm) {
        Ok(served) => Ok(served),
        Err(e) => {
            warn!(%namespace, configmap = name, error = %e, "the live document is unreadable; fitting in policy order");
            Ok(Served::new())
        }
    }
}

/// The ConfigMap as a reconcile should compare against, from the watch cache and the
/// remembered write.
#[derive(Debug, PartialEq)]
pub enum Seen {
    Known(Option<ConfigMapView>),
    /// The cache lacks an object we wrote: either it has not caught up with our create yet,
    /// or the object was deleted since. Only the server can tell.
    AskServer,
}

/// Decides which view of the ConfigMap is current. The remembered write stands in only
/// while the cache holds an older version of the object; once the cache has caught up it
/// is forgotten, so a later deletion or edit is seen as it is.
pub fn seen_configmap(
    cached: Option<ConfigMapView>,
    written: &mut Option<Written<ConfigMapView>>,
) -> Seen {
    match (cached, written.as_ref()) {
        (cached, None) => Seen::Known(cached),
        (None, Some(_)) => Seen::AskServer,
        (Some(c), Some(w)) => match compare(&c.resource_version, &w.resource_version) {
            Some(Ordering::Less) => Seen::Known(Some(w.value.clone())),
            _ => {
                *written = None;
                Seen::Known(Some(c))
            }
        },
    }
}

/// Reads the ConfigMap from the API server (when the cache cannot tell, see [`Seen`]).
async fn live_configmap(
    ctx: &Context,
    namespace: &str,
    name: &str,
) -> Result<Option<ConfigMapView>, Error> {
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), namespace);
    let found = api
        .get_opt(name)
        .await
        .map_err(|e| Error::api(format!("reading ConfigMap {namespace}/{name}"), e))?;
    Ok(found.as_ref().map(ConfigMapView::from_configmap))
}

/// What compiling did to one policy, given whether the document could be written.
fn verdict(
    view: &PolicyView,
    outcome: Option<&PolicyOutcome>,
    blocked: Option<&Blocked>,
) -> Verdict {
    let outcome = match &view.spec {
        Err(e) => return Verdict::Invalid(vec![e.clone()]),
        Ok(_) => outcome,
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

/// Looks up (or simulates, on the blocking pool: a summary is CPU work that must not hold
/// up the async workers, which also renew the Lease) the summaries of new policy
/// generations, and forgets policies that are gone.
async fn refresh_summaries(
    memory: &mut Memory,
    compilation: &rebound_policy::Compilation,
    summaries: &Arc<Summaries>,
) {
    let present: HashSet<&str> = compilation
        .document
        .policies
        .iter()
        .map(|p| p.uid.as_str())
        .collect();
    memory
        .summaries
        .retain(|uid, _| present.contains(uid.as_str()));
    let stale: Vec<(String, i64, rebound_policy::ResolvedPolicy)> = compilation
        .document
        .policies
        .iter()
        .filter(|p| {
            memory
                .summaries
                .get(&p.uid)
                .is_none_or(|(generation, _)| *generation != p.generation)
        })
        .map(|p| (p.uid.clone(), p.generation, p.params.clone()))
        .collect();
    if stale.is_empty() {
        return;
    }
    let summaries = Arc::clone(summaries);
    let computed = tokio::task::spawn_blocking(move || {
        stale
            .into_iter()
            .map(|(uid, generation, params)| (uid, (generation, summaries.get(&params))))
            .collect::<Vec<_>>()
    })
    .await;
    match computed {
        Ok(summaries) => memory.summaries.extend(summaries),
        // Only a panic in the simulation gets here; statuses go out without a summary.
        Err(e) => warn!(error = %e, "schedule summary failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(rv: &str) -> ConfigMapView {
        ConfigMapView {
            uid: "u".to_owned(),
            resource_version: rv.to_owned(),
            managed: true,
            labelled: true,
            content: crate::objects::Content::of(Some(&format!("doc@{rv}")), None),
            hash_annotation: None,
        }
    }

    fn wrote(rv: &str) -> Option<Written<ConfigMapView>> {
        Some(Written {
            resource_version: rv.to_owned(),
            value: view(rv),
        })
    }

    #[test]
    fn our_write_stands_in_only_until_the_cache_catches_up() {
        let mut memory = wrote("10");
        assert_eq!(
            seen_configmap(Some(view("9")), &mut memory),
            Seen::Known(Some(view("10")))
        );
        assert!(memory.is_some());
        assert_eq!(
            seen_configmap(Some(view("10")), &mut memory),
            Seen::Known(Some(view("10")))
        );
        assert!(memory.is_none(), "caught up: forgotten");
        // Then someone deletes it: the cache's word is final.
        assert_eq!(seen_configmap(None, &mut memory), Seen::Known(None));
    }

    #[test]
    fn a_missing_object_we_wrote_is_asked_for() {
        // Right after a create, or deleted before the cache saw our write.
        let mut memory = wrote("10");
        assert_eq!(seen_configmap(None, &mut memory), Seen::AskServer);
        let mut nothing = None;
        assert_eq!(seen_configmap(None, &mut nothing), Seen::Known(None));
    }

    #[test]
    fn an_edit_after_our_write_wins() {
        let mut memory = wrote("10");
        assert_eq!(
            seen_configmap(Some(view("12")), &mut memory),
            Seen::Known(Some(view("12")))
        );
    }
}
