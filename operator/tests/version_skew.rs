//! A CRD upgraded before the operator: a policy using a field this build does not know
//! still compiles (the operator reads specs tolerantly; people are told by admission and
//! `rebound validate`). Uses a cluster of its own whose CRD declares an extra field.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use rebound_tests::DedicatedCluster;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn a_spec_field_from_a_newer_crd_does_not_make_the_policy_invalid() -> Result<()> {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cluster-version-skew");
    let cluster = tokio::task::spawn_blocking(move || DedicatedCluster::start(&dir)).await??;
    let mut crd = cluster.retry_policy_crd()?;
    // A newer release's fields: one at the top of the spec, one inside backoff.
    let spec = crd
        .pointer_mut("/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties")
        .and_then(Value::as_object_mut)
        .context("spec properties")?;
    spec.insert("priority".to_owned(), json!({"type": "integer"}));
    spec.get_mut("backoff")
        .and_then(|b| b.get_mut("properties"))
        .and_then(Value::as_object_mut)
        .context("backoff properties")?
        .insert("spread".to_owned(), json!({"type": "string"}));
    cluster.apply_crd(&crd)?;

    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "op-skew").await?;
    let _op = Operator::start(cluster.kubeconfig(), scoped(&ns, &[]))?;

    let newer = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: newer\n\
                 spec:\n  queues: [\"reports\"]\n  priority: 3\n  maxAttempts: 4\n  backoff:\n    \
                 base: 2s\n    spread: zones\n";
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], newer)?
        .ok()?;
    // The API server stored the new fields (they are in its schema)...
    let stored = cluster
        .kubectl(["get", "-n", &ns, "retrypolicy", "newer", "-o", "json"])?
        .ok()?
        .stdout;
    let stored: Value = serde_json::from_str(&stored)?;
    ensure!(
        stored.pointer("/spec/priority") == Some(&json!(3)),
        "{stored}"
    );
    ensure!(stored.pointer("/spec/backoff/spread") == Some(&json!("zones")));

    // ...and the operator compiles the policy with the fields it knows.
    wait_for_reason(&client, &ns, "newer", "Compiled", WAIT).await?;
    let doc = converged(&client, &ns, WAIT).await?;
    let names: Vec<&str> = doc.policies.iter().map(|p| p.name.as_str()).collect();
    ensure!(names == ["newer"], "{names:?}");
    let params = &doc.policies[0].params;
    ensure!(
        params.max_attempts == 4 && params.base_ms == 2_000,
        "{params:?}"
    );
    Ok(())
}
