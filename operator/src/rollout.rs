//! Rollouts in a namespace's reconcile: for each policy that declares `spec.rollout`, the
//! evidence the sidecars reported is merged into its status, the state machine
//! (`rebound_policy::rollout::machine`) runs once, and the result says what the compiled
//! document serves, what status and Events to write, and when to look again.
//!
//! Policies without `spec.rollout` never enter here: a namespace without one pays one
//! check per policy and an empty map.

use std::collections::HashMap;
use std::sync::Arc;

use rebound_policy::compiled::{CompiledRollout, compiled_rollout};
use rebound_policy::resolve::{ResolvedPolicy, resolve_rollout};
use rebound_policy::rollout::machine::{self, Input, RolloutEvent, Transition};
use rebound_policy::spec::RolloutStatus;
use rebound_policy::{CompiledPolicy, resolve};

use crate::freshness::newest;
use crate::objects::PolicyView;
pub use crate::objects::RolloutSeen;

pub mod conditions;
pub mod evidence;
pub mod reports;

pub use reports::Reports;

/// What one policy's rollout makes of this reconcile.
#[derive(Clone, Debug)]
pub struct Plan {
    pub transition: Transition,
    /// What the document serves outside the canary, and the canary while one runs.
    pub stable: ResolvedPolicy,
    pub compiled: Option<CompiledRollout>,
}

/// Plans by policy name.
pub type Plans = HashMap<String, Plan>;

/// Runs the machine for every policy of the namespace with a valid `spec.rollout`.
/// `written` holds the rollout statuses this operator wrote that the watch cache may not
/// show yet (by uid); `served` those the ConfigMap serves whose status write failed (see
/// `Memory::served_rollouts`); `reports` the sidecars' live reports of the namespace;
/// `step_lead_ms` how long after it is written a step takes effect.
pub fn plan(
    views: &[Arc<PolicyView>],
    written: &HashMap<String, crate::freshness::Written<RolloutStatus>>,
    served: &HashMap<String, (String, RolloutStatus)>,
    reports: &[Arc<rebound_policy::rollout::evidence::EvidenceReport>],
    now_unix_ms: u64,
    step_lead_ms: u64,
) -> Plans {
    let mut plans = Plans::new();
    for view in views {
        let Ok(spec) = &view.spec else { continue };
        let Some(rollout_spec) = &spec.rollout else {
            continue;
        };
        // An invalid spec is reported by the compile; its rollout status stays as it is.
        let (Ok(params), Ok(rollout)) = (resolve(spec), resolve_rollout(rollout_spec)) else {
            continue;
        };
        let cached = view.rollout.as_deref().map(|r| &r.status);
        let prev = match served.get(&view.uid) {
            // The ConfigMap serves it and nothing has written the policy since.
            Some((rv, status)) if *rv == view.resource_version => Some(status.clone()),
            _ => newest(
                Some((view.resource_version.as_str(), cached)),
                written.get(&view.uid),
            )
            .cloned(),
        };
        let request = view.rollout.as_deref().and_then(|r| r.request.as_ref());
        let prev = prev.map(|mut p| {
            evidence::merge(&mut p, &view.name, reports);
            p
        });
        let counts = prev
            .as_ref()
            .map(|p| evidence::summed(&p.evidence))
            .unwrap_or_default();
        let mut transition = machine::step(Input {
            prev: prev.as_ref(),
            params: &params,
            rollout: &rollout,
            evidence: &counts.mature,
            now_unix_ms,
            step_lead_ms,
            request,
        });
        // A new revision has no evidence yet, unless sidecars already report it.
        evidence::merge(&mut transition.status, &view.name, reports);
        let (stable, compiled) = compiled_rollout(&transition.status, &params);
        plans.insert(
            view.name.clone(),
            Plan {
                transition,
                stable,
                compiled,
            },
        );
    }
    plans
}

/// Puts the plans into a compiled namespace's policies (the stable parameters and the
/// rollout); `true` when any was changed, so the document's hash must be stamped again.
pub fn apply(policies: &mut [CompiledPolicy], plans: &Plans) -> bool {
    if plans.is_empty() {
        return false;
    }
    let mut changed = false;
    for p in policies.iter_mut() {
        if let Some(plan) = plans.get(&p.name) {
            p.params = plan.stable.clone();
            p.rollout = plan.compiled.clone();
            changed = true;
        }
    }
    changed
}

