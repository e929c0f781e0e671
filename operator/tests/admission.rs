//! What deploy/ ships beyond RBAC, on the real API server: the ValidatingAdmissionPolicy
//! that confines the operator's ConfigMap writes to its own ConfigMap, and the Pod Security
//! `restricted` label of its namespace (the Deployment's pod passes, a privileged one not).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use rebound_tests::{TestEnv, client_from_kubeconfig, repo_root, yaml_documents};

const SA: &str = "system:serviceaccount:rebound-system:rebound-operator";
const WAIT: Duration = Duration::from_secs(60);

fn apply_deploy(env: &TestEnv) -> Result<()> {
    for file in ["deploy/rbac.yaml", "deploy/admission.yaml"] {
        let path = repo_root().join(file);
        env.cluster
            .kubectl(["apply", "--server-side", "-f", &path.to_string_lossy()])?
            .ok()?;
    }
    Ok(())
}

fn configmap(name: &str, labelled: bool) -> ConfigMap {
    let labels = labelled.then(|| {
        BTreeMap::from([(
            "app.kubernetes.io/managed-by".to_owned(),
            "rebound-operator".to_owned(),
        )])
    });
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels,
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    }
}

/// The API's answer to a dry-run create: `None` if admitted, else the status code.
async fn refused<K>(api: &Api<K>, object: &K) -> Result<Option<u16>>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&dry, object).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(status)) => Ok(Some(status.code)),
        Err(e) => Err(e.into()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_account_may_write_only_its_configmap() -> Result<()> {
    let env = TestEnv::new("op-vap").await?;
    let ns = env.namespace.as_str();
    apply_deploy(&env)?;
    let kubeconfig = env.cluster.mint_user_kubeconfig(
        SA,
        &[
            "system:serviceaccounts",
            "system:serviceaccounts:rebound-system",
        ],
    )?;
    let operator = client_from_kubeconfig(&kubeconfig).await?;
    let as_operator: Api<ConfigMap> = Api::namespaced(operator, ns);
    let as_admin: Api<ConfigMap> = Api::namespaced(env.client.clone(), ns);

    // RBAC allows the create; the policy (once the API server has loaded it) refuses it.
    eventually("the admission policy to refuse", WAIT, || async {
        Ok(refused(&as_operator, &configmap("other", true))
            .await?
            .filter(|code| *code == 403))
    })
    .await?;
    ensure!(refused(&as_operator, &configmap(CM, false)).await? == Some(403));
    ensure!(refused(&as_operator, &configmap(CM, true)).await?.is_none());
    // Nobody else is affected.
    ensure!(
        refused(&as_admin, &configmap("other", false))
            .await?
            .is_none()
    );
    Ok(())
}

/// The pod the Deployment in deploy/operator.yaml would create.
fn operator_pod() -> Result<Pod> {
    let docs = yaml_documents(&repo_root().join("deploy/operator.yaml"))?;
    let deployment = docs
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .context("no Deployment in deploy/operator.yaml")?;
    let template = deployment
        .pointer("/spec/template")
        .cloned()
        .context("no pod template")?;
    let mut pod: Pod = serde_json::from_value(template)?;
    pod.metadata.name = Some(rebound_tests::unique_name("operator"));
    Ok(pod)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_namespace_enforces_restricted_pod_security() -> Result<()> {
    let env = TestEnv::new("op-psa").await?;
    apply_deploy(&env)?;
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), "rebound-system");

    let ours = operator_pod()?;
    if let Some(code) = refused(&pods, &ours).await? {
        bail!("the operator's pod was refused ({code})");
    }
    let mut privileged = operator_pod()?;
    let container = privileged
        .spec
        .as_mut()
        .and_then(|s| s.containers.first_mut())
        .context("no container")?;
    container.security_context = Some(k8s_openapi::api::core::v1::SecurityContext {
        privileged: Some(true),
        ..Default::default()
    });
    ensure!(
        refused(&pods, &privileged).await? == Some(403),
        "a privileged pod was admitted to rebound-system"
    );
    Ok(())
}
