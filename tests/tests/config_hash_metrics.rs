//! The staleness join's two sides agree: the real operator's
//! `rebound_operator_config_info{namespace, config_hash}` and a real watch-mode sidecar's
//! `rebound_sidecar_config_info{config_hash}` carry the same string for the same compiled
//! ConfigMap, which is also what the sidecar's answers name. The operator's per-namespace
//! and per-policy series follow the policies: a losing policy is not ready, and deleting
//! the policies removes them.

use std::{net::SocketAddr, time::Duration};

use anyhow::Result;
use rebound_sidecar::pb::v1::{GetPolicyRequest, retry_advisor_client::RetryAdvisorClient};
use rebound_test_support::{eventually, free_port, http_get, metrics::Samples};
use rebound_tests::{TestEnv, process::Running};

const WAIT: Duration = Duration::from_secs(60);
const OPERATOR_INFO: &str = "rebound_operator_config_info";
const READY: &str = "rebound_operator_policy_ready";

fn spawn(name: &str, env: &TestEnv, args: &[String]) -> Result<Running> {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    Running::workspace_binary(name, env.cluster.kubeconfig(), args, logs)
}

fn policy(name: &str, base: &str) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {name}}}\nspec:\n  queues: [orders]\n  backoff: {{strategy: constant, base: {base}, jitter: {{kind: none}}}}\n  maxAttempts: 5\n"
    )
}

fn scrape(addr: SocketAddr) -> Option<Samples> {
    let r = http_get(addr, "/metrics").ok()?;
    Samples::parse(&r.body).ok()
}

/// The hashes the operator reports for `namespace` (one once it holds a configuration).
fn operator_hashes(metrics: SocketAddr, namespace: &str) -> Vec<String> {
    scrape(metrics).map_or_else(Vec::new, |s| {
        s.matching(OPERATOR_INFO, &[("namespace", namespace)])
            .filter_map(|s| s.labels.get("config_hash").cloned())
            .collect()
    })
}

fn sidecar_hash(admin: SocketAddr) -> Option<String> {
    let s = scrape(admin)?;
    let info = s.matching("rebound_sidecar_config_info", &[]).next()?;
    info.labels.get("config_hash").cloned()
}

/// Waits until the operator reports one hash other than `not` and the sidecar loaded it.
async fn agreed(
    operator: SocketAddr,
    sidecar: SocketAddr,
    namespace: &str,
    not: Option<&str>,
) -> Result<String> {
    eventually("operator and sidecar on one hash", WAIT, || async move {
        let ours = operator_hashes(operator, namespace);
        Ok(match ours.as_slice() {
            [one] if Some(one.as_str()) != not && sidecar_hash(sidecar).as_ref() == Some(one) => {
                Some(one.clone())
            }
            _ => None,
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_and_sidecar_report_one_config_hash_and_policy_series_follow_policies()
-> Result<()> {
    let env = TestEnv::new("hash-metrics").await?;
    let ns = env.namespace.clone();
    let operator_metrics = free_port()?;
    let _operator = spawn(
        "rebound-operator",
        &env,
        &[
            format!("--namespaces={ns}"),
            "--leader-elect=false".into(),
            format!("--metrics-addr={operator_metrics}"),
        ],
    )?;
    env.apply_until_ready(&policy("orders", "2s"), "orders")?;
    let (grpc, admin) = (free_port()?, free_port()?);
    let _sidecar = spawn(
        "rebound-sidecar",
        &env,
        &[
            format!("--configmap={ns}/rebound-policies"),
            format!("--listen={grpc}"),
            format!("--admin-listen={admin}"),
        ],
    )?;
    let first = agreed(operator_metrics, admin, &ns, None).await?;
    let mut client = RetryAdvisorClient::new(rebound_sidecar::client::tcp_channel(grpc).await?);
    let answered = client
        .get_policy(GetPolicyRequest {
            queue: "orders".into(),
        })
        .await?
        .into_inner();
    assert_eq!(
        answered.policy.map(|p| p.config_hash),
        Some(first.clone()),
        "GetPolicy names the hash both /metrics report"
    );

    // A second policy for the same queue loses it: not ready (older wins; created in the
    // same second, the name decides, and "shadow" sorts after "orders"). The content
    // changed, so both sides move to the new hash and the operator drops the old one.
    env.kubectl_stdin(["apply", "-f", "-"], &policy("shadow", "5s"))?
        .ok()?;
    let second = agreed(operator_metrics, admin, &ns, Some(&first)).await?;
    let ready = |samples: &Samples, name: &str| {
        samples.value(READY, &[("namespace", &ns), ("policy", name)])
    };
    let readiness = eventually("shadow is not ready", WAIT, || async {
        Ok(scrape(operator_metrics).filter(|s| ready(s, "shadow") == Some(0.0)))
    })
    .await?;
    assert_eq!(ready(&readiness, "orders"), Some(1.0));
    assert_eq!(
        operator_hashes(operator_metrics, &ns),
        [second],
        "one hash per namespace"
    );
    let generated = readiness.value(
        "rebound_operator_config_generated_timestamp_seconds",
        &[("namespace", &ns)],
    );
    assert!(generated.is_some_and(|t| t > 1.7e9), "{generated:?}");

    // No policies left: the namespace's series go (the sidecar loads the empty document).
    env.kubectl(["delete", "retrypolicy", "--all", "--wait=true"])?
        .ok()?;
    let gone = eventually("the namespace's series removed", WAIT, || async {
        Ok(scrape(operator_metrics).filter(|s| {
            s.matching(OPERATOR_INFO, &[("namespace", &ns)]).count() == 0
                && s.matching(READY, &[("namespace", &ns)]).count() == 0
        }))
    })
    .await?;
    assert_eq!(
        gone.matching(
            "rebound_operator_config_generated_timestamp_seconds",
            &[("namespace", &ns)]
        )
        .count(),
        0
    );
    Ok(())
}
