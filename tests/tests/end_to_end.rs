//! The whole loop as users run it: `kubectl apply` a RetryPolicy → `rebound-operator`
//! compiles the namespace into its ConfigMap → `rebound-sidecar --configmap` watches it →
//! a gRPC client's answers change. Both programs are the real binaries of this workspace
//! (built by `cargo test --workspace`), talking to the real kube-apiserver.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use rebound_sidecar::pb::v1::{DecideRequest, retry_advisor_client::RetryAdvisorClient};
use rebound_test_support::free_port;
use rebound_tests::{TestEnv, process::Running};
use tonic::transport::Channel;

fn spawn(name: &str, env: &TestEnv, args: &[String]) -> Result<Running> {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    Running::workspace_binary(name, env.cluster.kubeconfig(), args, logs)
}

fn policy(base: &str) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: orders}}\nspec:\n  queues: [orders]\n  backoff: {{strategy: constant, base: {base}, jitter: {{kind: none}}}}\n  maxAttempts: 5\n"
    )
}

async fn delay_for_orders(client: &mut RetryAdvisorClient<Channel>) -> Option<(u64, String)> {
    let request = DecideRequest {
        queue: "orders".into(),
        attempt: 1,
        job_id: "order-1".into(),
        ..DecideRequest::default()
    };
    let answer = client.decide(request).await.ok()?.into_inner();
    Some((answer.delay_ms, answer.policy?.config_hash))
}

/// Polls until the sidecar answers `want_ms`; returns how long that took and the hash.
async fn wait_for_delay(
    client: &mut RetryAdvisorClient<Channel>,
    want_ms: u64,
) -> Result<(Duration, String)> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if let Some((delay, hash)) = delay_for_orders(client).await
            && delay == want_ms
        {
            return Ok((start.elapsed(), hash));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("the sidecar never answered {want_ms} ms")
}

/// The compiled document the operator wrote into the namespace's ConfigMap.
fn configmap_document(env: &TestEnv) -> Result<rebound_policy::CompiledDocument> {
    let out = env
        .kubectl([
            "get",
            "configmap",
            "rebound-policies",
            "-o",
            "jsonpath={.data.policies\\.json}",
        ])?
        .ok()?;
    Ok(rebound_policy::CompiledDocument::from_json(
        out.stdout.as_bytes(),
    )?)
}

fn configmap_hash(env: &TestEnv) -> Result<String> {
    Ok(configmap_document(env)?.hash)
}

/// The operator, watching only the test's namespace.
fn spawn_operator(env: &TestEnv) -> Result<Running> {
    spawn(
        "rebound-operator",
        env,
        &[
            format!("--namespaces={}", env.namespace),
            "--leader-elect=false".into(),
            format!("--metrics-addr={}", free_port()?),
        ],
    )
}

