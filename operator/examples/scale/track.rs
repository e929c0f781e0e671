//! Convergence as two watches see it: which policies are Ready at their generation, and
//! which hash each namespace's ConfigMap announces. Polling with a list of every policy
//! (what this benchmark did first) costs the API server a full list per poll — 250 MB of
//! JSON at 100,000 policies — and slows down the very thing it measures.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::watcher;
use kube::runtime::watcher::Event;
use rebound_policy::RetryPolicy;
use tokio::task::JoinHandle;

/// The hash annotation the operator writes beside the document.
const HASH_ANNOTATION: &str = "rebound.dev/hash";

#[derive(Default)]
struct State {
    /// (namespace, name) of every policy Ready at its current generation.
    ready: HashSet<(String, String)>,
    /// namespace → announced hash of its ConfigMap.
    hashes: HashMap<String, String>,
}

/// Watches RetryPolicies and the ConfigMaps named `rebound-policies` in every namespace.
pub struct Tracker {
    state: Arc<Mutex<State>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Tracker {
    pub fn start(client: &kube::Client) -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let policies: Api<RetryPolicy> = Api::all(client.clone());
        let cms: Api<ConfigMap> = Api::all(client.clone());
        let (s1, s2) = (state.clone(), state.clone());
        let policy_task = tokio::spawn(async move {
            let stream = watcher(policies, watcher::Config::default());
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                let mut state = s1.lock().unwrap_or_else(|e| e.into_inner());
                match event {
                    Ok(Event::Apply(p) | Event::InitApply(p)) => {
                        let key = key(&p.metadata);
                        if is_ready(&p) {
                            state.ready.insert(key);
                        } else {
                            state.ready.remove(&key);
                        }
                    }
                    Ok(Event::Delete(p)) => {
                        state.ready.remove(&key(&p.metadata));
                    }
                    Ok(Event::Init) => state.ready.clear(),
                    Ok(Event::InitDone) | Err(_) => {}
                }
            }
        });
        let cm_task = tokio::spawn(async move {
            let stream = watcher(
                cms,
                watcher::Config::default().fields("metadata.name=rebound-policies"),
            );
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                let mut state = s2.lock().unwrap_or_else(|e| e.into_inner());
                match event {
                    Ok(Event::Apply(cm) | Event::InitApply(cm)) => {
                        let ns = cm.metadata.namespace.clone().unwrap_or_default();
                        let hash = cm
                            .metadata
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get(HASH_ANNOTATION))
                            .cloned()
                            .unwrap_or_default();
                        state.hashes.insert(ns, hash);
                    }
                    Ok(Event::Delete(cm)) => {
                        state
                            .hashes
                            .remove(&cm.metadata.namespace.unwrap_or_default());
                    }
                    Ok(Event::Init) => state.hashes.clear(),
                    Ok(Event::InitDone) | Err(_) => {}
                }
            }
        });
        Self {
            state,
            tasks: vec![policy_task, cm_task],
        }
    }

    /// Policies Ready at their generation, and namespaces whose ConfigMap announces the
    /// expected hash.
    pub fn progress(&self, expected: &HashMap<String, String>) -> (usize, usize) {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let at_hash = expected
            .iter()
            .filter(|(ns, hash)| state.hashes.get(*ns) == Some(*hash))
            .count();
        (state.ready.len(), at_hash)
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn key(meta: &kube::api::ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Ready=True for the policy's current generation.
fn is_ready(p: &RetryPolicy) -> bool {
    let status = p.status.as_ref();
    status.and_then(|s| s.observed_generation) == p.metadata.generation
        && status.is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}
