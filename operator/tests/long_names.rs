//! The longest valid RetryPolicy name (253 characters) works end to end: compiled into the
//! ConfigMap, status written, and its Event published (the Event's own name must stay
//! within the limit too).

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use rebound_tests::TestEnv;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn a_253_character_policy_name_works_end_to_end() -> Result<()> {
    let env = TestEnv::new("op-long").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;
    let names = [
        "x".repeat(253),
        format!("{}-{}", "a".repeat(235), "b".repeat(17)),
    ];
    ensure!(names.iter().all(|n| n.len() == 253));
    let manifests: String = names
        .iter()
        .enumerate()
        .map(|(i, n)| policy(n, &[&format!("queue-{i}")], 3))
        .collect();
    env.kubectl_stdin(["apply", "-f", "-"], &manifests)?.ok()?;

    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.len() == 2);
    for name in &names {
        eventually("the Compiled event", WAIT, || async {
            Ok(events(client, ns)
                .await?
                .iter()
                .any(|e| e.reason == "Compiled" && &e.regarding == name)
                .then_some(()))
        })
        .await?;
    }
    let warnings = op.warnings()?;
    ensure!(warnings.is_empty(), "warnings: {warnings:#?}");
    Ok(())
}
