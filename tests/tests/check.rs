//! `rebound check` against the real API server: a healthy release and Pod pass (exit 0,
//! every verdict parsed from `-o json`); a Pod on an old sidecar image, a stale fleet
//! Lease, a sidecar behind the operator's configuration and a missing injection policy are
//! each named, with exit code 1.
//!
//! There is no kubelet: Pods are API objects, and the Leases and the operator's status are
//! written as the sidecars and the Deployment controller would write them; the last test
//! runs a real operator and a real sidecar in watch mode for one such Pod instead. Each run uses
//! a release of its own (name and namespace), so nothing of another test is looked at.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use rebound_test_support::{eventually, free_port, workspace_binary};
use rebound_tests::helm::{Helm, chart_dir, manifests};
use rebound_tests::process::Running;
use rebound_tests::{TestEnv, unique_name};
use serde_json::{Value, json};

const NEW_IMAGE: &str = "example/rebound-sidecar:2.0";
const OLD_IMAGE: &str = "example/rebound-sidecar:1.0";

/// Server-side apply of `object` (a JSON manifest) as the test's field manager.
async fn apply(client: &kube::Client, object: &Value) -> Result<()> {
    let kind = object["kind"].as_str().context("no kind")?;
    let (group, version) = match object["apiVersion"].as_str().context("no apiVersion")? {
        v if v.contains('/') => v.split_once('/').context("apiVersion")?,
        v => ("", v),
    };
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let plural = match kind {
        k if k.ends_with('y') => format!("{}ies", k.trim_end_matches('y').to_lowercase()),
        k => format!("{}s", k.to_lowercase()),
    };
    let resource = ApiResource::from_gvk_with_plural(&gvk, &plural);
    let name = object["metadata"]["name"].as_str().context("no name")?;
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    api.patch(
        name,
        &PatchParams::apply("rebound-tests").force(),
        &Patch::Apply(object),
    )
    .await
    .with_context(|| format!("applying {kind} {name}"))?;
    Ok(())
}

/// The release: the chart's admission policies, a stand-in injection policy, the
/// parameters, and an operator Deployment and Lease as a running one leaves them.
async fn install(client: &kube::Client, release: &str, ns: &str) -> Result<()> {
    let rendered = Helm::get()?
        // Not the chart's injection policies: they bind cluster-wide, and the shared
        // cluster's other tests admit annotated Pods (stand-ins below).
        .template(
            release,
            &chart_dir("rebound"),
            ns,
            &[],
            &["injection.enabled=false".to_owned()],
        )?
        .ok()?;
    for object in manifests(&rendered.stdout)? {
        let kind = object["kind"].as_str().unwrap_or_default();
        if kind.starts_with("ValidatingAdmissionPolicy") {
            apply(client, &object).await?;
        }
    }
    // Stand-ins for the chart's injection policies, by the names `rebound inject
    // --admission-policy` gives them, with a match condition that is never true: the
    // shared cluster's other tests admit annotated Pods through policies of their own.
    for (kind, name) in rebound_cli::inject::policy_names(&format!("{release}-sidecar")) {
        let mutating = kind.starts_with("Mutating");
        let mut spec = json!({
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE"], "resources": ["pods"]}]},
            "matchConditions": [{"name": "never", "expression": "false"}],
        });
        let mut binding = json!({"policyName": name});
        if mutating {
            spec["paramKind"] = json!({"apiVersion": "v1", "kind": "ConfigMap"});
            spec["reinvocationPolicy"] = json!("Never");
            spec["mutations"] = json!([{"patchType": "ApplyConfiguration",
                "applyConfiguration": {"expression": "Object{}"}}]);
            binding["paramRef"] = json!({"name": "rebound-injection", "namespace": ns,
                "parameterNotFoundAction": "Allow"});
        } else {
            spec["validations"] = json!([{"expression": "true"}]);
            binding["validationActions"] = json!(["Deny"]);
        }
        let labels = json!({"app.kubernetes.io/instance": release});
        apply(
            client,
            &json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                "metadata": {"name": name, "labels": labels}, "spec": spec,
            }),
        )
        .await?;
        apply(
            client,
            &json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": format!("{kind}Binding"),
                "metadata": {"name": name, "labels": labels}, "spec": binding,
            }),
        )
        .await?;
    }
    apply(
        client,
        &json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "rebound-injection", "namespace": ns},
            "data": {"image": NEW_IMAGE, "configMapName": "rebound-policies"},
        }),
    )
    .await?;

    let operator = format!("{release}-operator");
    let labels = json!({"app.kubernetes.io/name": "rebound-operator"});
    apply(
        client,
        &json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": operator, "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "operator", "image": "example/operator:1"}]}}},
        }),
    )
    .await?;
    // What the Deployment controller reports once the replica is Ready.
    Api::<Deployment>::namespaced(client.clone(), ns)
        .patch_status(
            &operator,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"replicas": 1, "readyReplicas": 1}})),
        )
        .await?;
    lease(client, ns, &operator, Timestamp::now(), None, None).await
}

