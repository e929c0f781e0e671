//! The writes of a reconcile: the ConfigMap (one request, with preconditions) and the
//! statuses that differ (a few at a time). Each write is remembered in [`Memory`] so the
//! next reconcile compares against it until the watch cache catches up.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use rebound_policy::{RetryPolicy, RetryPolicyStatus};
use tracing::{debug, info};

use crate::FIELD_MANAGER;
use crate::configmap::Plan;
use crate::context::{Context, Memory};
use crate::error::{Error, status_code};
use crate::fleet;
use crate::freshness::{Written, compare, newest};
use crate::objects::{ConfigMapView, PolicyView, policy_resource};
use crate::rollout::conditions;
use crate::status::{self, StatusSeen, Verdict};

/// Status writes in flight at once, all namespaces together. A burst of creates shares
/// the API server with the creates themselves, and its status writes get about their
/// share of requests in flight: fewer than the creating client's left most statuses to
/// be written after the last create (docs/operator.md, Benchmarks). Operator-wide, so
/// namespaces reconciled at once do not multiply it: as many as 8 namespaces at 16 each
/// could have in flight before, now all available to one namespace.
pub(crate) const STATUS_WRITES_IN_FLIGHT: usize = 128;

pub(crate) async fn write_configmap(
    ctx: &Context,
    namespace: &str,
    name: &str,
    plan: Plan,
    memory: &mut Memory,
) -> Result<(), Error> {
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), namespace);
    let conflict = || Error::Conflict(format!("ConfigMap {namespace}/{name}"));
    let record = |cm: &ConfigMap| Written {
        resource_version: cm.resource_version().unwrap_or_default(),
        value: ConfigMapView::from_configmap(cm),
    };
    match plan {
        Plan::UpToDate | Plan::NotOwned => Ok(()),
        Plan::Create(cm) => {
            ctx.metrics.wrote("configmap");
            let params = PostParams {
                field_manager: Some(FIELD_MANAGER.to_owned()),
                ..PostParams::default()
            };
            match api.create(&params, &cm).await {
                Ok(created) => {
                    info!(%namespace, configmap = name, "created ConfigMap");
                    memory.configmap = Some(record(&created));
                    Ok(())
                }
                Err(e) if status_code(&e) == Some(409) => Err(conflict()),
                Err(e) => Err(Error::api(
                    format!("creating ConfigMap {namespace}/{name}"),
                    e,
                )),
            }
        }
        Plan::Switch(patch) => {
            ctx.metrics.wrote("configmap");
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_owned()),
                ..PatchParams::default()
            };
            match api.patch(name, &params, &Patch::Merge(&patch)).await {
                Ok(patched) => {
                    info!(%namespace, configmap = name, "ConfigMap document changed form");
                    memory.configmap = Some(record(&patched));
                    Ok(())
                }
                Err(e) if matches!(status_code(&e), Some(409) | Some(404)) => Err(conflict()),
                Err(e) => Err(Error::api(
                    format!("switching ConfigMap {namespace}/{name}"),
                    e,
                )),
            }
        }
        Plan::Apply(cm) => {
            ctx.metrics.wrote("configmap");
            let params = PatchParams::apply(FIELD_MANAGER).force();
            match api.patch(name, &params, &Patch::Apply(&cm)).await {
                Ok(applied) => {
                    debug!(%namespace, configmap = name, "applied ConfigMap");
                    memory.configmap = Some(record(&applied));
                    Ok(())
                }
                Err(e) if matches!(status_code(&e), Some(409) | Some(404)) => Err(conflict()),
                Err(e) => Err(Error::api(
                    format!("applying ConfigMap {namespace}/{name}"),
                    e,
                )),
            }
        }
    }
}

