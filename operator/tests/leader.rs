//! Two replicas: only the Lease holder writes; killing it hands over to the other.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use rebound_tests::TestEnv;

#[tokio::test(flavor = "multi_thread")]
async fn only_the_leader_writes_and_a_standby_takes_over() -> Result<()> {
    let env = TestEnv::new("op-leader").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let lease = ["--lease-duration=6", "--lease-grace=2"];
    let args = |id: &str| {
        let mut a = scoped(ns, &lease);
        a.push(format!("--identity={id}"));
        a
    };
    let mut first = Operator::start(env.cluster.kubeconfig(), args("replica-a"))?;
    eventually("replica-a to lead", Duration::from_secs(30), || async {
        Ok(first.is_leader().then_some(()))
    })
    .await?;
    let second = Operator::start(env.cluster.kubeconfig(), args("replica-b"))?;
    eventually("replica-b to be up", Duration::from_secs(30), || async {
        Ok(second
            .metric("rebound_operator_leader")
            .is_ok()
            .then_some(()))
    })
    .await?;

    env.kubectl_stdin(["apply", "-f", "-"], &policy("p", &["jobs"], 4))?
        .ok()?;
    converged(client, ns, Duration::from_secs(60)).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let holder = leases
        .get("rebound-operator")
        .await?
        .spec
        .and_then(|s| s.holder_identity);
    ensure!(holder.as_deref() == Some("replica-a"), "holder {holder:?}");
    ensure!(first.writes()? > 0.0);
    ensure!(
        !second.is_leader() && second.writes()? == 0.0,
        "the standby wrote"
    );

    first.kill();
    let killed = Instant::now();
    eventually(
        "replica-b to take over",
        Duration::from_secs(60),
        || async { Ok(second.is_leader().then_some(())) },
    )
    .await?;
    eprintln!(
        "failover after {:.1}s (lease 6s)",
        killed.elapsed().as_secs_f64()
    );
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p", &["jobs"], 6))?
        .ok()?;
    let doc = converged(client, ns, Duration::from_secs(60)).await?;
    ensure!(doc.policies[0].params.max_attempts == 6);
    ensure!(second.writes()? > 0.0);
    Ok(())
}