/// A Lease renewed at `renewed`, live for an hour (so no test is about timing), with the
/// sidecar's labels and configuration hash when `configmap` is given.
async fn lease(
    client: &kube::Client,
    ns: &str,
    name: &str,
    renewed: Timestamp,
    configmap: Option<&str>,
    hash: Option<&str>,
) -> Result<()> {
    let mut body = Lease::default();
    body.metadata.name = Some(name.to_owned());
    if let Some(cm) = configmap {
        body.metadata.labels = Some(rebound_tests::lease::labels(cm));
    }
    if let Some(h) = hash {
        body.metadata.annotations =
            Some([("rebound.dev/config-hash".to_owned(), h.to_owned())].into());
    }
    body.spec = Some(LeaseSpec {
        holder_identity: Some(name.to_owned()),
        lease_duration_seconds: Some(3600),
        renew_time: Some(MicroTime(renewed)),
        ..LeaseSpec::default()
    });
    let mut value = serde_json::to_value(&body)?;
    value["apiVersion"] = json!("coordination.k8s.io/v1");
    value["kind"] = json!("Lease");
    value["metadata"]["namespace"] = json!(ns);
    apply(client, &value).await
}

/// A workload namespace: its RoleBinding, the compiled ConfigMap (hash `h-2`), and one
/// injected Pod per `(name, image, lease renewed at, hash loaded)`.
async fn workload(
    env: &TestEnv,
    prefix: &str,
    pods: &[(&str, &str, Timestamp, &str)],
) -> Result<String> {
    let client = &env.client;
    let ns = env.cluster.create_namespace(client, prefix).await?;
    apply(client, &json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "rebound-sidecar", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rebound-sidecar"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
            "name": format!("system:serviceaccounts:{ns}")}],
    }))
    .await?;
    apply(
        client,
        &json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "rebound-policies", "namespace": ns,
                "annotations": {"rebound.dev/hash": "h-2"}},
            "data": {"policies.json": "{}"},
        }),
    )
    .await?;
    for (pod, image, renewed, hash) in pods {
        apply(client, &json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {"rebound.dev/injected": "true"}},
            "spec": {
                "automountServiceAccountToken": false,
                "initContainers": [{"name": "rebound-sidecar", "image": image, "restartPolicy": "Always"}],
                "containers": [{"name": "worker", "image": "example/worker:1.0"}],
            },
        }))
        .await?;
        let name = format!("rebound-sidecar-{pod}");
        lease(
            client,
            &ns,
            &name,
            *renewed,
            Some("rebound-policies"),
            Some(hash),
        )
        .await?;
    }
    Ok(ns)
}

/// Deletes the release's cluster-wide objects (admission policies and bindings, all
/// labelled with the release) when the test ends, whatever happens.
struct Release {
    cluster: &'static rebound_tests::Cluster,
    name: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        let kinds = "validatingadmissionpolicybindings,validatingadmissionpolicies,\
                     mutatingadmissionpolicybindings,mutatingadmissionpolicies";
        let selector = format!("app.kubernetes.io/instance={}", self.name);
        let _ = self
            .cluster
            .kubectl(["delete", kinds, "-l", &selector, "--ignore-not-found"]);
    }
}

/// `rebound check ARGS -o json`: exit code and the parsed report.
fn check(env: &TestEnv, release: &str, release_ns: &str, args: &[&str]) -> Result<(i32, Value)> {
    let out = Command::new(workspace_binary("rebound")?)
        .args([
            "check",
            "--release",
            release,
            "--release-namespace",
            release_ns,
            "-o",
            "json",
        ])
        .args(args)
        .arg("--kubeconfig")
        .arg(env.cluster.kubeconfig())
        .output()?;
    let code = out.status.code().context("killed by a signal")?;
    let report: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "not JSON (exit {code}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((code, report))
}

