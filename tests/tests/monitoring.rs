//! Rebound's Prometheus rules, alerts and dashboard (`monitoring/`): promtool's checks and
//! unit tests pass and can fail, every alert has a firing and a silent unit test, the
//! conventions of its labels and annotations and a runbook section, every dashboard query
//! parses and returns data, and the chart's PrometheusRule, PodMonitors, ServiceMonitor and
//! dashboard ConfigMap are made from them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use rebound_tests::helm::{Helm, chart_dir, find, manifests, schema_violations};
use rebound_tests::injection::cli_inject;
use rebound_tests::prometheus::{PrometheusTools, dashboard_queries};
use rebound_tests::{repo_root, yaml_documents};
use serde_json::{Value, json};

const RUNBOOKS: &str = "https://github.com/rebound-dev/rebound/blob/main/docs/runbooks.md";

fn monitoring_dir() -> PathBuf {
    repo_root().join("monitoring")
}

fn rules() -> Result<Value> {
    yaml_documents(&monitoring_dir().join("rules.yaml"))?
        .pop()
        .context("monitoring/rules.yaml is empty")
}

/// Every rule of every group.
fn all_rules(rules: &Value) -> Vec<&Value> {
    rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect()
}

fn named<'a>(rules: &'a Value, kind: &str) -> Vec<(&'a str, &'a Value)> {
    all_rules(rules)
        .into_iter()
        .filter_map(|r| r[kind].as_str().map(|n| (n, r)))
        .collect()
}

/// The promtool unit test files, `monitoring/tests/*.yaml`.
fn test_files() -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(monitoring_dir().join("tests"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|f| f.extension().is_some_and(|e| e == "yaml"));
    files.sort();
    ensure!(!files.is_empty(), "no promtool unit tests");
    Ok(files)
}

/// Every `tests[]` entry of every unit test file.
fn unit_tests() -> Result<Vec<Value>> {
    let mut all = Vec::new();
    for file in test_files()? {
        let doc = yaml_documents(&file)?.pop().context("empty test file")?;
        all.extend(doc["tests"].as_array().cloned().unwrap_or_default());
    }
    Ok(all)
}

fn promtool_test(dir: &Path, files: &[PathBuf]) -> Result<rebound_tests::CmdOutput> {
    let mut args = vec!["test".into(), "rules".into()];
    args.extend(files.iter().map(|f| f.clone().into_os_string()));
    PrometheusTools::get()?.promtool(dir, args)
}

#[test]
fn promtool_checks_the_rules_and_passes_the_unit_tests() -> Result<()> {
    let tools = PrometheusTools::get()?;
    tools
        .promtool(&repo_root(), ["check", "rules", "monitoring/rules.yaml"])?
        .ok()?;
    promtool_test(&repo_root(), &test_files()?)?.ok()?;
    Ok(())
}

/// For every alert, a copy of the rules where it never fires, and one where its severity
/// differs: the unit tests must fail on each, so each alert's firing test and its labels
/// are really checked.
#[test]
fn the_unit_tests_fail_when_an_alert_changes() -> Result<()> {
    let rules = rules()?;
    let tmp = tempfile::tempdir()?;
    let tests: Vec<(PathBuf, String)> = test_files()?
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f)?;
            Ok((f, text))
        })
        .collect::<Result<_>>()?;
    for (name, _) in named(&rules, "alert") {
        // Only the files that test this alert (the dead-letter one evaluates eight days).
        let mine: Vec<&(PathBuf, String)> = tests
            .iter()
            .filter(|(f, _)| {
                yaml_documents(f).is_ok_and(|d| {
                    d.iter()
                        .flat_map(|doc| doc["tests"].as_array().into_iter().flatten())
                        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
                        .any(|a| a["alertname"] == name)
                })
            })
            .collect();
        ensure!(!mine.is_empty(), "no unit test file tests {name}");
        for mutation in ["never fires", "severity"] {
            let mut changed = rules.clone();
            for group in changed["groups"].as_array_mut().into_iter().flatten() {
                for rule in group["rules"].as_array_mut().into_iter().flatten() {
                    if rule["alert"] == name {
                        match mutation {
                            "never fires" => rule["expr"] = json!("vector(1) == 0"),
                            _ => rule["labels"]["severity"] = json!("mutated"),
                        }
                    }
                }
            }
            std::fs::write(
                tmp.path().join("rules.yaml"),
                serde_json::to_string(&changed)?,
            )?;
            let mut files = Vec::new();
            for (f, text) in &mine {
                let copy = tmp.path().join(f.file_name().context("no file name")?);
                let mut doc: Value = serde_saphyr::from_str(text)?;
                doc["rule_files"] = json!(["rules.yaml"]);
                std::fs::write(&copy, serde_json::to_string(&doc)?)?;
                files.push(copy);
            }
            let out = promtool_test(tmp.path(), &files)?;
            ensure!(
                !out.success(),
                "the unit tests pass although {name} {mutation}"
            );
        }
    }
    Ok(())
}

