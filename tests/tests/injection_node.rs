//! Injection on a real node: in a new namespace that enforces Pod Security `restricted`,
//! a Deployment with nothing but `rebound.dev/inject: "true"` runs Ready with the chart's
//! sidecar, every answer of its worker comes from the sidecar over the socket, and each
//! Pod's fleet Lease is there; a budgeted policy's status counts its two sidecars; a Job
//! and a CronJob with the annotation complete; after `helm upgrade` with another sidecar
//! image, `rebound check` names the Pods still on the old one (exit 1) until they are
//! rolled (exit 0). docs/install.md's injection section runs here as pasted.
//!
//! One node per machine (`.state/node`, or `REBOUND_NODE_STATE_DIR`); the test stops it
//! and checks that nothing of it is left on the host.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use std::process::Command;

use rebound_test_support::workspace_binary;
use rebound_tests::doc::{run_shell, shell_blocks, shell_env};
use rebound_tests::helm::{Helm, chart_dir};
use rebound_tests::node::{Node, WORKER_IMAGE, on_a_node, wait_for};
use rebound_tests::repo_root;
use serde_json::{Value, json};

const OPERATOR_NS: &str = "rebound-system";
const SIDECAR_IMAGE: &str = "ghcr.io/rebound-dev/rebound-sidecar:0.1.0";
/// The sidecar image `helm upgrade` switches to (`injection.image.tag`).
const NEW_TAG: &str = "0.1.1-next";
const NEW_SIDECAR_IMAGE: &str = "ghcr.io/rebound-dev/rebound-sidecar:0.1.1-next";

#[test]
fn one_annotation_makes_a_worker_a_rebound_worker() -> Result<()> {
    on_a_node("injection_node", run_steps)
}

fn run_steps(node: &Node) -> Result<()> {
    node.install_charts(OPERATOR_NS)
        .context("step: helm install of both charts")?;
    install_page_injection(node).context("step: docs/install.md, section 4")?;
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
    budget_counts_the_replicas(node, &ns).context("step: a budgeted policy's status")?;
    jobs_complete(node, &ns).context("step: the annotated Job and CronJob")?;
    upgrade_changes_new_pods(node, &ns).context("step: helm upgrade with another image")?;
    check_names_pods_until_rolled(node, &ns).context("step: rebound check after the upgrade")?;
    Ok(())
}

/// The section of docs/install.md that applies the injected example, run as a user pastes
/// it (its namespace and policy come from sections 1 to 3, which the node test runs).
fn install_page_injection(node: &Node) -> Result<()> {
    const SECTION: &str = "## 4. A worker, by injection";
    let page = std::fs::read_to_string(repo_root().join("docs/install.md"))?;
    let lines: Vec<&str> = page.lines().collect();
    let start = lines
        .iter()
        .position(|l| *l == SECTION)
        .with_context(|| format!("docs/install.md has no {SECTION:?}"))?;
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## "))
        .map_or(lines.len(), |i| start + 1 + i);
    // `line` is 1-based, and the heading is on line `start + 1`.
    let commands: Vec<String> = shell_blocks(&page)
        .into_iter()
        .filter(|b| b.line > start + 1 && b.line <= end)
        .flat_map(|b| b.commands)
        .collect();
    ensure!(!commands.is_empty(), "{SECTION:?} has no sh block");

    node.kubectl(["create", "namespace", "team-a"])?.ok()?;
    let policy = repo_root().join("examples/policies/webhooks.yaml");
    node.kubectl(["-n", "team-a", "apply", "-f", &policy.display().to_string()])?
        .ok()?;
    node.kubectl([
        "-n",
        "team-a",
        "wait",
        "--for=condition=Ready",
        "retrypolicy/webhooks",
        "--timeout=60s",
    ])?
    .ok()?;
    let helm = Helm::get()?;
    let env = shell_env(
        node.kubeconfig(),
        &[helm.path(), node.kubectl_path()],
        &node.state_dir().join("install-doc"),
    );
    let mut last = String::new();
    for command in &commands {
        last = run_shell(command, &env)?;
    }
    // The page's last command prints the Pod's first init container.
    ensure!(
        last.trim() == "rebound-sidecar",
        "the page's Pod has {:?} as its first init container",
        last.trim()
    );
    let pods = node.get_json(["pods", "-n", "team-a", "-l", "app=worker-injected"])?;
    let pod = pods["items"][0]["metadata"]["name"]
        .as_str()
        .context("no Pod of worker-injected")?
        .to_owned();
    let answer = wait_for(
        "the page's injected worker to log an answer",
        Duration::from_secs(30),
        || {
            Ok(node
                .json_logs("team-a", &pod, "worker")?
                .into_iter()
                .rfind(|l| l["event"] == "answer"))
        },
    )?;
    ensure!(
        answer["source"] == "sidecar"
            && answer["policy"] == "team-a/webhooks"
            && answer["target"] == "unix:///run/rebound/rebound.sock",
        "the page's injected worker said {answer}"
    );
    println!("docs/install.md section 4: {pod} Ready, answered by its injected sidecar");
    Ok(())
}

