//! Rebound on a real node: the charts, the images and workers with their sidecar as Pods
//! on a kubelet with containerd (`dev/cluster-up.sh --node`, see `rebound_tests::node`).
//!
//! One node per machine, so this is one test that walks the install path in order (each
//! step a function, named in the failure) and ends by stopping the node and proving that
//! nothing of it is left on the host. Figures (propagation delays, failover time) are
//! printed, never asserted.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use rebound_tests::doc::{run_shell, shell_blocks, shell_env};
use rebound_tests::helm::{Helm, chart_dir};
use rebound_tests::node::{NODE_IP, Node, WORKER_IMAGE, json_lines, on_a_node, wait_for};
use rebound_tests::{repo_root, yaml_documents};
use serde_json::{Value, json};

const OPERATOR_NS: &str = "rebound-system";

#[test]
fn rebound_runs_on_a_real_node() -> Result<()> {
    on_a_node("node", run_steps)
}

fn run_steps(node: &Node) -> Result<()> {
    let collector = Collector::start()?;
    install_page_runs_on_the_node(node).context("step: docs/install.md")?;
    install_charts(node).context("step: helm install of both charts")?;
    images_run_under_their_security_context(node, OPERATOR_NS, "rebound-operator")
        .context("step: the operator's securityContext")?;
    let file = start_worker(node, &collector, "examples/worker/worker.yaml", "worker")
        .context("step: examples/worker/worker.yaml")?;
    images_run_under_their_security_context(node, &file.namespace, "worker")
        .context("step: the sidecar's securityContext")?;
    let watch = start_worker(
        node,
        &collector,
        "examples/worker/worker-watch.yaml",
        "worker-watch",
    )
    .context("step: examples/worker/worker-watch.yaml")?;
    policy_change_reaches_every_sidecar(node, &collector, &[&file, &watch])
        .context("step: a changed policy reaches both sidecars")?;
    policy_rollout_is_watched_and_promoted(node, &collector, &watch)
        .context("step: a policy change rolled out and promoted")?;
    rollout_restart_loses_no_call(node, &collector, &file).context("step: rollout restart")?;
    leader_failover(node, &file).context("step: leader Pod deleted")?;
    wrong_configmap_is_not_ready_and_falls_back(node, &collector, &watch)
        .context("step: a sidecar with a wrong --configmap")?;
    node_restarts_keep_containers(node, &file).context("step: kubelet and containerd restarts")?;
    upgrade_and_uninstall_keep_policies(node, &file).context("step: helm upgrade and uninstall")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 7. docs/install.md, every `sh` block as a user pastes it

fn install_page_runs_on_the_node(node: &Node) -> Result<()> {
    // A new cluster has no CRD: take away the one the harness installed.
    node.kubectl(["delete", "crd", "retrypolicies.rebound.dev", "--wait=true"])?
        .ok()?;
    let helm = Helm::get()?;
    let scratch = node.state_dir().join("install-doc");
    let env = shell_env(
        node.kubeconfig(),
        &[helm.path(), node.kubectl_path()],
        &scratch,
    );
    let page = std::fs::read_to_string(repo_root().join("docs/install.md"))?;
    let mut outputs = Vec::new();
    for command in shell_blocks(&page).iter().flat_map(|b| &b.commands) {
        outputs.push((command.clone(), run_shell(command, &env)?));
    }
    // The page's worker prints answers of its sidecar, over the shared socket (the log
    // command again until the first one is there: it may run before the first call).
    let logs = outputs
        .iter()
        .find(|(c, _)| c.starts_with("kubectl -n team-a logs deployment/worker"))
        .map(|(c, _)| c.clone())
        .context("the page never shows the worker's log")?;
    let answer = wait_for(
        "the page's worker to log an answer",
        Duration::from_secs(30),
        || {
            Ok(json_lines(&run_shell(&logs, &env)?)
                .into_iter()
                .rfind(|l| l["event"] == json!("answer")))
        },
    )?;
    ensure!(
        answer["source"] == json!("sidecar")
            && answer["policy"] == json!("team-a/webhooks")
            && answer["target"] == json!("unix:///run/rebound/rebound.sock"),
        "the page's worker said {answer}"
    );
    // Section 4's Pod got its sidecar from the chart's admission policy.
    let first_init = outputs
        .iter()
        .find(|(c, _)| c.starts_with("kubectl -n team-a get pods -l app=worker-injected"))
        .map(|(_, o)| o.trim());
    ensure!(
        first_init == Some("rebound-sidecar"),
        "the injected worker's first init container: {first_init:?}"
    );
    let answers: Vec<&str> = outputs
        .iter()
        .filter(|(c, _)| c.contains("auth can-i"))
        .map(|(_, o)| o.trim())
        .collect();
    ensure!(
        answers == ["yes", "no"],
        "kubectl auth can-i said {answers:?}"
    );
    // After the page's uninstall block: the CRD and the policy stay.
    let policy = node.get_json(["retrypolicy", "-n", "team-a", "webhooks"])?;
    ensure!(policy["metadata"]["name"] == json!("webhooks"), "{policy}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 1. Charts

fn install_charts(node: &Node) -> Result<()> {
    let started = Instant::now();
    node.install_charts(OPERATOR_NS)?;
    let deployment = node.get_json(["deployment", "-n", OPERATOR_NS, "rebound-operator"])?;
    let ready = deployment["status"]["readyReplicas"].as_i64().unwrap_or(0);
    ensure!(
        ready == 2,
        "the operator has {ready}/2 ready replicas: {}",
        deployment["status"]
    );
    eprintln!(
        "node: operator 2/2 Ready {:.1}s after helm install (both charts)",
        started.elapsed().as_secs_f64()
    );
    // The Lease may still name a Pod of the page's release, uninstalled with its RBAC
    // (so it could not release it): it expires after leaseDuration.
    wait_for(
        "one of the operator's Pods to hold the Lease",
        Duration::from_secs(60),
        || {
            let pods = operator_pods(node)?;
            let holder = lease_holder(node)?;
            Ok(pods
                .iter()
                .any(|p| holder.starts_with(p.as_str()))
                .then_some(()))
        },
    )?;
    let pdb = node.get_json(["poddisruptionbudget", "-n", OPERATOR_NS, "rebound-operator"])?;
    ensure!(
        pdb["spec"]["minAvailable"] == json!(1),
        "PDB: {}",
        pdb["spec"]
    );
    Ok(())
}

fn operator_pods(node: &Node) -> Result<Vec<String>> {
    Ok(pods_of(node, OPERATOR_NS, "rebound-operator")?
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .collect())
}

fn lease_holder(node: &Node) -> Result<String> {
    let lease = node.get_json(["lease", "-n", OPERATOR_NS, "rebound-operator"])?;
    lease["spec"]["holderIdentity"]
        .as_str()
        .map(String::from)
        .context("the Lease has no holder")
}

// ---------------------------------------------------------------------------------------
// 8. The images under the Pod's securityContext

/// The processes of Rebound's containers (the operator's, and the sidecars of the Pods
/// labelled `app.kubernetes.io/name=<app>` in `namespace`) run as 65532 with no
/// capability and no new privileges, on a read-only root: read from /proc of the node,
/// where they really run.
fn images_run_under_their_security_context(node: &Node, namespace: &str, app: &str) -> Result<()> {
    let mut checked = 0;
    for pod in &pods_of(node, namespace, app)? {
        let statuses = ["initContainerStatuses", "containerStatuses"]
            .iter()
            .flat_map(|f| pod["status"][f].as_array().cloned().unwrap_or_default());
        for container in statuses {
            if !container["image"]
                .as_str()
                .is_some_and(|i| i.starts_with("ghcr.io/rebound-dev/"))
            {
                continue;
            }
            let id = container["containerID"]
                .as_str()
                .and_then(|id| id.strip_prefix("containerd://"))
                .context("no containerd container ID")?;
            check_process_security(node.container_pid(id)?)
                .with_context(|| format!("{} in {}", container["name"], pod["metadata"]["name"]))?;
            checked += 1;
        }
    }
    ensure!(checked > 0, "no Rebound container in {namespace} ({app})");
    Ok(())
}

fn check_process_security(pid: u32) -> Result<()> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    ensure!(
        field("Uid:").iter().all(|u| *u == "65532"),
        "Uid: {:?}",
        field("Uid:")
    );
    ensure!(
        field("Gid:").iter().all(|g| *g == "65532"),
        "Gid: {:?}",
        field("Gid:")
    );
    for caps in ["CapEff:", "CapPrm:", "CapBnd:"] {
        ensure!(
            field(caps) == ["0000000000000000"],
            "{caps} {:?}",
            field(caps)
        );
    }
    ensure!(
        field("NoNewPrivs:") == ["1"],
        "NoNewPrivs: {:?}",
        field("NoNewPrivs:")
    );
    let root = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .map(String::from)
        .context("no root mount")?;
    let options = root.split(' ').nth(5).unwrap_or_default();
    ensure!(
        options.split(',').any(|o| o == "ro"),
        "root mounted {options}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 2. The examples' workers

struct Worker {
    namespace: String,
    deployment: String,
}

/// Applies a policy and an example worker (only its image swapped for the test worker,
/// which reports every answer to `collector`) in a `restricted` namespace; waits until the
/// Pod is Ready and its first call was answered by the sidecar.
fn start_worker(node: &Node, collector: &Collector, example: &str, name: &str) -> Result<Worker> {
    let namespace = node.restricted_namespace(name)?;
    let policy = repo_root().join("examples/policies/webhooks.yaml");
    node.kubectl([
        "apply",
        "-n",
        namespace.as_str(),
        "-f",
        &policy.display().to_string(),
    ])?
    .ok()?;
    node.kubectl([
        "wait",
        "-n",
        &namespace,
        "--for=condition=Ready",
        "retrypolicy/webhooks",
        "--timeout=60s",
    ])?
    .ok()?;
    let objects = yaml_documents(&repo_root().join(example))?
        .into_iter()
        .map(|o| as_test_worker(o, &collector.url()))
        .collect::<Result<Vec<_>>>()?;
    node.apply(&namespace, &objects)?;
    node.kubectl([
        "rollout",
        "status",
        "-n",
        &namespace,
        &format!("deployment/{name}"),
        "--timeout=180s",
    ])?
    .ok()?;
    let pod = running_pods(node, &namespace, name)?
        .into_iter()
        .next()
        .context("no Pod")?;
    // The sidecar started (and passed its startup probe) before the worker started.
    let sidecar_started =
        &pod["status"]["initContainerStatuses"][0]["state"]["running"]["startedAt"];
    let worker_started = &pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"];
    ensure!(
        sidecar_started.as_str() <= worker_started.as_str() && sidecar_started.is_string(),
        "sidecar started {sidecar_started}, worker {worker_started}"
    );
    let pod_name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let first = wait_for("the worker's first answer", Duration::from_secs(30), || {
        Ok(collector.reports_of(&pod_name).into_iter().next())
    })?;
    ensure!(first["seq"] == json!(1), "first report: {first}");
    // The worker asks over the socket the example shares with the sidecar.
    ensure!(
        first["target"] == json!("unix:///run/rebound/rebound.sock"),
        "the worker was not pointed at the sidecar's socket: {first}"
    );
    ensure!(
        first["source"] == json!("sidecar"),
        "the first call was not answered by the sidecar: {first}"
    );
    ensure!(
        first["policy"] == json!(format!("{namespace}/webhooks")),
        "answered by {} instead of {namespace}/webhooks",
        first["policy"]
    );
    Ok(Worker {
        namespace,
        deployment: name.to_string(),
    })
}

/// The example with the worker container's image replaced by the test worker, told
/// where to report; nothing else changes (the images are loaded: never pull).
fn as_test_worker(mut object: Value, report_url: &str) -> Result<Value> {
    if object["kind"] != json!("Deployment") {
        return Ok(object);
    }
    let spec = &mut object["spec"]["template"]["spec"];
    for sidecar in spec["initContainers"].as_array_mut().into_iter().flatten() {
        sidecar["imagePullPolicy"] = json!("Never");
    }
    let worker = spec["containers"]
        .as_array_mut()
        .and_then(|c| c.first_mut())
        .context("the example has no worker container")?;
    worker["image"] = json!(WORKER_IMAGE);
    worker["imagePullPolicy"] = json!("Never");
    let env = worker["env"]
        .as_array_mut()
        .context("the worker has no env")?;
    env.push(json!({"name": "REPORT_URL", "value": report_url}));
    env.push(json!({"name": "QUEUE", "value": "webhooks"}));
    env.push(
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
    );
    Ok(object)
}

/// The Pods labelled `app.kubernetes.io/name=<app>` in `namespace`.
fn pods_of(node: &Node, namespace: &str, app: &str) -> Result<Vec<Value>> {
    let pods = node.get_json([
        "pods",
        "-n",
        namespace,
        "-l",
        &format!("app.kubernetes.io/name={app}"),
    ])?;
    Ok(pods["items"].as_array().cloned().unwrap_or_default())
}

fn running_pods(node: &Node, namespace: &str, app: &str) -> Result<Vec<Value>> {
    Ok(pods_of(node, namespace, app)?
        .into_iter()
        .filter(|p| {
            p["metadata"]["deletionTimestamp"].is_null() && p["status"]["phase"] == json!("Running")
        })
        .collect())
}

// ---------------------------------------------------------------------------------------
// 3. A changed policy

fn policy_change_reaches_every_sidecar(
    node: &Node,
    collector: &Collector,
    workers: &[&Worker],
) -> Result<()> {
    for worker in workers {
        let policy = node.get_json(["retrypolicy", "-n", &worker.namespace, "webhooks"])?;
        let generation = policy["metadata"]["generation"].as_i64().unwrap_or(0);
        let changed = json!({
            "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
            "metadata": {"name": "webhooks"},
            "spec": {"queues": ["webhooks"], "maxAttempts": 3,
                     "backoff": {"strategy": "constant", "base": "250ms"}},
        });
        let applied = Instant::now();
        node.apply(&worker.namespace, &[changed])?;
        let pod = running_pods(node, &worker.namespace, &worker.deployment)?
            .into_iter()
            .next()
            .context("no Pod")?;
        let pod_name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let since = collector.len();
        let report = wait_for(
            "an answer from the changed policy",
            Duration::from_secs(150),
            || {
                Ok(collector.reports_since(since).into_iter().find(|r| {
                    r["pod"] == json!(pod_name) && r["generation"].as_i64() > Some(generation)
                }))
            },
        )?;
        eprintln!(
            "node: {}: the sidecar answered the changed policy {:.1}s after kubectl apply",
            worker.deployment,
            applied.elapsed().as_secs_f64()
        );
        ensure!(report["source"] == json!("sidecar"), "{report}");
        // Attempt 3 of 3 is now the last one.
        let last = wait_for("an answer for attempt 3", Duration::from_secs(10), || {
            Ok(collector.reports_since(since).into_iter().find(|r| {
                r["pod"] == json!(pod_name)
                    && r["generation"].as_i64() > Some(generation)
                    && r["attempt"] == json!(3)
            }))
        })?;
        ensure!(
            last["decision"] == json!("DECISION_GIVE_UP"),
            "attempt 3: {last}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 3b. A policy change rolled out by `kubectl apply`, watched by `kubectl rebound rollout`

/// The `webhooks` policy at `max_attempts` with one manual 50 % step.
fn rolled_webhooks(max_attempts: u32) -> Value {
    json!({
        "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
        "metadata": {"name": "webhooks"},
        "spec": {"queues": ["webhooks"], "maxAttempts": max_attempts,
                 "backoff": {"strategy": "constant", "base": "250ms"},
                 "rollout": {"steps": [{"weight": 50}]}},
    })
}

/// The policy once the operator has observed its generation and its rollout is `phase`.
fn rollout_in_phase(node: &Node, namespace: &str, phase: &str) -> Result<Value> {
    wait_for(
        &format!("the rollout to be {phase}"),
        Duration::from_secs(60),
        || {
            let p = node.get_json(["retrypolicy", "-n", namespace, "webhooks"])?;
            let observed = p["status"]["observedGeneration"] == p["metadata"]["generation"];
            Ok((observed && p["status"]["rollout"]["phase"] == json!(phase)).then_some(p))
        },
    )
}

/// `kubectl rebound ARGS` against the node's cluster.
fn plugin(node: &Node, args: &[&str]) -> Result<std::process::Command> {
    let mut cmd =
        std::process::Command::new(rebound_test_support::workspace_binary("kubectl-rebound")?);
    cmd.env("KUBECONFIG", node.kubeconfig()).args(args);
    Ok(cmd)
}

fn policy_rollout_is_watched_and_promoted(
    node: &Node,
    collector: &Collector,
    worker: &Worker,
) -> Result<()> {
    let ns = worker.namespace.as_str();
    // The first revision that declares `rollout` applies at once.
    node.apply(ns, &[rolled_webhooks(3)])?;
    let healthy = rollout_in_phase(node, ns, "Healthy")?;
    let stable = healthy["status"]["rollout"]["revision"].clone();
    let pod = running_pods(node, ns, &worker.deployment)?
        .into_iter()
        .next()
        .context("no Pod")?;
    let pod_name = pod["metadata"]["name"].clone();

    let since = collector.len();
    node.apply(ns, &[rolled_webhooks(4)])?;
    let paused = rollout_in_phase(node, ns, "Paused")?;
    let canary = paused["status"]["rollout"]["revision"].clone();
    ensure!(canary != stable, "a new revision: {paused}");
    // The Pod's sidecar answers jobs from both revisions, each job from one.
    let answers = wait_for(
        "the Pod's answers from both revisions",
        Duration::from_secs(60),
        || {
            let answers: Vec<Value> = collector
                .reports_since(since)
                .into_iter()
                .filter(|r| r["pod"] == pod_name && r["source"] == json!("sidecar"))
                .filter(|r| r["revision"] == canary || r["revision"] == stable)
                .collect();
            let both = answers.iter().any(|r| r["revision"] == canary)
                && answers.iter().any(|r| r["revision"] == stable);
            Ok((both && answers.len() >= 20).then_some(answers))
        },
    )?;
    let mut per_job: BTreeMap<String, Value> = BTreeMap::new();
    for a in &answers {
        let job = a["job"].as_str().unwrap_or_default().to_owned();
        let first = per_job
            .entry(job.clone())
            .or_insert_with(|| a["revision"].clone());
        ensure!(
            *first == a["revision"],
            "{job} got two revisions: {first} and {a}"
        );
    }
    // What the Pod's sidecar counted reached the operator through its Lease.
    wait_for(
        "the sidecar's evidence in the status",
        Duration::from_secs(60),
        || {
            let p = node.get_json(["retrypolicy", "-n", ns, "webhooks"])?;
            let seen: u64 = p["status"]["rollout"]["evidence"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|e| e["steps"].as_array().cloned().unwrap_or_default())
                .filter_map(|s| s["seen"][1].as_u64())
                .sum();
            Ok((seen > 0).then_some(()))
        },
    )?;

    // A person watches and promotes: the watch ends with 0 on Healthy.
    let out_path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(rebound_tests::unique_name("rollout-status"));
    let mut watch = rebound_tests::process::Running(
        plugin(
            node,
            &[
                "rollout",
                "status",
                "webhooks",
                "-n",
                ns,
                "--timeout=120s",
                "-o",
                "json",
            ],
        )?
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::process::Stdio::null())
        .spawn()?,
    );
    let promote = plugin(node, &["rollout", "promote", "webhooks", "-n", ns])?.output()?;
    ensure!(
        promote.status.success(),
        "promote: {}",
        String::from_utf8_lossy(&promote.stderr)
    );
    let exit = watch.0.wait()?;
    let printed = std::fs::read_to_string(&out_path)?;
    ensure!(exit.success(), "rollout status exited {exit}: {printed}");
    let last = json_lines(&printed)
        .pop()
        .context("rollout status printed nothing")?;
    assert_eq!(last["phase"], json!("Healthy"), "{last}");
    let promoted = rollout_in_phase(node, ns, "Healthy")?;
    assert_eq!(promoted["status"]["rollout"]["stableRevision"], canary);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 5. Rollout restart

fn rollout_restart_loses_no_call(
    node: &Node,
    collector: &Collector,
    worker: &Worker,
) -> Result<()> {
    let old: Vec<String> = running_pods(node, &worker.namespace, &worker.deployment)?
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .collect();
    let since = collector.len();
    let deployment = format!("deployment/{}", worker.deployment);
    node.kubectl(["rollout", "restart", "-n", &worker.namespace, &deployment])?
        .ok()?;
    node.kubectl([
        "rollout",
        "status",
        "-n",
        &worker.namespace,
        &deployment,
        "--timeout=180s",
    ])?
    .ok()?;
    for pod in &old {
        let stopped = wait_for(
            "the old worker's stop report",
            Duration::from_secs(60),
            || {
                Ok(collector
                    .reports_since(since)
                    .into_iter()
                    .find(|r| r["pod"] == json!(pod) && r["event"] == json!("stopped")))
            },
        )?;
        ensure!(
            stopped["fallbacks"] == json!(0),
            "{pod} fell back during the restart: {stopped}"
        );
    }
    let reports = collector.reports_since(since);
    let fallbacks: Vec<&Value> = reports
        .iter()
        .filter(|r| r["event"] == json!("answer") && r["source"] != json!("sidecar"))
        .collect();
    ensure!(
        fallbacks.is_empty(),
        "answers not from the sidecar during the restart: {fallbacks:#?}"
    );
    let new = running_pods(node, &worker.namespace, &worker.deployment)?;
    let new_name = new
        .first()
        .and_then(|p| p["metadata"]["name"].as_str())
        .context("no new Pod")?;
    ensure!(
        !old.iter().any(|o| o == new_name),
        "the Pod was not replaced"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 4. Leader failover

fn leader_failover(node: &Node, worker: &Worker) -> Result<()> {
    let holder = lease_holder(node)?;
    let pods = operator_pods(node)?;
    let leader = pods
        .iter()
        .find(|p| holder.starts_with(p.as_str()))
        .context("no leader Pod")?
        .clone();
    let deleted = Instant::now();
    node.kubectl(["delete", "pod", "-n", OPERATOR_NS, &leader, "--wait=false"])?
        .ok()?;
    let new_holder = wait_for(
        "another replica to take the Lease",
        Duration::from_secs(60),
        || {
            let h = lease_holder(node)?;
            Ok((!h.starts_with(leader.as_str())).then_some(h))
        },
    )?;
    eprintln!(
        "node: the Lease moved to {new_holder} {:.1}s after the leader Pod was deleted",
        deleted.elapsed().as_secs_f64()
    );
    ensure!(
        deleted.elapsed() < Duration::from_secs(30),
        "took longer than leaseDuration + grace"
    );
    node.kubectl([
        "rollout",
        "status",
        "-n",
        OPERATOR_NS,
        "deployment/rebound-operator",
        "--timeout=120s",
    ])?
    .ok()?;
    node.kubectl([
        "wait",
        "-n",
        &worker.namespace,
        "--for=condition=Ready",
        "retrypolicy/webhooks",
        "--timeout=60s",
    ])?
    .ok()?;
    // At rest the operators write nothing: the policy and the ConfigMap keep their version.
    let versions = || -> Result<(String, String)> {
        let p = node.get_json(["retrypolicy", "-n", &worker.namespace, "webhooks"])?;
        let c = node.get_json(["configmap", "-n", &worker.namespace, "rebound-policies"])?;
        Ok((
            p["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            c["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        ))
    };
    std::thread::sleep(Duration::from_secs(5));
    let at_rest = versions()?;
    std::thread::sleep(Duration::from_secs(20));
    ensure!(
        versions()? == at_rest,
        "the operator wrote the policy or the ConfigMap at rest"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Bad input: a wrong --configmap

fn wrong_configmap_is_not_ready_and_falls_back(
    node: &Node,
    collector: &Collector,
    worker: &Worker,
) -> Result<()> {
    let deployment = node.get_json(["deployment", "-n", &worker.namespace, &worker.deployment])?;
    let mut broken = deployment.clone();
    let args = broken["spec"]["template"]["spec"]["initContainers"][0]["args"]
        .as_array_mut()
        .context("no sidecar args")?;
    for arg in args.iter_mut() {
        if arg.as_str().is_some_and(|a| a.starts_with("--configmap=")) {
            *arg = json!("--configmap=$(POD_NAMESPACE)/no-such-configmap");
        }
    }
    broken["metadata"] =
        json!({"name": "worker-broken", "labels": {"app.kubernetes.io/name": "worker-broken"}});
    broken["spec"]["selector"] =
        json!({"matchLabels": {"app.kubernetes.io/name": "worker-broken"}});
    broken["spec"]["template"]["metadata"]["labels"] =
        json!({"app.kubernetes.io/name": "worker-broken"});
    broken.as_object_mut().map(|o| o.remove("status"));
    node.apply(&worker.namespace, &[broken])?;
    let pod = wait_for("the broken Pod", Duration::from_secs(60), || {
        let pods = node.get_json([
            "pods",
            "-n",
            &worker.namespace,
            "-l",
            "app.kubernetes.io/name=worker-broken",
        ])?;
        Ok(pods["items"].as_array().and_then(|p| p.first()).cloned())
    })?;
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // The sidecar never passes its startup probe: the Pod is not Ready and says why.
    std::thread::sleep(Duration::from_secs(10));
    let pod = node.get_json(["pod", "-n", &worker.namespace, &name])?;
    let ready = pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == json!("Ready"))
        .map(|c| c["status"].clone());
    ensure!(
        ready == Some(json!("False")),
        "the Pod with a wrong --configmap is Ready: {ready:?}"
    );
    let missing = format!("configmap/{}/no-such-configmap", worker.namespace);
    let logs = node.json_logs(&worker.namespace, &name, "rebound")?;
    ensure!(
        logs.iter().any(|l| l["level"] == json!("WARN")
            && l["fields"]["origin"] == json!(missing)
            && l["fields"]["state"] == json!("none")),
        "no warning names {missing}: {logs:#?}"
    );
    // The startup probe holds the worker back: it never ran against an unloaded sidecar.
    let worker_state = &pod["status"]["containerStatuses"][0]["state"];
    ensure!(
        worker_state["running"].is_null(),
        "the worker started: {worker_state}"
    );
    let asked = collector.reports_of(&name);
    ensure!(asked.is_empty(), "the held-back worker asked: {asked:#?}");
    node.kubectl([
        "delete",
        "deployment",
        "-n",
        &worker.namespace,
        "worker-broken",
        "--wait=false",
    ])?
    .ok()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Faults: kubelet and containerd restarts

fn container_ids(node: &Node, worker: &Worker) -> Result<BTreeMap<String, (String, i64)>> {
    let mut ids = BTreeMap::new();
    for pod in running_pods(node, &worker.namespace, &worker.deployment)? {
        for status in ["initContainerStatuses", "containerStatuses"] {
            for c in pod["status"][status].as_array().into_iter().flatten() {
                ids.insert(
                    format!(
                        "{}/{}",
                        pod["metadata"]["name"].as_str().unwrap_or_default(),
                        c["name"].as_str().unwrap_or_default()
                    ),
                    (
                        c["containerID"].as_str().unwrap_or_default().to_string(),
                        c["restartCount"].as_i64().unwrap_or(-1),
                    ),
                );
            }
        }
    }
    Ok(ids)
}

fn node_restarts_keep_containers(node: &Node, worker: &Worker) -> Result<()> {
    let before = container_ids(node, worker)?;
    ensure!(!before.is_empty(), "no containers");
    for process in ["kubelet", "containerd"] {
        node.kill_and_restart(process)?;
        std::thread::sleep(Duration::from_secs(10));
        node.kubectl([
            "rollout",
            "status",
            "-n",
            &worker.namespace,
            &format!("deployment/{}", worker.deployment),
            "--timeout=120s",
        ])?
        .ok()?;
        let after = container_ids(node, worker)?;
        ensure!(
            after == before,
            "after {process} restarted the containers changed:\nbefore {before:#?}\nafter {after:#?}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 6. helm upgrade and uninstall

fn upgrade_and_uninstall_keep_policies(node: &Node, worker: &Worker) -> Result<()> {
    let chart = chart_dir("rebound").display().to_string();
    let before = node.get_json(["deployment", "-n", OPERATOR_NS, "rebound-operator"])?;
    node.helm(&[
        "upgrade",
        "rebound",
        &chart,
        "--namespace",
        OPERATOR_NS,
        "--set",
        "image.pullPolicy=Never",
        "--set",
        "logLevel=debug",
        "--wait",
        "--timeout",
        "180s",
    ])?;
    let after = node.get_json(["deployment", "-n", OPERATOR_NS, "rebound-operator"])?;
    ensure!(
        after["metadata"]["generation"].as_i64() > before["metadata"]["generation"].as_i64(),
        "helm upgrade did not change the Deployment"
    );
    ensure!(
        after["status"]["updatedReplicas"] == json!(2)
            && after["status"]["readyReplicas"] == json!(2),
        "{}",
        after["status"]
    );
    node.helm(&["uninstall", "rebound", "--namespace", OPERATOR_NS, "--wait"])?;
    node.helm(&["uninstall", "rebound-crds", "--wait"])?;
    node.get_json(["crd", "retrypolicies.rebound.dev"])
        .context("the CRD is gone")?;
    node.get_json(["retrypolicy", "-n", &worker.namespace, "webhooks"])
        .context("the policy is gone")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The collector: the workers POST every answer to the node's address.

#[derive(Clone)]
struct Collector {
    url: String,
    reports: Arc<Mutex<Vec<Value>>>,
}

impl Collector {
    fn start() -> Result<Collector> {
        let listener =
            TcpListener::bind((NODE_IP, 0)).context("listening on the node's address")?;
        let url = format!("http://{}/report", listener.local_addr()?);
        let reports = Arc::new(Mutex::new(Vec::new()));
        let sink = reports.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let sink = sink.clone();
                std::thread::spawn(move || {
                    let _ = serve(stream, &sink);
                });
            }
        });
        Ok(Collector { url, reports })
    }

    fn url(&self) -> String {
        self.url.clone()
    }

    fn len(&self) -> usize {
        self.reports.lock().map(|r| r.len()).unwrap_or(0)
    }

    fn reports_since(&self, from: usize) -> Vec<Value> {
        self.reports
            .lock()
            .map(|r| r.get(from..).map(<[Value]>::to_vec).unwrap_or_default())
            .unwrap_or_default()
    }

    fn reports_of(&self, pod: &str) -> Vec<Value> {
        self.reports_since(0)
            .into_iter()
            .filter(|r| r["pod"] == json!(pod))
            .collect()
    }
}

/// One HTTP/1.1 connection: each POST body is a report; answers 204.
fn serve(stream: std::net::TcpStream, sink: &Mutex<Vec<Value>>) -> Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().context("Content-Length")?;
            }
        }
        if length > 1 << 20 {
            bail!("report too large");
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        if let Some(report) = json_lines(&String::from_utf8_lossy(&body))
            .into_iter()
            .next()
            && let Ok(mut reports) = sink.lock()
        {
            reports.push(report);
        }
        writer.write_all(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")?;
    }
}