/// The earliest time any plan must be looked at again, in Unix milliseconds.
pub fn next_check(plans: &Plans) -> Option<u64> {
    plans
        .values()
        .filter_map(|p| p.transition.next_check_ms)
        .min()
}

/// The Event of one thing that happened.
pub fn event_note(event: &RolloutEvent) -> crate::status::EventNote {
    let (reason, note) = match event {
        RolloutEvent::Started { revision } => ("RolloutStarted", format!("rolling out {revision}")),
        RolloutEvent::StepStarted { step, weight } => (
            "StepStarted",
            format!(
                "step {} started: the new revision serves {weight} % of jobs",
                step + 1
            ),
        ),
        RolloutEvent::Promoted { revision } => ("Promoted", format!("{revision} serves every job")),
        RolloutEvent::Paused { step, why } => ("Paused", format!("step {}: {why}", step + 1)),
        RolloutEvent::RolledBack { why } => (
            "RolledBack",
            format!("rolled back to the stable revision: {why}"),
        ),
        RolloutEvent::Aborted => (
            "Aborted",
            "aborted: the stable revision serves every job".to_owned(),
        ),
        RolloutEvent::RequestRefused { id, why } => {
            ("RequestRefused", format!("request {id} refused: {why}"))
        }
        RolloutEvent::StatusUnreadable { why } => ("RolloutStatusUnreadable", why.clone()),
    };
    crate::status::EventNote {
        warning: event.is_warning(),
        reason,
        note,
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::DynamicObject;
    use rebound_policy::rollout::assign::revision_id;
    use rebound_policy::spec::{RolloutAction, RolloutPhase, RolloutRequest};

    fn spec(max_attempts: u32) -> serde_json::Value {
        serde_json::json!({
            "queues": ["q"],
            "backoff": {"strategy": "constant", "base": "1s"},
            "maxAttempts": max_attempts,
            "rollout": {"steps": [{"weight": 10}, {"weight": 50}]},
        })
    }

    /// The policy at `max_attempts` 5, paused at step 0 of a rollout from 3, with `request`.
    fn view(request: Option<&RolloutRequest>) -> Arc<PolicyView> {
        let stable = resolve(&serde_json::from_value(spec(3)).expect("spec")).expect("valid");
        let new = resolve(&serde_json::from_value(spec(5)).expect("spec")).expect("valid");
        let status = RolloutStatus {
            phase: RolloutPhase::Paused,
            revision: revision_id(&new),
            stable_revision: revision_id(&stable),
            stable_params: serde_json::to_value(&stable).ok(),
            step: Some(0),
            steps: vec![rebound_policy::spec::StartedStep {
                weight: 10,
                start_unix_ms: 1_000,
            }],
            request: request.cloned(),
            ..RolloutStatus::default()
        };
        let object: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                         "generation": 2},
            "spec": spec(5),
            "status": {"observedGeneration": 2, "rollout": status},
        }))
        .expect("object");
        Arc::new(PolicyView::from_dynamic(&object).expect("view"))
    }

    #[test]
    fn a_refused_status_write_never_moves_a_served_step() {
        let probe = view(None);
        let revision = probe
            .rollout
            .as_ref()
            .expect("rollout")
            .status
            .revision
            .clone();
        let promote = RolloutRequest {
            step: None,
            action: RolloutAction::Promote,
            revision,
            id: "a".to_owned(),
        };
        let views = [view(Some(&promote))];
        let first = plan(&views, &HashMap::new(), &HashMap::new(), &[], 10_000, 0);
        let started = first["p"].transition.status.steps.clone();
        assert_eq!(started.len(), 2);
        assert_eq!(started[1].start_unix_ms, 10_000);
        // The ConfigMap serving step 1 was written, the status write refused: the cache
        // still shows step 0 and the request. The next plan keeps the served start.
        let served = HashMap::from([(
            "u".to_owned(),
            ("7".to_owned(), first["p"].transition.status.clone()),
        )]);
        let again = plan(&views, &HashMap::new(), &served, &[], 20_000, 0);
        assert_eq!(again["p"].transition.status.steps, started);
        assert_eq!(again["p"].compiled.as_ref().map(|c| c.steps.len()), Some(2));
        // Without it, the request would be acted on again with another start.
        let forgot = plan(&views, &HashMap::new(), &HashMap::new(), &[], 20_000, 0);
        assert_eq!(forgot["p"].transition.status.steps[1].start_unix_ms, 20_000);
    }
}
