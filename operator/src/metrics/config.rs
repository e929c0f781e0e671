//! Per-namespace series: the compiled configuration the operator holds as current
//! (`config_info{namespace, config_hash}`, `config_generated_timestamp_seconds{namespace}`)
//! and each policy's readiness (`policy_ready{namespace, policy}`). Only the leader
//! reconciles, so only the leader has them; a namespace's series go with its policies.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// What a reconcile leaves the operator holding for a namespace's ConfigMap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldConfig<'a> {
    /// The ConfigMap holds this document's hash: written now or confirmed unchanged.
    Holds(&'a str),
    /// The write failed: what was held before is still what the ConfigMap holds.
    Keep,
    /// No policies (or the ConfigMap is not ours): nothing to compare sidecars with.
    Nothing,
}

#[derive(Debug, Default)]
struct Held {
    hash: Option<String>,
    /// Each policy's name and readiness. Encoded at scrape time: a labelled gauge per
    /// policy (two label `String`s, an `Arc`'d gauge, a map slot) cost about 270 bytes,
    /// a fifth of what the operator held per policy at 100,000.
    policies: Vec<(Box<str>, bool)>,
}

type HeldMap = Arc<Mutex<HashMap<String, Held>>>;

/// The families and what each namespace last set, to remove what a reconcile drops.
pub(super) struct ConfigSeries {
    info: Family<Labels, Gauge>,
    generated: Family<Labels, Gauge<f64, AtomicU64>>,
    held: HeldMap,
}

/// `policy_ready{namespace, policy}`, written from [`Held`] on each scrape.
#[derive(Debug)]
struct PolicyReady(HeldMap);

impl Collector for PolicyReady {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut family = encoder.encode_descriptor(
            "policy_ready",
            "1 while the RetryPolicy's Ready condition is True, else 0",
            None,
            MetricType::Gauge,
        )?;
        for (namespace, held) in all.iter() {
            for (name, ready) in &held.policies {
                let labels = [("namespace", namespace.as_str()), ("policy", &**name)];
                ConstGauge::new(i64::from(*ready)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

impl ConfigSeries {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let s = Self {
            info: Family::default(),
            generated: Family::default(),
            held: HeldMap::default(),
        };
        registry.register(
            "config_info",
            "1 per namespace for the compiled configuration its ConfigMap holds (written or confirmed unchanged by the leader); config_hash is the hash sidecars report",
            s.info.clone(),
        );
        registry.register(
            "config_generated_timestamp_seconds",
            "When the namespace's current configuration was first written (or first confirmed by this process), in Unix seconds",
            s.generated.clone(),
        );
        registry.register_collector(Box::new(PolicyReady(s.held.clone())));
        s
    }

    /// Records what a reconcile of `namespace` left: its configuration and each policy's
    /// readiness (`(name, ready)`), replacing what the namespace listed before.
    pub(super) fn set(&self, namespace: &str, config: HeldConfig<'_>, policies: &[(String, bool)]) {
        let mut all = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let held = all.entry(namespace.to_owned()).or_default();
        let ns = || ("namespace", namespace.to_owned());
        match config {
            HeldConfig::Keep => {}
            HeldConfig::Holds(hash) if held.hash.as_deref() == Some(hash) => {}
            HeldConfig::Holds(hash) => {
                if let Some(old) = held.hash.replace(hash.to_owned()) {
                    self.info.remove(&vec![ns(), ("config_hash", old)]);
                }
                self.info
                    .get_or_create(&vec![ns(), ("config_hash", hash.to_owned())])
                    .set(1);
                self.generated.get_or_create(&vec![ns()]).set(unix_now());
            }
            HeldConfig::Nothing => {
                if let Some(old) = held.hash.take() {
                    self.info.remove(&vec![ns(), ("config_hash", old)]);
                    self.generated.remove(&vec![ns()]);
                }
            }
        }
        held.policies = policies
            .iter()
            .map(|(name, ready)| (name.as_str().into(), *ready))
            .collect();
        if held.hash.is_none() && held.policies.is_empty() {
            all.remove(namespace);
        }
    }

    /// Forgets every namespace (leadership lost: another replica reports them).
    pub(super) fn clear(&self) {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.info.clear();
        self.generated.clear();
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use rebound_test_support::metrics::Samples;

    use super::super::Metrics;
    use super::*;

    fn samples(m: &Metrics) -> Samples {
        Samples::parse(&m.encode()).expect("an exposition")
    }

    #[test]
    fn a_namespace_holds_one_hash_and_its_series_go_with_it_or_with_leadership() {
        let m = Metrics::new();
        let ready = |pairs: &[(&str, bool)]| -> Vec<(String, bool)> {
            pairs.iter().map(|(n, r)| ((*n).to_owned(), *r)).collect()
        };
        m.set_namespace_config(
            "a",
            HeldConfig::Holds("sha256:1"),
            &ready(&[("p", true), ("q", false)]),
        );
        m.set_namespace_config("a", HeldConfig::Holds("sha256:2"), &ready(&[("p", true)]));
        m.set_namespace_config("b", HeldConfig::Holds("sha256:9"), &ready(&[("r", true)]));
        // A failed write keeps what is held.
        m.set_namespace_config("b", HeldConfig::Keep, &ready(&[("r", false)]));
        let s = samples(&m);
        let info: Vec<_> = s
            .matching("rebound_operator_config_info", &[])
            .map(|s| s.labels.clone())
            .collect();
        assert_eq!(info.len(), 2, "{info:?}");
        assert_eq!(
            s.value(
                "rebound_operator_config_info",
                &[("namespace", "a"), ("config_hash", "sha256:2")]
            ),
            Some(1.0)
        );
        assert_eq!(
            s.value(
                "rebound_operator_config_info",
                &[("namespace", "b"), ("config_hash", "sha256:9")]
            ),
            Some(1.0)
        );
        assert_eq!(s.count("rebound_operator_policy_ready"), 2, "q was removed");
        assert_eq!(
            s.value(
                "rebound_operator_policy_ready",
                &[("namespace", "b"), ("policy", "r")]
            ),
            Some(0.0)
        );

        m.set_namespace_config("a", HeldConfig::Nothing, &[]);
        let s = samples(&m);
        assert_eq!(
            s.matching("rebound_operator_config_info", &[("namespace", "a")])
                .count(),
            0
        );
        assert_eq!(
            s.matching(
                "rebound_operator_config_generated_timestamp_seconds",
                &[("namespace", "a")]
            )
            .count(),
            0
        );
        assert_eq!(
            s.matching("rebound_operator_policy_ready", &[("namespace", "a")])
                .count(),
            0
        );

        m.clear_namespaces();
        let s = samples(&m);
        for name in [
            "rebound_operator_config_info",
            "rebound_operator_config_generated_timestamp_seconds",
            "rebound_operator_policy_ready",
        ] {
            assert_eq!(s.count(name), 0, "{name} after leadership is lost");
        }
    }
}
