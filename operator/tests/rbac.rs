//! The operator as its service account, with only the RBAC from deploy/rbac.yaml.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use rebound_tests::{TestEnv, repo_root, unique_name};

const WAIT: Duration = Duration::from_secs(60);
const SA: &str = "system:serviceaccount:rebound-system:rebound-operator";

#[tokio::test(flavor = "multi_thread")]
async fn service_account_does_its_job_and_nothing_more() -> Result<()> {
    let env = TestEnv::new("op-rbac").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    // Everything deploy/ ships for it: RBAC and the admission policy.
    for file in ["deploy/rbac.yaml", "deploy/admission.yaml"] {
        let path = repo_root().join(file);
        env.cluster
            .kubectl(["apply", "--server-side", "-f", &path.to_string_lossy()])?
            .ok()?;
    }
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
    converged(client, ns, WAIT).await?;
    eventually("the Compiled event", WAIT, || async {
        Ok(events(client, ns)
            .await?
            .iter()
            .any(|e| e.reason == "Compiled")
            .then_some(()))
    })
    .await?;
    // Nothing refused, nothing retried: no WARN or ERROR record at all.
    let warnings = op.warnings()?;
    ensure!(warnings.is_empty(), "warnings: {warnings:#?}");

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
        // Injected Pods are watched (metadata only, by label) to bind the sidecar role.
        (vec!["list", "pods", "-A"], true),
        (vec!["get", "pods", "-n", ns], false),
        (vec!["bind", "clusterroles/rebound-sidecar"], true),
        (vec!["bind", "clusterroles/admin"], false),
        (vec!["create", "rolebindings", "-n", ns], true),
        (
            vec!["patch", "rolebindings/rebound-sidecar", "-n", ns],
            true,
        ),
        (vec!["patch", "rolebindings/other", "-n", ns], false),
        (
            vec!["delete", "rolebindings/rebound-sidecar", "-n", ns],
            false,
        ),
        (vec!["create", "clusterrolebindings"], false),
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
        (vec!["delete", cm.as_str(), "-n", ns], false),
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

/// The check above can fail: the same operator under an account without any RBAC logs
/// its refused requests as warnings carrying the API's status code.
#[tokio::test(flavor = "multi_thread")]
async fn refused_requests_are_logged_with_their_status_code() -> Result<()> {
    let env = TestEnv::new("op-norbac").await?;
    let ns = env.namespace.as_str();
    let user = unique_name("nobody");
    let kubeconfig = env.cluster.mint_user_kubeconfig(&user, &[])?;
    let op = Operator::start(&kubeconfig, scoped(ns, &["--leader-elect=false"]))?;
    let refused = eventually("a refused request in the log", WAIT, || async {
        let warnings = op.warnings()?;
        Ok(warnings
            .into_iter()
            .find(|r| r.get("code").and_then(serde_json::Value::as_u64) == Some(403)))
    })
    .await?;
    ensure!(
        field(&refused, "message") == Some("watch failed; retrying with backoff"),
        "{refused:#?}"
    );
    Ok(())
}
