//! The failures `monitoring_node` drives, each in a `restricted` namespace of its own with
//! the test worker (`dev/node/worker`, its adapter counters on [`WORKER_METRICS_PORT`])
//! beside a sidecar: hand-written as in `examples/worker/worker.yaml`, or injected by the
//! chart, so both of the chart's PodMonitors find one.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use rebound_tests::node::{Node, WORKER_IMAGE, wait_for};
use rebound_tests::{repo_root, yaml_documents};
use serde_json::{Value, json};

use crate::WORKER_METRICS_PORT;

/// A worker Deployment's one Pod.
pub struct Worker {
    pub namespace: String,
    pub pod: String,
    /// The job of its sidecar's series: the chart's PodMonitor that selects it.
    pub sidecar_job: &'static str,
    /// The sidecar's container name.
    pub sidecar: &'static str,
}

/// Hand-written sidecars (`examples/worker/worker.yaml`): PodMonitor and container.
const HAND_WRITTEN: (&str, &str) = ("rebound-system/rebound-sidecar-hand-written", "rebound");
/// Injected sidecars (the chart's admission policy): PodMonitor and container.
const INJECTED: (&str, &str) = ("rebound-system/rebound-sidecar", "rebound-sidecar");

pub struct Scenarios {
    /// Its sidecar gets stopped: the worker falls back.
    fallback: Worker,
    /// Policy `storm`: every job dead-lettered at its second failure, retries over budget.
    storm: Worker,
    /// Its sidecar reads `pinned-policies`, a copy the test controls.
    stale: Worker,
    /// The operator's hash that `pinned-policies` holds at the start.
    pinned_hash: String,
    /// Policies `first` and `second` on one queue.
    not_ready: String,
}

/// A stopped process, continued (SIGCONT) when dropped, on failure too.
pub struct Stopped(libc::pid_t);

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a PID and a signal number has no memory effects.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

impl Scenarios {
    /// Namespaces, policies and workers, applied together and then waited for.
    pub fn start(node: &Node) -> Result<Scenarios> {
        let namespaces: Vec<String> = ["mon-fallback", "mon-storm", "mon-stale", "mon-notready"]
            .iter()
            .map(|p| node.restricted_namespace(p))
            .collect::<Result<_>>()?;
        let [fallback, storm, stale, not_ready] = namespaces.as_slice() else {
            unreachable!("four prefixes")
        };
        let webhooks = yaml_documents(&repo_root().join("examples/policies/webhooks.yaml"))?;
        node.apply(fallback, &webhooks)?;
        node.apply(stale, &webhooks)?;
        node.apply(storm, &[storm_policy()])?;
        node.apply(not_ready, &[queue_policy("first", "reports")])?;
        for ns in &namespaces {
            node.kubectl([
                "wait",
                "-n",
                ns,
                "--for=condition=Ready",
                "retrypolicy",
                "--all",
                "--timeout=60s",
            ])?
            .ok()?;
        }
        // Created after `first` is Ready: the older policy keeps the queue.
        node.apply(not_ready, &[queue_policy("second", "reports")])?;
        let compiled = node.get_json(["configmap", "-n", stale, "rebound-policies"])?;
        let pinned_hash = compiled["metadata"]["annotations"]["rebound.dev/hash"]
            .as_str()
            .context("rebound-policies has no hash annotation")?
            .to_string();
        node.apply(stale, &[pinned(&compiled["data"])])?;

        // 20 calls a second: the fallback share falls quickly once the sidecar is back.
        node.apply(
            fallback,
            &[worker("rebound-policies", &[("INTERVAL", "50ms")])?],
        )?;
        // Attempts 1 and 2 of each job: 5 budgeted retries and 5 dead letters a second; its
        // sidecar injected (watch mode, a fleet Lease), with /metrics on the Pod IP.
        node.apply(storm, &[injected_worker(&[("ATTEMPTS", "2")])])?;
        node.apply(stale, &[worker("pinned-policies", &[])?])?;
        let mut pods = Vec::new();
        for (ns, (sidecar_job, sidecar)) in [
            (fallback, HAND_WRITTEN),
            (storm, INJECTED),
            (stale, HAND_WRITTEN),
        ] {
            node.kubectl([
                "rollout",
                "status",
                "-n",
                ns,
                "deployment/worker",
                "--timeout=180s",
            ])?
            .ok()?;
            pods.push(Worker {
                namespace: ns.clone(),
                pod: running_pod(node, ns)?,
                sidecar_job,
                sidecar,
            });
        }
        let stale = pods.pop().context("three workers")?;
        let storm = pods.pop().context("three workers")?;
        let fallback = pods.pop().context("three workers")?;
        Ok(Scenarios {
            fallback,
            storm,
            stale,
            pinned_hash,
            not_ready: not_ready.clone(),
        })
    }