/// Writes the statuses that differ, a few at a time; emits an event for each change.
/// `sidecars` is the count of live sidecar Leases that share the budgets.
pub(crate) async fn write_statuses(
    ctx: &Context,
    namespace: &str,
    verdicts: Vec<(Arc<PolicyView>, Verdict)>,
    sidecars: u32,
    plans: &crate::rollout::Plans,
    memory: &mut Memory,
) -> Result<(), Error> {
    let now = status::now_rfc3339();
    let cm_name = ctx.flags.configmap_name.as_str();
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), namespace, &policy_resource());
    let present: HashSet<String> = verdicts.iter().map(|(v, _)| v.uid.clone()).collect();
    memory.statuses.retain(|uid, _| present.contains(uid));
    memory.rollouts.retain(|uid, _| present.contains(uid));
    memory
        .served_rollouts
        .retain(|uid, _| present.contains(uid));

    let mut writes = Vec::new();
    for (view, verdict) in verdicts {
        // Once the cache holds our write (or something newer), the cache has the word.
        if let Some(w) = memory.statuses.get(&view.uid)
            && compare(&view.resource_version, &w.resource_version)
                .is_some_and(|o| o != std::cmp::Ordering::Less)
        {
            memory.statuses.remove(&view.uid);
            memory.rollouts.remove(&view.uid);
        }
        let current = newest(
            Some((view.resource_version.as_str(), view.status.as_ref())),
            memory.statuses.get(&view.uid),
        )
        .cloned();
        let summary = memory
            .summaries
            .get(&view.uid)
            .filter(|(generation, _)| *generation == view.generation)
            .map(|(_, s)| fleet::shared_summary(s, sidecars));
        let mut desired = status::desired(
            view.generation,
            &verdict,
            summary.as_ref(),
            current.as_ref(),
            &now,
            cm_name,
        );
        let plan = plans.get(&view.name);
        match (plan, view.rollout.as_deref()) {
            (Some(plan), _) => conditions::decorate(
                &mut desired,
                &plan.transition.status,
                &verdict,
                current.as_ref(),
                &now,
            ),
            // Not planned (an invalid spec): the rollout status stays as it is.
            (None, Some(seen))
                if view.spec.as_ref().is_ok_and(|s| s.rollout.is_some()) || view.spec.is_err() =>
            {
                desired.rollout = Some(seen.status.clone());
            }
            (None, _) => {}
        }
        let seen = StatusSeen::of(&desired);
        if current.as_ref() == Some(&seen) {
            continue;
        }
        let mut notes: Vec<status::EventNote> = plan
            .map(|p| {
                p.transition
                    .happened
                    .iter()
                    .map(crate::rollout::event_note)
                    .collect()
            })
            .unwrap_or_default();
        // While a rollout runs, its own Events say what changed.
        let rolling = plan.is_some_and(|p| {
            p.transition.status.phase != rebound_policy::spec::RolloutPhase::Healthy
        });
        if !(rolling && matches!(verdict, Verdict::Serving { .. })) {
            notes.extend(status::event(&verdict, current.as_ref(), &desired));
        }
        writes.push((view, desired, seen, notes));
    }

    let results: Vec<_> = futures::stream::iter(writes)
        .map(|(view, desired, seen, notes)| {
            let api = api.clone();
            async move {
                // Never closed; a closed semaphore would only lift the limit.
                let _permit = ctx.status_writes.acquire().await.ok();
                ctx.metrics.wrote("status");
                let result = patch_status(&api, &view.name, &desired).await;
                (view, seen, notes, desired.rollout, result)
            }
        })
        .buffer_unordered(STATUS_WRITES_IN_FLIGHT)
        .collect()
        .await;

    let mut first_error = None;
    for (view, seen, notes, rollout, result) in results {
        match result {
            Ok(resource_version) => {
                memory.served_rollouts.remove(&view.uid);
                for note in notes {
                    ctx.events.emit(note, view.object_ref());
                }
                if let Some(rollout) = rollout {
                    memory.rollouts.insert(
                        view.uid.clone(),
                        Written {
                            resource_version: resource_version.clone(),
                            value: rollout,
                        },
                    );
                }
                memory.statuses.insert(
                    view.uid.clone(),
                    Written {
                        resource_version,
                        value: seen,
                    },
                );
            }
            // Deleted since the cache saw it; its deletion triggers another reconcile.
            Err(e) if status_code(&e) == Some(404) => {}
            Err(e) => {
                if first_error.is_none() {
                    first_error = Some(Error::api(
                        format!("writing status of RetryPolicy {namespace}/{}", view.name),
                        e,
                    ));
                }
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Server-side applies the status subresource; returns the new resourceVersion.
async fn patch_status(
    api: &Api<DynamicObject>,
    name: &str,
    status: &RetryPolicyStatus,
) -> Result<String, kube::Error> {
    let body = serde_json::json!({
        "apiVersion": RetryPolicy::api_version(&()),
        "kind": RetryPolicy::kind(&()),
        "status": status,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let updated = api
        .patch_status(name, &params, &Patch::Apply(&body))
        .await?;
    Ok(updated.resource_version().unwrap_or_default())
}
