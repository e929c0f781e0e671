//! Prometheus scrape configs made from the chart's `PodMonitor` and `ServiceMonitor`
//! objects (what `helm template` renders), the way the Prometheus Operator generates them:
//! Kubernetes service discovery (role `pod`, or `endpoints` for a ServiceMonitor), the
//! selector and port as `keep` rules, and the `namespace`, `pod`, `container` (and
//! `service`, `endpoint`) target labels and the `job` name it sets. A test's Prometheus
//! scrapes real Pods with the labels a cluster's Prometheus would give their series.
//!
//! Only what the chart uses is translated (`matchLabels`, `namespaceSelector`, `port`,
//! `path`, `honorLabels`, `sampleLimit`); anything else fails, naming the field.

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Map, Value, json};

/// How the test's Prometheus reaches the API server for discovery: its URL and the files
/// of the CA and a client certificate.
#[derive(Debug, Clone)]
pub struct ApiServer {
    pub url: String,
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
}

/// One scrape config per endpoint of a rendered PodMonitor or ServiceMonitor, with
/// `interval` as scrape interval (a test scrapes more often than the chart's default).
pub fn scrape_configs(monitor: &Value, api: &ApiServer, interval: &str) -> Result<Vec<Value>> {
    let kind = monitor["kind"].as_str().unwrap_or_default();
    let (role, prefix, endpoints) = match kind {
        "PodMonitor" => ("pod", "podMonitor", "podMetricsEndpoints"),
        "ServiceMonitor" => ("endpoints", "serviceMonitor", "endpoints"),
        other => bail!("not a PodMonitor or ServiceMonitor: kind {other:?}"),
    };
    let namespace = str_at(monitor, "/metadata/namespace")?;
    let name = str_at(monitor, "/metadata/name")?;
    let spec = &monitor["spec"];
    for field in spec.as_object().into_iter().flat_map(Map::keys) {
        ensure!(
            ["selector", "namespaceSelector", endpoints].contains(&field.as_str())
                || field == "sampleLimit",
            "{kind} {name}: spec.{field} is not translated"
        );
    }
    let mut sd = json!({
        "role": role,
        "api_server": api.url,
        "tls_config": {"ca_file": api.ca_file, "cert_file": api.cert_file,
                       "key_file": api.key_file},
    });
    let selector = &spec["namespaceSelector"];
    if selector["any"] != json!(true) {
        let names = match selector["matchNames"].as_array() {
            Some(names) => names.clone(),
            None => vec![json!(namespace)],
        };
        sd["namespaces"] = json!({"names": names});
    }
    if let Some(fields) = spec["selector"].as_object() {
        for field in fields.keys() {
            ensure!(
                field == "matchLabels",
                "{kind} {name}: spec.selector.{field} is not translated"
            );
        }
    }
    let object = if role == "pod" { "pod" } else { "service" };
    let mut configs = Vec::new();
    let list = spec[endpoints]
        .as_array()
        .with_context(|| format!("{kind} {name}: no spec.{endpoints}"))?;
    for (i, endpoint) in list.iter().enumerate() {
        let port = endpoint["port"]
            .as_str()
            .with_context(|| format!("{kind} {name}: spec.{endpoints}[{i}].port"))?;
        let mut relabel = vec![json!({"source_labels": ["job"],
                                      "target_label": "__tmp_prometheus_job_name"})];
        for (label, value) in spec["selector"]["matchLabels"]
            .as_object()
            .into_iter()
            .flatten()
        {
            let label = sanitize(label);
            relabel.push(json!({
                "action": "keep",
                "source_labels": [format!("__meta_kubernetes_{object}_label_{label}"),
                                  format!("__meta_kubernetes_{object}_labelpresent_{label}")],
                "regex": format!("({});true", value.as_str().unwrap_or_default()),
            }));
        }
        if role == "pod" {
            relabel.push(
                json!({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                                "regex": "(Failed|Succeeded)"}),
            );
            relabel.push(json!({"action": "keep",
                                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                                "regex": port}));
            relabel.push(copy("__meta_kubernetes_namespace", "namespace"));
            relabel.push(copy("__meta_kubernetes_pod_container_name", "container"));
            relabel.push(copy("__meta_kubernetes_pod_name", "pod"));
            relabel.push(json!({"target_label": "job",
                                "replacement": format!("{namespace}/{name}")}));
        } else {
            relabel.push(json!({"action": "keep",
                                "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                                "regex": port}));
            for target in ["Node", "Pod"] {
                relabel.push(json!({
                    "source_labels": ["__meta_kubernetes_endpoint_address_target_kind",
                                      "__meta_kubernetes_endpoint_address_target_name"],
                    "separator": ";", "regex": format!("{target};(.*)"), "replacement": "${1}",
                    "target_label": target.to_lowercase(),
                }));
            }
            relabel.push(copy("__meta_kubernetes_namespace", "namespace"));
            relabel.push(copy("__meta_kubernetes_service_name", "service"));
            relabel.push(copy("__meta_kubernetes_pod_name", "pod"));
            relabel.push(copy("__meta_kubernetes_pod_container_name", "container"));
            relabel.push(
                json!({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                                "regex": "(Failed|Succeeded)"}),
            );
            relabel.push(json!({"source_labels": ["__meta_kubernetes_service_name"],
                                "target_label": "job", "replacement": "${1}"}));
        }
        relabel.push(json!({"target_label": "endpoint", "replacement": port}));
        let mut config = json!({
            "job_name": format!("{prefix}/{namespace}/{name}/{i}"),
            "honor_labels": endpoint["honorLabels"].as_bool().unwrap_or(false),
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "metrics_path": endpoint["path"].as_str().unwrap_or("/metrics"),
            "kubernetes_sd_configs": [sd.clone()],
            "relabel_configs": relabel,
        });
        if let Some(limit) = spec["sampleLimit"].as_u64().filter(|l| *l > 0) {
            config["sample_limit"] = json!(limit);
        }
        configs.push(config);
    }
    Ok(configs)
}

/// A relabel rule copying a meta label to a target label.
fn copy(from: &str, to: &str) -> Value {
    json!({"source_labels": [from], "target_label": to})
}

/// A Kubernetes label name as Prometheus's meta label suffix (`rebound.dev/sidecar` →
/// `rebound_dev_sidecar`).
fn sanitize(label: &str) -> String {
    label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

fn str_at<'a>(object: &'a Value, pointer: &str) -> Result<&'a str> {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .with_context(|| format!("no {pointer} in {object}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api() -> ApiServer {
        ApiServer {
            url: "https://10.200.0.1:6443".into(),
            ca_file: "ca.crt".into(),
            cert_file: "a.crt".into(),
            key_file: "a.key".into(),
        }
    }

    #[test]
    fn a_pod_monitor_keeps_its_label_and_port_and_names_the_job() -> Result<()> {
        let monitor = json!({"kind": "PodMonitor",
            "metadata": {"name": "rebound-sidecar", "namespace": "rebound-system"},
            "spec": {"namespaceSelector": {"any": true},
                     "selector": {"matchLabels": {"rebound.dev/sidecar": "true"}},
                     "podMetricsEndpoints": [{"port": "admin", "path": "/metrics"}]}});
        let configs = scrape_configs(&monitor, &api(), "1s")?;
        ensure!(configs.len() == 1);
        let c = &configs[0];
        ensure!(c["kubernetes_sd_configs"][0]["namespaces"].is_null(), "{c}");
        let rules = c["relabel_configs"].as_array().context("relabel")?;
        ensure!(rules.contains(&json!({"action": "keep",
            "source_labels": ["__meta_kubernetes_pod_label_rebound_dev_sidecar",
                              "__meta_kubernetes_pod_labelpresent_rebound_dev_sidecar"],
            "regex": "(true);true"})));
        ensure!(rules.contains(&json!({"target_label": "job",
                                       "replacement": "rebound-system/rebound-sidecar"})));
        let unsupported = json!({"kind": "PodMonitor",
            "metadata": {"name": "m", "namespace": "n"},
            "spec": {"selector": {"matchExpressions": []}, "podMetricsEndpoints": []}});
        ensure!(scrape_configs(&unsupported, &api(), "1s").is_err());
        Ok(())
    }
}