/// A sidecar watching the namespace's ConfigMap, and a client connected to it.
async fn spawn_watching_sidecar(env: &TestEnv) -> Result<(Running, RetryAdvisorClient<Channel>)> {
    let grpc = free_port()?;
    let sidecar = spawn(
        "rebound-sidecar",
        env,
        &[
            format!("--configmap={}/rebound-policies", env.namespace),
            format!("--listen={grpc}"),
            "--no-admin".into(),
        ],
    )?;
    Ok((sidecar, connect(grpc).await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_reaches_the_sidecar_through_the_operator() -> Result<()> {
    let env = TestEnv::new("e2e").await?;
    let _operator = spawn_operator(&env)?;
    env.apply_until_ready(&policy("2s"), "orders")?;

    let (_sidecar, mut client) = spawn_watching_sidecar(&env).await?;
    let (_, first_hash) = wait_for_delay(&mut client, 2_000).await?;
    assert_eq!(
        first_hash,
        configmap_hash(&env)?,
        "the sidecar serves the operator's document"
    );

    // Propagation: apply → operator → ConfigMap → watch → new answers.
    let applied = Instant::now();
    env.kubectl_stdin(["apply", "-f", "-"], &policy("5s"))?
        .ok()?;
    let (_, second_hash) = wait_for_delay(&mut client, 5_000).await?;
    let propagation = applied.elapsed();
    assert_ne!(first_hash, second_hash);
    assert_eq!(second_hash, configmap_hash(&env)?);
    eprintln!(
        "kubectl apply → sidecar answer changed in {} ms",
        propagation.as_millis()
    );
    Ok(())
}

async fn connect(addr: SocketAddr) -> Result<RetryAdvisorClient<Channel>> {
    let start = Instant::now();
    loop {
        match rebound_sidecar::client::tcp_channel(addr).await {
            Ok(channel) => return Ok(RetryAdvisorClient::new(channel)),
            Err(e) if start.elapsed() > Duration::from_secs(30) => {
                return Err(e).context("connecting to the sidecar");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A `retryBudget` travels the same loop: the status summary names it, the ConfigMap's
/// document carries it, and the real sidecar binary stretches retries over it. Budget 1/s,
/// burst 1, a constant 2 s delay: ten jobs asked one after the other cannot all run 2 s
/// later in distinct seconds, so the budget must stretch some; a repeated question gets the
/// identical answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_budget_reaches_the_sidecar_through_the_operator() -> Result<()> {
    let env = TestEnv::new("e2e-budget").await?;
    let _operator = spawn_operator(&env)?;
    let manifest = format!("{}  retryBudget: {{ratePerSecond: 1}}\n", policy("2s"));
    env.apply_until_ready(&manifest, "orders")?;
    let summary = env
        .kubectl([
            "get",
            "retrypolicy/orders",
            "-o",
            "jsonpath={.status.summary.retryBudget}",
        ])?
        .ok()?;
    // No sidecar holds a Lease in this namespace yet, so the operator cannot say how many
    // share the budget (docs/operator.md).
    assert_eq!(
        summary.stdout.trim(),
        "1/s, burst 1 (1s slots) per sidecar (no sidecar Leases)"
    );
    let doc = configmap_document(&env)?;
    assert_eq!(
        doc.policies[0].params.retry_budget,
        Some(rebound_policy::resolve::RetryBudget {
            rate_per_second: 1,
            burst: 1
        })
    );

    let (_sidecar, mut client) = spawn_watching_sidecar(&env).await?;
    wait_for_delay(&mut client, 2_000).await?;
    let ask = |job: &str| DecideRequest {
        queue: "orders".into(),
        attempt: 1,
        job_id: job.into(),
        ..DecideRequest::default()
    };
    let mut answers = Vec::new();
    let mut asked_last = std::time::Instant::now();
    for i in 0..10 {
        asked_last = std::time::Instant::now();
        answers.push(client.decide(ask(&format!("job-{i}"))).await?.into_inner());
    }
    for a in &answers {
        assert_eq!(a.delay_ms, 2_000 + a.budget_delay_ms, "{a:?}");
        assert_eq!(a.budget_stretched, a.budget_delay_ms > 0, "{a:?}");
    }
    assert!(answers.iter().any(|a| a.budget_stretched), "{answers:?}");
    // A repeat runs at the same time as the first answer: its delay counts from its own
    // arrival, no new slot.
    let again = client.decide(ask("job-9")).await?.into_inner();
    let between_ms = u64::try_from(asked_last.elapsed().as_millis()).unwrap_or(u64::MAX);
    let last = answers.last().expect("ten answers");
    let earlier = last.delay_ms.checked_sub(again.delay_ms);
    assert!(
        earlier.is_some_and(|ms| ms <= between_ms + 1),
        "{again:?} vs {last:?}"
    );
    assert_eq!(
        (again.budget_stretched, &again.policy),
        (last.budget_stretched, &last.policy)
    );
    Ok(())
}
