//! Drift on the managed ConfigMap: deleted, data edited, labels edited. The operator
//! repairs each within seconds (a resync is not needed), and a policy's status never says
//! Ready while the ConfigMap cannot hold its document.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rebound_tests::{TestEnv, unique_name};

const WAIT: Duration = Duration::from_secs(30);
/// Far longer than any test here: repairs must come from watch events, not the resync.
const NO_RESYNC: &str = "--resync=1h";

async fn started(env: &TestEnv) -> Result<Operator> {
    let op = Operator::start(
        env.cluster.kubeconfig(),
        scoped(&env.namespace, &[NO_RESYNC]),
    )?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p", &["jobs"], 4))?
        .ok()?;
    converged(&env.client, &env.namespace, WAIT).await?;
    Ok(op)
}

fn managed_by(cm: &ConfigMap) -> Option<String> {
    cm.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("app.kubernetes.io/managed-by"))
        .cloned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_configmap_is_recreated() -> Result<()> {
    let env = TestEnv::new("op-drift-del").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = started(&env).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let first = cms.get(CM).await?.metadata.uid;

    env.kubectl(["delete", "configmap", CM])?.ok()?;
    converged(client, ns, WAIT).await?;
    let second = cms.get(CM).await?.metadata.uid;
    ensure!(second != first, "not recreated");

    // And again, right after the operator's own create.
    env.kubectl(["delete", "configmap", CM])?.ok()?;
    converged(client, ns, WAIT).await?;
    ensure!(cms.get(CM).await?.metadata.uid != second, "not recreated");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn data_and_annotation_edits_are_repaired() -> Result<()> {
    let env = TestEnv::new("op-drift-data").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = started(&env).await?;
    let good = configmap_document(client, ns).await?;

    env.kubectl([
        "patch",
        "configmap",
        CM,
        "--type=merge",
        "-p",
        r#"{"data":{"policies.json":"{}","extra":"x"}}"#,
    ])?
    .ok()?;
    converged(client, ns, WAIT).await?;
    env.kubectl(["annotate", "configmap", CM, "rebound.dev/hash-"])?
        .ok()?;
    converged(client, ns, WAIT).await?;
    ensure!(configmap_document(client, ns).await? == good);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_removed_label_is_put_back() -> Result<()> {
    let env = TestEnv::new("op-drift-label").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = started(&env).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);

    // Without the label the ConfigMap is still the one the operator wrote (its field
    // manager owns the data): drift, not someone else's ConfigMap.
    env.kubectl(["label", "configmap", CM, "app.kubernetes.io/managed-by-"])?
        .ok()?;
    eventually("the managed-by label to be back", WAIT, || async {
        Ok((managed_by(&cms.get(CM).await?).as_deref() == Some("rebound-operator")).then_some(()))
    })
    .await?;
    converged(client, ns, WAIT).await?;

    env.kubectl([
        "label",
        "--overwrite",
        "configmap",
        CM,
        "app.kubernetes.io/managed-by=someone",
    ])?
    .ok()?;
    eventually("the managed-by label to be restored", WAIT, || async {
        Ok((managed_by(&cms.get(CM).await?).as_deref() == Some("rebound-operator")).then_some(()))
    })
    .await?;
    converged(client, ns, WAIT).await?;
    Ok(())
}

/// Everything the operator needs in one namespace, split so the ConfigMap `create` can be
/// taken away on its own.
fn rbac(ns: &str, user: &str) -> String {
    format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: operator\n  \
         namespace: {ns}\nrules:\n\
         - apiGroups: [rebound.dev]\n  resources: [retrypolicies]\n  verbs: [get, list, watch]\n\
         - apiGroups: [rebound.dev]\n  resources: [retrypolicies/status]\n  verbs: [patch]\n\
         - apiGroups: [\"\"]\n  resources: [configmaps]\n  resourceNames: [{CM}]\n  \
         verbs: [get, list, watch, patch]\n\
         - apiGroups: [events.k8s.io]\n  resources: [events]\n  verbs: [create, patch]\n\
         - apiGroups: [coordination.k8s.io]\n  resources: [leases]\n  verbs: [list, watch]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: operator\n  \
         namespace: {ns}\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: Role\n  \
         name: operator\nsubjects:\n- kind: User\n  name: {user}\n---\n{}",
        create_rbac(ns, user)
    )
}

fn create_rbac(ns: &str, user: &str) -> String {
    format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: create-cm\n  \
         namespace: {ns}\nrules:\n- apiGroups: [\"\"]\n  resources: [configmaps]\n  verbs: [create]\n\
         ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  \
         name: create-cm\n  namespace: {ns}\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  \
         kind: Role\n  name: create-cm\nsubjects:\n- kind: User\n  name: {user}\n"
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn status_is_not_ready_while_the_configmap_is_missing() -> Result<()> {
    let env = TestEnv::new("op-drift-status").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let user = unique_name("drift-operator");
    env.kubectl_stdin(["apply", "-f", "-"], &rbac(ns, &user))?
        .ok()?;
    let kubeconfig = env.cluster.mint_user_kubeconfig(&user, &[])?;
    let op = Operator::start(
        &kubeconfig,
        scoped(ns, &[NO_RESYNC, "--leader-elect=false"]),
    )?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p", &["jobs"], 4))?
        .ok()?;
    converged(client, ns, WAIT).await?;

    // The operator cannot create the ConfigMap again once it is gone.
    env.kubectl(["delete", "rolebinding", "create-cm"])?.ok()?;
    env.kubectl(["delete", "configmap", CM])?.ok()?;
    let p = wait_for_reason(client, ns, "p", "ApplyFailed", WAIT).await?;
    let status = p.status.unwrap_or_default();
    ensure!(ready_condition(&status.conditions).is_some_and(|c| c.status == "False"));
    ensure!(condition(&status.conditions, "Reconciling").is_some_and(|c| c.status == "True"));

    // Allowed again: the next retry recreates it and the policy is Ready again. Nothing
    // the operator watches changes, so that retry comes when its backoff says (doubling,
    // full jitter): wait for the longest one it logged, once a retry under way has failed.
    env.kubectl_stdin(["apply", "-f", "-"], &create_rbac(ns, &user))?
        .ok()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let next_retry = op
        .logs()?
        .iter()
        .filter(|r| field(r, "message") == Some("reconcile failed"))
        .filter_map(|r| r.get("retry_in_ms")?.as_u64())
        .max()
        .unwrap_or(0);
    converged(client, ns, WAIT + Duration::from_millis(next_retry)).await?;
    Ok(())
}
