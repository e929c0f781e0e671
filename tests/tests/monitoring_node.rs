//! Rebound's alerts and dashboard against a real Prometheus scraping real Pods on the node
//! (`dev/cluster-up.sh --node`): the chart's operator and workers with their sidecars and
//! the Go adapter's counters. Prometheus (`dev/prometheus.sh`, on 127.0.0.1) finds them
//! through Kubernetes service discovery against the node's API server, with the scrape
//! configs made from the chart's own PodMonitor and ServiceMonitor (`rebound_tests::scrape`),
//! and loads `monitoring/rules.yaml` with only the alerts' `for:` shortened (every other
//! field as in the file, checked).
//!
//! Real failures, concurrently, each in its own namespace:
//!
//! | failure | alert | after the fix |
//! |---|---|---|
//! | the worker's sidecar process stopped (SIGSTOP) | ReboundWorkersOnFallback | sidecar continued: resolved |
//! | a policy dead-lettering every job's second failure, its retry budget at 1/s under 5 retries/s (10 decisions/s) | ReboundDeadLetterRateHigh, ReboundRetriesStretchedByBudget | not fixed: still firing (their 1 h and 10 min windows outlast a test) |
//! | the sidecar's ConfigMap replaced by one it refuses while the operator compiles a new hash | ReboundSidecarConfigStale, ReboundSidecarConfigReloadFailing | the operator's document copied in: resolved |
//! | a RetryPolicy losing its queue to an older one | ReboundPolicyNotReady | its queue renamed: resolved |
//!
//! While every alert fires, every dashboard query returns series. One node per machine
//! (`.state/node`, or `REBOUND_NODE_STATE_DIR`): the test stops it, and Prometheus, on
//! failure too, and checks that nothing of the node is left on the host.

#[path = "monitoring_node/scenarios.rs"]
mod scenarios;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use rebound_tests::helm::{Helm, chart_dir, manifests};
use rebound_tests::node::{Node, on_a_node, wait_for};
use rebound_tests::prometheus::{Server, dashboard_queries};
use rebound_tests::scrape::{ApiServer, scrape_configs};
use rebound_tests::{json_contains, repo_root, yaml_documents};
use scenarios::Scenarios;
use serde_json::{Value, json};

const OPERATOR_NS: &str = "rebound-system";
/// Every alert's `for:` in the test's copy of the rules (the file says 5 to 30 minutes).
const ALERT_FOR: &str = "3s";
/// Scrape and evaluation interval (the chart's monitors say 30s).
const INTERVAL: &str = "1s";
/// Where the test worker serves the adapter's counters (`METRICS_LISTEN`).
const WORKER_METRICS_PORT: u16 = 9091;

#[test]
fn alerts_fire_on_real_failures_and_resolve_after_the_fix() -> Result<()> {
    on_a_node("monitoring_node", run_steps)
}

