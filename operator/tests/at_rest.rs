//! An operator at rest stays at rest, and a change near the ConfigMap limit takes down
//! only itself. One test, one operator over two namespaces, and one shared at-rest window
//! at the end: with `--resync=2s` every namespace is reconciled in full about ten times in
//! it, and each of those reconciles would write if a comparison were wrong (the loop this
//! guards against wrote every 2 s). The 60 s version is in `docs/operator.md`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::near_limit::*;
use common::refusal::*;
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DynamicObject, ListParams};
use rebound_tests::{TestEnv, retry_policy_resource};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const RESYNC: Duration = Duration::from_secs(2);
/// Ten resync periods.
fn window() -> Duration {
    std::env::var("REBOUND_AT_REST_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(RESYNC * 10, Duration::from_secs)
}

#[tokio::test(flavor = "multi_thread")]
async fn at_rest_nothing_is_written_and_a_growing_policy_leaves_only_itself_out() -> Result<()> {
    let env = TestEnv::new("op-rest").await?;
    let client = &env.client;
    let foreign = env.namespace.clone();
    let big = env.cluster.create_namespace(client, "op-rest-big").await?;
    let op = Operator::start(
        env.cluster.kubeconfig(),
        vec![
            format!("--namespaces={foreign},{big}"),
            format!("--lease-namespace={foreign}"),
            format!("--resync={}s", RESYNC.as_secs()),
        ],
    )?;

    // 1. Another field manager adds a condition type and a status field of its own.
    let mut manifests = policy("p0", &["a"], 3);
    manifests.push_str(&policy("p1", &["b"], 3));
    env.kubectl_stdin(["apply", "-f", "-"], &manifests)?.ok()?;
    converged(client, &foreign, WAIT).await?;
    other_tool_status(
        &env,
        "p0",
        json!({"conditions": [{"type": "Healthy", "status": "True", "reason": "Probed",
            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
    )?;
    other_tool_status(
        &env,
        "p1",
        json!({"summary": {"retryBudget": "set by other-tool"}}),
    )?;
    // Any edit in the namespace reconciles it (a status write alone triggers nothing).
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p2", &["c"], 3))?
        .ok()?;
    converged(client, &foreign, WAIT).await?;

    // 2. Near the limit, the oldest policy grows past it.
    let shape = Shape::new(&big)?;
    let policies: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &big, &retry_policy_resource());
    apply(&policies, &shape.manifest(0, SMALL)).await?;
    for i in 1..shape.count {
        apply(&policies, &shape.manifest(i, shape.queues(i))).await?;
    }
    let before = converged(client, &big, WAIT).await?;
    ensure!(before.policies.len() == shape.count, "all fit at first");
    apply(&policies, &shape.manifest(0, FULL)).await?;
    let parsed = left_out_alone(client, &big, &name(0), &[], shape.count - 1).await?;
    let event = events(client, &big)
        .await?
        .into_iter()
        .find(|e| e.regarding == name(0) && e.reason == "DocumentTooLarge")
        .context("a DocumentTooLarge event")?;
    ensure!(TooLarge::parse(&event.note)? == parsed);

    // 3. At rest: no write, no object changes, while reconciles keep running.
    tokio::time::sleep(RESYNC * 2).await;
    let start = Snapshot::take(&op, client, &[&foreign, &big]).await?;
    tokio::time::sleep(window()).await;
    let end = Snapshot::take(&op, client, &[&foreign, &big]).await?;
    eprintln!(
        "at rest for {:?}: {} writes, {} reconciles, {} objects of which {} changed",
        window(),
        end.writes - start.writes,
        end.reconciles - start.reconciles,
        end.versions.len(),
        end.versions
            .iter()
            .filter(|(k, v)| start.versions.get(*k) != Some(*v))
            .count()
    );
    ensure!(
        end.writes == start.writes,
        "{} writes at rest",
        end.writes - start.writes
    );
    ensure!(end.versions == start.versions, "objects changed at rest");
    // The window did see reconciles (each namespace about every 2 s).
    ensure!(
        end.reconciles - start.reconciles >= 5.0,
        "only {} reconciles in the window",
        end.reconciles - start.reconciles
    );
    // The other tool's condition and field are left where they are.
    let p0 = status_json(client, &foreign, "p0").await?;
    let types: Vec<&str> = p0["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["type"].as_str())
        .collect();
    ensure!(
        types.contains(&"Healthy") && types.contains(&"Ready"),
        "{types:?}"
    );
    let p1 = status_json(client, &foreign, "p1").await?;
    ensure!(p1["summary"]["retryBudget"] == "set by other-tool");
    Ok(())
}

/// `kubectl apply --server-side --subresource=status --field-manager=other-tool`.
fn other_tool_status(env: &TestEnv, name: &str, status: Value) -> Result<()> {
    let manifest = json!({
        "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
        "metadata": {"name": name}, "status": status,
    });
    env.kubectl_stdin(
        [
            "apply",
            "--server-side",
            "--subresource=status",
            "--field-manager=other-tool",
            "-f",
            "-",
        ],
        &manifest.to_string(),
    )?
    .ok()?;
    Ok(())
}

async fn status_json(client: &kube::Client, ns: &str, name: &str) -> Result<Value> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &retry_policy_resource());
    Ok(api.get(name).await?.data["status"].clone())
}

/// What changes if anything is written: the operator's write counter and every object's
/// resourceVersion.
struct Snapshot {
    writes: f64,
    reconciles: f64,
    versions: BTreeMap<String, String>,
}

impl Snapshot {
    async fn take(op: &Operator, client: &kube::Client, namespaces: &[&str]) -> Result<Self> {
        let mut versions = BTreeMap::new();
        for ns in namespaces {
            let policies: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), ns, &retry_policy_resource());
            for p in policies.list_metadata(&ListParams::default()).await?.items {
                versions.insert(
                    format!("{ns}/rp/{}", p.metadata.name.unwrap_or_default()),
                    p.metadata.resource_version.unwrap_or_default(),
                );
            }
            let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
            for cm in cms.list_metadata(&ListParams::default()).await?.items {
                versions.insert(
                    format!("{ns}/cm/{}", cm.metadata.name.unwrap_or_default()),
                    cm.metadata.resource_version.unwrap_or_default(),
                );
            }
        }
        Ok(Self {
            writes: op.writes()?,
            reconciles: op.metric("rebound_operator_reconciles_total")?,
            versions,
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn deleted_namespaces_are_forgotten() -> Result<()> {
    let env = TestEnv::new("op-forget").await?;
    let client = &env.client;
    let mut namespaces = vec![env.namespace.clone()];
    for _ in 0..2 {
        namespaces.push(env.cluster.create_namespace(client, "op-forget").await?);
    }
    let op = Operator::start(
        env.cluster.kubeconfig(),
        vec![
            format!("--namespaces={}", namespaces.join(",")),
            format!("--lease-namespace={}", namespaces[0]),
        ],
    )?;
    for ns in &namespaces {
        env.cluster
            .kubectl_stdin(["-n", ns, "apply", "-f", "-"], &policy("p", &["q"], 3))?
            .ok()?;
        converged(client, ns, WAIT).await?;
    }
    // (The last reconcile puts its namespace's state back right after its status write.)
    eventually("three namespaces held", WAIT, || async {
        let held = op.metric("rebound_operator_namespaces_held")?;
        let compiled = op.metric("rebound_operator_policies_compiled")?;
        Ok((held == 3.0 && compiled == 3.0).then_some(()))
    })
    .await?;

    // What deleting a namespace does to its contents (this control plane has no namespace
    // controller to do it): the policies go, then the ConfigMap, then the namespace.
    for ns in &namespaces {
        env.cluster
            .kubectl(["-n", ns, "delete", "retrypolicy", "--all"])?
            .ok()?;
        eventually("the empty document", WAIT, || async {
            let doc = configmap_document(client, ns).await?;
            Ok(doc.filter(|(d, _)| d.policies.is_empty()).map(|_| ()))
        })
        .await?;
        env.cluster
            .kubectl(["-n", ns, "delete", "configmap", CM])?
            .ok()?;
        env.cluster
            .kubectl(["delete", "namespace", ns, "--wait=false"])?
            .ok()?;
    }
    eventually("every namespace forgotten", WAIT, || async {
        let held = op.metric("rebound_operator_namespaces_held")?;
        let compiled = op.metric("rebound_operator_policies_compiled")?;
        let bytes = op.metric("rebound_operator_configmap_bytes")?;
        Ok((held == 0.0 && compiled == 0.0 && bytes == 0.0).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_configmap_write_flips_no_status_until_it_persists() -> Result<()> {
    let env = TestEnv::new("op-refused").await?;
    let (client, ns) = (&env.client, env.namespace.clone());
    let op = Operator::start(env.cluster.kubeconfig(), scoped(&ns, &[]))?;
    let manifests: String = ["p0", "p1", "p2"]
        .iter()
        .map(|p| policy(p, &[p], 3))
        .collect();
    env.kubectl_stdin(["apply", "-f", "-"], &manifests)?.ok()?;
    converged(client, &ns, WAIT).await?;
    let before = versions(client, &ns).await?;

    // A few seconds of refused writes: retried, no status moves.
    let refusal = Refusal::start(&env)?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p0", &["p0"], 4))?
        .ok()?;
    eventually("a refused write", WAIT, || async {
        let errors = sample(
            &op,
            "rebound_operator_reconciles_total",
            "{result=\"error\"}",
        )?;
        Ok((errors >= 1.0).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reasons = ready_reasons(client, &ns).await?;
    ensure!(!reasons.iter().any(|r| r == "ApplyFailed"), "{reasons:?}");
    drop(refusal);
    converged(client, &ns, WAIT).await?;
    let after = versions(client, &ns).await?;
    ensure!(
        after.get("p1") == before.get("p1") && after.get("p2") == before.get("p2"),
        "unchanged policies were written: {before:?} → {after:?}"
    );
    ensure!(
        !events(client, &ns)
            .await?
            .iter()
            .any(|e| e.reason == "ApplyFailed"),
        "an ApplyFailed event for a transient failure"
    );

    // Refused for longer: the policies say so.
    let _refusal = Refusal::start(&env)?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p0", &["p0"], 5))?
        .ok()?;
    wait_for_reason(client, &ns, "p0", "ApplyFailed", WAIT).await?;
    Ok(())
}

/// Near the limit, on a cluster whose CRD admits specs the Rust validation refuses: fixing
/// an old invalid policy (and growing it) leaves out only it, and a new invalid policy
/// among the left-out ones reports `InvalidSpec`, not `DocumentTooLarge`.
#[tokio::test(flavor = "multi_thread")]
async fn near_the_limit_a_fixed_policy_leaves_only_itself_out() -> Result<()> {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cluster-at-rest-relaxed");
    let cluster = relaxed_cluster(dir).await?;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "op-fixed").await?;
    let _op = Operator::start(cluster.kubeconfig(), scoped(&ns, &[]))?;
    let shape = Shape::new(&ns)?;
    let policies: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &retry_policy_resource());
    // cap below base: refused by CEL in a normal cluster.
    let invalid = |mut manifest: Value| {
        manifest["spec"]["backoff"] = json!({"base": "10s", "cap": "1s"});
        manifest
    };
    apply(&policies, &invalid(shape.manifest(0, SMALL))).await?;
    for i in 1..shape.count {
        apply(&policies, &shape.manifest(i, shape.queues(i))).await?;
    }
    wait_for_reason(&client, &ns, &name(0), "InvalidSpec", WAIT).await?;
    wait_for_reason(&client, &ns, &name(shape.count - 1), "Compiled", WAIT).await?;

    apply(&policies, &shape.manifest(0, FULL)).await?;
    left_out_alone(&client, &ns, &name(0), &[], shape.count - 1).await?;

    apply(&policies, &invalid(shape.manifest(99, SMALL))).await?;
    wait_for_reason(&client, &ns, &name(99), "InvalidSpec", WAIT).await?;
    left_out_alone(&client, &ns, &name(0), &[&name(99)], shape.count - 1).await?;
    Ok(())
}
