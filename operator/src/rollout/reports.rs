//! The sidecars' evidence reports, from the annotation of the fleet Leases the operator
//! already watches. Only Leases that carry the annotation take memory here, and a Lease
//! event triggers its namespace only when its report changed (renewals alone trigger
//! nothing). An unreadable report is skipped with one warning per Lease and text.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::runtime::watcher::Event;
use rebound_policy::rollout::evidence::{EVIDENCE_ANNOTATION, EvidenceReport};
use tracing::warn;

/// One Lease's report as last read: its text (to tell a change) and what it says, if
/// readable.
#[derive(Debug)]
struct Held {
    text: String,
    report: Option<Arc<EvidenceReport>>,
}

/// Live reports per namespace and Lease name; shared with the reconciles.
#[derive(Clone, Debug, Default)]
pub struct Reports(Arc<Mutex<HashMap<String, HashMap<String, Held>>>>);

impl Reports {
    /// The readable reports of a namespace.
    pub fn in_namespace(&self, namespace: &str) -> Vec<Arc<EvidenceReport>> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.get(namespace)
            .into_iter()
            .flat_map(|leases| leases.values())
            .filter_map(|h| h.report.clone())
            .collect()
    }

    /// A Lease event; returns the namespace when a report appeared, changed or went.
    /// A re-list reads every listed Lease again; a report of a Lease deleted during a
    /// watch gap stays until the namespace's next event (its counts are in status anyway).
    pub fn event(&self, event: &Event<Lease>) -> Vec<String> {
        match event {
            Event::Apply(lease) | Event::InitApply(lease) => self.put(lease),
            Event::Delete(lease) => {
                let (Some(ns), Some(name)) = (lease.namespace(), lease.metadata.name.as_ref())
                else {
                    return Vec::new();
                };
                let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
                let removed = all.get_mut(&ns).and_then(|l| l.remove(name)).is_some();
                all.retain(|_, leases| !leases.is_empty());
                if removed { vec![ns] } else { Vec::new() }
            }
            Event::Init | Event::InitDone => Vec::new(),
        }
    }

    fn put(&self, lease: &Lease) -> Vec<String> {
        let (Some(ns), Some(name)) = (lease.namespace(), lease.metadata.name.clone()) else {
            return Vec::new();
        };
        let text = lease.annotations().get(EVIDENCE_ANNOTATION);
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let leases = all.entry(ns.clone()).or_default();
        let changed = match text {
            None => leases.remove(&name).is_some(),
            Some(text) if leases.get(&name).is_some_and(|h| &h.text == text) => false,
            Some(text) => {
                let report = match EvidenceReport::parse(text) {
                    Ok(r) => Some(Arc::new(r)),
                    Err(e) => {
                        warn!(namespace = %ns, lease = %name, error = %e, "unreadable rollout evidence report; skipped");
                        None
                    }
                };
                leases.insert(
                    name,
                    Held {
                        text: text.clone(),
                        report,
                    },
                );
                true
            }
        };
        all.retain(|_, leases| !leases.is_empty());
        if changed { vec![ns] } else { Vec::new() }
    }
}
