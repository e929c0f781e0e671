//! Injection on a real node: in a new namespace that enforces Pod Security `restricted`,
//! a Deployment with nothing but `rebound.dev/inject: "true"` runs Ready with the chart's
//! sidecar, every answer of its worker comes from the sidecar over the socket, and each
//! Pod's fleet Lease is there; a Job and a CronJob with the annotation complete.
//!
//! One node per machine (`.state/node`, or `REBOUND_NODE_STATE_DIR`); the test stops it
//! and checks that nothing of it is left on the host.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use rebound_tests::helm::{Helm, chart_dir};
use rebound_tests::node::{HostSnapshot, Node, WORKER_IMAGE, wait_for};
use rebound_tests::repo_root;
use serde_json::{Value, json};

const OPERATOR_NS: &str = "rebound-system";
const SIDECAR_IMAGE: &str = "ghcr.io/rebound-dev/rebound-sidecar:0.1.0";

#[test]
fn one_annotation_makes_a_worker_a_rebound_worker() -> Result<()> {
    let state = repo_root().join(
        std::env::var("REBOUND_NODE_STATE_DIR").unwrap_or_else(|_| ".state/node".to_string()),
    );
    let before = HostSnapshot::take(&state)?;
    let node = Node::start(&state).context("starting the node")?;
    let steps = run_steps(&node);
    let stopped = node.stop().context("dev/cluster-down.sh");
    steps?;
    stopped?;
    let left = HostSnapshot::take(&state)?.left_over(&before);
    ensure!(
        left.is_empty(),
        "the node left these on the host: {left:#?}"
    );
    Ok(())
}

fn run_steps(node: &Node) -> Result<()> {
    install_charts(node).context("step: helm install of both charts")?;
    let ns = node.restricted_namespace("inject-node")?;
    let policy = repo_root().join("examples/policies/webhooks.yaml");
    node.kubectl([
        "-n",
        ns.as_str(),
        "apply",
        "-f",
        &policy.display().to_string(),
    ])?
    .ok()
    .context("the namespace's RetryPolicy")?;
    operator_binds_sidecar_role(node, &ns).context("step: the operator binds the sidecar role")?;
    deployment_runs_with_its_sidecar(node, &ns).context("step: the annotated Deployment")?;
    jobs_complete(node, &ns).context("step: the annotated Job and CronJob")?;
    upgrade_changes_new_pods(node, &ns).context("step: helm upgrade with another image")?;
    Ok(())
}

/// `helm upgrade` with another sidecar image: the parameters change, the policy does not,
/// and the next Pod created gets the new image (a server-side dry-run: no Pod runs it).
fn upgrade_changes_new_pods(node: &Node, ns: &str) -> Result<()> {
    let chart = chart_dir("rebound").display().to_string();
    helm(
        node,
        &[
            "upgrade",
            "rebound",
            &chart,
            "--namespace",
            OPERATOR_NS,
            "--reuse-values",
            "--set",
            "injection.image.tag=0.1.1-next",
        ],
    )?;
    let wanted = "ghcr.io/rebound-dev/rebound-sidecar:0.1.1-next";
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "after-upgrade", "annotations": {"rebound.dev/inject": "true"}},
        "spec": pod_template("after", json!([container("w", WORKER_IMAGE, &[])]), "Always")["spec"],
    });
    let got = wait_for(
        "new Pods to get the new image",
        Duration::from_secs(30),
        || {
            let out = node
                .kubectl_stdin(
                    [
                        "-n",
                        ns,
                        "create",
                        "--dry-run=server",
                        "-o",
                        "json",
                        "-f",
                        "-",
                    ],
                    &pod.to_string(),
                )?
                .ok()?;
            let admitted: Value = serde_json::from_str(&out.stdout)?;
            let image = admitted["spec"]["initContainers"][0]["image"].clone();
            Ok((image == wanted).then_some(admitted))
        },
    )?;
    ensure!(
        got["metadata"]["annotations"]["rebound.dev/sidecar-image"] == wanted,
        "the annotation does not name the new image"
    );
    println!("helm upgrade: new Pods get {wanted}");
    Ok(())
}

fn helm(node: &Node, args: &[&str]) -> Result<String> {
    let mut all = vec![
        "--kubeconfig".to_string(),
        node.kubeconfig().display().to_string(),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    Ok(Helm::get()?.run(&all)?.ok()?.stdout)
}

fn install_charts(node: &Node) -> Result<()> {
    let crds = chart_dir("rebound-crds").display().to_string();
    let chart = chart_dir("rebound").display().to_string();
    helm(
        node,
        &[
            "upgrade",
            "--install",
            "rebound-crds",
            &crds,
            "--take-ownership",
            "--wait",
        ],
    )?;
    helm(
        node,
        &[
            "upgrade",
            "--install",
            "rebound",
            &chart,
            "--namespace",
            OPERATOR_NS,
            "--create-namespace",
            "--set",
            "image.pullPolicy=Never",
            "--wait",
            "--timeout",
            "180s",
        ],
    )?;
    Ok(())
}

/// The RoleBinding the operator keeps in every namespace with RetryPolicies or injected
/// Pods: nobody writes it but the operator, and the sidecars' watch mode depends on it.
fn operator_binds_sidecar_role(node: &Node, ns: &str) -> Result<()> {
    let binding = wait_for(
        "the operator's RoleBinding rebound-sidecar",
        Duration::from_secs(60),
        || {
            let out = node.kubectl([
                "-n",
                ns,
                "get",
                "rolebinding",
                "rebound-sidecar",
                "-o",
                "json",
            ])?;
            if !out.status.success() {
                return Ok(None);
            }
            Ok(Some(serde_json::from_str::<Value>(&out.stdout)?))
        },
    )?;
    ensure!(
        binding["roleRef"]["kind"] == "ClusterRole"
            && binding["roleRef"]["name"] == "rebound-sidecar",
        "roleRef: {}",
        binding["roleRef"]
    );
    let group = format!("system:serviceaccounts:{ns}");
    ensure!(
        binding["subjects"]
            == json!([{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}]),
        "subjects: {}",
        binding["subjects"]
    );
    Ok(())
}

/// A restricted-compliant container of the user's, and nothing about Rebound.
fn container(name: &str, image: &str, args: &[&str]) -> Value {
    json!({
        "name": name,
        "image": image,
        "imagePullPolicy": "Never",
        "args": args,
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]},
        },
    })
}