#[test]
fn every_alert_follows_the_conventions_and_has_unit_tests_and_a_runbook() -> Result<()> {
    let rules = rules()?;
    let alerts = named(&rules, "alert");
    ensure!(alerts.len() >= 10, "only {} alerts", alerts.len());
    let tests = unit_tests()?;
    let alert_tests: Vec<&Value> = tests
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .collect();
    let runbooks = std::fs::read_to_string(repo_root().join("docs/runbooks.md"))?;
    for (name, rule) in &alerts {
        ensure!(
            name.starts_with("Rebound") && name.chars().all(|c| c.is_ascii_alphanumeric()),
            "{name}: not CamelCase with the Rebound prefix"
        );
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        ensure!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        ensure!(rule["for"].is_string(), "{name}: no `for`");
        let annotations = rule["annotations"]
            .as_object()
            .with_context(|| format!("{name}: no annotations"))?;
        let keys: BTreeSet<&str> = annotations.keys().map(String::as_str).collect();
        ensure!(
            keys == BTreeSet::from(["summary", "description", "runbook_url"]),
            "{name}: annotations {keys:?}"
        );
        let text = |k: &str| annotations[k].as_str().unwrap_or_default();
        ensure!(!text("summary").contains("{{"), "{name}: templated summary");
        ensure!(
            text("description").contains("{{"),
            "{name}: static description"
        );
        ensure!(
            text("runbook_url") == format!("{RUNBOOKS}#{}", name.to_lowercase()),
            "{name}: runbook_url {}",
            text("runbook_url")
        );

        // A firing test whose alerts carry the rule's severity and all its annotations,
        // and a silent one.
        let mine: Vec<&&Value> = alert_tests
            .iter()
            .filter(|t| t["alertname"] == *name)
            .collect();
        let firing: Vec<&Value> = mine
            .iter()
            .flat_map(|t| t["exp_alerts"].as_array().into_iter().flatten())
            .collect();
        ensure!(!firing.is_empty(), "{name}: no unit test where it fires");
        ensure!(
            mine.iter()
                .any(|t| t["exp_alerts"].as_array().is_some_and(Vec::is_empty)),
            "{name}: no unit test where it stays silent"
        );
        for alert in firing {
            ensure!(
                alert["exp_labels"]["severity"] == severity,
                "{name}: a test expects severity {}",
                alert["exp_labels"]["severity"]
            );
            let expected: BTreeSet<&str> = alert["exp_annotations"]
                .as_object()
                .map(|a| a.keys().map(String::as_str).collect())
                .unwrap_or_default();
            ensure!(
                expected == keys,
                "{name}: a test expects annotations {expected:?}"
            );
        }

        let section = runbook_section(&runbooks, name)
            .with_context(|| format!("{name}: no `## {name}` in docs/runbooks.md"))?;
        let headings: Vec<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("### "))
            .collect();
        ensure!(
            headings == ["Meaning", "Impact", "Diagnosis", "Mitigation"],
            "{name}: runbook sections {headings:?}"
        );
    }

    // Every recording rule is evaluated by a promql_expr_test.
    let exprs: Vec<&str> = tests
        .iter()
        .flat_map(|t| t["promql_expr_test"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    for (record, _) in named(&rules, "record") {
        ensure!(
            exprs.iter().any(|e| reads_metric(e, record)),
            "{record}: no promql_expr_test"
        );
    }
    Ok(())
}

/// Whether PromQL `expr` names `metric` (a whole metric name, not a prefix of another).
fn reads_metric(expr: &str, metric: &str) -> bool {
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    expr.match_indices(metric).any(|(at, _)| {
        let before = expr[..at].chars().next_back();
        let after = expr[at + metric.len()..].chars().next();
        !before.is_some_and(name_char) && !after.is_some_and(name_char)
    })
}

/// The lines of `## NAME` up to the next `## ` heading.
fn runbook_section<'a>(doc: &'a str, name: &str) -> Option<&'a str> {
    let heading = format!("\n## {name}\n");
    let start = doc.find(&heading)? + heading.len();
    let rest = &doc[start..];
    Some(rest.find("\n## ").map_or(rest, |end| &rest[..end]))
}

