//! A real GitOps engine syncs RetryPolicies: Flux's source-controller and
//! kustomize-controller (built by `dev/build-flux.sh`) run against the test cluster and
//! sync a Git repository served on 127.0.0.1 (`githttp`), with the real rebound-operator
//! compiling what they apply. A Kustomization with `wait: true` reads the policy's status
//! through kstatus; a commit the API server refuses leaves the Kustomization not Ready with
//! the field named, and the previous policy serving.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use rebound_policy::CompiledDocument;
use rebound_policy::compiled::CONFIGMAP_KEY;
use rebound_test_support::{eventually, free_port};
use rebound_tests::compiled::CONFIGMAP;
use rebound_tests::flux::{Flux, GitServer, condition};
use rebound_tests::process::Running;
use rebound_tests::{TestEnv, retry_policy_resource};
use serde_json::Value;

/// Long enough for a sync on a busy 2-core machine; each step takes a few seconds.
const STEP: Duration = Duration::from_secs(40);
/// How long the Kustomization must stay not Ready with the operator down: Flux reports an
/// apply without `wait` as Ready within a second.
const WAIT_HELD: Duration = Duration::from_secs(4);

fn policy(max_attempts: u32) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: orders\nspec:\n  queues: [orders]\n  backoff: {{strategy: constant, base: 2s, jitter: {{kind: none}}}}\n  maxAttempts: {max_attempts}\n"
    )
}

fn sync_objects(url: &str, namespace: &str) -> String {
    format!(
        r#"apiVersion: source.toolkit.fluxcd.io/v1
kind: GitRepository
metadata:
  name: policies
spec:
  interval: 1s
  timeout: 10s
  url: {url}
  ref: {{branch: main}}
---
apiVersion: kustomize.toolkit.fluxcd.io/v1
kind: Kustomization
metadata:
  name: policies
spec:
  interval: 1m
  retryInterval: 1s
  timeout: 30s
  path: ./policies
  prune: true
  wait: true
  targetNamespace: {namespace}
  sourceRef: {{kind: GitRepository, name: policies}}
"#
    )
}

fn kustomizations(env: &TestEnv) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kustomize.toolkit.fluxcd.io", "v1", "Kustomization"),
        "kustomizations",
    );
    Api::namespaced_with(env.client.clone(), &env.namespace, &resource)
}

async fn get_json(api: &Api<DynamicObject>, name: &str) -> Result<Option<Value>> {
    Ok(match api.get_opt(name).await? {
        Some(object) => Some(serde_json::to_value(object)?),
        None => None,
    })
}

/// The Kustomization once its last attempt is `commit`, with its Ready condition settled
/// (True or False, not Unknown while it works).
async fn kustomization_at(env: &TestEnv, commit: &str) -> Result<Value> {
    let api = kustomizations(env);
    let revision = format!("main@sha1:{commit}");
    eventually(
        &format!("the Kustomization to settle at {revision}"),
        STEP,
        || async {
            let Some(k) = get_json(&api, "policies").await? else {
                return Ok(None);
            };
            let attempted =
                k.pointer("/status/lastAttemptedRevision") == Some(&revision.clone().into());
            // Flux patches the conditions before the rest of the status, in two requests:
            // Ready may read True while `lastAppliedRevision` still names the commit before.
            let applied =
                k.pointer("/status/lastAppliedRevision") == Some(&revision.clone().into());
            let settled = condition(&k, "Ready")
                .is_some_and(|c| c["status"] == "False" || (c["status"] == "True" && applied));
            let current = condition(&k, "Ready")
                .is_some_and(|c| c["observedGeneration"] == k["metadata"]["generation"]);
            Ok((attempted && settled && current).then_some(k))
        },
    )
    .await
}

/// The `maxAttempts` the compiled ConfigMap holds for `orders`, when it holds it.
async fn compiled_max_attempts(env: &TestEnv) -> Result<Option<u32>> {
    let api: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let Some(cm) = api.get_opt(CONFIGMAP).await? else {
        return Ok(None);
    };
    let Some(json) = cm.data.and_then(|mut d| d.remove(CONFIGMAP_KEY)) else {
        return Ok(None);
    };
    let document = CompiledDocument::from_json(json.as_bytes())?;
    Ok(document
        .policies
        .iter()
        .find(|p| p.name == "orders")
        .map(|p| p.params.max_attempts))
}

