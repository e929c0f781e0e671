//! Rebound operator: watches RetryPolicies, compiles each namespace with
//! [`rebound_policy::compile`] into one ConfigMap, and reports status, events and metrics.
//!
//! Everything that decides something about a policy lives in `rebound-policy`; this crate
//! only moves data between the API server and that crate. The pure parts (status, plans,
//! triggers, backoff) are separate modules with plain unit tests; [`reconcile`] and
//! [`controller`] do the I/O.

pub mod backoff;
pub mod bindings;
pub mod burst;
pub mod cache;
pub mod configmap;
pub mod context;
pub mod controller;
pub mod error;
pub mod events;
pub mod fit;
pub mod flags;
pub mod fleet;
pub mod freshness;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod objects;
pub mod owned;
pub mod reconcile;
pub mod rollout;
pub mod status;
pub mod summary;
pub mod triggers;
pub mod writes;

pub use error::Error;
pub use flags::Flags;

/// Field manager of every write the operator makes (server-side apply and creates).
pub const FIELD_MANAGER: &str = "rebound-operator";
