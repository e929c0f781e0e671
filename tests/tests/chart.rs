//! The Helm charts: `helm lint --strict` and a server-side dry-run for every values file of
//! the test matrix (`charts/*/ci/`), what the values schema rejects, what each setting
//! renders, and the drift checks against `crds/` and `deploy/`.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod};
use kube::api::PostParams;
use rebound_tests::helm::{
    Helm, chart_dir, ci_values, find, manifests, object_key, schema_violations, template_failure,
};
use rebound_tests::kubelet::{move_flags, resolve, start_as};
use rebound_tests::{
    TestEnv, json_contains, repo_root, retry_policy_crd_file, unique_name, yaml_documents,
};
use serde_json::{Value, json};

const CHARTS: [&str; 2] = ["rebound-crds", "rebound"];

/// The default values, then every `ci/*-values.yaml`.
fn matrix(chart: &str) -> Result<Vec<Option<PathBuf>>> {
    let mut all = vec![None];
    all.extend(ci_values(chart)?.into_iter().map(Some));
    Ok(all)
}

fn render(
    chart: &str,
    namespace: &str,
    values: Option<&PathBuf>,
    sets: &[&str],
) -> Result<Vec<Value>> {
    let values: Vec<PathBuf> = values.into_iter().cloned().collect();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let out = Helm::get()?
        .template("rebound", &chart_dir(chart), namespace, &values, &sets)?
        .ok()
        .with_context(|| format!("helm template {chart} {values:?} {sets:?}"))?;
    manifests(&out.stdout)
}

fn render_sets(sets: &[&str]) -> Result<Vec<Value>> {
    render("rebound", "rebound-system", None, sets)
}

fn kinds(objects: &[Value]) -> Vec<String> {
    let mut k: Vec<String> = objects.iter().map(object_key).collect();
    k.sort();
    k
}

fn container(objects: &[Value]) -> Result<&Value> {
    let dep = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .context("no Deployment rendered")?;
    dep.pointer("/spec/template/spec/containers/0")
        .context("the Deployment has no container")
}

fn args(objects: &[Value]) -> Result<Vec<String>> {
    Ok(container(objects)?["args"]
        .as_array()
        .context("no args")?
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect())
}