/// A promtool unit test: each query, wrapped in `clamp_max(count(...), 1)`, must give 1 on
/// the busy fixture at 15m, so it parses, is an instant vector and returns data.
fn dashboard_test(dir: &Path, queries: &[(String, String)]) -> Result<PathBuf> {
    let series: Value = yaml_documents(&monitoring_dir().join("tests/dashboard/series.yaml"))?
        .pop()
        .context("empty dashboard fixture")?;
    let exprs: Vec<Value> = queries
        .iter()
        .map(|(_, q)| {
            json!({"expr": format!("clamp_max(count({q}), 1)"), "eval_time": "15m",
                   "exp_samples": [{"labels": "{}", "value": 1}]})
        })
        .collect();
    let test = json!({
        "rule_files": [monitoring_dir().join("rules.yaml")],
        "evaluation_interval": "1m",
        "tests": [{"name": "dashboard", "interval": "1m", "input_series": series,
                   "promql_expr_test": exprs}],
    });
    let file = dir.join("dashboard-test.yaml");
    std::fs::write(&file, serde_json::to_string(&test)?)?;
    Ok(file)
}

#[test]
fn every_dashboard_query_parses_and_returns_data() -> Result<()> {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(
        monitoring_dir().join("dashboard.json"),
    )?)?;
    ensure!(dashboard["uid"] == "rebound-overview");
    let queries = dashboard_queries(&dashboard)?;
    ensure!(queries.len() >= 20, "only {} queries", queries.len());
    let tmp = tempfile::tempdir()?;
    let file = dashboard_test(tmp.path(), &queries)?;
    promtool_test(tmp.path(), &[file])?
        .ok()
        .context("a dashboard query failed (promtool names it)")?;
    // The check can fail: a query that does not parse, and one that returns nothing.
    for bad in [
        "sum by (policy (rebound_sidecar_decisions_total)",
        "rebound_sidecar_nothing",
    ] {
        let file = dashboard_test(tmp.path(), &[("bad".to_owned(), bad.to_owned())])?;
        ensure!(
            !promtool_test(tmp.path(), &[file])?.success(),
            "promtool accepted {bad:?}"
        );
    }
    Ok(())
}

fn render(sets: &[&str]) -> Result<Vec<Value>> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let out = Helm::get()?
        .template(
            "rebound",
            &chart_dir("rebound"),
            "rebound-system",
            &[],
            &sets,
        )?
        .ok()?;
    manifests(&out.stdout)
}

fn count(objects: &[Value], kind: &str) -> usize {
    objects.iter().filter(|o| o["kind"] == kind).count()
}

