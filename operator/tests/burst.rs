//! A burst of creates in one namespace (a `kubectl apply` of a directory, a GitOps sync):
//! compiled in a few ConfigMap writes, not one per create, and the last write holds every
//! policy.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use futures::{StreamExt, TryStreamExt};
use kube::Api;
use kube::api::PostParams;
use rebound_policy::RetryPolicy;
use rebound_test_support::metrics::Samples;
use rebound_tests::TestEnv;

/// Policies created, and how many creates are in flight at a time.
const POLICIES: usize = 400;
const IN_FLIGHT: usize = 32;

fn manifest(i: usize) -> Result<RetryPolicy> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "rebound.dev/v1alpha1",
        "kind": "RetryPolicy",
        "metadata": {"name": format!("p{i:04}")},
        "spec": {
            "queues": [format!("queue-{i}"), format!("queue-{i}-*")],
            "maxAttempts": 3 + i % 20,
            "backoff": {"base": "1s", "cap": "5m"}
        }
    }))?)
}

fn configmap_writes(op: &Operator) -> Result<f64> {
    let text = http_get(op.metrics, "/metrics")?.ok()?;
    Ok(Samples::parse(&text)?
        .value(
            "rebound_operator_api_writes_total",
            &[("kind", "configmap")],
        )
        .unwrap_or(0.0))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_creates_is_compiled_in_a_few_writes() -> Result<()> {
    let env = TestEnv::new("op-burst").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;
    eventually("the operator to lead", Duration::from_secs(60), || async {
        Ok(op.is_leader().then_some(()))
    })
    .await?;

    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let policies = (0..POLICIES).map(manifest).collect::<Result<Vec<_>>>()?;
    futures::stream::iter(policies)
        .map(|p| {
            let api = api.clone();
            async move { api.create(&PostParams::default(), &p).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await
        .context("creating the policies")?;

    let doc = converged(client, ns, Duration::from_secs(120)).await?;
    ensure!(
        doc.policies.len() == POLICIES,
        "{} compiled",
        doc.policies.len()
    );
    let writes = configmap_writes(&op)?;
    eprintln!("{writes} ConfigMap writes for {POLICIES} creates");
    // One write per second of burst at most, plus the first; the creates take a few
    // seconds even on a loaded machine. Without coalescing every reconcile that ran during
    // the burst wrote a document.
    ensure!(
        writes >= 1.0 && writes <= (POLICIES / 20) as f64,
        "{writes} ConfigMap writes for {POLICIES} creates\n{}",
        op.log_tail()
    );
    Ok(())
}
