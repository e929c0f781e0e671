//! The process set-up Rebound's binaries share: allocator tuning, the log format, the
//! Pod's namespace, the shutdown signals, and how they reach the API server (the client
//! and the watch backoff).

#[cfg(feature = "kube")]
pub mod api_client;
pub mod watch_backoff;

use std::io::IsTerminal;

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Keeps glibc from holding on to freed memory: fixed mmap and trim thresholds, so a large
/// buffer decoded and then freed (a big ConfigMap, a reload's garbage) does not stay
/// resident (glibc otherwise raises both thresholds after the first large buffer is freed).
/// Call it first in `main`, before other threads start.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before other threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 * 1024);
    }
}

/// How log records are written to stderr.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line, event fields flattened.
    Json,
    /// Human-readable lines.
    Text,
}

/// How a binary logs: the format and its own choices where the binaries differ.
#[derive(Debug, Clone, Copy)]
pub struct Logging<'a> {
    pub format: LogFormat,
    /// The filter when `RUST_LOG` is unset, e.g. `info`.
    pub default_filter: &'a str,
    /// JSON records carry the event's fields at the top level rather than under `fields`.
    pub flatten_json_fields: bool,
    /// Colours only when stderr is a terminal (otherwise tracing-subscriber's default).
    pub ansi_only_on_terminal: bool,
}

impl Logging<'_> {
    /// Installs the global subscriber, writing to stderr; `RUST_LOG` overrides the filter.
    pub fn init(self) {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(self.default_filter));
        let mut builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        if self.ansi_only_on_terminal {
            builder = builder.with_ansi(std::io::stderr().is_terminal());
        }
        match self.format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder
                .json()
                .flatten_event(self.flatten_json_fields)
                .init(),
        }
    }
}

/// Where the service account's namespace is mounted in a Pod.
const SERVICE_ACCOUNT_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// `given` if set, else the Pod's namespace: `POD_NAMESPACE` (the downward API), else the
/// mounted service account's namespace, else `default`. Empty values count as unset.
pub fn pod_namespace(given: Option<&str>) -> String {
    pod_namespace_from(
        given,
        std::env::var("POD_NAMESPACE").ok().as_deref(),
        std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
            .ok()
            .as_deref(),
    )
}

fn pod_namespace_from(
    given: Option<&str>,
    env: Option<&str>,
    service_account: Option<&str>,
) -> String {
    [given, env, service_account.map(str::trim)]
        .into_iter()
        .flatten()
        .find(|ns| !ns.is_empty())
        .unwrap_or("default")
        .to_owned()
}

/// The signal that asked the process to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGTERM: the kubelet stopping the Pod.
    Terminate,
    /// SIGINT: Ctrl-C.
    Interrupt,
}

/// A handler for a stop signal could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("installing the {signal} handler")]
pub struct SignalError {
    signal: &'static str,
    #[source]
    source: std::io::Error,
}

/// SIGTERM and SIGINT, listened for from [`StopSignals::install`] on.
#[derive(Debug)]
pub struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl StopSignals {
    pub fn install() -> Result<Self, SignalError> {
        let listen = |kind: SignalKind, name: &'static str| {
            signal(kind).map_err(|source| SignalError {
                signal: name,
                source,
            })
        };
        Ok(Self {
            terminate: listen(SignalKind::terminate(), "SIGTERM")?,
            interrupt: listen(SignalKind::interrupt(), "SIGINT")?,
        })
    }

    /// Completes on the next SIGTERM or SIGINT.
    pub async fn recv(&mut self) -> StopSignal {
        tokio::select! {
            _ = self.terminate.recv() => StopSignal::Terminate,
            _ = self.interrupt.recv() => StopSignal::Interrupt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_is_the_first_set_of_flag_env_and_service_account() {
        assert_eq!(pod_namespace_from(Some("a"), Some("b"), Some("c\n")), "a");
        assert_eq!(pod_namespace_from(None, Some("b"), Some("c\n")), "b");
        assert_eq!(pod_namespace_from(Some(""), Some(""), Some("c\n")), "c");
        assert_eq!(pod_namespace_from(None, None, Some(" \n")), "default");
        assert_eq!(pod_namespace_from(None, None, None), "default");
    }

    #[tokio::test]
    async fn a_sigterm_is_reported_as_terminate() -> Result<(), SignalError> {
        let mut signals = StopSignals::install()?;
        // SAFETY: raise only sends a signal to this process, whose handler is installed.
        unsafe {
            libc::raise(libc::SIGTERM);
        }
        assert_eq!(signals.recv().await, StopSignal::Terminate);
        Ok(())
    }
}