#[test]
fn the_chart_ships_the_rules_and_the_dashboard_from_monitoring() -> Result<()> {
    let check = std::process::Command::new("bash")
        .arg(repo_root().join("dev/gen-chart-monitoring.sh"))
        .arg("--check")
        .status()?;
    ensure!(
        check.success(),
        "charts/rebound/files/monitoring is stale: run dev/gen-chart-monitoring.sh"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(
        monitoring_dir().join("dashboard.json"),
    )?)?;

    // Defaults: the dashboard only (no Prometheus Operator kind).
    let objects = render(&[])?;
    for kind in ["PodMonitor", "PrometheusRule", "ServiceMonitor"] {
        ensure!(count(&objects, kind) == 0, "{kind} rendered by default");
    }
    let cm = find(&objects, "ConfigMap", "rebound-dashboard")?;
    ensure!(cm["metadata"]["labels"]["grafana_dashboard"] == "1");
    ensure!(cm["metadata"]["namespace"] == "rebound-system");
    let shipped: Value = serde_json::from_str(
        cm["data"]["rebound.json"]
            .as_str()
            .context("no rebound.json")?,
    )?;
    ensure!(shipped == dashboard, "the ConfigMap's dashboard differs");
    let off = render(&["metrics.dashboard.enabled=false"])?;
    ensure!(find(&off, "ConfigMap", "rebound-dashboard").is_err());

    // The PrometheusRule is monitoring/rules.yaml, with the runbook base swapped.
    let rules = rules()?;
    let on = render(&["metrics.prometheusRule.enabled=true"])?;
    let rule = find(&on, "PrometheusRule", "rebound-operator")?;
    ensure!(
        rule["spec"]["groups"] == rules["groups"],
        "the PrometheusRule differs"
    );
    let base = "https://runbooks.example.com/rebound.md";
    let moved = render(&[
        "metrics.prometheusRule.enabled=true",
        &format!("metrics.prometheusRule.runbookBaseUrl={base}"),
    ])?;
    let moved = find(&moved, "PrometheusRule", "rebound-operator")?;
    let mut expected = rules.clone();
    for group in expected["groups"].as_array_mut().into_iter().flatten() {
        for r in group["rules"].as_array_mut().into_iter().flatten() {
            if let Some(name) = r["alert"].as_str().map(str::to_lowercase) {
                r["annotations"]["runbook_url"] = json!(format!("{base}#{name}"));
            }
        }
    }
    ensure!(
        moved["spec"]["groups"] == expected["groups"],
        "runbookBaseUrl did not move every runbook_url"
    );

    // The ServiceMonitor keeps the operator's `namespace` label (the policy namespace).
    let sm = render(&["metrics.serviceMonitor.enabled=true"])?;
    let sm = find(&sm, "ServiceMonitor", "rebound-operator")?;
    ensure!(sm["spec"]["endpoints"][0]["honorLabels"] == true);
    Ok(())
}