/// The verdict of `check` on `object`.
fn verdict<'a>(report: &'a Value, check: &str, object: &str) -> Result<&'a Value> {
    report["checks"]
        .as_array()
        .context("no checks")?
        .iter()
        .find(|v| v["check"] == check && v["object"] == object)
        .with_context(|| format!("no {check} verdict on {object} in {report:#}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn check_passes_a_healthy_release_and_names_what_is_wrong() -> Result<()> {
    let env = TestEnv::new("check-release").await?;
    let release = unique_name("chk");
    let rns = env.namespace.clone();
    let _release = Release {
        cluster: env.cluster,
        name: release.clone(),
    };
    install(&env.client, &release, &rns).await?;
    let now = Timestamp::now();
    let healthy = workload(&env, "check-ok", &[("current", NEW_IMAGE, now, "h-2")]).await?;
    let old = workload(&env, "check-old", &[("old", OLD_IMAGE, now, "h-2")]).await?;
    let an_hour_ago = now - SignedDuration::from_secs(7200);
    let stale = workload(
        &env,
        "check-stale",
        &[
            ("stale", NEW_IMAGE, an_hour_ago, "h-2"),
            ("behind", NEW_IMAGE, now, "h-1"),
        ],
    )
    .await?;

    let (code, report) = check(&env, &release, &rns, &["-n", &healthy])?;
    ensure!(code == 0, "healthy: exit {code}: {report:#}");
    ensure!(
        report["ok"] == true && report["summary"]["fail"] == 0,
        "{report:#}"
    );
    let pod = format!("pod/{healthy}/current");
    for (name, object) in [
        (
            "crd",
            "customresourcedefinition/retrypolicies.rebound.dev".to_owned(),
        ),
        (
            "operator.ready",
            format!("deployment/{rns}/{release}-operator"),
        ),
        ("operator.leader", format!("lease/{rns}/{release}-operator")),
        (
            "admission.inject",
            format!("mutatingadmissionpolicy/{release}-sidecar-inject"),
        ),
        (
            "admission.configmaps",
            format!("validatingadmissionpolicy/{release}-operator-configmaps"),
        ),
        (
            "admission.leases",
            format!("validatingadmissionpolicy/{release}-sidecar-leases"),
        ),
        (
            "admission.rolebindings",
            format!("validatingadmissionpolicy/{release}-operator-rolebindings"),
        ),
        ("parameters", format!("configmap/{rns}/rebound-injection")),
        ("pod.image", pod.clone()),
        ("pod.lease", pod.clone()),
        ("pod.config", pod.clone()),
    ] {
        let v = verdict(&report, name, &object)?;
        ensure!(v["status"] == "ok", "{name}: {v:#}");
    }

    let (code, report) = check(&env, &release, &rns, &["-n", &old])?;
    ensure!(code == 1, "old image: exit {code}");
    let v = verdict(&report, "pod.image", &format!("pod/{old}/old"))?;
    ensure!(
        v["status"] == "fail" && v["expected"] == NEW_IMAGE && v["actual"] == OLD_IMAGE,
        "{v:#}"
    );

    let (code, report) = check(&env, &release, &rns, &["-n", &stale])?;
    ensure!(code == 1, "stale Lease: exit {code}");
    let v = verdict(&report, "pod.lease", &format!("pod/{stale}/stale"))?;
    ensure!(v["status"] == "fail", "{v:#}");
    let v = verdict(&report, "pod.config", &format!("pod/{stale}/behind"))?;
    ensure!(
        v["status"] == "fail" && v["expected"] == "h-2" && v["actual"] == "h-1",
        "{v:#}"
    );
    let v = verdict(&report, "pod.lease", &format!("pod/{stale}/behind"))?;
    ensure!(v["status"] == "ok", "{v:#}");

    // -A: every namespace's injected Pods (others' too; only ours are looked at).
    let (code, report) = check(&env, &release, &rns, &["-A"])?;
    ensure!(code == 1, "-A: exit {code}");
    for object in [
        pod.clone(),
        format!("pod/{old}/old"),
        format!("pod/{stale}/stale"),
    ] {
        verdict(&report, "pod.image", &object)?;
    }

    // No injection policy: named, and the healthy namespace fails too.
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "MutatingAdmissionPolicy",
        ),
        "mutatingadmissionpolicies",
    );
    Api::<DynamicObject>::all_with(env.client.clone(), &resource)
        .delete(&format!("{release}-sidecar-inject"), &Default::default())
        .await?;
    let (code, report) = check(&env, &release, &rns, &["-n", &healthy])?;
    ensure!(code == 1, "no policy: exit {code}");
    let v = verdict(
        &report,
        "admission.inject",
        &format!("mutatingadmissionpolicy/{release}-sidecar-inject"),
    )?;
    ensure!(v["status"] == "fail", "{v:#}");
    ensure!(
        report["ok"] == false && report["summary"]["fail"] == 1,
        "{report:#}"
    );
    Ok(())
}