    pub fn workers(&self) -> [&Worker; 3] {
        [&self.fallback, &self.storm, &self.stale]
    }

    /// Stops the fallback worker's sidecar (SIGSTOP: its process stays, answers nothing)
    /// until the returned value is dropped; moves the stale namespace's policy on (a new
    /// hash) while `pinned-policies` gets a document the sidecar refuses.
    pub fn break_things(&self, node: &Node) -> Result<Stopped> {
        let pod = node.get_json(["pod", "-n", &self.fallback.namespace, &self.fallback.pod])?;
        let id = pod["status"]["initContainerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == "rebound")
            .and_then(|c| c["containerID"].as_str())
            .and_then(|id| id.strip_prefix("containerd://"))
            .context("the sidecar has no container ID")?;
        let pid = libc::pid_t::try_from(node.container_pid(id)?)?;
        // SAFETY: kill(2) with a PID and a signal number has no memory effects.
        ensure!(
            unsafe { libc::kill(pid, libc::SIGSTOP) } == 0,
            "SIGSTOP {pid}"
        );
        let stopped = Stopped(pid);
        let mut changed = yaml_documents(&repo_root().join("examples/policies/webhooks.yaml"))?;
        changed[0]["spec"]["maxAttempts"] = json!(3);
        node.apply(&self.stale.namespace, &changed)?;
        node.apply(
            &self.stale.namespace,
            &[pinned(
                &json!({"policies.json": "{\"not\": \"a compiled document\"}"}),
            )],
        )?;
        Ok(stopped)
    }

    /// The fallback worker's alert.
    pub fn fallback_alert(&self) -> Value {
        json!({"alertname": "ReboundWorkersOnFallback", "namespace": self.fallback.namespace,
               "pod": self.fallback.pod, "adapter": "river"})
    }

    /// Labels each alert but the fallback one must fire with.
    pub fn firing(&self) -> Vec<Value> {
        let mut all = self.fixed();
        all.remove(0);
        all.extend(self.unfixed());
        all
    }

    /// Alerts [`Scenarios::fix`] resolves.
    pub fn fixed(&self) -> Vec<Value> {
        let (ns, pod) = (&self.stale.namespace, &self.stale.pod);
        vec![
            self.fallback_alert(),
            json!({"alertname": "ReboundSidecarConfigStale", "namespace": ns, "pod": pod,
                   "container": "rebound", "config_hash": self.pinned_hash}),
            json!({"alertname": "ReboundSidecarConfigReloadFailing", "namespace": ns,
                   "pod": pod, "state": "stale"}),
            json!({"alertname": "ReboundPolicyNotReady", "namespace": self.not_ready,
                   "policy": "second"}),
        ]
    }

    /// Alerts left firing: their windows (1 h, 10 min) outlast the test.
    pub fn unfixed(&self) -> Vec<Value> {
        let policy = format!("{}/storm", self.storm.namespace);
        [
            "ReboundDeadLetterRateHigh",
            "ReboundRetriesStretchedByBudget",
        ]
        .iter()
        .map(|name| {
            json!({"alertname": name, "namespace": self.storm.namespace,
                               "policy": policy})
        })
        .collect()
    }

    /// Each of `expected` (alert labels without `severity`) fires with exactly those
    /// labels, and for its own namespace only among the test's.
    pub fn check_labels(&self, firing: &[Value], expected: &[Value]) -> Result<()> {
        let mine = [
            self.fallback.namespace.as_str(),
            &self.storm.namespace,
            &self.stale.namespace,
            &self.not_ready,
        ];
        for labels in expected {
            let name = &labels["alertname"];
            let alerts: Vec<&Value> = firing
                .iter()
                .filter(|a| a["labels"]["alertname"] == *name)
                .filter(|a| mine.contains(&a["labels"]["namespace"].as_str().unwrap_or_default()))
                .collect();
            let mut labels = labels.clone();
            labels["severity"] = json!("warning");
            ensure!(
                alerts.len() == 1 && alerts[0]["labels"] == labels,
                "{name}: {alerts:#?}"
            );
        }
        Ok(())
    }

    /// Gives the stale sidecar the operator's current document and renames the losing
    /// policy's queue (the stopped sidecar is continued by dropping its [`Stopped`]).
    pub fn fix(&self, node: &Node) -> Result<()> {
        let ns = &self.stale.namespace;
        let compiled =
            wait_for(
                "the operator's new document",
                Duration::from_secs(30),
                || {
                    let cm = node.get_json(["configmap", "-n", ns, "rebound-policies"])?;
                    Ok((cm["metadata"]["annotations"]["rebound.dev/hash"]
                        != self.pinned_hash.as_str())
                    .then_some(cm))
                },
            )?;
        node.apply(ns, &[pinned(&compiled["data"])])?;
        node.apply(&self.not_ready, &[queue_policy("second", "exports")])?;
        Ok(())
    }
}

/// Every job dead-lettered at its second failure; a retry budget of 1 a second.
fn storm_policy() -> Value {
    json!({"apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
           "metadata": {"name": "storm"},
           "spec": {"queues": ["webhooks"], "maxAttempts": 2,
                    "backoff": {"strategy": "constant", "base": "1s"},
                    "terminal": {"action": "deadLetter", "deadLetterQueue": "webhooks-dead"},
                    "retryBudget": {"ratePerSecond": 1, "burst": 1}}})
}

fn queue_policy(name: &str, queue: &str) -> Value {
    json!({"apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
           "metadata": {"name": name},
           "spec": {"queues": [queue], "maxAttempts": 5,
                    "backoff": {"strategy": "constant", "base": "1s"}}})
}

/// The ConfigMap `pinned-policies` with `data`.
fn pinned(data: &Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pinned-policies"},
           "data": data})
}

