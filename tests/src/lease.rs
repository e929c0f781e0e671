//! Sidecar Leases as the sidecar writes them (the scheme of `docs/sidecar.md`), and clients
//! that act as a Pod: a ServiceAccount token bound to a Pod object by TokenRequest, which
//! needs no kubelet.

use std::collections::BTreeMap;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use serde_json::json;

use crate::{Cluster, TestEnv, repo_root, yaml_documents};

/// Name prefix of a sidecar's Lease: `rebound-sidecar-<pod name>`.
pub const PREFIX: &str = "rebound-sidecar-";
/// Label naming the ConfigMap whose policies a sidecar serves.
pub const CONFIGMAP_LABEL: &str = "rebound.dev/configmap";

/// The labels of every sidecar Lease, plus the ConfigMap it serves.
pub fn labels(configmap: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "rebound".to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            "sidecar".to_owned(),
        ),
        (CONFIGMAP_LABEL.to_owned(), configmap.to_owned()),
    ])
}

/// The Lease of the sidecar of `pod`, renewed at `renewed`, live for `duration_s` seconds.
pub fn sidecar_lease(pod: &str, configmap: &str, renewed: Timestamp, duration_s: i32) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(format!("{PREFIX}{pod}")),
            labels: Some(labels(configmap)),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(pod.to_owned()),
            lease_duration_seconds: Some(duration_s),
            renew_time: Some(MicroTime(renewed)),
            ..LeaseSpec::default()
        }),
    }
}

/// Creates a Pod object `name` running as `service_account` (never scheduled: the test
/// cluster has no node) and returns it as stored, with its uid.
pub async fn create_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    service_account: &str,
) -> Result<Pod> {
    create_labelled_pod(client, namespace, name, service_account, &[]).await
}

/// [`create_pod`] with `labels` (`rebound.dev/injected` for a Pod as injection leaves it).
pub async fn create_labelled_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    service_account: &str,
    labels: &[(&str, &str)],
) -> Result<Pod> {
    let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels.collect()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            service_account_name: Some(service_account.to_owned()),
            automount_service_account_token: Some(false),
            containers: vec![Container {
                name: "worker".to_owned(),
                image: Some("example/worker:1.0".to_owned()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("creating Pod {namespace}/{name}"))
}

/// A token of `service_account`, bound to `pod` when given (then the API server adds the
/// Pod's name to the user's `extra` as `authentication.kubernetes.io/pod-name`).
pub async fn token(
    client: &kube::Client,
    namespace: &str,
    service_account: &str,
    pod: Option<&Pod>,
) -> Result<String> {
    let bound_object_ref = pod.map(|p| BoundObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Pod".to_owned()),
        name: p.metadata.name.clone(),
        uid: p.metadata.uid.clone(),
    });
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            bound_object_ref,
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let answer = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(service_account, &PostParams::default(), &request)
        .await
        .with_context(|| format!("TokenRequest for {namespace}/{service_account}"))?;
    answer
        .status
        .and_then(|s| s.token)
        .context("the TokenRequest returned no token")
}

/// A client of `cluster` that authenticates with the bearer `token` only.
pub async fn client_with_token(cluster: &Cluster, token: &str) -> Result<kube::Client> {
    let mut kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())
        .with_context(|| format!("reading {}", cluster.kubeconfig().display()))?;
    let user = kubeconfig
        .auth_infos
        .first_mut()
        .context("the kubeconfig has no user")?;
    // No client certificate: the token alone says who this is.
    user.auth_info = Some(
        serde_json::from_value(serde_json::json!({ "token": token })).context("a token user")?,
    );
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .context("loading the token kubeconfig")?;
    kube::Client::try_from(config).context("creating a kube client")
}

/// What a worker namespace of an install has for its sidecars: deploy/rbac.yaml and
/// deploy/admission.yaml (cluster-wide, as an install applies them), then the worker's
/// ServiceAccount, Role and RoleBinding from examples/worker/worker-watch.yaml.
pub fn apply_sidecar_rbac(env: &TestEnv) -> Result<()> {
    for file in ["deploy/rbac.yaml", "deploy/admission.yaml"] {
        let path = repo_root().join(file);
        env.cluster
            .kubectl(["apply", "--server-side", "-f", &path.to_string_lossy()])?
            .ok()?;
    }
    let items: Vec<_> = yaml_documents(&repo_root().join("examples/worker/worker-watch.yaml"))?
        .into_iter()
        .filter(|d| d["kind"] != "Deployment")
        .collect();
    ensure!(
        items.len() == 3,
        "expected ServiceAccount, Role, RoleBinding"
    );
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    env.kubectl_stdin(["apply", "--server-side", "-f", "-"], &list.to_string())?
        .ok()?;
    Ok(())
}

/// The API's refusal of a request as (HTTP code, Status reason); `None` when it succeeded.
pub fn refusal<T>(result: kube::Result<T>) -> Result<Option<(u16, String)>> {
    match result {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(status)) => Ok(Some((status.code, status.reason.clone()))),
        Err(e) => Err(e.into()),
    }
}

/// [`refusal`] of a request RBAC does not allow.
pub fn forbidden() -> Option<(u16, String)> {
    Some((403, "Forbidden".to_owned()))
}

/// A create the API server checks (admission included) but does not store.
pub fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}