/// The injected PodMonitor selects what injection produces (its label, its port name); the
/// hand-written one the documented label and the examples' port name.
#[test]
fn pod_monitors_select_injected_and_hand_written_sidecars() -> Result<()> {
    let objects = render(&["metrics.podMonitor.enabled=true"])?;
    ensure!(count(&objects, "PodMonitor") == 2);
    let injected = find(&objects, "PodMonitor", "rebound-sidecar")?;
    let hand = find(&objects, "PodMonitor", "rebound-sidecar-hand-written")?;
    for pm in [injected, hand] {
        ensure!(pm["spec"]["namespaceSelector"] == json!({"any": true}));
        ensure!(pm["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics");
        ensure!(pm["spec"].get("sampleLimit").is_none());
    }
    ensure!(hand["spec"]["selector"]["matchLabels"] == json!({"rebound.dev/sidecar": "true"}));

    // What `rebound inject` (the admission policy's twin) makes of an annotated Pod.
    let params = find(&objects, "ConfigMap", "rebound-injection")?;
    let mut params_file = tempfile::NamedTempFile::new()?;
    std::io::Write::write_all(&mut params_file, serde_json::to_string(params)?.as_bytes())?;
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "worker", "namespace": "team-a",
                     "annotations": {"rebound.dev/inject": "true"}},
        "spec": {"containers": [{"name": "worker", "image": "worker:1"}]},
    });
    let pod = cli_inject(&pod, params_file.path(), &[])?;
    let selector = injected["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("no matchLabels")?;
    for (k, v) in selector {
        ensure!(
            pod["metadata"]["labels"][k] == *v,
            "the injected Pod lacks {k}={v}: {}",
            pod["metadata"]["labels"]
        );
    }
    let port = injected["spec"]["podMetricsEndpoints"][0]["port"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        port_names(&pod["spec"]).contains(&port.to_owned()),
        "the injected Pod has no port {port}"
    );
    // The port answers /metrics: a sidecar listening beyond loopback serves it only
    // with --metrics-beyond-loopback.
    ensure!(
        serves_metrics(&pod["spec"], port),
        "the injected sidecar serves no /metrics on {port}: {}",
        pod["spec"]["initContainers"][0]["args"]
    );
    for (sets, expected) in [
        (vec![], false),
        (
            vec!["metrics.podMonitor.enabled=true", "injection.metrics=false"],
            false,
        ),
        (vec!["injection.metrics=true"], true),
        (
            vec!["metrics.podMonitor.enabled=false", "injection.metrics=auto"],
            false,
        ),
    ] {
        let objects = render(&sets)?;
        let params = find(&objects, "ConfigMap", "rebound-injection")?;
        ensure!(
            params["data"]["metrics"] == json!(expected.to_string()),
            "{sets:?}: the parameter metrics is {}",
            params["data"]["metrics"]
        );
    }

    let hand_port = hand["spec"]["podMetricsEndpoints"][0]["port"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    for file in [
        "examples/worker/worker.yaml",
        "examples/worker/worker-watch.yaml",
    ] {
        let deployment = yaml_documents(&repo_root().join(file))?
            .into_iter()
            .find(|d| d["kind"] == "Deployment")
            .with_context(|| format!("no Deployment in {file}"))?;
        let template = &deployment["spec"]["template"];
        ensure!(
            port_names(&template["spec"]).contains(&hand_port),
            "{file}: no port {hand_port}"
        );
        for (k, v) in hand["spec"]["selector"]["matchLabels"]
            .as_object()
            .context("no matchLabels")?
        {
            ensure!(
                template["metadata"]["labels"][k] == *v,
                "{file}: the Pod template lacks {k}={v}"
            );
        }
        ensure!(
            serves_metrics(&template["spec"], &hand_port),
            "{file}: the container with port {hand_port} serves no /metrics"
        );
    }

    // Scoped to the watched namespaces, or to podMonitor.namespaces; a sample limit.
    let scoped = render(&[
        "metrics.podMonitor.enabled=true",
        "watchNamespaces={team-a,team-b}",
        "metrics.podMonitor.sampleLimit=20000",
    ])?;
    let pm = find(&scoped, "PodMonitor", "rebound-sidecar")?;
    ensure!(pm["spec"]["namespaceSelector"] == json!({"matchNames": ["team-a", "team-b"]}));
    ensure!(pm["spec"]["sampleLimit"] == 20000);
    let own = render(&[
        "metrics.podMonitor.enabled=true",
        "watchNamespaces={team-a,team-b}",
        "metrics.podMonitor.namespaces={team-c}",
    ])?;
    let pm = find(&own, "PodMonitor", "rebound-sidecar")?;
    ensure!(pm["spec"]["namespaceSelector"] == json!({"matchNames": ["team-c"]}));
    Ok(())
}

/// Names of every port of every container and init container of a Pod spec.
fn port_names(spec: &Value) -> Vec<String> {
    ["containers", "initContainers"]
        .iter()
        .flat_map(|k| spec[k].as_array().into_iter().flatten())
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect()
}

/// Whether the container exposing port `port` is a sidecar that serves `/metrics` there:
/// its admin port listens on the Pod IP, so it needs `--metrics-beyond-loopback`.
fn serves_metrics(spec: &Value, port: &str) -> bool {
    ["containers", "initContainers"]
        .iter()
        .flat_map(|k| spec[k].as_array().into_iter().flatten())
        .filter(|c| {
            c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["name"] == port)
        })
        .any(|c| {
            c["args"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|a| a == "--metrics-beyond-loopback")
        })
}

#[test]
fn the_schema_rejects_bad_monitoring_values_naming_the_field() -> Result<()> {
    for (set, pointer) in [
        (
            "metrics.podMonitor.sampleLimit=-1",
            "/metrics/podMonitor/sampleLimit",
        ),
        (
            "metrics.podMonitor.handWritten.port=Admin_Port",
            "/metrics/podMonitor/handWritten/port",
        ),
        (
            "metrics.podMonitor.namespaces={Team_A}",
            "/metrics/podMonitor/namespaces/0",
        ),
        (
            "metrics.prometheusRule.runbookBaseUrl=runbooks.md",
            "/metrics/prometheusRule/runbookBaseUrl",
        ),
        (
            "metrics.dashboard.namespace=Grafana_NS",
            "/metrics/dashboard/namespace",
        ),
        ("metrics.dashboard.enabeld=true", "/metrics/dashboard"),
        ("injection.metrics=yes", "/injection/metrics"),
    ] {
        let out = Helm::get()?.template(
            "rebound",
            &chart_dir("rebound"),
            "rebound-system",
            &[],
            &[set.to_owned()],
        )?;
        if out.success() {
            bail!("helm accepted {set}");
        }
        let violations = schema_violations(&out.stderr);
        ensure!(
            violations.iter().any(|v| v.pointer == pointer),
            "{set}: expected a violation at {pointer}, helm said:\n{}",
            out.stderr
        );
    }
    Ok(())
}