/// The retry budget as `summary.retryBudget` words it (docs/operator.md, "The fleet"):
/// `<budget> for <n> sidecars`, `<budget> for 1 sidecar`, or `<budget> per sidecar (no
/// sidecar Leases)` for none. The count, or an error for any other text.
fn sidecars_sharing(summary: &str, budget: &str) -> Result<u32> {
    let rest = summary
        .strip_prefix(budget)
        .with_context(|| format!("{summary:?} does not start with {budget:?}"))?;
    if rest == " per sidecar (no sidecar Leases)" {
        return Ok(0);
    }
    let (count, noun) = rest
        .strip_prefix(" for ")
        .and_then(|r| r.split_once(' '))
        .with_context(|| format!("{summary:?}: not `{budget} for <n> sidecars`"))?;
    ensure!(
        !count.is_empty() && count.bytes().all(|b| b.is_ascii_digit()),
        "{summary:?}: {count:?} is not a count"
    );
    let n: u32 = count.parse()?;
    let want = if n == 1 { "sidecar" } else { "sidecars" };
    ensure!(noun == want, "{summary:?}: {noun:?} after {n}");
    Ok(n)
}

#[test]
fn the_budget_summary_is_read_exactly() {
    let budget = "10/s, burst 1 (100ms slots)";
    let n = |s: &str| sidecars_sharing(s, budget).ok();
    assert_eq!(n("10/s, burst 1 (100ms slots) for 2 sidecars"), Some(2));
    assert_eq!(n("10/s, burst 1 (100ms slots) for 1 sidecar"), Some(1));
    assert_eq!(
        n("10/s, burst 1 (100ms slots) per sidecar (no sidecar Leases)"),
        Some(0)
    );
    for wrong in [
        "10/s, burst 1 (100ms slots) for 2 sidecar",
        "10/s, burst 1 (100ms slots) for 1 sidecars",
        "10/s, burst 1 (100ms slots) for +2 sidecars",
        "10/s, burst 1 (100ms slots) for 2 sidecars now",
        "5/s, burst 1 (200ms slots) for 2 sidecars",
        "running for 2 sidecars",
    ] {
        assert_eq!(n(wrong), None, "{wrong}");
    }
}

/// A policy with a `retryBudget` in the namespace of the 2-replica Deployment: its status
/// says the budget is shared by 2 sidecars, one per replica, counted from their Leases.
fn budget_counts_the_replicas(node: &Node, ns: &str) -> Result<()> {
    // 10/s, burst 1 is worded `10/s, burst 1 (100ms slots)`.
    const BUDGET: &str = "10/s, burst 1 (100ms slots)";
    let policy = json!({
        "apiVersion": "rebound.dev/v1alpha1",
        "kind": "RetryPolicy",
        "metadata": {"name": "budgeted"},
        "spec": {
            "queues": ["budgeted"],
            "backoff": {"strategy": "constant", "base": "1s", "jitter": {"kind": "none"}},
            "maxAttempts": 5,
            "retryBudget": {"ratePerSecond": 10, "burst": 1},
        }
    });
    node.apply(ns, &[policy])?;
    let mut last = None;
    let counted = wait_for(
        "the budgeted policy's status to count 2 sidecars",
        Duration::from_secs(60),
        || {
            let policy = node.get_json(["retrypolicy", "-n", ns, "budgeted"])?;
            let Some(summary) = policy["status"]["summary"]["retryBudget"].as_str() else {
                return Ok(None);
            };
            let n = sidecars_sharing(summary, BUDGET)?;
            last = Some(n);
            Ok((n == 2).then(|| summary.to_owned()))
        },
    )
    .with_context(|| format!("last count: {last:?}"))?;
    println!("budgeted policy: retryBudget {counted:?}");
    Ok(())
}

/// `rebound check -n NS -o json` (the workspace's binary): its exit code and report.
fn check(node: &Node, ns: &str) -> Result<(i32, Value)> {
    let out = Command::new(workspace_binary("rebound")?)
        .args(["check", "-n", ns, "-o", "json", "--kubeconfig"])
        .arg(node.kubeconfig())
        .output()
        .context("running rebound check")?;
    let code = out
        .status
        .code()
        .context("rebound check killed by a signal")?;
    let report: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "rebound check printed no JSON (exit {code}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((code, report))
}

/// The `pod.image` verdict of `check` on `pod/NS/NAME`.
fn image_verdict<'a>(report: &'a Value, ns: &str, pod: &str) -> Result<&'a Value> {
    let object = format!("pod/{ns}/{pod}");
    report["checks"]
        .as_array()
        .context("the report has no checks")?
        .iter()
        .find(|v| v["check"] == "pod.image" && v["object"] == object.as_str())
        .with_context(|| format!("no pod.image verdict on {object}: {report:#}"))
}