/// The test worker with nothing but `rebound.dev/inject: "true"` (and `rebound.dev/metrics:
/// "true"`, as `injection.metrics` would set for a PodMonitor): the chart adds its sidecar.
fn injected_worker(env: &[(&str, &str)]) -> Value {
    let mut vars = worker_env();
    vars.extend(env.iter().map(|(n, v)| json!({"name": n, "value": v})));
    json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "worker"},
    "spec": {"replicas": 1,
             "selector": {"matchLabels": {"app.kubernetes.io/name": "worker"}},
             "template": {
                 "metadata": {"labels": {"app.kubernetes.io/name": "worker"},
                              "annotations": {"rebound.dev/inject": "true",
                                              "rebound.dev/metrics": "true"}},
                 "spec": {
                     "automountServiceAccountToken": false,
                     "securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{
                         "name": "worker", "image": WORKER_IMAGE,
                         "imagePullPolicy": "Never", "env": vars,
                         "ports": [{"name": "metrics",
                                    "containerPort": WORKER_METRICS_PORT}],
                         "securityContext": {"allowPrivilegeEscalation": false,
                                             "capabilities": {"drop": ["ALL"]}},
                     }]}}}})
}

/// What every test worker is told: its queue, name, and where to serve its counters.
fn worker_env() -> Vec<Value> {
    vec![
        json!({"name": "QUEUE", "value": "webhooks"}),
        json!({"name": "METRICS_LISTEN", "value": format!(":{WORKER_METRICS_PORT}")}),
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
    ]
}

/// `examples/worker/worker.yaml` with the test worker (serving its adapter counters on
/// the port named `metrics`, `env` added) and the sidecar reading `configmap`.
fn worker(configmap: &str, env: &[(&str, &str)]) -> Result<Value> {
    let mut deployment = yaml_documents(&repo_root().join("examples/worker/worker.yaml"))?
        .into_iter()
        .find(|o| o["kind"] == "Deployment")
        .context("the example has no Deployment")?;
    let spec = &mut deployment["spec"]["template"]["spec"];
    for sidecar in spec["initContainers"].as_array_mut().into_iter().flatten() {
        sidecar["imagePullPolicy"] = json!("Never");
    }
    for volume in spec["volumes"].as_array_mut().into_iter().flatten() {
        if volume["name"] == "rebound-policies" {
            volume["configMap"]["name"] = json!(configmap);
        }
    }
    let container = spec["containers"]
        .as_array_mut()
        .and_then(|c| c.first_mut())
        .context("the example has no worker container")?;
    container["image"] = json!(WORKER_IMAGE);
    container["imagePullPolicy"] = json!("Never");
    container["ports"] = json!([{"name": "metrics", "containerPort": WORKER_METRICS_PORT}]);
    let vars = container["env"]
        .as_array_mut()
        .context("the worker has no env")?;
    vars.extend(worker_env());
    for (name, value) in env {
        vars.push(json!({"name": name, "value": value}));
    }
    Ok(deployment)
}

fn running_pod(node: &Node, namespace: &str) -> Result<String> {
    let pods = node.get_json([
        "pods",
        "-n",
        namespace,
        "-l",
        "app.kubernetes.io/name=worker",
    ])?;
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null() && p["status"]["phase"] == "Running")
        .and_then(|p| p["metadata"]["name"].as_str())
        .map(String::from)
        .with_context(|| format!("no running worker Pod in {namespace}"))
}
