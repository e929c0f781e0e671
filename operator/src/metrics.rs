//! Prometheus metrics. The totals carry no per-object labels; the per-namespace and
//! per-policy series ([`config`]) are one per namespace with policies and one per
//! RetryPolicy, removed with them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

mod config;

use config::ConfigSeries;
pub use config::HeldConfig;

type Label = [(&'static str, &'static str); 1];

/// Per-namespace figures, summed into the gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NamespaceFigures {
    pub compiled: i64,
    pub not_ready: i64,
    pub configmap_bytes: i64,
}

/// Every metric the operator exports, plus the readiness flag behind /readyz.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<Label, Counter>,
    reconcile_seconds: Histogram,
    api_writes: Family<Label, Counter>,
    watch_errors: Counter,
    http_refused: Counter,
    policies_compiled: Gauge,
    policies_not_ready: Gauge,
    configmap_bytes: Gauge,
    leader: Gauge,
    namespaces_held: Gauge,
    namespaces: Mutex<HashMap<String, NamespaceFigures>>,
    config: ConfigSeries,
    ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("rebound_operator");
        let build = Family::<Label, Gauge>::default();
        build
            .get_or_create(&[("version", env!("CARGO_PKG_VERSION"))])
            .set(1);
        registry.register("build_info", "The build: version label, value 1", build);
        let reconciles = Family::<Label, Counter>::default();
        registry.register(
            "reconciles",
            "Namespace reconciles by result",
            reconciles.clone(),
        );
        let reconcile_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        registry.register(
            "reconcile_duration_seconds",
            "Time to reconcile one namespace",
            reconcile_seconds.clone(),
        );
        let api_writes = Family::<Label, Counter>::default();
        registry.register(
            "api_writes",
            "Write requests sent to the API server, by object kind (lease renewals excluded)",
            api_writes.clone(),
        );
        let watch_errors = Counter::default();
        registry.register(
            "watch_errors",
            "Watch stream errors (each is retried with backoff)",
            watch_errors.clone(),
        );
        let http_refused = Counter::default();
        registry.register(
            "http_connections_refused",
            "Connections to this server closed unserved because it was at its connection cap",
            http_refused.clone(),
        );
        let policies_compiled = Gauge::default();
        registry.register(
            "policies_compiled",
            "RetryPolicies in the compiled documents",
            policies_compiled.clone(),
        );
        let policies_not_ready = Gauge::default();
        registry.register(
            "policies_not_ready",
            "RetryPolicies whose Ready condition is not True",
            policies_not_ready.clone(),
        );
        let configmap_bytes = Gauge::default();
        registry.register(
            "configmap_bytes",
            "Bytes of compiled documents held in the ConfigMaps, all namespaces",
            configmap_bytes.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the Lease",
            leader.clone(),
        );
        let namespaces_held = Gauge::default();
        registry.register(
            "namespaces_held",
            "Namespaces the operator keeps state for between reconciles (those with policies)",
            namespaces_held.clone(),
        );
        let config = ConfigSeries::register(&mut registry);
        Self {
            registry,
            config,
            reconciles,
            reconcile_seconds,
            api_writes,
            watch_errors,
            http_refused,
            policies_compiled,
            policies_not_ready,
            configmap_bytes,
            leader,
            namespaces_held,
            namespaces: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
        }
    }

    pub fn reconciled(&self, ok: bool, seconds: f64) {
        let result = if ok { "success" } else { "error" };
        self.reconciles.get_or_create(&[("result", result)]).inc();
        self.reconcile_seconds.observe(seconds);
    }

    /// Counts one write request of `kind` (`configmap`, `status` or `event`).
    pub fn wrote(&self, kind: &'static str) {
        self.api_writes.get_or_create(&[("kind", kind)]).inc();
    }

    pub fn watch_error(&self) {
        self.watch_errors.inc();
    }

    pub fn http_refused(&self) {
        self.http_refused.inc();
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// How many namespaces' memories are held.
    pub fn set_namespaces_held(&self, n: usize) {
        self.namespaces_held
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Records a namespace's figures and refreshes the totals.
    pub fn set_namespace(&self, namespace: &str, figures: NamespaceFigures) {
        let mut all = self.namespaces.lock().unwrap_or_else(|e| e.into_inner());
        if figures == NamespaceFigures::default() {
            all.remove(namespace);
        } else {
            all.insert(namespace.to_owned(), figures);
        }
        let sum = |f: fn(&NamespaceFigures) -> i64| all.values().map(f).sum::<i64>();
        self.policies_compiled.set(sum(|f| f.compiled));
        self.policies_not_ready.set(sum(|f| f.not_ready));
        self.configmap_bytes.set(sum(|f| f.configmap_bytes));
    }

    /// Records the configuration a reconcile of `namespace` left held and each of its
    /// policies' readiness (`(name, ready)`).
    pub fn set_namespace_config(
        &self,
        namespace: &str,
        config: HeldConfig<'_>,
        policies: &[(String, bool)],
    ) {
        self.config.set(namespace, config, policies);
    }

    /// Forgets all namespaces (when leadership is lost, another replica reports them).
    pub fn clear_namespaces(&self) {
        self.config.clear();
        let mut all = self.namespaces.lock().unwrap_or_else(|e| e.into_inner());
        all.clear();
        self.policies_compiled.set(0);
        self.policies_not_ready.set(0);
        self.configmap_bytes.set(0);
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_info_names_the_version() {
        let text = Metrics::new().encode();
        let series = format!(
            "rebound_operator_build_info{{version=\"{}\"}} ",
            env!("CARGO_PKG_VERSION")
        );
        let value = text.lines().find_map(|l| l.strip_prefix(series.as_str()));
        assert_eq!(value, Some("1"));
    }

    #[test]
    fn totals_sum_namespaces_without_labels() {
        let m = Metrics::new();
        let f = |c| NamespaceFigures {
            compiled: c,
            not_ready: 0,
            configmap_bytes: 100,
        };
        m.set_namespace("a", f(2));
        m.set_namespace("b", f(3));
        m.wrote("status");
        let text = m.encode();
        assert!(text.contains("rebound_operator_policies_compiled 5"));
        assert!(text.contains("rebound_operator_configmap_bytes 200"));
        assert!(text.contains("rebound_operator_api_writes_total{kind=\"status\"} 1"));
        assert!(!text.contains("namespace="));
    }
}
