//! Command-line flags (each also readable from a `REBOUND_*` environment variable).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// The rebound-operator's settings.
#[derive(Parser, Debug, Clone)]
#[command(name = "rebound-operator", version, about)]
pub struct Flags {
    /// Namespaces to watch, comma separated; empty means all namespaces. A name given twice
    /// counts once.
    #[arg(long, env = "REBOUND_NAMESPACES", value_delimiter = ',', num_args = 0.., value_parser = parse_namespace)]
    pub namespaces: Vec<String>,

    /// Name of the ConfigMap written into each namespace. The RBAC in deploy/ names it too.
    #[arg(
        long,
        env = "REBOUND_CONFIGMAP_NAME",
        default_value = "rebound-policies"
    )]
    pub configmap_name: String,

    /// Address of the /metrics, /livez and /readyz server.
    #[arg(long, env = "REBOUND_METRICS_ADDR", default_value = "127.0.0.1:9090")]
    pub metrics_addr: SocketAddr,

    /// Elect a leader on a Lease so several replicas can run with one writer.
    #[arg(long, env = "REBOUND_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,

    /// Namespace of the Lease; default: the pod's namespace (POD_NAMESPACE or the service
    /// account mount), else `default`.
    #[arg(long, env = "REBOUND_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// Name of the Lease.
    #[arg(long, env = "REBOUND_LEASE_NAME", default_value = "rebound-operator")]
    pub lease_name: String,

    /// Seconds a leader holds the Lease without renewing it; the failover time.
    #[arg(long, env = "REBOUND_LEASE_DURATION", default_value_t = 15)]
    pub lease_duration: u64,

    /// Seconds before expiry at which the leader renews (must be below the duration). The
    /// default leaves 5 s between the renewal and the deadline (as client-go's defaults): a
    /// busy API server takes seconds to write and read back a renewal, and with 2.5 s a
    /// leader lost its term 3 to 21 times while 10,000 policies were created.
    #[arg(long, env = "REBOUND_LEASE_GRACE", default_value_t = 10)]
    pub lease_grace: u64,

    /// Identity in the Lease; default: POD_NAME, else hostname and process id.
    #[arg(long, env = "REBOUND_IDENTITY")]
    pub identity: Option<String>,

    /// Period of the full resync that repairs drift nobody told us about.
    #[arg(long, env = "REBOUND_RESYNC", default_value = "5m", value_parser = parse_duration)]
    pub resync: Duration,

    /// How long after the operator writes a rollout step it takes effect: time for every
    /// sidecar to load it, so no job is placed by the old weight on one sidecar and the
    /// new on another. Watch-mode sidecars load within a second; sidecars reading the
    /// ConfigMap as a mounted file follow the kubelet's sync (up to about a minute): set
    /// 90s for those.
    #[arg(long, env = "REBOUND_ROLLOUT_STEP_LEAD", default_value = "10s", value_parser = parse_duration)]
    pub rollout_step_lead: Duration,

    /// Namespaces reconciled at the same time.
    #[arg(long, env = "REBOUND_CONCURRENCY", default_value_t = 8)]
    pub concurrency: u16,

    /// ClusterRole bound (RoleBinding `rebound-sidecar`) to the ServiceAccounts of every
    /// namespace with RetryPolicies or injected Pods, so watch-mode sidecars need no RBAC
    /// YAML; empty: no bindings. The chart passes `<release>-sidecar`.
    #[arg(long, env = "REBOUND_SIDECAR_CLUSTER_ROLE")]
    pub sidecar_cluster_role: Option<String>,

    /// How the watches fetch what exists at start and after a gap: `stream` (one watch
    /// that sends the objects, then a bookmark: Kubernetes ≥ 1.32, the WatchList feature)
    /// or `pages` (paged lists, for older servers or WatchList turned off).
    #[arg(long, env = "REBOUND_INITIAL_LIST", value_enum, default_value_t = InitialList::Stream)]
    pub initial_list: InitialList,

    /// Log format.
    #[arg(long, env = "REBOUND_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    pub log_format: LogFormat,
}

pub use rebound_runtime::LogFormat;

/// See [`Flags::initial_list`].
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitialList {
    Stream,
    Pages,
}