fn pod_template(app: &str, containers: Value, restart: &str) -> Value {
    json!({
        "metadata": {"labels": {"app": app}, "annotations": {"rebound.dev/inject": "true"}},
        "spec": {
            "restartPolicy": restart,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": containers,
        }
    })
}

fn deployment_runs_with_its_sidecar(node: &Node, ns: &str) -> Result<()> {
    // The worker wants no API access: its sidecar still watches, with its own token.
    let mut template = pod_template(
        "worker",
        json!([container("worker", WORKER_IMAGE, &[])]),
        "Always",
    );
    template["spec"]["automountServiceAccountToken"] = json!(false);
    let deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "worker"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "worker"}},
            "template": template,
        }
    });
    node.apply(ns, &[deployment])?;
    node.kubectl([
        "-n",
        ns,
        "rollout",
        "status",
        "deployment/worker",
        "--timeout=180s",
    ])?
    .ok()?;
    let pods = node.get_json(["pods", "-n", ns, "-l", "app=worker"])?;
    let pods: Vec<Value> = pods["items"].as_array().cloned().unwrap_or_default();
    ensure!(pods.len() == 2, "{} worker Pods", pods.len());
    for pod in &pods {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        ensure!(
            pod["spec"]["initContainers"][0]["name"] == "rebound-sidecar"
                && pod["spec"]["initContainers"][0]["image"] == SIDECAR_IMAGE,
            "{name}: no sidecar from the chart's parameters"
        );
        let ready = pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        ensure!(ready, "{name} is not Ready");
        let token_mounted = pod["spec"]["containers"][0]["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| {
                m["mountPath"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("/var/run/secrets/kubernetes.io"))
            });
        ensure!(
            !token_mounted,
            "{name}: the worker got a ServiceAccount token"
        );
        // Every answer from the sidecar, over the socket, from the namespace's policy.
        let answers = wait_for(
            "answers in the worker's log",
            Duration::from_secs(30),
            || {
                let lines = node.json_logs(ns, name, "worker")?;
                let answers: Vec<Value> = lines
                    .into_iter()
                    .filter(|l| l["event"] == "answer")
                    .collect();
                Ok((answers.len() >= 5).then_some(answers))
            },
        )?;
        for a in &answers {
            ensure!(
                a["source"] == "sidecar"
                    && a["target"] == "unix:///run/rebound/rebound.sock"
                    && a["policy"] == json!(format!("{ns}/webhooks")),
                "{name}: an answer not from the sidecar: {a}"
            );
        }
        let lease = node.get_json(["lease", "-n", ns, &format!("rebound-sidecar-{name}")])?;
        ensure!(
            lease["spec"]["holderIdentity"].is_string(),
            "{name}: its fleet Lease has no holder: {lease}"
        );
        println!(
            "{name}: Ready, {} answers from the sidecar, Lease held",
            answers.len()
        );
    }
    Ok(())
}

/// Whether every Pod with `selector` ended Succeeded (at least one).
fn all_succeeded(node: &Node, ns: &str, selector: &str) -> Result<Option<usize>> {
    let pods = node.get_json(["pods", "-n", ns, "-l", selector])?;
    let phases: Vec<String> = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| p["status"]["phase"].as_str().unwrap_or_default().to_owned())
        .collect();
    Ok((!phases.is_empty() && phases.iter().all(|p| p == "Succeeded")).then_some(phases.len()))
}

fn jobs_complete(node: &Node, ns: &str) -> Result<()> {
    // The sidecar image's own binary as the job: it exits at once, after the sidecar
    // answered its startup probe; the native sidecar must then stop for the Pod to end.
    let job_container = || json!([container("job", SIDECAR_IMAGE, &["--version"])]);
    let job = json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "once"},
        "spec": {"backoffLimit": 0, "template": pod_template("once", job_container(), "Never")}
    });
    let cron = json!({
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": "every-minute"},
        "spec": {
            "schedule": "* * * * *",
            "jobTemplate": {"spec": {"backoffLimit": 0, "template": pod_template("cron", job_container(), "Never")}}
        }
    });
    node.apply(ns, &[job, cron])?;
    node.kubectl([
        "-n",
        ns,
        "wait",
        "--for=condition=Complete",
        "job/once",
        "--timeout=180s",
    ])?
    .ok()?;
    let n = wait_for("the Job's Pod to succeed", Duration::from_secs(60), || {
        all_succeeded(node, ns, "app=once")
    })?;
    println!("Job: complete, {n} Pod Succeeded");
    let n = wait_for("a CronJob run to succeed", Duration::from_secs(150), || {
        all_succeeded(node, ns, "app=cron")
    })?;
    println!("CronJob: a run complete, {n} Pod Succeeded");
    let pods = node.get_json(["pods", "-n", ns, "-l", "app=cron"])?;
    let injected = pods["items"][0]["metadata"]["labels"]["rebound.dev/injected"].clone();
    ensure!(injected == "true", "the CronJob's Pod was not injected");
    Ok(())
}