fn spawn(env: &TestEnv, binary: &str, args: &[String]) -> Result<Running> {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    Running::workspace_binary(binary, env.cluster.kubeconfig(), args, logs)
}

fn policy(base: &str) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: orders}}\nspec:\n  queues: [orders]\n  backoff: {{strategy: constant, base: {base}, jitter: {{kind: none}}}}\n  maxAttempts: 5\n"
    )
}

/// Waits until `rebound check -n NS` passes with the Pod serving the ConfigMap's hash
/// `not` is not; returns that hash.
async fn passes(env: &TestEnv, release: &str, rns: &str, ns: &str, not: &str) -> Result<String> {
    let object = format!("pod/{ns}/worker");
    eventually(
        "rebound check to pass on the live sidecar",
        Duration::from_secs(60),
        || async {
            let (code, report) = check(env, release, rns, &["-n", ns])?;
            let v = verdict(&report, "pod.config", &object)?;
            let hash = v["actual"].as_str().unwrap_or_default().to_owned();
            Ok(
                (code == 0 && v["status"] == "ok" && !hash.is_empty() && hash != not)
                    .then_some(hash),
            )
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_sidecar_publishes_the_configuration_it_serves() -> Result<()> {
    let env = TestEnv::new("check-live").await?;
    let release = unique_name("chk");
    let rns = env.namespace.clone();
    let _release = Release {
        cluster: env.cluster,
        name: release.clone(),
    };
    install(&env.client, &release, &rns).await?;
    let ns = env
        .cluster
        .create_namespace(&env.client, "check-live-w")
        .await?;
    env.cluster
        .kubectl_stdin(["-n", &ns, "apply", "-f", "-"], &policy("1s"))?
        .ok()?;
    apply(&env.client, &json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "worker", "namespace": ns, "labels": {"rebound.dev/injected": "true"}},
        "spec": {
            "automountServiceAccountToken": false,
            "initContainers": [{"name": "rebound-sidecar", "image": NEW_IMAGE, "restartPolicy": "Always"}],
            "containers": [{"name": "worker", "image": "example/worker:1.0"}],
        },
    }))
    .await?;
    // The operator compiles and binds; the sidecar of Pod "worker" serves and holds its Lease.
    let _operator = spawn(
        &env,
        "rebound-operator",
        &[
            format!("--namespaces={ns}"),
            "--leader-elect=false".into(),
            format!("--metrics-addr={}", free_port()?),
            "--sidecar-cluster-role=rebound-sidecar".into(),
        ],
    )?;
    let _sidecar = spawn(
        &env,
        "rebound-sidecar",
        &[
            format!("--configmap={ns}/rebound-policies"),
            "--pod-name=worker".into(),
            format!("--listen={}", free_port()?),
            "--no-admin".into(),
        ],
    )?;

    let first = passes(&env, &release, &rns, &ns, "").await?;
    // A policy change: the operator's new hash, and the sidecar's Lease following it.
    env.cluster
        .kubectl_stdin(["-n", &ns, "apply", "-f", "-"], &policy("2s"))?
        .ok()?;
    let second = passes(&env, &release, &rns, &ns, &first).await?;
    let configmap: k8s_openapi::api::core::v1::ConfigMap = Api::namespaced(env.client.clone(), &ns)
        .get("rebound-policies")
        .await?;
    let latest = configmap
        .metadata
        .annotations
        .unwrap_or_default()
        .remove("rebound.dev/hash");
    ensure!(
        latest.as_deref() == Some(second.as_str()),
        "{latest:?} != {second}"
    );
    Ok(())
}