impl Flags {
    /// Checks what clap cannot: the lease timings.
    pub fn check(&self) -> Result<(), String> {
        if self.lease_grace == 0 || self.lease_grace >= self.lease_duration {
            return Err(format!(
                "--lease-grace ({}) must be above 0 and below --lease-duration ({})",
                self.lease_grace, self.lease_duration
            ));
        }
        if self.configmap_name.is_empty() {
            return Err("--configmap-name must not be empty".to_owned());
        }
        Ok(())
    }

    /// The namespaces to watch, each once in the order first given, or `None` for all.
    pub fn scope(&self) -> Option<Vec<String>> {
        let mut list: Vec<String> = Vec::new();
        for ns in self.namespaces.iter().filter(|n| !n.is_empty()) {
            if !list.contains(ns) {
                list.push(ns.clone());
            }
        }
        (!list.is_empty()).then_some(list)
    }

    /// Namespace of the Lease, following the flag, then the pod environment.
    pub fn lease_namespace(&self) -> String {
        rebound_runtime::pod_namespace(self.lease_namespace.as_deref())
    }

    /// Identity in the Lease and in events' reporting instance.
    pub fn identity(&self) -> String {
        if let Some(id) = self.identity.as_ref().filter(|n| !n.is_empty()) {
            return id.clone();
        }
        if let Ok(pod) = std::env::var("POD_NAME")
            && !pod.is_empty()
        {
            return pod;
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "rebound-operator".to_owned());
        format!("{host}-{}", std::process::id())
    }
}

/// A namespace name (an RFC 1123 label), trimmed; empty entries (`a,,b`) are skipped later.
fn parse_namespace(text: &str) -> Result<String, String> {
    let name = text.trim();
    let valid = name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if valid {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{name:?} is not a namespace name (at most 63 lowercase letters, digits and '-', \
             starting and ending with a letter or digit)"
        ))
    }
}

/// Parses a Kubernetes-style duration (`30s`, `5m`) with the policy crate's parser.
fn parse_duration(text: &str) -> Result<Duration, String> {
    rebound_policy::KubeDuration::parse(text)
        .map(|d| Duration::from_millis(d.as_millis()))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_scope() {
        let c = Flags::parse_from(["rebound-operator"]);
        assert_eq!(c.configmap_name, "rebound-policies");
        assert_eq!(c.scope(), None);
        assert_eq!(c.resync, Duration::from_secs(300));
        assert!(c.check().is_ok());
        let c = Flags::parse_from(["x", "--namespaces", "a,b", "--resync=30s"]);
        assert_eq!(c.scope(), Some(vec!["a".to_owned(), "b".to_owned()]));
        assert_eq!(c.resync, Duration::from_secs(30));
    }

    #[test]
    fn namespaces_are_trimmed_and_counted_once() {
        let c = Flags::parse_from(["x", "--namespaces", "b,a, b,,a"]);
        assert_eq!(c.scope(), Some(vec!["b".to_owned(), "a".to_owned()]));
        assert_eq!(Flags::parse_from(["x", "--namespaces", ""]).scope(), None);
    }

    #[test]
    fn bad_flag_values_are_usage_errors() {
        for args in [
            ["x", "--log-format=jsn"],
            ["x", "--namespaces=a,Bad_Name"],
            ["x", "--namespaces=-a"],
        ] {
            let e = Flags::try_parse_from(args).expect_err("must be refused");
            // Both are usage errors (exit code 2) that name the flag.
            assert!(
                matches!(
                    e.kind(),
                    clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue
                ),
                "{args:?}: {:?}",
                e.kind()
            );
            assert_eq!(e.exit_code(), 2);
        }
        let c = Flags::parse_from(["x", "--log-format=text"]);
        assert_eq!(c.log_format, LogFormat::Text);
    }

    #[test]
    fn the_default_renewal_has_five_seconds_to_be_seen() {
        let c = Flags::parse_from(["x"]);
        assert!(c.check().is_ok());
        let renewal = Duration::from_secs(c.lease_duration - c.lease_grace);
        let deadline = crate::leader::renew_deadline(c.lease_duration, c.lease_grace);
        assert_eq!(deadline - renewal, Duration::from_secs(5));
    }

    #[test]
    fn lease_timings_are_checked() {
        let c = Flags::parse_from(["x", "--lease-duration=5", "--lease-grace=5"]);
        assert!(c.check().is_err());
    }
}
