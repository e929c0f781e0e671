//! The sidecar's Prometheus metrics: request-path counters are one atomic add; a scrape
//! sets the configuration gauges from the store and encodes everything.

use std::{
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use prometheus_client::{
    encoding::{EncodeLabelValue, LabelValueEncoder},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::fleet_share::FleetShare;
use crate::rollout_evidence::RolloutEvidence;
use crate::source_link::SourceLink;

mod budget;
mod decisions;
mod fleet;

use budget::BudgetFamilies;
pub use budget::BudgetSeries;
pub use decisions::{DELAY_BUCKETS, DecisionFamily, Decisions, Reason};
use fleet::FleetGauges;

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
    pub hash: &'a str,
    pub origin: &'a str,
    pub sequence: u64,
    pub policies: usize,
    pub loaded_at: SystemTime,
}

type Label = [(&'static str, &'static str); 1];
type Labels = Vec<(&'static str, LabelText)>;

/// A label value from outside (a path, a namespace), escaped as the exposition format
/// requires; the client library writes label values as given.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct LabelText(Arc<str>);

impl EncodeLabelValue for LabelText {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        use std::fmt::Write as _;
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// Why a request (or batch item) got an error instead of a decision, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    NotFound,
    InvalidArgument,
}

/// Every metric the sidecar exports, through the Prometheus client library the operator
/// uses too. Request-path counters are held as handles: an increment is one atomic add.
pub struct Metrics {
    registry: Registry,
    decisions: DecisionFamily,
    not_found: Counter,
    invalid_argument: Counter,
    unavailable: Counter,
    decide_seconds: Histogram,
    batch_seconds: Histogram,
    reloads: Counter,
    reload_failures: Counter,
    reads: Counter,
    last_reload_seconds: Gauge<f64, AtomicU64>,
    // Set from the store's state at each scrape.
    state: Family<Label, Gauge>,
    info: Family<Labels, Gauge>,
    generation: Gauge,
    policies: Gauge,
    loaded_at: Gauge<f64, AtomicU64>,
    budget: BudgetFamilies,
    fleet: Arc<FleetShare>,
    fleet_gauges: FleetGauges,
    evidence: Arc<RolloutEvidence>,
    link: Arc<SourceLink>,
    source_connected: Gauge,
    source_disconnected_seconds: Gauge<f64, AtomicU64>,
    /// One scrape at a time: each resets the configuration gauges before encoding.
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("rebound_sidecar");
        let build = Family::<Labels, Gauge>::default();
        build
            .get_or_create(&vec![(
                "version",
                LabelText(env!("CARGO_PKG_VERSION").into()),
            )])
            .set(1);
        registry.register("build_info", "The build: version label, value 1", build);

        let decisions = DecisionFamily::register(&mut registry);
        let rejected = Family::<Label, Counter>::default();
        registry.register(
            "rejected_requests",
            "Requests (or batch items) answered with an error, by gRPC code",
            rejected.clone(),
        );
        let code = |c: &'static str| rejected.get_or_create(&[("code", c)]).clone();

        // 1 µs to 33 ms: a decision takes microseconds, the worst valid one about 100.
        let durations = Family::<Label, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(1e-6, 2.0, 16))) as fn() -> Histogram,
        );
        registry.register(
            "decision_duration_seconds",
            "Time the sidecar spent deciding one call (a whole batch for DecideBatch), transport excluded",
            durations.clone(),
        );
        let rpc = |r: &'static str| durations.get_or_create(&[("rpc", r)]).clone();

        let reloads = Counter::default();
        registry.register(
            "config_reloads",
            "Configurations loaded (the first one included)",
            reloads.clone(),
        );
        let reload_failures = Counter::default();
        registry.register(
            "config_reload_failures",
            "New configurations rejected; the last good one kept answering",
            reload_failures.clone(),
        );
        let reads = Counter::default();
        registry.register(
            "config_reads",
            "Times the configuration input was read, changed or not; stays flat at rest",
            reads.clone(),
        );
        let last_reload_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "config_last_reload_duration_seconds",
            "Read, parse, check and index time of the last configuration loaded",
            last_reload_seconds.clone(),
        );
        let state = Family::<Label, Gauge>::default();
        registry.register(
            "config_state",
            "1 for the current state: none (nothing loaded), active, empty (no policies: every queue NOT_FOUND), stale (latest input rejected, last good kept)",
            state.clone(),
        );
        let info = Family::<Labels, Gauge>::default();
        registry.register(
            "config_info",
            "The loaded configuration: content hash (as the operator reports it) and origin, value 1",
            info.clone(),
        );
        let generation = Gauge::default();
        registry.register(
            "config_generation",
            "Sequence number of the loaded configuration in this process (1 = first)",
            generation.clone(),
        );
        let policies = Gauge::default();
        registry.register(
            "config_policies",
            "Policies in the loaded configuration",
            policies.clone(),
        );
        let loaded_at = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "config_loaded_timestamp_seconds",
            "When the loaded configuration was installed, in Unix seconds",
            loaded_at.clone(),
        );
        let source_connected = Gauge::default();
        registry.register(
            "config_source_connected",
            "1 while the configuration source is reachable; 0 while a watch-mode sidecar cannot reach the API server and answers from the last good configuration without seeing changes",
            source_connected.clone(),
        );
        let source_disconnected_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "config_source_disconnected_seconds",
            "How long the configuration source has been unreachable (0 while connected): alert when it stays above a minute",
            source_disconnected_seconds.clone(),
        );
        let budget = BudgetFamilies::register(&mut registry);
        let fleet_gauges = FleetGauges::register(&mut registry);
        let evidence = Arc::new(RolloutEvidence::register(&mut registry));
        Self {
            evidence,
            budget,
            fleet: Arc::new(FleetShare::default()),
            fleet_gauges,
            link: Arc::new(SourceLink::default()),
            source_connected,
            source_disconnected_seconds,
            decisions,
            not_found: code("not_found"),
            invalid_argument: code("invalid_argument"),
            unavailable: code("unavailable"),
            decide_seconds: rpc("Decide"),
            batch_seconds: rpc("DecideBatch"),
            registry,
            reloads,
            reload_failures,
            reads,
            last_reload_seconds,
            state,
            info,
            generation,
            policies,
            loaded_at,
            scrape: Mutex::new(()),
        }
    }

    /// Whether the configuration source is reachable; watch mode keeps it current.
    pub fn source_link(&self) -> &Arc<SourceLink> {
        &self.link
    }

    /// The share of the retry budgets this sidecar books, as the fleet task last set it.
    pub fn fleet(&self) -> &Arc<FleetShare> {
        &self.fleet
    }

    /// The rollout evidence this sidecar counts (on only with a fleet Lease).
    pub fn evidence(&self) -> &Arc<RolloutEvidence> {
        &self.evidence
    }

    /// The handles of one budgeted policy's series, created once per configuration so the
    /// request path only adds to atomics.
    pub fn budget_series(&self, identity: &str) -> BudgetSeries {
        let labels = policy_label(identity);
        let f = &self.budget;
        BudgetSeries {
            admitted: f.admitted.get_or_create(&labels).clone(),
            stretched: f.stretched.get_or_create(&labels).clone(),
            deadline: f.deadline.get_or_create(&labels).clone(),
            repeats: f.repeats.get_or_create(&labels).clone(),
            added_delay: f.added_delay.get_or_create(&labels).clone(),
        }
    }

    /// Drops a policy's budget series (its budget or the policy was removed), so series
    /// stay bounded by the policies loaded.
    pub fn remove_budget_series(&self, identity: &str) {
        let labels = policy_label(identity);
        let f = &self.budget;
        f.admitted.remove(&labels);
        f.stretched.remove(&labels);
        f.deadline.remove(&labels);
        f.repeats.remove(&labels);
        f.added_delay.remove(&labels);
    }

    /// The decision series, from which each configuration gets its policies' handles.
    pub fn decisions(&self) -> &DecisionFamily {
        &self.decisions
    }

    pub fn count_rejected(&self, rejection: Rejection) {
        match rejection {
            Rejection::NotFound => &self.not_found,
            Rejection::InvalidArgument => &self.invalid_argument,
        }
        .inc();
    }

    /// A request arrived before any configuration was loaded.
    pub fn count_unavailable(&self) {
        self.unavailable.inc();
    }

    /// Time spent deciding one `Decide` call.
    pub fn decided(&self, took: Duration) {
        self.decide_seconds.observe(took.as_secs_f64());
    }

    /// Time spent deciding one whole `DecideBatch` call.
    pub fn decided_batch(&self, took: Duration) {
        self.batch_seconds.observe(took.as_secs_f64());
    }

    pub fn reloaded(&self, took: Duration) {
        self.reloads.inc();
        self.last_reload_seconds.set(took.as_secs_f64());
    }

    pub fn reload_failed(&self) {
        self.reload_failures.inc();
    }

    pub fn reload_failures(&self) -> u64 {
        self.reload_failures.get()
    }

    /// The configuration input was read (a file opened and read, or a watch event's bytes
    /// taken), whether or not it turned out to be new.
    pub fn read_input(&self) {
        self.reads.inc();
    }

    pub fn input_reads(&self) -> u64 {
        self.reads.get()
    }

    /// The OpenMetrics text exposition (what [`CONTENT_TYPE`] names).
    pub fn render(&self, state: ConfigState, current: Option<ConfigView<'_>>) -> String {
        let _one_at_a_time = self.scrape.lock().unwrap_or_else(|e| e.into_inner());
        for s in ConfigState::ALL {
            self.state
                .get_or_create(&[("state", s.as_str())])
                .set(i64::from(s == state));
        }
        self.info.clear();
        match current {
            Some(cfg) => {
                self.info
                    .get_or_create(&vec![
                        ("config_hash", LabelText(cfg.hash.into())),
                        ("origin", LabelText(cfg.origin.into())),
                    ])
                    .set(1);
                self.generation
                    .set(i64::try_from(cfg.sequence).unwrap_or(i64::MAX));
                self.policies
                    .set(i64::try_from(cfg.policies).unwrap_or(i64::MAX));
                self.loaded_at.set(
                    cfg.loaded_at
                        .duration_since(UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                );
            }
            None => {
                self.generation.set(0);
                self.policies.set(0);
                self.loaded_at.set(0.0);
            }
        }
        self.fleet_gauges.set(&self.fleet);
        let link = self.link.status();
        self.source_connected.set(i64::from(link.connected));
        self.source_disconnected_seconds
            .set(link.disconnected_since_ms.map_or(0.0, |since| {
                crate::system_now_ms().saturating_sub(since) as f64 / 1e3
            }));
        let mut out = String::with_capacity(4096);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

fn policy_label(identity: &str) -> Labels {
    vec![("policy", LabelText(identity.into()))]
}

/// The content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    /// `name{labels} value` samples of an exposition, by name and labels.
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn renders_counters_states_and_escapes_labels() {
        let m = Metrics::default();
        m.count_rejected(Rejection::NotFound);
        m.count_rejected(Rejection::NotFound);
        m.reload_failed();
        m.decided(Duration::from_micros(3));
        let text = m.render(ConfigState::None, None);
        assert_eq!(
            sample(
                &text,
                "rebound_sidecar_rejected_requests_total{code=\"not_found\"}"
            ),
            Some(2.0)
        );
        assert_eq!(
            sample(&text, "rebound_sidecar_config_reload_failures_total"),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, "rebound_sidecar_config_state{state=\"none\"}"),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, "rebound_sidecar_config_state{state=\"stale\"}"),
            Some(0.0)
        );
        assert_eq!(
            sample(
                &text,
                "rebound_sidecar_decision_duration_seconds_count{rpc=\"Decide\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &text,
                &format!(
                    "rebound_sidecar_build_info{{version=\"{}\"}}",
                    env!("CARGO_PKG_VERSION")
                )
            ),
            Some(1.0)
        );
        assert!(text.ends_with("# EOF\n"), "an OpenMetrics exposition");

        let loaded = m.render(
            ConfigState::Active,
            Some(ConfigView {
                hash: "a\"b\\c\nd",
                origin: "test",
                sequence: 2,
                policies: 3,
                loaded_at: SystemTime::now(),
            }),
        );
        assert_eq!(
            sample(&loaded, "rebound_sidecar_config_state{state=\"none\"}"),
            Some(0.0)
        );
        assert_eq!(
            sample(&loaded, "rebound_sidecar_config_policies"),
            Some(3.0)
        );
        assert_eq!(
            sample(
                &loaded,
                "rebound_sidecar_config_info{config_hash=\"a\\\"b\\\\c\\nd\",origin=\"test\"}"
            ),
            Some(1.0),
            "label values escaped: {loaded}"
        );
    }
}
