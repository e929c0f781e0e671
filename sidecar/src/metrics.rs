//! Counters in plain atomics and their Prometheus text rendering: an increment is one
//! relaxed atomic add on the request path, and a scrape formats a few lines.

use std::{
    fmt::Write,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::answer::Outcome;

/// Which configuration the sidecar answers from; what tells "the policies were removed"
/// from "the configuration is broken".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigState {
    /// Nothing valid loaded yet: UNAVAILABLE, health NOT_SERVING.
    None,
    /// The latest input was used and holds policies.
    Active,
    /// The latest input was used and holds no policies (the namespace's last RetryPolicy
    /// was deleted): every queue is NOT_FOUND, health SERVING.
    Empty,
    /// The latest input was rejected (unreadable, invalid, deleted); answers come from the
    /// last good configuration.
    Stale,
}

impl ConfigState {
    pub const ALL: [ConfigState; 4] = [Self::None, Self::Active, Self::Empty, Self::Stale];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Active => "active",
            Self::Empty => "empty",
            Self::Stale => "stale",
        }
    }
}

/// What a scrape reports about the loaded configuration.
#[derive(Clone, Copy, Debug)]
pub struct ConfigView<'a> {
    pub namespace: &'a str,
    pub hash: &'a str,
    pub origin: &'a str,
    pub sequence: u64,
    pub policies: usize,
    pub loaded_at: SystemTime,
}

/// Process-wide counters.
#[derive(Debug, Default)]
pub struct Metrics {
    retry: AtomicU64,
    give_up_max_attempts: AtomicU64,
    give_up_deadline: AtomicU64,
    give_up_non_retryable: AtomicU64,
    not_found: AtomicU64,
    invalid_argument: AtomicU64,
    unavailable: AtomicU64,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
    reads: AtomicU64,
    last_reload_micros: AtomicU64,
}

