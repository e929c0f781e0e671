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
/// show yet (by uid); `reports` the sidecars' live reports of the namespace;
/// `step_lead_ms` how long after it is written a step takes effect.
pub fn plan(
    views: &[Arc<PolicyView>],
    written: &HashMap<String, crate::freshness::Written<RolloutStatus>>,
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
        let prev = newest(
            Some((view.resource_version.as_str(), cached)),
            written.get(&view.uid),
        )
        .cloned();
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
