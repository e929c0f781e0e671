//! The operator as its service account, with only the RBAC from deploy/rbac.yaml.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use rebound_tests::{TestEnv, repo_root, unique_name};

const SA: &str = "system:serviceaccount:rebound-system:rebound-operator";

#[tokio::test(flavor = "multi_thread")]
async fn service_account_does_its_job_and_nothing_more() -> Result<()> {
    let env = TestEnv::new("op-rbac").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let rbac = repo_root().join("deploy/rbac.yaml");
    env.cluster
        .kubectl(["apply", "-f", &rbac.to_string_lossy()])?
        .ok()?;
    let kubeconfig = env.cluster.mint_user_kubeconfig(
        SA,
        &[
            "system:serviceaccounts",
            "system:serviceaccounts:rebound-system",
        ],
    )?;

    let lease = format!("--lease-name={}", unique_name("rbac"));
    let args = vec![
        format!("--namespaces={ns}"),
        "--lease-namespace=rebound-system".to_owned(),
        lease,
    ];
    let op = Operator::start(&kubeconfig, args)?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p", &["jobs"], 4))?
        .ok()?;
    env.kubectl(["create", "configmap", "unrelated", "--from-literal=a=b"])?
        .ok()?;
    converged(client, ns, Duration::from_secs(60)).await?;
    eventually("the Compiled event", Duration::from_secs(30), || async {
        Ok(events(client, ns)
            .await?
            .iter()
            .any(|e| e.reason == "Compiled")
            .then_some(()))
    })
    .await?;
    let log = std::fs::read_to_string(&op.log)?;
    ensure!(
        !log.contains("forbidden") && !log.contains("403"),
        "{}",
        op.log_tail()
    );

    let can = |args: &[&str]| -> Result<bool> {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        all.extend_from_slice(&[
            "--as",
            SA,
            "--as-group",
            "system:serviceaccounts",
            "--as-group",
            "system:serviceaccounts:rebound-system",
        ]);
        Ok(env.cluster.kubectl(all)?.stdout.trim() == "yes")
    };
    let cm = format!("configmaps/{CM}");
    for (args, expected) in [
        (vec!["get", "secrets", "-A"], false),
        (vec!["list", "secrets", "-n", ns], false),
        (vec!["list", "secrets", "-n", "rebound-system"], false),
        (vec!["get", "configmaps/unrelated", "-n", ns], false),
        (vec!["list", "configmaps", "-n", ns], false),
        (vec!["update", "retrypolicies.rebound.dev", "-n", ns], false),
        (vec!["patch", "retrypolicies.rebound.dev", "-n", ns], false),
        (vec!["delete", "retrypolicies.rebound.dev", "-n", ns], false),
        (vec!["list", "pods", "-A"], false),
        (vec!["watch", "retrypolicies.rebound.dev", "-A"], true),
        (
            vec![
                "patch",
                "retrypolicies.rebound.dev",
                "--subresource=status",
                "-n",
                ns,
            ],
            true,
        ),
        (vec!["patch", cm.as_str(), "-n", ns], true),
        (vec!["create", "events.events.k8s.io", "-n", ns], true),
        (
            vec![
                "patch",
                "leases.coordination.k8s.io",
                "-n",
                "rebound-system",
            ],
            true,
        ),
        (vec!["patch", "leases.coordination.k8s.io", "-n", ns], false),
    ] {
        ensure!(
            can(&args)? == expected,
            "kubectl auth can-i {args:?}: expected {expected}"
        );
    }
    Ok(())
}
