//! What reconciles share: the watch caches they read, the memory each namespace keeps
//! between its reconciles, and the clients they write with. Its own module so that
//! [`crate::reconcile`] (deciding) and [`crate::writes`] (executing) both depend on it and
//! not on each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rebound_policy::spec::ScheduleSummary;

use crate::cache::Cache;
use crate::events::Events;
use crate::freshness::Written;
use crate::metrics::Metrics;
use crate::objects::{ConfigMapView, PolicyView};
use crate::status::StatusSeen;
use crate::summary::Summaries;
use crate::{Flags, backoff::Requeue};

/// The watch caches a reconcile reads from (one per watched scope).
#[derive(Clone, Default)]
pub struct Stores {
    pub policies: Vec<Cache<PolicyView>>,
    pub configmaps: Vec<Cache<ConfigMapView>>,
    /// Live sidecars per namespace, from the sidecar Lease watch.
    pub sidecars: crate::fleet::Counts,
    /// The sidecars' rollout evidence reports, from the same watch.
    pub reports: crate::rollout::Reports,
}

impl Stores {
    pub(crate) fn policies_in(&self, namespace: &str) -> Vec<Arc<PolicyView>> {
        self.policies
            .iter()
            .flat_map(|c| c.in_namespace(namespace))
            .collect()
    }

    /// Live sidecars serving the operator's ConfigMap in `namespace`.
    pub(crate) fn sidecars_in(&self, namespace: &str) -> u32 {
        self.sidecars.get(namespace)
    }

    pub(crate) fn configmap(&self, namespace: &str, name: &str) -> Option<ConfigMapView> {
        self.configmaps
            .iter()
            .find_map(|c| c.get(namespace, name))
            .map(|view| (*view).clone())
    }
}

/// What a namespace's reconciles remember between runs: our own writes (until the watch
/// cache catches up) and each policy generation's schedule summary (shared through
/// [`Summaries`] with every policy of equal parameters).
#[derive(Default)]
pub struct Memory {
    pub(crate) configmap: Option<Written<ConfigMapView>>,
    /// Status writes the watch cache has not caught up with yet.
    pub(crate) statuses: HashMap<String, Written<StatusSeen>>,
    /// Of those, the `status.rollout` written (policies in rollout only), by uid.
    pub(crate) rollouts: HashMap<String, Written<rebound_policy::spec::RolloutStatus>>,
    /// Rollout statuses the ConfigMap already serves whose status write has not succeeded,
    /// by uid, with the policy's resourceVersion they were planned from: the next plan
    /// starts from them, so a refused status write cannot pick a step's start again
    /// (sidecars may already place jobs by it).
    pub(crate) served_rollouts: HashMap<String, (String, rebound_policy::spec::RolloutStatus)>,
    pub(crate) summaries: HashMap<String, (i64, Arc<ScheduleSummary>)>,
    /// The namespace's document as last compressed (only when it is stored compressed).
    pub(crate) compressed: crate::configmap::Compressed,
    /// When a rollout of the namespace must be looked at again (Unix ms).
    pub(crate) next_rollout_check_ms: Option<u64>,
    /// Since when ConfigMap writes have failed, while they do.
    pub(crate) apply_failing_since: Option<std::time::Instant>,
}

/// Everything a reconcile needs; shared by all of them.
pub struct Context {
    pub client: kube::Client,
    pub flags: Arc<Flags>,
    pub stores: Stores,
    pub memory: Mutex<HashMap<String, Memory>>,
    pub requeue: Requeue,
    pub metrics: Arc<Metrics>,
    pub events: Events,
    pub summaries: Arc<Summaries>,
    /// Recent policy events per namespace, to compile a burst once.
    pub bursts: Arc<crate::burst::Bursts>,
    /// Status writes in flight, all namespaces together (see `writes`).
    pub status_writes: Arc<tokio::sync::Semaphore>,
}

impl Memory {
    /// Writes of ours the watch cache has not shown yet (forgotten once it has).
    pub(crate) fn has_unconfirmed_writes(&self) -> bool {
        self.configmap.is_some() || !self.statuses.is_empty() || !self.rollouts.is_empty()
    }

    /// Holds nothing that a fresh `Memory` would not: dropping it loses nothing.
    fn is_empty(&self) -> bool {
        !self.has_unconfirmed_writes()
            && self.served_rollouts.is_empty()
            && self.summaries.is_empty()
            && self.compressed.is_none()
            && self.apply_failing_since.is_none()
            && self.next_rollout_check_ms.is_none()
    }
}

impl Context {
    /// Takes a namespace's memory for a reconcile; an empty one stands in for it meanwhile,
    /// so the count of namespaces held does not dip while reconciles run.
    pub(crate) fn take_memory(&self, namespace: &str) -> Memory {
        let mut all = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        all.get_mut(namespace)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Keeps a namespace's memory until its next reconcile; an empty one is dropped, so
    /// namespaces without policies (deleted ones too) cost nothing.
    pub(crate) fn put_memory(&self, namespace: &str, memory: Memory) {
        let mut all = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        if memory.is_empty() {
            all.remove(namespace);
        } else {
            all.insert(namespace.to_owned(), memory);
        }
        self.metrics.set_namespaces_held(all.len());
    }
}