fn run_steps(node: &Node) -> Result<()> {
    node.install_charts(OPERATOR_NS)
        .context("step: helm install of both charts")?;
    let scenarios = Scenarios::start(node).context("step: the scenarios' workers")?;
    // Declared before the server: dropped after it.
    let tmp = tempfile::tempdir()?;
    let config = prometheus_config(node, tmp.path()).context("step: the scrape configs")?;
    let server = Server::up(&tmp.path().join("prometheus"), &config)?;
    targets_are_discovered(&server, &scenarios).context("step: service discovery")?;
    let stopped = scenarios.break_things(node)?;
    // The sidecar continues once its worker's alert fires (before its liveness probe
    // restarts it); the alert resolves while the others fire.
    let fallback = [scenarios.fallback_alert()];
    let fired = wait_for_alerts(&server, &fallback, Duration::from_secs(50))
        .context("step: ReboundWorkersOnFallback firing")?;
    drop(stopped);
    scenarios.check_labels(&fired, &fallback)?;
    let fired = wait_for_alerts(&server, &scenarios.firing(), Duration::from_secs(120))
        .context("step: every other alert firing")?;
    scenarios.check_labels(&fired, &scenarios.unfixed())?;
    every_dashboard_query_returns_data(&server).context("step: the dashboard")?;
    scenarios.fix(node)?;
    resolved(&server, &scenarios).context("step: the fixed ones resolved")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The chart and Prometheus

/// Writes the Prometheus config (and the rules' copy) into `dir`: the scrape configs of
/// the chart's rendered PodMonitors and ServiceMonitor, and of the workers' own PodMonitor
/// for their adapter counters (a user's, not the chart's).
fn prometheus_config(node: &Node, dir: &Path) -> Result<std::path::PathBuf> {
    let kubeconfig = yaml_documents(node.kubeconfig())?
        .pop()
        .context("empty kubeconfig")?;
    let pki = node.state_dir().join("pki");
    let file = |name: &str| pki.join(name).display().to_string();
    let api = ApiServer {
        url: kubeconfig["clusters"][0]["cluster"]["server"]
            .as_str()
            .context("the kubeconfig names no server")?
            .to_string(),
        ca_file: file("ca.crt"),
        cert_file: file("admin.crt"),
        key_file: file("admin.key"),
    };
    let rendered = Helm::get()?
        .template(
            "rebound",
            &chart_dir("rebound"),
            OPERATOR_NS,
            &[],
            &[
                "metrics.podMonitor.enabled=true".to_string(),
                "metrics.serviceMonitor.enabled=true".to_string(),
            ],
        )?
        .ok()?;
    let mut monitors: Vec<Value> = manifests(&rendered.stdout)?
        .into_iter()
        .filter(|o| o["kind"] == "PodMonitor" || o["kind"] == "ServiceMonitor")
        .collect();
    ensure!(
        monitors.len() == 3,
        "the chart renders {} monitors",
        monitors.len()
    );
    monitors.push(json!({
        "kind": "PodMonitor",
        "metadata": {"name": "worker-adapter", "namespace": OPERATOR_NS},
        "spec": {"namespaceSelector": {"any": true},
                 "selector": {"matchLabels": {"app.kubernetes.io/name": "worker"}},
                 "podMetricsEndpoints": [{"port": "metrics"}]},
    }));
    let mut scrape = Vec::new();
    for monitor in &monitors {
        scrape.extend(scrape_configs(monitor, &api, INTERVAL)?);
    }
    let rules = dir.join("rules.json");
    std::fs::write(&rules, serde_json::to_string(&rules_copy()?)?)?;
    let config = json!({
        "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
        "rule_files": [rules],
        "scrape_configs": scrape,
    });
    let path = dir.join("prometheus.json");
    std::fs::write(&path, serde_json::to_string(&config)?)?;
    Ok(path)
}

/// `monitoring/rules.yaml` with every alert's `for` set to [`ALERT_FOR`]; checked to
/// differ from the file in nothing else.
fn rules_copy() -> Result<Value> {
    let original = yaml_documents(&repo_root().join("monitoring/rules.yaml"))?
        .pop()
        .context("empty rules file")?;
    let mut copy = original.clone();
    let mut alerts = 0;
    for group in copy["groups"].as_array_mut().into_iter().flatten() {
        for rule in group["rules"].as_array_mut().into_iter().flatten() {
            if rule.get("alert").is_some() {
                rule["for"] = json!(ALERT_FOR);
                alerts += 1;
            }
        }
    }
    ensure!(alerts >= 10, "{alerts} alerts in monitoring/rules.yaml");
    let mut back = copy.clone();
    let groups = back["groups"].as_array_mut().into_iter().flatten();
    for (group, orig) in groups.zip(original["groups"].as_array().into_iter().flatten()) {
        let rules = group["rules"].as_array_mut().into_iter().flatten();
        for (rule, orig) in rules.zip(orig["rules"].as_array().into_iter().flatten()) {
            if let Some(f) = orig.get("for") {
                rule["for"] = f.clone();
            }
        }
    }
    ensure!(back == original, "the copy changed more than `for`");
    Ok(copy)
}

/// Every worker Pod's sidecar and adapter, and both operator replicas, are scraped (health
/// `up`) with the labels the Prometheus Operator would give them.
fn targets_are_discovered(server: &Server, scenarios: &Scenarios) -> Result<()> {
    wait_for("every target up", Duration::from_secs(60), || {
        let data = server.api("/api/v1/targets?state=active")?;
        let targets = data["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = |labels: Value| {
            targets
                .iter()
                .filter(|t| t["health"] == "up" && json_contains(&t["labels"], &labels))
                .count()
        };
        let operator = json!({"job": "rebound-operator-metrics", "namespace": OPERATOR_NS,
                              "container": "operator", "endpoint": "metrics"});
        let all = scenarios.workers().iter().all(|w| {
            let sidecar = json!({"job": w.sidecar_job, "namespace": w.namespace,
                                 "pod": w.pod, "container": w.sidecar});
            let adapter = json!({"job": "rebound-system/worker-adapter",
                                 "namespace": w.namespace, "pod": w.pod, "container": "worker"});
            up(sidecar) == 1 && up(adapter) == 1
        });
        let operators = up(operator);
        Ok((operators == 2 && all).then_some(()))
    })
}

/// Polls `/api/v1/alerts` until each of `expected` (alert name and labels it must have) is
/// `firing`; the firing alerts then.
fn wait_for_alerts(server: &Server, expected: &[Value], timeout: Duration) -> Result<Vec<Value>> {
    let started = Instant::now();
    let mut missing = Vec::new();
    let fired = wait_for("the alerts to fire", timeout, || {
        let alerts = server.alerts()?;
        let firing: Vec<Value> = alerts
            .into_iter()
            .filter(|a| a["state"] == "firing")
            .collect();
        missing = expected
            .iter()
            .filter(|e| !firing.iter().any(|a| json_contains(&a["labels"], e)))
            .cloned()
            .collect();
        Ok(missing.is_empty().then_some(firing))
    })
    .with_context(|| format!("not firing: {missing:?}"))?;
    eprintln!(
        "monitoring_node: {} alerts firing {:.0}s after the failures",
        expected.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(fired)
}

fn every_dashboard_query_returns_data(server: &Server) -> Result<()> {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(
        repo_root().join("monitoring/dashboard.json"),
    )?)?;
    let queries = dashboard_queries(&dashboard)?;
    let empty: Vec<&(String, String)> = queries
        .iter()
        .filter(|(_, q)| server.query(q).map_or(true, |r| r.is_empty()))
        .collect();
    ensure!(empty.is_empty(), "panels without data: {empty:#?}");
    eprintln!(
        "monitoring_node: {} dashboard queries returned series",
        queries.len()
    );
    Ok(())
}

fn resolved(server: &Server, scenarios: &Scenarios) -> Result<()> {
    let started = Instant::now();
    let fixed = scenarios.fixed();
    let mut left = Vec::new();
    wait_for(
        "the fixed alerts to resolve",
        Duration::from_secs(120),
        || {
            left = server
                .alerts()?
                .into_iter()
                .filter(|a| fixed.iter().any(|f| json_contains(&a["labels"], f)))
                .collect();
            Ok(left.is_empty().then_some(()))
        },
    )
    .with_context(|| format!("still pending or firing: {left:#?}"))?;
    eprintln!(
        "monitoring_node: {} alerts resolved {:.0}s after the fixes",
        fixed.len(),
        started.elapsed().as_secs_f64()
    );
    // The unfixed ones still fire: the fixes resolved their own alerts only.
    let alerts = server.alerts()?;
    for expected in scenarios.unfixed() {
        ensure!(
            alerts
                .iter()
                .any(|a| a["state"] == "firing" && json_contains(&a["labels"], &expected)),
            "{expected} stopped firing: {alerts:?}"
        );
    }
    Ok(())
}
