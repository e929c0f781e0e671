//! A spec that passes admission but fails Rust validation (an older CRD, disabled CEL) is
//! reported as invalid and left out; the rest of the namespace still compiles. Uses a
//! cluster of its own whose CRD has every CEL rule (x-kubernetes-validations) removed.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn invalid_in_rust_is_reported_and_left_out() -> Result<()> {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cluster-relaxed-crd");
    let cluster = relaxed_cluster(dir).await?;

    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "op-relaxed").await?;
    let _op = Operator::start(cluster.kubeconfig(), scoped(&ns, &[]))?;

    // cap below base: rejected by CEL in a normal cluster, admitted here.
    let bad = |cap: &str| {
        format!(
            "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: bad\nspec:\n  \
             queues: [\"reports\"]\n  backoff:\n    base: 10s\n    cap: {cap}\n"
        )
    };
    let both = policy("good", &["emails"], 4) + &bad("1s");
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &both)?
        .ok()?;

    let p = wait_for_reason(&client, &ns, "bad", "InvalidSpec", WAIT).await?;
    let status = p.status.unwrap_or_default();
    let ready = ready_condition(&status.conditions).expect("Ready");
    ensure!(
        ready.message.contains("spec.backoff.cap"),
        "{}",
        ready.message
    );
    ensure!(condition(&status.conditions, "Stalled").is_some_and(|c| c.status == "True"));
    ensure!(status.summary.is_none());
    wait_for_reason(&client, &ns, "good", "Compiled", WAIT).await?;
    let (doc, _) = configmap_document(&client, &ns)
        .await?
        .context("ConfigMap")?;
    let names: Vec<&str> = doc.policies.iter().map(|p| p.name.as_str()).collect();
    ensure!(names == ["good"], "{names:?}");
    let warned = events(&client, &ns)
        .await?
        .into_iter()
        .any(|e| e.reason == "InvalidSpec" && e.regarding == "bad");
    ensure!(warned, "no InvalidSpec event");

    // Fixed: it joins the document.
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &bad("1m"))?
        .ok()?;
    let doc = converged(&client, &ns, WAIT).await?;
    ensure!(doc.policies.len() == 2);
    Ok(())
}
