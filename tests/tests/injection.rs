//! Sidecar injection on the real API server: the admission policies that `rebound inject
//! --admission-policy` generates, fed a table of Pods, give field for field what `rebound
//! inject` writes for the same Pods (both created by server-side dry-run, so both get the
//! server's defaults). Pods not asking, and Pods in excluded namespaces, are admitted as
//! submitted; malformed overrides are refused naming the annotation. The real sidecar
//! binary, started with an injected Pod's arguments, serves `/metrics` beyond loopback
//! exactly when the Pod asks.

use anyhow::{Context as _, Result, bail, ensure};
use rebound_tests::injection::{Installed, cli_inject, comparable, create_pod, differences};
use rebound_tests::process::Running;
use rebound_tests::{TestEnv, json_contains};
use serde_json::{Value, json};

const IMAGE: &str = "rebound.dev/sidecar-under-test:1";

/// The policies are cluster-wide and point at one parameter namespace: one test at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn pod(name: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations, "labels": {"app": "worker"}},
        // The ServiceAccount admission plugin sets this on a real cluster; the test
        // cluster runs without it, and a projected token needs it.
        "spec": {
            "serviceAccountName": "default",
            "containers": [{"name": "worker", "image": "worker:1"}]
        }
    })
}

fn on(name: &str, extra: Value) -> Value {
    let mut annotations = json!({"rebound.dev/inject": "true"});
    if let (Some(a), Some(e)) = (annotations.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    pod(name, annotations)
}

/// The table: (case, Pod, injected?).
fn cases() -> Vec<(&'static str, Value, bool)> {
    let mut own_init = on("own-init", json!({}));
    own_init["spec"]["initContainers"] = json!([{"name": "migrate", "image": "migrate:1"}]);
    let mut own_volumes = on("own-volumes", json!({}));
    own_volumes["spec"]["volumes"] = json!([{"name": "data", "emptyDir": {}}]);
    own_volumes["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "data", "mountPath": "/data"}]);
    let mut own_target = on("own-target", json!({}));
    own_target["spec"]["containers"][0]["env"] =
        json!([{"name": "A", "value": "1"}, {"name": "REBOUND_TARGET", "value": "10.0.0.9:7411"}]);
    let mut two = on("two-containers", json!({}));
    two["spec"]["containers"] = json!([
        {"name": "worker", "image": "worker:1", "env": [{"name": "A", "value": "1"}]},
        {"name": "helper", "image": "helper:1"}
    ]);
    let mut bare = on("no-labels", json!({}));
    if let Some(meta) = bare["metadata"].as_object_mut() {
        meta.remove("labels");
    }
    vec![
        ("plain", on("plain", json!({})), true),
        ("own init containers", own_init, true),
        ("own volumes", own_volumes, true),
        ("existing REBOUND_TARGET", own_target, true),
        ("two app containers", two, true),
        ("no labels", bare, true),
        (
            "mode file",
            on("mode-file", json!({"rebound.dev/mode": "file"})),
            true,
        ),
        (
            "mode watch",
            on("mode-watch", json!({"rebound.dev/mode": "watch"})),
            true,
        ),
        (
            "configmap",
            on(
                "configmap",
                json!({"rebound.dev/configmap": "other-policies"}),
            ),
            true,
        ),
        (
            "cpu",
            on("cpu", json!({"rebound.dev/sidecar-cpu-request": "25m"})),
            true,
        ),
        (
            "memory request",
            on(
                "mem-req",
                json!({"rebound.dev/sidecar-memory-request": "24Mi"}),
            ),
            true,
        ),
        (
            "memory limit",
            on(
                "mem-limit",
                json!({"rebound.dev/sidecar-memory-limit": "96Mi"}),
            ),
            true,
        ),
        (
            "log level",
            on("log-level", json!({"rebound.dev/log-level": "debug"})),
            true,
        ),
        (
            "transport tcp",
            on("tcp", json!({"rebound.dev/transport": "tcp"})),
            true,
        ),
        (
            "metrics on",
            on("metrics-on", json!({"rebound.dev/metrics": "true"})),
            true,
        ),
        (
            "metrics off",
            on("metrics-off", json!({"rebound.dev/metrics": "false"})),
            true,
        ),
        (
            "opt-out",
            pod("opt-out", json!({"rebound.dev/inject": "false"})),
            false,
        ),
        (
            "not annotated",
            pod("not-annotated", json!({"team": "a"})),
            false,
        ),
    ]
}

/// What the API server admits for `pod`, next to what it admits for the CLI's output.
async fn admitted_pair(
    env: &TestEnv,
    namespace: &str,
    installed: &Installed<'_>,
    pod: &Value,
    cli_args: &[&str],
) -> Result<(Value, Value, Value)> {
    let rendered = cli_inject(pod, installed.params_file.path(), cli_args)?;
    let by_policy = create_pod(&env.client, namespace, pod, true).await?;
    let by_cli = create_pod(&env.client, namespace, &rendered, true).await?;
    Ok((rendered, comparable(by_policy), comparable(by_cli)))
}

fn is_injected(pod: &Value) -> bool {
    pod.pointer("/spec/initContainers/0/name") == Some(&json!("rebound-sidecar"))
}

/// Whether the injected sidecar serves `/metrics` on its admin port (the Pod IP).
fn serves_metrics(pod: &Value) -> bool {
    pod.pointer("/spec/initContainers/0/args")
        .and_then(Value::as_array)
        .is_some_and(|args| args.iter().any(|a| a == "--metrics-beyond-loopback"))
}

/// The cases of the parameter `metrics`: (case, Pod, serves /metrics?) with the parameter
/// off (the default) and on.
fn metrics_cases(param: bool) -> Vec<(&'static str, Value, bool)> {
    vec![
        ("no annotation", on("metrics-default", json!({})), param),
        (
            "annotation true",
            on("metrics-true", json!({"rebound.dev/metrics": "true"})),
            true,
        ),
        (
            "annotation false",
            on("metrics-false", json!({"rebound.dev/metrics": "false"})),
            false,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn the_policy_injects_exactly_what_the_cli_renders() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = TestEnv::new("inject").await?;
    let system = env
        .cluster
        .create_namespace(&env.client, "inject-system")
        .await?;
    let mut installed = Installed::apply(env.cluster, &system, IMAGE)?;
    installed
        .wait_until_in_effect(&env.client, &env.namespace)
        .await?;

    let mut failures = Vec::new();
    for (case, pod, injected) in cases() {
        let (rendered, by_policy, by_cli) =
            admitted_pair(&env, &env.namespace, &installed, &pod, &[]).await?;
        let diff = differences(&by_policy, &by_cli);
        if !diff.is_empty() {
            failures.push(format!("{case}: policy vs CLI:\n  {}", diff.join("\n  ")));
        }
        if is_injected(&by_policy) != injected {
            failures.push(format!(
                "{case}: injected {}, expected {injected}",
                !injected
            ));
        }
        if !injected {
            // Left alone: the CLI writes the input back, the server keeps every field.
            ensure!(
                rendered == pod,
                "{case}: the CLI changed a Pod it must not inject"
            );
            ensure!(
                json_contains(&by_policy, &pod),
                "{case}: admission changed the Pod"
            );
            ensure!(
                by_policy
                    .pointer("/metadata/labels/rebound.dev~1injected")
                    .is_none(),
                "{case}: labelled as injected"
            );
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));

    // The parameter `metrics`, off (the chart's default) then on, and the annotation
    // overriding it either way: the flag is there exactly when asked, policy and CLI alike.
    for param in [false, true] {
        if param {
            installed.set_param(IMAGE, "metrics", "true")?;
            wait_for_metrics_param(&env).await?;
        }
        for (case, pod, expected) in metrics_cases(param) {
            let (_, by_policy, by_cli) =
                admitted_pair(&env, &env.namespace, &installed, &pod, &[]).await?;
            let diff = differences(&by_policy, &by_cli);
            if !diff.is_empty() {
                failures.push(format!(
                    "parameter {param}, {case}: policy vs CLI:\n  {}",
                    diff.join("\n  ")
                ));
            }
            if serves_metrics(&by_policy) != expected {
                failures.push(format!(
                    "parameter {param}, {case}: --metrics-beyond-loopback {}, expected {expected}",
                    !expected
                ));
            }
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));

    // Injected once only: the admitted Pod, submitted again, comes back as it went in.
    let once = create_pod(&env.client, &env.namespace, &on("again", json!({})), true).await?;
    let mut resubmit = comparable(once.clone());
    if let Some(status) = resubmit.as_object_mut() {
        status.remove("status");
    }
    let twice = comparable(create_pod(&env.client, &env.namespace, &resubmit, true).await?);
    let diff = differences(&comparable(once), &twice);
    ensure!(diff.is_empty(), "injected twice:\n  {}", diff.join("\n  "));
    Ok(())
}

/// Until the API server's copy of the parameters has `metrics: "true"` (its informer
/// follows the ConfigMap within about a second).
async fn wait_for_metrics_param(env: &TestEnv) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let probe = create_pod(&env.client, &env.namespace, &on("probe", json!({})), true).await?;
        if serves_metrics(&probe) {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the parameter metrics=true did not reach the policy within 30s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn namespace_label_injects_and_excluded_namespaces_are_untouched() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = TestEnv::new("inject-ns").await?;
    let system = env
        .cluster
        .create_namespace(&env.client, "inject-system")
        .await?;
    let installed = Installed::apply(env.cluster, &system, IMAGE)?;
    installed
        .wait_until_in_effect(&env.client, &env.namespace)
        .await?;
    env.cluster
        .kubectl([
            "label",
            "namespace",
            &env.namespace,
            "rebound.dev/inject=enabled",
        ])?
        .ok()?;

    // The namespace label injects a Pod without the annotation, as `--enable` does.
    let plain = pod("by-namespace", json!({"team": "a"}));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (by_policy, by_cli) = loop {
        // Until the label reaches both bindings' namespace selectors.
        let pair = admitted_pair(&env, &env.namespace, &installed, &plain, &["--enable"]).await;
        match pair {
            Ok((_, by_policy, by_cli)) if is_injected(&by_policy) => break (by_policy, by_cli),
            Ok(_) | Err(_) if std::time::Instant::now() < deadline => {}
            Ok((_, by_policy, by_cli)) => break (by_policy, by_cli),
            Err(e) => return Err(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    };
    let diff = differences(&by_policy, &by_cli);
    ensure!(
        diff.is_empty(),
        "namespace label: policy vs CLI:\n  {}",
        diff.join("\n  ")
    );
    ensure!(
        is_injected(&by_policy),
        "the namespace label did not inject"
    );
    let out = pod("opted-out", json!({"rebound.dev/inject": "false"}));
    let admitted = create_pod(&env.client, &env.namespace, &out, true).await?;
    ensure!(!is_injected(&admitted), "the opt-out was injected");

    // Never in kube-system nor in Rebound's own namespace, annotation or not.
    for namespace in ["kube-system", system.as_str()] {
        let asked = on("excluded", json!({}));
        let admitted = create_pod(&env.client, namespace, &asked, true).await?;
        ensure!(!is_injected(&admitted), "injected in {namespace}");
        ensure!(json_contains(&admitted, &asked), "changed in {namespace}");
    }
    drop(installed);
    Ok(())
}

/// The refusal's message as Kubernetes documents a ValidatingAdmissionPolicy denial:
/// `<resource> "<name>" is forbidden: ValidatingAdmissionPolicy '<policy>' with binding
/// '<binding>' denied request: <message>`.
fn denial(err: kube::Error) -> Result<(String, String)> {
    let kube::Error::Api(status) = err else {
        bail!("not a refusal by the API: {err}");
    };
    let (prefix, message) = status
        .message
        .split_once(" denied request: ")
        .with_context(|| format!("not an admission policy denial: {}", status.message))?;
    let policy = prefix
        .split_once("ValidatingAdmissionPolicy '")
        .and_then(|(_, p)| p.split('\'').next())
        .with_context(|| format!("not a ValidatingAdmissionPolicy: {prefix}"))?;
    let annotation = message
        .split_once(": ")
        .map(|(a, _)| a.to_owned())
        .with_context(|| format!("no annotation in {message:?}"))?;
    Ok((policy.to_owned(), annotation))
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_overrides_are_refused_naming_the_annotation() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = TestEnv::new("inject-bad").await?;
    let system = env
        .cluster
        .create_namespace(&env.client, "inject-system")
        .await?;
    let installed = Installed::apply(env.cluster, &system, IMAGE)?;
    installed
        .wait_until_in_effect(&env.client, &env.namespace)
        .await?;
    for (key, value) in [
        ("rebound.dev/inject", "enabled"),
        ("rebound.dev/mode", "push"),
        ("rebound.dev/configmap", "Not_A_Name"),
        ("rebound.dev/sidecar-cpu-request", "lots"),
        ("rebound.dev/sidecar-memory-request", "16MB"),
        ("rebound.dev/sidecar-memory-limit", "-64Mi"),
        ("rebound.dev/log-level", "loud"),
        ("rebound.dev/transport", "udp"),
        ("rebound.dev/metrics", "yes"),
        ("rebound.dev/sidecar-cpu", "10m"),
    ] {
        let bad = on("bad", json!({key: value}));
        let err = match create_pod(&env.client, &env.namespace, &bad, true).await {
            Ok(_) => bail!("{key}={value:?} was admitted"),
            Err(e) => e,
        };
        let (policy, annotation) = denial(err)?;
        ensure!(
            policy == "rebound-sidecar-inject-overrides",
            "{key}: denied by {policy}"
        );
        ensure!(
            annotation == key,
            "{key}={value:?}: the refusal names {annotation}"
        );
        // The CLI refuses it too, naming the same annotation.
        let cli = cli_inject(&bad, installed.params_file.path(), &[]);
        let message = cli.err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(
            message.split(": ").any(|part| part == key),
            "{key}: the CLI said {message:?}"
        );
    }

    // Without the parameters, annotated Pods are refused (naming the annotation and the
    // missing ConfigMap) and others still admitted.
    installed.delete_params(&system)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match create_pod(
            &env.client,
            &env.namespace,
            &on("no-params", json!({})),
            true,
        )
        .await
        {
            Err(e) => {
                let (policy, annotation) = denial(e)?;
                ensure!(
                    policy == "rebound-sidecar-inject-overrides",
                    "denied by {policy}"
                );
                ensure!(
                    annotation == "rebound.dev/inject",
                    "the refusal names {annotation}"
                );
                break;
            }
            Ok(_) if std::time::Instant::now() > deadline => {
                bail!("an annotated Pod was admitted without the parameters")
            }
            Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(250)).await,
        }
    }
    let other = pod("other", json!({"team": "a"}));
    let admitted = create_pod(&env.client, &env.namespace, &other, true).await?;
    ensure!(
        json_contains(&admitted, &other),
        "a Pod not asking was changed"
    );
    Ok(())
}

/// What `GET /metrics` on the admin port gets from the real sidecar binary started with
/// the arguments and environment of `container` (a file-mode sidecar): the kubelet's
/// `$(POD_IP)` expanded to 0.0.0.0 (beyond loopback, like a Pod IP, and reachable here on
/// 127.0.0.1), the port and the Pod's paths moved into a temporary directory.
fn scrape_sidecar(container: &Value) -> Result<rebound_test_support::HttpResponse> {
    let tmp = tempfile::tempdir()?;
    let policies = tmp.path().join("policies");
    std::fs::create_dir(&policies)?;
    let admin = rebound_test_support::free_port()?;
    let args: Vec<String> = container["args"]
        .as_array()
        .context("no args")?
        .iter()
        .filter_map(Value::as_str)
        .map(|a| {
            a.replace("$(POD_IP):7412", &format!("0.0.0.0:{}", admin.port()))
                .replace("/etc/rebound", &policies.display().to_string())
                .replace("/run/rebound", &tmp.path().display().to_string())
        })
        .collect();
    let env: Vec<(String, String)> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_owned(),
                e["value"].as_str()?.to_owned(),
            ))
        })
        .collect();
    let _sidecar = Running(
        std::process::Command::new(rebound_test_support::workspace_binary("rebound-sidecar")?)
            .args(&args)
            .envs(env)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    );
    rebound_test_support::eventually_blocking(
        "the sidecar's admin port",
        std::time::Duration::from_secs(30),
        || Ok(rebound_test_support::http_get(admin, "/metrics").ok()),
    )
}