#[test]
fn every_chart_lints_strictly_with_every_values_file() -> Result<()> {
    let helm = Helm::get()?;
    for chart in CHARTS {
        for values in matrix(chart)? {
            let mut cmd: Vec<std::ffi::OsString> =
                vec!["lint".into(), "--strict".into(), chart_dir(chart).into()];
            if let Some(v) = &values {
                cmd.extend(["--values".into(), v.into()]);
            }
            let out = helm.run(&cmd)?;
            ensure!(
                out.success(),
                "helm lint --strict {chart} {values:?}:\n{}{}",
                out.stdout,
                out.stderr
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_rendering_passes_a_server_side_dry_run() -> Result<()> {
    let env = TestEnv::new("chart-dry-run").await?;
    // The namespaces ci/watch-namespaces-values.yaml binds the operator in.
    for ns in ["team-a", "team-b"] {
        env.cluster
            .kubectl_stdin(
                ["apply", "-f", "-"],
                &format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n"),
            )?
            .ok()?;
    }
    // The Prometheus Operator kinds ci/monitoring-values.yaml renders.
    for kind in ["servicemonitor", "podmonitor", "prometheusrule"] {
        let crd = repo_root().join(format!("tests/fixtures/{kind}-crd.yaml"));
        env.cluster
            .kubectl(["apply", "--server-side", "-f", &crd.to_string_lossy()])?
            .ok()?;
        env.cluster
            .kubectl([
                "wait",
                "--for=condition=Established",
                &format!("crd/{kind}s.monitoring.coreos.com"),
                "--timeout=60s",
            ])?
            .ok()?;
    }

    for chart in CHARTS {
        for values in matrix(chart)? {
            let values: Vec<PathBuf> = values.into_iter().collect();
            let out = Helm::get()?
                .template("rebound", &chart_dir(chart), &env.namespace, &values, &[])?
                .ok()?;
            let rendered = manifests(&out.stdout)?;
            // Server-side apply, as `helm install` and GitOps tools write: the CRD is
            // larger than client-side apply's annotation allows.
            let applied = env
                .cluster
                .kubectl_stdin(
                    [
                        "apply",
                        "--server-side",
                        "--force-conflicts",
                        "--field-manager=rebound-chart-dry-run",
                        "--dry-run=server",
                        "-o",
                        "json",
                        "-f",
                        "-",
                    ],
                    &out.stdout,
                )?
                .ok()
                .with_context(|| format!("dry-run of {chart} {values:?}"))?;
            let answer: Value = serde_json::from_str(&applied.stdout)?;
            let items = match answer["kind"].as_str() {
                Some("List") => answer["items"].as_array().cloned().unwrap_or_default(),
                _ => vec![answer],
            };
            ensure!(
                kinds(&items) == kinds(&rendered),
                "{chart} {values:?}: the API server accepted {:?}, the chart rendered {:?}",
                kinds(&items),
                kinds(&rendered)
            );
        }
    }
    Ok(())
}

#[test]
fn the_schema_rejects_bad_values_naming_the_field() -> Result<()> {
    let helm = Helm::get()?;
    let chart = chart_dir("rebound");
    for (sets, pointer) in [
        (vec!["replicaCount=0"], "/replicaCount"),
        (vec!["replicaCount=two"], "/replicaCount"),
        (vec!["logFormat=yaml"], "/logFormat"),
        (vec!["watchNamespaces={Team_A}"], "/watchNamespaces/0"),
        (vec!["configMapName=Bad_Name"], "/configMapName"),
        (vec!["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (vec!["image.digest=latest"], "/image/digest"),
        (vec!["image.repository="], "/image/repository"),
        (vec!["metrics.port=70000"], "/metrics/port"),
        (vec!["resync=5 minutes"], "/resync"),
        (
            vec!["leaderElection.leaseDuration=1"],
            "/leaderElection/leaseDuration",
        ),
        (vec!["extraArgs={-v}"], "/extraArgs/0"),
        (
            vec!["metrics.serviceMonitor.interval=often"],
            "/metrics/serviceMonitor/interval",
        ),
        // Two replicas and no leader election would mean two writers.
        (
            vec!["replicaCount=2", "leaderElection.enabled=false"],
            "/leaderElection/enabled",
        ),
        (vec!["replicas=2"], ""),
    ] {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let out = helm.template("rebound", &chart, "rebound-system", &[], &sets)?;
        ensure!(!out.success(), "helm accepted {sets:?}");
        let violations = schema_violations(&out.stderr);
        ensure!(
            violations.iter().any(|v| v.pointer == pointer),
            "{sets:?}: expected a violation at {pointer:?}, helm said:\n{}",
            out.stderr
        );
        if pointer.is_empty() {
            // An unknown key is named in the message of the root's violation.
            let key = sets[0].split('=').next().unwrap_or_default();
            ensure!(
                violations
                    .iter()
                    .any(|v| v.message.contains(&format!("'{key}'"))),
                "{sets:?}: the message does not name {key}: {violations:?}"
            );
        }
    }
    // What the schema cannot express, the templates check.
    for (sets, field) in [
        (
            vec!["leaderElection.leaseGrace=15"],
            "leaderElection.leaseGrace",
        ),
        (
            vec![
                "metrics.serviceMonitor.enabled=true",
                "metrics.service.enabled=false",
            ],
            "metrics.serviceMonitor.enabled",
        ),
        (vec!["serviceAccount.create=false"], "serviceAccount.name"),
    ] {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let out = helm.template("rebound", &chart, "rebound-system", &[], &sets)?;
        ensure!(!out.success(), "helm accepted {sets:?}");
        let message = template_failure(&out.stderr)
            .with_context(|| format!("{sets:?}: no template failure in:\n{}", out.stderr))?;
        ensure!(
            message.starts_with(field),
            "{sets:?}: {message:?} does not start with {field}"
        );
    }
    Ok(())
}

#[test]
fn lease_rbac_and_the_pdb_follow_replicas_and_leader_election() -> Result<()> {
    for (sets, lease_rbac, pdb, leader_arg) in [
        (vec![], true, true, "--lease-name=rebound-operator"),
        (
            vec!["replicaCount=1"],
            true,
            false,
            "--lease-name=rebound-operator",
        ),
        (
            vec!["replicaCount=1", "leaderElection.enabled=false"],
            false,
            false,
            "--leader-elect=false",
        ),
        (
            vec!["replicaCount=3"],
            true,
            true,
            "--lease-name=rebound-operator",
        ),
    ] {
        let objects = render_sets(&sets)?;
        let has = |kind: &str, name: &str| find(&objects, kind, name).is_ok();
        ensure!(
            has("Role", "rebound-operator-leader-election") == lease_rbac
                && has("RoleBinding", "rebound-operator-leader-election") == lease_rbac,
            "{sets:?}: Lease RBAC expected {lease_rbac}: {:?}",
            kinds(&objects)
        );
        ensure!(
            has("PodDisruptionBudget", "rebound-operator") == pdb,
            "{sets:?}: PDB expected {pdb}"
        );
        let args = args(&objects)?;
        ensure!(
            args.iter().any(|a| a == leader_arg),
            "{sets:?}: {leader_arg} not in {args:?}"
        );
        // Leases cluster-wide: only read (the sidecars' membership); writes stay in the Role.
        let rules = &find(&objects, "ClusterRole", "rebound-operator")?["rules"];
        let lease_verbs: Vec<&Value> = rules
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["resources"] == json!(["leases"]))
            .map(|r| &r["verbs"])
            .collect();
        ensure!(
            lease_verbs == [&json!(["list", "watch"])],
            "the ClusterRole grants Leases: {rules}"
        );
    }
    Ok(())
}

/// The sidecars' ClusterRole grants exactly what the worker's Role in
/// examples/worker/worker-watch.yaml grants, and follows the ConfigMap name.
#[test]
fn sidecar_cluster_role_has_the_worker_role_rules() -> Result<()> {
    let example = yaml_documents(&repo_root().join("examples/worker/worker-watch.yaml"))?;
    let role = example
        .iter()
        .find(|d| d["kind"] == "Role")
        .context("no Role in examples/worker/worker-watch.yaml")?;
    let objects = render_sets(&[])?;
    ensure!(
        find(&objects, "ClusterRole", "rebound-sidecar")?["rules"] == role["rules"],
        "the chart's rebound-sidecar ClusterRole differs from the example's Role"
    );
    let renamed = render_sets(&["configMapName=team-policies"])?;
    let rules = &find(&renamed, "ClusterRole", "rebound-sidecar")?["rules"];
    ensure!(
        rules[0]["resourceNames"] == json!(["team-policies"]),
        "{rules}"
    );
    Ok(())
}

#[test]
fn watched_namespaces_get_role_bindings_and_no_cluster_binding() -> Result<()> {
    let objects = render_sets(&["watchNamespaces={team-a,team-b}"])?;
    ensure!(find(&objects, "ClusterRoleBinding", "rebound-operator").is_err());
    for ns in ["team-a", "team-b"] {
        let rb = objects
            .iter()
            .find(|o| o["kind"] == "RoleBinding" && o["metadata"]["namespace"] == ns)
            .with_context(|| format!("no RoleBinding in {ns}"))?;
        ensure!(
            rb["roleRef"]
                == json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rebound-operator"})
        );
        ensure!(
            rb["subjects"]
                == json!([{"kind": "ServiceAccount", "name": "rebound-operator", "namespace": "rebound-system"}])
        );
    }
    let args = args(&objects)?;
    ensure!(
        args.contains(&"--namespaces=team-a,team-b".to_owned()),
        "{args:?}"
    );
    Ok(())
}

#[test]
fn settings_reach_the_operator_flags_and_environment() -> Result<()> {
    let objects = render_sets(&[
        "configMapName=team-policies",
        "logLevel=debug",
        "logFormat=text",
        "resync=30s",
        "concurrency=4",
        "metrics.port=9191",
        "leaderElection.leaseName=my-lease",
        "leaderElection.leaseDuration=20",
        "leaderElection.leaseGrace=4",
        "image.tag=1.2.3",
    ])?;
    let args = args(&objects)?;
    for want in [
        "--configmap-name=team-policies",
        "--metrics-addr=0.0.0.0:9191",
        "--lease-name=my-lease",
        "--lease-duration=20",
        "--lease-grace=4",
        "--resync=30s",
        "--concurrency=4",
        "--log-format=text",
    ] {
        ensure!(args.contains(&want.to_owned()), "{want} not in {args:?}");
    }
    let c = container(&objects)?;
    ensure!(
        c["image"] == "ghcr.io/rebound-dev/rebound-operator:1.2.3",
        "{}",
        c["image"]
    );
    let env = c["env"].as_array().context("no env")?;
    ensure!(
        env.iter()
            .any(|e| e["name"] == "RUST_LOG" && e["value"] == "debug")
    );
    ensure!(c["ports"][0]["containerPort"] == 9191);
    // The RBAC follows the ConfigMap name: the operator may touch no other.
    let rules = &find(&objects, "ClusterRole", "rebound-operator")?["rules"];
    ensure!(
        rules.as_array().is_some_and(|r| r
            .iter()
            .any(|r| r["resourceNames"] == json!(["team-policies"]))),
        "{rules}"
    );
    let svc = find(&objects, "Service", "rebound-operator-metrics")?;
    ensure!(svc["spec"]["ports"][0]["targetPort"] == "metrics");
    Ok(())
}

#[test]
fn every_object_has_the_standard_labels() -> Result<()> {
    for values in matrix("rebound")? {
        for obj in render("rebound", "rebound-system", values.as_ref(), &[])? {
            let labels = &obj["metadata"]["labels"];
            for key in [
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/version",
                "app.kubernetes.io/managed-by",
                "app.kubernetes.io/part-of",
                "helm.sh/chart",
            ] {
                ensure!(
                    labels[key].is_string(),
                    "{} has no {key} label",
                    object_key(&obj)
                );
            }
            ensure!(labels["helm.sh/chart"] == "rebound-0.1.0");
            ensure!(labels["app.kubernetes.io/managed-by"] == "Helm");
        }
    }
    Ok(())
}

/// The chart's default image is what dev/build-images.sh tags: the workspace version.
#[test]
fn default_image_is_the_one_the_image_script_builds() -> Result<()> {
    let cargo = std::fs::read_to_string(repo_root().join("Cargo.toml"))?;
    let version = cargo
        .lines()
        .skip_while(|l| l.trim() != "[workspace.package]")
        .find_map(|l| l.trim().strip_prefix("version = "))
        .context("no workspace version")?
        .trim_matches('"')
        .to_owned();
    let objects = render_sets(&[])?;
    ensure!(
        container(&objects)?["image"] == format!("ghcr.io/rebound-dev/rebound-operator:{version}")
    );
    for chart in CHARTS {
        let meta: Value = yaml_documents(&chart_dir(chart).join("Chart.yaml"))?
            .pop()
            .context("empty Chart.yaml")?;
        ensure!(
            meta["appVersion"] == version,
            "{chart} appVersion is not {version}"
        );
    }
    Ok(())
}

/// The CRD chart holds exactly the generated CRD, plus labels and the keep annotation.
#[test]
fn crd_chart_matches_the_generated_crd() -> Result<()> {
    let expected = yaml_documents(&retry_policy_crd_file())?;
    for (sets, keep) in [(vec![], true), (vec!["keep=false"], false)] {
        let mut rendered = render("rebound-crds", "default", None, &sets)?;
        ensure!(
            rendered.len() == expected.len(),
            "{} objects rendered",
            rendered.len()
        );
        for obj in &mut rendered {
            let meta = obj["metadata"].as_object_mut().context("no metadata")?;
            let labels = meta.remove("labels").context("no labels")?;
            ensure!(labels["app.kubernetes.io/part-of"] == "rebound");
            let annotations = meta.remove("annotations");
            let policy = annotations
                .as_ref()
                .map(|a| a["helm.sh/resource-policy"].clone());
            ensure!(
                policy == keep.then(|| json!("keep")),
                "{sets:?}: resource policy {policy:?}"
            );
        }
        ensure!(
            rendered == expected,
            "charts/rebound-crds differs from crds/: run dev/gen-chart-crds.sh"
        );
    }
    Ok(())
}

/// Every object in deploy/ (but the Namespace, which Helm leaves to `--create-namespace`)
/// is what the chart renders with default values, field for field: the same RBAC rules,
/// bindings, Deployment flags, probes and security settings. The chart adds labels, a
/// metrics Service and a PodDisruptionBudget, and grants nothing deploy/ does not.
#[test]
fn default_rendering_matches_deploy() -> Result<()> {
    let chart = render_sets(&[])?;
    let mut deploy = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo_root().join("deploy"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|f| f.extension().is_some_and(|e| e == "yaml"));
    files.sort();
    ensure!(!files.is_empty(), "deploy/ has no manifests");
    for file in files {
        deploy.extend(yaml_documents(&file)?);
    }
    deploy.retain(|o| o["kind"] != "Namespace");
    for want in &deploy {
        let key = object_key(want);
        let got = chart
            .iter()
            .find(|o| object_key(o) == key)
            .with_context(|| format!("the chart renders no {key}"))?;
        ensure!(
            json_contains(got, want),
            "{key} differs from deploy/:\nchart:  {got}\ndeploy: {want}"
        );
    }
    for got in &chart {
        let kind = got["kind"].as_str().unwrap_or_default();
        if matches!(
            kind,
            "ClusterRole" | "Role" | "ClusterRoleBinding" | "RoleBinding"
        ) {
            let key = object_key(got);
            let want = deploy
                .iter()
                .find(|o| object_key(o) == key)
                .with_context(|| format!("the chart grants {key}, deploy/ does not"))?;
            for field in ["rules", "roleRef", "subjects"] {
                ensure!(
                    got[field] == want[field],
                    "{key}: {field} differs from deploy/"
                );
            }
        } else {
            ensure!(
                matches!(
                    kind,
                    "ServiceAccount"
                        | "Deployment"
                        | "Service"
                        | "PodDisruptionBudget"
                        | "ValidatingAdmissionPolicy"
                        | "ValidatingAdmissionPolicyBinding"
                        | "MutatingAdmissionPolicy"
                        | "MutatingAdmissionPolicyBinding"
                        | "ConfigMap"
                        | "FlowSchema"
                        | "PriorityLevelConfiguration"
                ),
                "unexpected {kind} in the default rendering"
            );
        }
    }
    Ok(())
}

/// The chart's Pod and the worker snippets' Pods are admitted in a namespace that
/// enforces Pod Security `restricted`.
#[tokio::test(flavor = "multi_thread")]
async fn pods_pass_pod_security_restricted() -> Result<()> {
    let env = TestEnv::new("chart-psa").await?;
    env.cluster
        .kubectl([
            "label",
            "namespace",
            &env.namespace,
            "pod-security.kubernetes.io/enforce=restricted",
        ])?
        .ok()?;
    let mut templates = Vec::new();
    for values in matrix("rebound")? {
        let objects = render("rebound", &env.namespace, values.as_ref(), &[])?;
        for o in objects.iter().filter(|o| o["kind"] == "Deployment") {
            templates.push((format!("chart {values:?}"), o["spec"]["template"].clone()));
        }
    }
    for file in [
        "examples/worker/worker.yaml",
        "examples/worker/worker-watch.yaml",
    ] {
        for o in yaml_documents(&repo_root().join(file))? {
            if o["kind"] == "Deployment" {
                templates.push((file.to_owned(), o["spec"]["template"].clone()));
            }
        }
    }
    ensure!(templates.len() >= 3, "no pod templates found");
    // A Pod that breaks `restricted` is refused, so the check can fail.
    let mut root = templates[0].1.clone();
    root["spec"]["securityContext"]["runAsNonRoot"] = json!(false);
    templates.push(("root".to_owned(), root));
    let pods: kube::Api<Pod> = kube::Api::namespaced(env.client.clone(), &env.namespace);
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    for (what, template) in templates {
        let mut pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "psa-check"}});
        pod["metadata"]["labels"] = template["metadata"]["labels"].clone();
        pod["spec"] = template["spec"].clone();
        let pod: Pod = serde_json::from_value(pod).with_context(|| format!("the Pod of {what}"))?;
        match pods.create(&dry_run, &pod).await {
            Ok(_) => ensure!(what != "root", "a Pod allowed to run as root was admitted"),
            Err(kube::Error::Api(e)) if what == "root" => {
                ensure!(e.code == 403 && e.reason == "Forbidden", "{e:?}");
            }
            Err(e) => return Err(e).with_context(|| format!("the Pod of {what}")),
        }
    }
    Ok(())
}

/// The operator as the chart's ServiceAccount, with only the RBAC the chart renders for
/// watched namespaces (one RoleBinding each, nothing cluster-wide) and the chart's rendered
/// arguments and environment: it reconciles the watched namespace's policy to Ready, holds
/// its Lease in the release namespace, and cannot see the namespace it does not watch.
#[tokio::test(flavor = "multi_thread")]
async fn operator_runs_as_the_chart_service_account_in_watched_namespaces() -> Result<()> {
    let env = TestEnv::new("chart-op").await?;
    let release_ns = env.namespace.as_str();
    let watched = env
        .cluster
        .create_namespace(&env.client, "chart-watched")
        .await?;
    let other = env
        .cluster
        .create_namespace(&env.client, "chart-other")
        .await?;
    let release = unique_name("rb");
    let out = Helm::get()?
        .template(
            &release,
            &chart_dir("rebound"),
            release_ns,
            &[],
            // The injection policies bind cluster-wide: in the shared cluster they would
            // inject other tests' annotated Pods (tests/tests/injection.rs covers them).
            &[
                format!("watchNamespaces={{{watched}}}"),
                "injection.enabled=false".to_owned(),
            ],
        )?
        .ok()?;
    // Everything but the Deployment, which nothing would run here: this test runs it.
    let (deployments, rest): (Vec<Value>, Vec<Value>) = manifests(&out.stdout)?
        .into_iter()
        .partition(|o| o["kind"] == "Deployment");
    ensure!(rest.iter().all(|o| o["kind"] != "ClusterRoleBinding"));
    let list = json!({"apiVersion": "v1", "kind": "List", "items": rest});
    env.cluster
        .kubectl_stdin(["apply", "-f", "-"], &list.to_string())?
        .ok()?;

    let pod_spec = &deployments.first().context("no Deployment")?["spec"]["template"]["spec"];
    let sa = pod_spec["serviceAccountName"]
        .as_str()
        .context("no serviceAccountName")?;
    let container: Container = serde_json::from_value(pod_spec["containers"][0].clone())?;
    let pod = format!("{release}-operator-0");
    let (args, vars) = resolve(&container, &pod, release_ns)?;
    let metrics = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let args = move_flags(
        args,
        &BTreeMap::from([("--metrics-addr", metrics.to_string())]),
        &[],
    );
    let op = start_as(
        env.cluster,
        "rebound-operator",
        release_ns,
        sa,
        &args,
        &vars,
    )?;

    let policy = repo_root().join("examples/policies/webhooks.yaml");
    for ns in [&watched, &other] {
        env.cluster
            .kubectl(["-n", ns, "apply", "-f", &policy.to_string_lossy()])?
            .ok()?;
    }
    env.cluster
        .kubectl([
            "-n",
            &watched,
            "wait",
            "--for=condition=Ready",
            "retrypolicy/webhooks",
            "--timeout=60s",
        ])?
        .ok()
        .with_context(|| op.log_tail())?;
    let leases: kube::Api<Lease> = kube::Api::namespaced(env.client.clone(), release_ns);
    let lease = leases.get(&format!("{release}-operator")).await?;
    ensure!(lease.spec.and_then(|s| s.holder_identity).as_deref() == Some(pod.as_str()));

    // The unwatched namespace: no status, no ConfigMap, and no right to look.
    let got = env
        .cluster
        .kubectl(["-n", &other, "get", "retrypolicy", "webhooks", "-o", "json"])?
        .ok()?;
    let got: Value = serde_json::from_str(&got.stdout)?;
    ensure!(
        got["status"].is_null(),
        "the unwatched policy has a status: {}",
        got["status"]
    );
    let configmaps: kube::Api<ConfigMap> = kube::Api::namespaced(env.client.clone(), &other);
    ensure!(configmaps.get_opt("rebound-policies").await?.is_none());
    let identity = format!("system:serviceaccount:{release_ns}:{sa}");
    for (ns, verb, resource, expected) in [
        (
            watched.as_str(),
            "watch",
            "retrypolicies.rebound.dev",
            "yes",
        ),
        (other.as_str(), "list", "retrypolicies.rebound.dev", "no"),
        (watched.as_str(), "list", "configmaps", "no"),
        (watched.as_str(), "get", "secrets", "no"),
    ] {
        let out = env
            .cluster
            .kubectl(["auth", "can-i", verb, resource, "-n", ns, "--as", &identity])?;
        ensure!(
            out.stdout.trim() == expected,
            "can-i {verb} {resource} -n {ns}: {}",
            out.stdout.trim()
        );
    }
    Ok(())
}