/// The operator, watching only the test's namespace.
fn spawn_operator(env: &TestEnv, logs: &Path) -> Result<Running> {
    Running::workspace_binary(
        "rebound-operator",
        env.cluster.kubeconfig(),
        &[
            format!("--namespaces={}", env.namespace),
            "--leader-elect=false".into(),
            format!("--metrics-addr={}", free_port()?),
        ],
        logs,
    )
}

/// The RetryPolicy `orders` as JSON.
async fn orders(env: &TestEnv) -> Result<Value> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.namespace, &retry_policy_resource());
    get_json(&api, "orders")
        .await?
        .context("the RetryPolicy orders does not exist")
}

fn is_ready_true(object: &Value) -> bool {
    condition(object, "Ready").is_some_and(|c| c["status"] == "True")
}

/// The words of a message split at anything that is not part of a field path, so
/// `spec.maxAttempts` matches only as a whole path, never inside a longer one.
fn path_tokens(message: &str) -> Vec<&str> {
    message
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '_'))
        .map(|t| t.trim_end_matches('.'))
        .filter(|t| !t.is_empty())
        .collect()
}

#[tokio::test]
async fn flux_syncs_policies_waits_on_their_status_and_keeps_serving_through_a_refused_commit()
-> Result<()> {
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let env = TestEnv::new("gitops-flux").await?;
    let operator = spawn_operator(&env, logs)?;
    let git = GitServer::start(logs)?;
    let flux = Flux::start(env.cluster, &env.namespace, logs)?;
    let context = || {
        format!(
            "logs: githttp {}, Flux {}",
            git.log().display(),
            flux.logs()
                .iter()
                .map(|l| l.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };

    // (i) The first commit: the policy is applied, compiled and Ready, and the
    // Kustomization is Ready.
    let first = git.commit(
        &[("policies/orders.yaml", &policy(5))],
        "orders: 5 attempts",
    )?;
    env.kubectl_stdin(
        ["apply", "-f", "-"],
        &sync_objects(&git.url(), &env.namespace),
    )?
    .ok()?;
    let k = kustomization_at(&env, &first).await.with_context(context)?;
    ensure!(
        is_ready_true(&k),
        "first commit: Kustomization not Ready: {k:#}"
    );
    let orders_ready = eventually("orders to be Ready", STEP, || async {
        let p = orders(&env).await?;
        Ok(is_ready_true(&p).then_some(p))
    })
    .await?;
    assert_eq!(orders_ready["spec"]["maxAttempts"], 5);
    let served = eventually("the ConfigMap to hold orders", STEP, || async {
        compiled_max_attempts(&env).await
    })
    .await?;
    assert_eq!(served, 5);

    // (ii) A commit changing maxAttempts while the operator is down: Flux applies it, but
    // with `wait: true` kstatus reads our stale observedGeneration as InProgress, so the
    // Kustomization is not Ready. Once the operator is back it compiles the new generation,
    // the compiled document follows and the Kustomization turns Ready.
    drop(operator);
    let second = git.commit(
        &[("policies/orders.yaml", &policy(7))],
        "orders: 7 attempts",
    )?;
    eventually("Flux to apply 7 attempts", STEP, || async {
        Ok((orders(&env).await?["spec"]["maxAttempts"] == 7).then_some(()))
    })
    .await
    .with_context(context)?;
    let second_revision: Value = format!("main@sha1:{second}").into();
    let held = std::time::Instant::now();
    while held.elapsed() < WAIT_HELD {
        let k = get_json(&kustomizations(&env), "policies")
            .await?
            .context("the Kustomization is gone")?;
        let ready_at_second =
            is_ready_true(&k) && k.pointer("/status/lastAppliedRevision") == Some(&second_revision);
        ensure!(
            !ready_at_second,
            "Ready while the policy's status is stale (wait: true ignored): {k:#}"
        );
        let p = orders(&env).await?;
        ensure!(
            p.pointer("/status/observedGeneration") != p.pointer("/metadata/generation"),
            "the status moved with the operator down: {p:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _operator = spawn_operator(&env, logs)?;
    let k = kustomization_at(&env, &second)
        .await
        .with_context(context)?;
    ensure!(
        is_ready_true(&k),
        "second commit: Kustomization not Ready: {k:#}"
    );
    assert_eq!(
        k.pointer("/status/lastAppliedRevision"),
        Some(&format!("main@sha1:{second}").into())
    );
    let p = orders(&env).await?;
    assert_eq!(p["spec"]["maxAttempts"], 7);
    assert_eq!(
        p.pointer("/status/observedGeneration"),
        p.pointer("/metadata/generation"),
        "Ready Kustomization before the operator saw the generation: {p:#}"
    );
    assert!(is_ready_true(&p), "{p:#}");
    let served = eventually("the ConfigMap to hold 7 attempts", STEP, || async {
        Ok(compiled_max_attempts(&env).await?.filter(|&n| n == 7))
    })
    .await?;
    assert_eq!(served, 7);

    // (iii) A commit the API server refuses: the Kustomization is not Ready, its message is
    // the API server's rejection naming the field, and the previous policy keeps serving.
    let third = git.commit(
        &[("policies/orders.yaml", &policy(0))],
        "orders: 0 attempts",
    )?;
    let k = kustomization_at(&env, &third).await.with_context(context)?;
    let ready = condition(&k, "Ready").context("no Ready condition")?;
    assert_eq!(ready["status"], "False", "{k:#}");
    assert_eq!(ready["reason"], "ReconciliationFailed", "{k:#}");
    let message = ready["message"].as_str().unwrap_or_default();
    assert!(
        path_tokens(message).contains(&"spec.maxAttempts"),
        "the rejection does not name spec.maxAttempts: {message}"
    );
    assert_eq!(
        k.pointer("/status/lastAppliedRevision"),
        Some(&format!("main@sha1:{second}").into()),
        "{k:#}"
    );
    let p = orders(&env).await?;
    assert_eq!(p["spec"]["maxAttempts"], 7);
    assert!(is_ready_true(&p), "{p:#}");
    assert_eq!(compiled_max_attempts(&env).await?, Some(7));
    Ok(())
}

/// `orders` with a rollout of one manual step: a change waits at 50 % for a person.
fn rolled_policy(max_attempts: u32) -> String {
    format!(
        "{}  rollout:\n    steps: [{{weight: 50}}]\n",
        policy(max_attempts)
    )
}

/// `kubectl rebound rollout ACTION orders` in the test's namespace.
fn rollout_action(env: &TestEnv, action: &str) -> Result<()> {
    let plugin = rebound_test_support::workspace_binary("kubectl-rebound")?;
    let out = std::process::Command::new(plugin)
        .env("KUBECONFIG", env.cluster.kubeconfig())
        .args(["rollout", action, "orders", "-n", &env.namespace])
        .output()?;
    ensure!(
        out.status.success(),
        "rollout {action}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The Kustomization while it waits on `commit`'s objects: applied, Ready not settled.
async fn kustomization_waiting(env: &TestEnv, commit: &str) -> Result<Value> {
    let revision: Value = format!("main@sha1:{commit}").into();
    eventually("the Kustomization to wait on the rollout", STEP, || async {
        let Some(k) = get_json(&kustomizations(env), "policies").await? else {
            return Ok(None);
        };
        let applied = k.pointer("/status/lastAttemptedRevision") == Some(&revision);
        let waiting = condition(&k, "Ready").is_some_and(|c| c["status"] == "Unknown");
        Ok((applied && waiting).then_some(k))
    })
    .await
}

/// The phase of `orders`' rollout, once the operator has observed its generation.
async fn rollout_phase(env: &TestEnv) -> Result<Option<String>> {
    let p = orders(env).await?;
    if p.pointer("/status/observedGeneration") != p.pointer("/metadata/generation") {
        return Ok(None);
    }
    Ok(p.pointer("/status/rollout/phase")
        .and_then(Value::as_str)
        .map(str::to_owned))
}

#[tokio::test]
async fn flux_shows_a_rollout_progressing_then_healthy_or_degraded() -> Result<()> {
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let env = TestEnv::new("gitops-rollout").await?;
    let _operator = spawn_operator(&env, logs)?;
    let git = GitServer::start(logs)?;
    let flux = Flux::start(env.cluster, &env.namespace, logs)?;
    let context = || {
        format!(
            "logs: githttp {}, Flux {:?}",
            git.log().display(),
            flux.logs()
        )
    };

    // The first revision with `rollout` applies at once: nothing to roll from.
    let first = git.commit(&[("policies/orders.yaml", &rolled_policy(5))], "orders: 5")?;
    env.kubectl_stdin(
        ["apply", "-f", "-"],
        &sync_objects(&git.url(), &env.namespace),
    )?
    .ok()?;
    let k = kustomization_at(&env, &first).await.with_context(context)?;
    ensure!(is_ready_true(&k), "first commit: {k:#}");

    // A change: the rollout waits at its manual step, and Flux waits with it (kstatus
    // InProgress: Reconciling=True) instead of calling the sync healthy.
    let second = git.commit(&[("policies/orders.yaml", &rolled_policy(7))], "orders: 7")?;
    kustomization_waiting(&env, &second)
        .await
        .with_context(context)?;
    let phase = eventually("the rollout to pause", STEP, || async {
        Ok(rollout_phase(&env).await?.filter(|p| p == "Paused"))
    })
    .await?;
    assert_eq!(phase, "Paused");
    let k = get_json(&kustomizations(&env), "policies")
        .await?
        .context("the Kustomization is gone")?;
    ensure!(!is_ready_true(&k), "Ready during the rollout: {k:#}");
    assert_eq!(compiled_max_attempts(&env).await?, Some(5), "stable serves");
    // Promoted by a person: Healthy, and the sync Ready at that commit.
    rollout_action(&env, "promote")?;
    let k = kustomization_at(&env, &second)
        .await
        .with_context(context)?;
    ensure!(is_ready_true(&k), "after promote: {k:#}");
    assert_eq!(rollout_phase(&env).await?.as_deref(), Some("Healthy"));
    assert_eq!(compiled_max_attempts(&env).await?, Some(7));

    // Another change, aborted: Degraded (Stalled=True, kstatus Failed), so the sync fails
    // its health check while the stable revision serves.
    let third = git.commit(&[("policies/orders.yaml", &rolled_policy(9))], "orders: 9")?;
    kustomization_waiting(&env, &third)
        .await
        .with_context(context)?;
    eventually("the rollout to pause", STEP, || async {
        Ok(rollout_phase(&env).await?.filter(|p| p == "Paused"))
    })
    .await?;
    rollout_action(&env, "abort")?;
    let k = kustomization_at(&env, &third).await.with_context(context)?;
    let ready = condition(&k, "Ready").context("no Ready condition")?;
    assert_eq!(ready["status"], "False", "{k:#}");
    assert_eq!(ready["reason"], "HealthCheckFailed", "{k:#}");
    assert_eq!(rollout_phase(&env).await?.as_deref(), Some("Degraded"));
    assert_eq!(compiled_max_attempts(&env).await?, Some(7), "stable serves");
    Ok(())
}

#[test]
fn path_tokens_match_whole_field_paths_only() {
    let tokens = path_tokens(
        r#"RetryPolicy/ns/orders dry-run failed (Invalid): RetryPolicy.rebound.dev "orders" is invalid: spec.maxAttempts: Invalid value: 0: spec.maxAttempts in body should be greater than or equal to 1"#,
    );
    assert!(tokens.contains(&"spec.maxAttempts"));
    assert!(!path_tokens("spec.maxAttemptsX is wrong").contains(&"spec.maxAttempts"));
    assert!(!path_tokens("spec.maxAttempts.inner").contains(&"spec.maxAttempts"));
}
