//! The API server stopped and started again under a running operator: it stops leading
//! while it cannot renew its Lease, recovers on its own (same process) and compiles what
//! changed. Uses a cluster of its own.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::*;
use rebound_tests::DedicatedCluster;

#[tokio::test(flavor = "multi_thread")]
async fn operator_recovers_from_an_apiserver_restart() -> Result<()> {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cluster-apiserver-restart");
    let cluster = tokio::task::spawn_blocking(move || DedicatedCluster::start(&dir)).await??;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "op-restart").await?;
    let mut op = Operator::start(cluster.kubeconfig(), scoped(&ns, &[]))?;
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &policy("p", &["jobs"], 4))?
        .ok()?;
    converged(&client, &ns, Duration::from_secs(60)).await?;

    cluster.stop_apiserver()?;
    // Long enough for watches and the Lease renewal to fail and back off.
    tokio::time::sleep(Duration::from_secs(20)).await;
    ensure!(
        op.alive(),
        "the operator exited while the API server was down"
    );
    // Unable to renew its Lease for longer than the renew deadline, it stopped leading
    // (the watches may not even have failed yet: a stopping API server drains them).
    ensure!(
        !op.is_leader(),
        "still leading after 20 s without renewing the Lease"
    );
    cluster.start_apiserver()?;
    let back = Instant::now();

    let client = cluster.client().await?;
    cluster
        .kubectl_stdin(["apply", "-n", &ns, "-f", "-"], &policy("p", &["jobs"], 7))?
        .ok()?;
    let doc = converged(&client, &ns, Duration::from_secs(90)).await?;
    eprintln!(
        "converged {:.1}s after the API server came back",
        back.elapsed().as_secs_f64()
    );
    ensure!(doc.policies[0].params.max_attempts == 7);
    ensure!(op.alive(), "the operator exited");
    ensure!(op.is_leader());
    Ok(())
}
