//! A `/metrics` exposition parsed into samples (with the `prometheus-parse` crate), so
//! tests assert on metric names, label sets and values instead of on lines of text.

use std::collections::BTreeMap;

use anyhow::{Context, Result, ensure};
use prometheus_parse::{Scrape, Value};

/// One sample: a histogram's buckets come as `<name>_bucket` samples with an `le` label.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of an exposition.
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    /// Parses a Prometheus text or OpenMetrics exposition (an OpenMetrics one must end
    /// with `# EOF`).
    pub fn parse(text: &str) -> Result<Self> {
        if text.contains("\n# EOF") || text.starts_with("# EOF") {
            ensure!(
                text.ends_with("# EOF\n") || text.ends_with("# EOF"),
                "an OpenMetrics exposition continues after # EOF"
            );
        }
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .context("parsing the exposition")?;
        let mut out = Vec::new();
        for s in scrape.samples {
            let labels: BTreeMap<String, String> = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => out.push(Sample {
                    name: s.metric,
                    labels,
                    value: v,
                }),
                Value::Histogram(buckets) => {
                    for b in buckets {
                        let mut labels = labels.clone();
                        labels.insert("le".to_owned(), format_le(b.less_than));
                        out.push(Sample {
                            name: format!("{}_bucket", s.metric),
                            labels,
                            value: b.count,
                        });
                    }
                }
                Value::Summary(quantiles) => {
                    for q in quantiles {
                        let mut labels = labels.clone();
                        labels.insert("quantile".to_owned(), q.quantile.to_string());
                        out.push(Sample {
                            name: s.metric.clone(),
                            labels,
                            value: q.count,
                        });
                    }
                }
            }
        }
        Ok(Self(out))
    }

    /// Samples named `name` whose labels include every pair of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The value of the one sample named `name` with exactly `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.0
            .iter()
            .find(|s| {
                s.name == name
                    && s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }

    /// How many samples are named `name`.
    pub fn count(&self, name: &str) -> usize {
        self.0.iter().filter(|s| s.name == name).count()
    }
}

/// The samples `GET /metrics` on `addr` answers (status 200 required).
pub fn scrape(addr: std::net::SocketAddr) -> Result<Samples> {
    Samples::parse(&crate::http_get(addr, "/metrics")?.ok()?)
}

/// The value of the unlabelled sample `name` that `addr`'s `/metrics` answers.
pub fn scrape_value(addr: std::net::SocketAddr, name: &str) -> Result<f64> {
    scrape(addr)?
        .value(name, &[])
        .with_context(|| format!("no sample {name} at {addr}"))
}

fn format_le(le: f64) -> String {
    if le.is_infinite() {
        "+Inf".to_owned()
    } else {
        le.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_gauges_and_histograms_become_samples() {
        let text = "# TYPE a counter\na_total{p=\"ns/x\",r=\"b\"} 3\n# TYPE h histogram\nh_bucket{le=\"1.0\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 7.5\nh_count 2\n# EOF\n";
        let s = Samples::parse(text).unwrap();
        assert_eq!(s.value("a_total", &[("p", "ns/x"), ("r", "b")]), Some(3.0));
        assert_eq!(s.value("h_bucket", &[("le", "1")]), Some(1.0));
        assert_eq!(s.value("h_bucket", &[("le", "+Inf")]), Some(2.0));
        assert_eq!(s.value("h_count", &[]), Some(2.0));
        assert!(Samples::parse("# EOF\nx 1\n").is_err());
    }
}
