//! SIGKILL in the middle of a burst of changes, more changes while the operator is down,
//! then a restart: the ConfigMap must end up with exactly the right content.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use rebound_tests::TestEnv;

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_a_burst_then_restart_converges() -> Result<()> {
    let env = TestEnv::new("op-crash").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let mut op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;

    let batch = |range: std::ops::Range<u32>, attempts: u32| -> String {
        range
            .map(|i| policy(&format!("p{i:02}"), &[&format!("queue-{i}")], attempts))
            .collect()
    };
    // Changes in flight while the operator works on them; it is killed mid-burst.
    env.kubectl_stdin(["apply", "-f", "-"], &batch(0..30, 3))?
        .ok()?;
    env.kubectl_stdin(["apply", "-f", "-"], &batch(10..20, 6))?
        .ok()?;
    op.kill();
    // While it is down: updates, deletions and new policies it never saw.
    env.kubectl_stdin(["apply", "-f", "-"], &batch(0..5, 9))?
        .ok()?;
    let gone: Vec<String> = (20..25).map(|i| format!("p{i:02}")).collect();
    let mut delete = vec!["delete".to_owned(), "retrypolicy".to_owned()];
    delete.extend(gone.iter().cloned());
    env.kubectl(delete)?.ok()?;
    env.kubectl_stdin(["apply", "-f", "-"], &batch(30..35, 2))?
        .ok()?;

    let _op = op.restart()?;
    let doc = converged(client, ns, Duration::from_secs(90)).await?;
    ensure!(doc.policies.len() == 30, "{} policies", doc.policies.len());
    ensure!(
        doc.policies.iter().all(|p| !gone.contains(&p.name)),
        "a deleted policy is still served"
    );
    let p03 = doc.policies.iter().find(|p| p.name == "p03").expect("p03");
    ensure!(p03.params.max_attempts == 9 && p03.generation == 2);
    Ok(())
}