/// The names of the Deployment's Pods not being deleted.
fn worker_pods(node: &Node, ns: &str) -> Result<Vec<String>> {
    let pods = node.get_json(["pods", "-n", ns, "-l", "app=worker"])?;
    Ok(pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .collect())
}

/// After `helm upgrade` to `NEW_SIDECAR_IMAGE`, `check` fails each running Pod of the
/// Deployment (expected the new image, actual the old) and exits 1; once the Deployment
/// is rolled, its new Pods pass and `check` exits 0.
///
/// The node has no registry and `NEW_SIDECAR_IMAGE` was never built: the sidecar image is
/// tagged under that name in the node's containerd (the same bytes, which is all the
/// kubelet needs with `IfNotPresent`, and `check` compares names), so the roll is a real
/// `kubectl rollout restart` whose Pods run the new name.
fn check_names_pods_until_rolled(node: &Node, ns: &str) -> Result<()> {
    let old_pods = worker_pods(node, ns)?;
    ensure!(old_pods.len() == 2, "worker Pods: {old_pods:?}");
    let (code, report) = check(node, ns)?;
    ensure!(
        code == 1,
        "check exited {code} with Pods on the old image: {report:#}"
    );
    ensure!(report["ok"] == false, "check says ok: {report:#}");
    let failed: Vec<&Value> = report["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["status"] == "fail")
        .collect();
    ensure!(
        failed.iter().all(|v| v["check"] == "pod.image"),
        "check failed more than pod.image: {failed:#?}"
    );
    for pod in &old_pods {
        let v = image_verdict(&report, ns, pod)?;
        ensure!(
            v["status"] == "fail"
                && v["expected"] == NEW_SIDECAR_IMAGE
                && v["actual"] == SIDECAR_IMAGE,
            "{pod}: pod.image verdict {v}"
        );
    }
    println!("check after the upgrade: exit 1, pod.image fails on {old_pods:?}");

    let socket = node.state_dir().join("node/containerd/containerd.sock");
    let tagged = Command::new("ctr")
        .arg("--address")
        .arg(&socket)
        .args([
            "--namespace",
            "k8s.io",
            "images",
            "tag",
            "--force",
            SIDECAR_IMAGE,
            NEW_SIDECAR_IMAGE,
        ])
        .output()
        .context("running ctr")?;
    ensure!(
        tagged.status.success(),
        "ctr images tag: {}",
        String::from_utf8_lossy(&tagged.stderr)
    );
    node.kubectl(["-n", ns, "rollout", "restart", "deployment/worker"])?
        .ok()?;
    node.kubectl([
        "-n",
        ns,
        "rollout",
        "status",
        "deployment/worker",
        "--timeout=180s",
    ])?
    .ok()?;
    // The new Pods' sidecars take their Leases as they start: check until all is current.
    let mut last = None;
    let (new_pods, report) = wait_for(
        "check to pass after the roll",
        Duration::from_secs(90),
        || {
            let pods = worker_pods(node, ns)?;
            let (code, report) = check(node, ns)?;
            let passed = code == 0 && pods.len() == 2;
            last = Some((code, report.clone()));
            Ok(passed.then_some((pods, report)))
        },
    )
    .with_context(|| format!("last check: {last:#?}"))?;
    for pod in &new_pods {
        ensure!(!old_pods.contains(pod), "{pod} was not rolled");
        let v = image_verdict(&report, ns, pod)?;
        ensure!(
            v["status"] == "ok"
                && v["expected"] == NEW_SIDECAR_IMAGE
                && v["actual"] == NEW_SIDECAR_IMAGE,
            "{pod}: pod.image verdict {v}"
        );
    }
    println!("check after the roll: exit 0, pod.image ok on {new_pods:?}");
    Ok(())
}

/// `helm upgrade` with another sidecar image: the parameters change, the policy does not,
/// and the next Pod created gets the new image (a server-side dry-run: no Pod runs it).
fn upgrade_changes_new_pods(node: &Node, ns: &str) -> Result<()> {
    let chart = chart_dir("rebound").display().to_string();
    node.helm(&[
        "upgrade",
        "rebound",
        &chart,
        "--namespace",
        OPERATOR_NS,
        "--reuse-values",
        "--set",
        &format!("injection.image.tag={NEW_TAG}"),
    ])?;
    let wanted = NEW_SIDECAR_IMAGE;
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
    // Its next runs would add Pods, on whatever image the parameters name then, to what
    // `check` looks at in this namespace after the upgrade.
    node.kubectl([
        "-n",
        ns,
        "delete",
        "cronjob",
        "every-minute",
        "--cascade=foreground",
        "--timeout=120s",
    ])?
    .ok()?;
    Ok(())
}