/// The sidecar of a Pod injected in file mode with these annotations, scraped.
fn scrape_injected_sidecar(annotations: Value) -> Result<rebound_test_support::HttpResponse> {
    let params = tempfile::NamedTempFile::new()?;
    std::fs::write(
        params.path(),
        serde_json::to_string(&rebound_tests::injection::params("rebound-system", IMAGE))?,
    )?;
    let mut annotations = annotations;
    annotations["rebound.dev/inject"] = json!("true");
    annotations["rebound.dev/mode"] = json!("file");
    let injected = cli_inject(&pod("scraped", annotations), params.path(), &[])?;
    scrape_sidecar(&injected["spec"]["initContainers"][0])
}

/// An OpenMetrics answer with the sidecar's configuration state (none: no policies).
fn serves_openmetrics(response: &rebound_test_support::HttpResponse) -> Result<()> {
    ensure!(
        response
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/openmetrics-text")),
        "content type {:?}",
        response.header("content-type")
    );
    let state = response
        .clone()
        .ok()?
        .lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(name, _)| *name == "rebound_sidecar_config_state{state=\"none\"}")
        .and_then(|(_, v)| v.trim().parse::<f64>().ok());
    ensure!(state == Some(1.0), "config state sample {state:?}");
    Ok(())
}

/// The sidecar an injected Pod gets serves `/metrics` on its Pod IP when the annotation
/// (or the parameter) asks, and only health there otherwise; the hand-written sidecar of
/// `examples/worker/worker.yaml` (what the hand-written PodMonitor selects) serves it.
#[test]
fn the_injected_sidecar_serves_metrics_beyond_loopback_exactly_when_asked() -> Result<()> {
    let on = scrape_injected_sidecar(json!({"rebound.dev/metrics": "true"}))?;
    serves_openmetrics(&on).context("metrics on")?;
    // Off (the default): the gRPC router answers the path, no metrics.
    let off = scrape_injected_sidecar(json!({}))?;
    ensure!(
        off.header("content-type") == Some("application/grpc"),
        "metrics off: content type {:?}",
        off.header("content-type")
    );

    let file = "examples/worker/worker.yaml";
    let deployment = rebound_tests::yaml_documents(&rebound_tests::repo_root().join(file))?
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .with_context(|| format!("no Deployment in {file}"))?;
    let sidecar = &deployment["spec"]["template"]["spec"]["initContainers"][0];
    serves_openmetrics(&scrape_sidecar(sidecar)?).context(file)?;
    Ok(())
}
