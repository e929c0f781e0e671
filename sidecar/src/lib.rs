//! Rebound's sidecar: a small gRPC server next to every worker that answers job libraries'
//! retry hooks with `rebound_policy::decide`, from a compiled policy document that it keeps
//! loaded and hot-reloads.
//!
//! Layout, from the wire inwards:
//! - [`server`] binds the listeners and serves the advisor, health, reflection and metrics;
//! - [`body_limit`] bounds the request bytes all of a server's calls hold at once;
//! - [`service`] is the thin tonic adapter around [`answer`];
//! - [`answer`] turns requests into `decide` calls and answers: pure, fuzzed, no I/O;
//! - [`retry_budgets`] holds each budgeted policy's retry-budget scheduler across reloads;
//! - [`rollout_evidence`] counts the jobs of policies in rollout for the fleet Lease;
//! - [`fleet_share`] holds this sidecar's share of the budgets for the request path, and
//!   [`fleet`] (watch mode) keeps it current from the namespace's sidecar Leases;
//! - [`store`] holds the current configuration and swaps it atomically;
//! - [`source`] watches a mounted directory, a YAML file or a ConfigMap for new ones, and
//!   [`source_link`] says whether it can (watch mode loses it with the API server);
//! - [`client`] opens channels to a sidecar over TCP or its Unix socket;
//! - `testkit` (feature `testkit`, on only for the tests, the load benchmark and the fuzz
//!   targets) generates policy tables and reproduces kubelet's volume updates.

pub mod answer;
pub mod body_limit;
pub mod client;
#[cfg(feature = "kubernetes")]
pub mod fleet;
pub mod fleet_share;
pub mod metrics;
pub mod pb;
pub mod retry_budgets;
pub mod rollout_evidence;
pub mod server;
pub mod service;
pub mod source;
pub mod source_link;
pub mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

/// Milliseconds since the Unix epoch from the system clock; the default clock for deadlines.
pub fn system_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
