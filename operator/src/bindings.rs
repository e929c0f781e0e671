//! The sidecars' RBAC without YAML: a RoleBinding `rebound-sidecar` in every namespace
//! with RetryPolicies or injected Pods (label `rebound.dev/injected=true`), binding the
//! chart's sidecar ClusterRole (`--sidecar-cluster-role`) to the group of the namespace's
//! ServiceAccounts, so a sidecar in watch mode can read the compiled ConfigMap and write
//! its Lease whatever ServiceAccount its Pod runs as.
//!
//! Both watches are metadata-only (a namespace is all this needs), so a cluster of many
//! Pods costs names, not specs. Bindings are applied (server-side apply, the operator's
//! field manager) once per namespace, again on every resync (repairing a deleted one),
//! and never deleted: the operator's RBAC has no delete, and a binding without sidecars
//! grants nothing that anyone uses.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, stream::BoxStream};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use serde_json::json;
use tracing::{debug, info, warn};

use crate::Flags;
use crate::backoff::watch_backoff;
use crate::objects::policy_resource;
use rebound_runtime::watch_backoff::WatchBackoffExt;

/// Name of the RoleBinding in each namespace.
pub const BINDING_NAME: &str = "rebound-sidecar";
/// The label the admission policy puts on injected Pods.
pub const INJECTED_SELECTOR: &str = "rebound.dev/injected=true";
/// List page size of both watches.
const PAGE: u32 = 100;
/// How soon a failed apply is tried again.
const RETRY: Duration = Duration::from_secs(5);

/// The namespaces never bound: the system's, and the operator's own.
pub fn excluded(namespace: &str, own: &str) -> bool {
    namespace == "kube-system" || namespace == own
}

/// The RoleBinding of `namespace`, as applied.
pub fn binding(namespace: &str, cluster_role: &str) -> serde_json::Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": BINDING_NAME,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/managed-by": crate::FIELD_MANAGER,
                "app.kubernetes.io/part-of": "rebound",
            },
        },
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": cluster_role,
        },
        "subjects": [{
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Group",
            "name": format!("system:serviceaccounts:{namespace}"),
        }],
    })
}

/// Runs until `stop` completes; does nothing without `--sidecar-cluster-role`.
pub async fn run(
    client: kube::Client,
    flags: Arc<Flags>,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let Some(role) = flags.sidecar_cluster_role.clone().filter(|r| !r.is_empty()) else {
        return;
    };
    let own = flags.lease_namespace();
    let scopes: Vec<Option<String>> = match flags.scope() {
        None => vec![None],
        Some(list) => list.into_iter().map(Some).collect(),
    };
    let resource = policy_resource();
    let mut streams: Vec<BoxStream<'static, Option<String>>> = Vec::new();
    for scope in &scopes {
        // Api<PartialObjectMeta<_>>: metadata-only lists and watches.
        type Meta<K> = Api<PartialObjectMeta<K>>;
        let (policies, pods): (Meta<DynamicObject>, Meta<Pod>) = match scope {
            None => (
                Api::all_with(client.clone(), &resource),
                Api::all(client.clone()),
            ),
            Some(ns) => (
                Api::namespaced_with(client.clone(), ns, &resource),
                Api::namespaced(client.clone(), ns),
            ),
        };
        streams.push(
            watcher(policies, watcher::Config::default().page_size(PAGE))
                .with_watch_backoff(watch_backoff("bindings/policies"))
                .map(namespace_of)
                .boxed(),
        );
        // Small pages: only one page of Pod metadata is decoded at a time.
        let pods_config = watcher::Config::default()
            .labels(INJECTED_SELECTOR)
            .page_size(PAGE);
        streams.push(
            watcher(pods, pods_config)
                .with_watch_backoff(watch_backoff("bindings/pods"))
                .map(namespace_of)
                .boxed(),
        );
    }
    // A tick for retries and resyncs, as an item of the same stream.
    let ticks = tokio_stream_interval(RETRY).map(|_| None).boxed();
    streams.push(ticks);
    let mut incoming = std::pin::pin!(futures::stream::select_all(streams).take_until(stop));

    let api = |ns: &str| Api::<RoleBinding>::namespaced(client.clone(), ns);
    let params = PatchParams::apply(crate::FIELD_MANAGER).force();
    // Namespaces seen, and those whose binding is applied since the last resync.
    let (mut seen, mut bound) = (BTreeSet::<String>::new(), BTreeSet::<String>::new());
    let mut last_resync = tokio::time::Instant::now();
    info!(cluster_role = %role, "binding the sidecar ClusterRole where sidecars live");
    while let Some(item) = incoming.next().await {
        if let Some(ns) = item {
            if excluded(&ns, &own) || bound.contains(&ns) {
                continue;
            }
            seen.insert(ns);
        } else if last_resync.elapsed() >= flags.resync {
            bound.clear();
            last_resync = tokio::time::Instant::now();
        }
        let todo: Vec<String> = seen.difference(&bound).cloned().collect();
        for ns in todo {
            let body = binding(&ns, &role);
            match api(&ns)
                .patch(BINDING_NAME, &params, &Patch::Apply(&body))
                .await
            {
                Ok(_) => {
                    debug!(namespace = %ns, "sidecar RoleBinding applied");
                    bound.insert(ns);
                }
                Err(kube::Error::Api(status)) if status.code == 404 || terminating(&status) => {
                    // The namespace is gone (or going): nothing to bind until it is seen again.
                    debug!(namespace = %ns, "namespace gone or terminating; not bound");
                    seen.remove(&ns);
                }
                Err(e) => {
                    let code = crate::error::status_code(&e);
                    warn!(namespace = %ns, error = %e, code, "cannot apply the sidecar RoleBinding; retrying");
                }
            }
        }
    }
    info!("sidecar bindings stopped");
}

/// Whether the API refused a write because the namespace is being deleted.
fn terminating(status: &kube::core::Status) -> bool {
    status
        .details
        .as_ref()
        .is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating"))
}

/// The namespace of a watched object's event, `None` for events that carry none.
fn namespace_of<K>(
    event: Result<watcher::Event<PartialObjectMeta<K>>, watcher::Error>,
) -> Option<String> {
    match event {
        Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o.metadata.namespace,
        Ok(_) => None,
        Err(e) => {
            warn!(error = %e, "bindings watch failed; retrying with backoff");
            None
        }
    }
}

fn tokio_stream_interval(period: Duration) -> impl futures::Stream<Item = ()> {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    futures::stream::unfold(interval, |mut interval| async move {
        interval.tick().await;
        Some(((), interval))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binding_names_the_role_and_the_namespace_group() {
        let b = binding("team-a", "rebound-sidecar");
        assert_eq!(b["metadata"]["name"], "rebound-sidecar");
        assert_eq!(b["metadata"]["namespace"], "team-a");
        assert_eq!(b["roleRef"]["kind"], "ClusterRole");
        assert_eq!(b["roleRef"]["name"], "rebound-sidecar");
        assert_eq!(b["subjects"][0]["kind"], "Group");
        assert_eq!(b["subjects"][0]["name"], "system:serviceaccounts:team-a");
    }

    #[test]
    fn system_and_own_namespaces_are_never_bound() {
        assert!(excluded("kube-system", "rebound-system"));
        assert!(excluded("rebound-system", "rebound-system"));
        assert!(!excluded("team-a", "rebound-system"));
    }
}