fn inc(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Metrics {
    pub fn count(&self, outcome: Outcome) {
        inc(match outcome {
            Outcome::Retry => &self.retry,
            Outcome::GiveUpMaxAttempts => &self.give_up_max_attempts,
            Outcome::GiveUpDeadline => &self.give_up_deadline,
            Outcome::GiveUpNonRetryable => &self.give_up_non_retryable,
            Outcome::NotFound => &self.not_found,
            Outcome::InvalidArgument => &self.invalid_argument,
        });
    }

    /// A request arrived before any configuration was loaded.
    pub fn count_unavailable(&self) {
        inc(&self.unavailable);
    }

    pub fn reloaded(&self, took: Duration) {
        inc(&self.reloads);
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.last_reload_micros.store(micros, Ordering::Relaxed);
    }

    pub fn reload_failed(&self) {
        inc(&self.reload_failures);
    }

    pub fn reload_failures(&self) -> u64 {
        self.reload_failures.load(Ordering::Relaxed)
    }

    /// The configuration input was read (a file opened and read, or a watch event's bytes
    /// taken), whether or not it turned out to be new.
    pub fn read_input(&self) {
        inc(&self.reads);
    }

    pub fn input_reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self, state: ConfigState, current: Option<ConfigView<'_>>) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::with_capacity(2048);
        let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        family(
            "rebound_sidecar_decisions_total",
            "counter",
            "Decisions answered, by outcome.",
            &[
                ("{outcome=\"retry\"}", get(&self.retry) as f64),
                (
                    "{outcome=\"give_up_max_attempts\"}",
                    get(&self.give_up_max_attempts) as f64,
                ),
                (
                    "{outcome=\"give_up_deadline\"}",
                    get(&self.give_up_deadline) as f64,
                ),
                (
                    "{outcome=\"give_up_non_retryable\"}",
                    get(&self.give_up_non_retryable) as f64,
                ),
            ],
        );
        family(
            "rebound_sidecar_rejected_requests_total",
            "counter",
            "Requests (or batch items) answered with an error, by gRPC code.",
            &[
                ("{code=\"not_found\"}", get(&self.not_found) as f64),
                (
                    "{code=\"invalid_argument\"}",
                    get(&self.invalid_argument) as f64,
                ),
                ("{code=\"unavailable\"}", get(&self.unavailable) as f64),
            ],
        );
        family(
            "rebound_sidecar_config_reloads_total",
            "counter",
            "Configurations loaded (the first one included).",
            &[("", get(&self.reloads) as f64)],
        );
        family(
            "rebound_sidecar_config_reload_failures_total",
            "counter",
            "New configurations rejected; the last good one kept answering.",
            &[("", get(&self.reload_failures) as f64)],
        );
        family(
            "rebound_sidecar_config_reads_total",
            "counter",
            "Times the configuration input was read, changed or not; stays flat at rest.",
            &[("", get(&self.reads) as f64)],
        );
        family(
            "rebound_sidecar_config_last_reload_duration_seconds",
            "gauge",
            "Read, parse, check and index time of the last configuration loaded.",
            &[("", get(&self.last_reload_micros) as f64 / 1e6)],
        );
        family(
            "rebound_sidecar_config_loaded",
            "gauge",
            "1 once a valid configuration is loaded (health is SERVING), else 0.",
            &[("", if current.is_some() { 1.0 } else { 0.0 })],
        );
        let states: Vec<(String, f64)> = ConfigState::ALL
            .iter()
            .map(|s| {
                (
                    format!("{{state=\"{}\"}}", s.as_str()),
                    if *s == state { 1.0 } else { 0.0 },
                )
            })
            .collect();
        let states: Vec<(&str, f64)> = states.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        family(
            "rebound_sidecar_config_state",
            "gauge",
            "1 for the current state: none (nothing loaded), active, empty (no policies: every queue NOT_FOUND), stale (latest input rejected, last good kept).",
            &states,
        );
        let Some(cfg) = current else { return out };
        let loaded_at = cfg
            .loaded_at
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let age = SystemTime::now()
            .duration_since(cfg.loaded_at)
            .map_or(0.0, |d| d.as_secs_f64());
        let info = format!(
            "{{namespace=\"{}\",hash=\"{}\",origin=\"{}\"}}",
            escape(cfg.namespace),
            escape(cfg.hash),
            escape(cfg.origin)
        );
        family(
            "rebound_sidecar_config_info",
            "gauge",
            "The loaded configuration: namespace, content hash and origin.",
            &[(&info, 1.0)],
        );
        family(
            "rebound_sidecar_config_generation",
            "gauge",
            "Sequence number of the loaded configuration in this process (1 = first).",
            &[("", cfg.sequence as f64)],
        );
        family(
            "rebound_sidecar_config_policies",
            "gauge",
            "Policies in the loaded configuration.",
            &[("", cfg.policies as f64)],
        );
        family(
            "rebound_sidecar_config_loaded_timestamp_seconds",
            "gauge",
            "When the loaded configuration was installed, in Unix seconds.",
            &[("", loaded_at)],
        );
        family(
            "rebound_sidecar_config_age_seconds",
            "gauge",
            "Seconds since the loaded configuration was installed.",
            &[("", age)],
        );
        out
    }
}

/// Escapes a label value: backslash, double quote and newline.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_escapes_labels() {
        let m = Metrics::default();
        m.count(Outcome::Retry);
        m.count(Outcome::Retry);
        m.reload_failed();
        let text = m.render(ConfigState::None, None);
        assert!(text.contains("rebound_sidecar_decisions_total{outcome=\"retry\"} 2\n"));
        assert!(text.contains("rebound_sidecar_config_reload_failures_total 1\n"));
        assert!(text.contains("rebound_sidecar_config_loaded 0\n"));
        assert!(text.contains("rebound_sidecar_config_state{state=\"none\"} 1\n"));
        assert!(text.contains("rebound_sidecar_config_state{state=\"stale\"} 0\n"));
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
