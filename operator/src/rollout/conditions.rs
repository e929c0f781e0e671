//! The conditions of a policy in rollout, on top of the ones every policy has.
//!
//! `Progressing`, `Degraded` and `Healthy` say where the rollout is, in Argo Rollouts'
//! words; kstatus' `Reconciling` is True while a rollout runs (Paused too: it still waits
//! for someone), `Stalled` after a rollback, and `Ready` is True only when Healthy, so
//! `kubectl wait --for=condition=Ready` and Flux's `wait` gate on a finished rollout.

use rebound_policy::RetryPolicyStatus;
use rebound_policy::spec::{AnalysisVerdict, Condition, RolloutPhase, RolloutStatus};

use crate::status::{READY, RECONCILING, STALLED, StatusSeen, Verdict};

pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
pub const HEALTHY: &str = "Healthy";

/// Condition reasons of rollouts.
pub mod reason {
    pub const ROLLOUT_STEP: &str = "RolloutStep";
    pub const ROLLOUT_PAUSED: &str = "RolloutPaused";
    pub const ROLLOUT_COMPLETE: &str = "RolloutComplete";
    pub const ROLLOUT_ABORTED: &str = "RolloutAborted";
    pub const ROLLED_BACK: &str = "RolledBack";
    pub const ABORTED: &str = "Aborted";
    pub const ROLLING_OUT: &str = "RollingOut";
}

/// Adds `rollout` and its conditions to the status a policy would have without one.
/// Ready/Reconciling/Stalled change only for a policy the document serves: a policy that
/// is invalid or not written keeps saying so.
pub fn decorate(
    status: &mut RetryPolicyStatus,
    rollout: &RolloutStatus,
    verdict: &Verdict,
    current: Option<&StatusSeen>,
    now: &str,
) {
    let generation = status.observed_generation.unwrap_or(0);
    let message = rollout.message.clone();
    let degraded_reason = match rollout.analysis.map(|a| a.verdict) {
        Some(AnalysisVerdict::Harm) => reason::ROLLED_BACK,
        _ => reason::ABORTED,
    };
    let (progressing, degraded, healthy) = match rollout.phase {
        RolloutPhase::Progressing => (
            ("True", reason::ROLLOUT_STEP),
            ("False", reason::ROLLOUT_STEP),
            ("False", reason::ROLLING_OUT),
        ),
        RolloutPhase::Paused => (
            ("True", reason::ROLLOUT_PAUSED),
            ("False", reason::ROLLOUT_PAUSED),
            ("False", reason::ROLLING_OUT),
        ),
        RolloutPhase::Healthy => (
            ("False", reason::ROLLOUT_COMPLETE),
            ("False", reason::ROLLOUT_COMPLETE),
            ("True", reason::ROLLOUT_COMPLETE),
        ),
        RolloutPhase::Degraded => (
            ("False", reason::ROLLOUT_ABORTED),
            ("True", degraded_reason),
            ("False", degraded_reason),
        ),
    };
    // Ready's message changes only with the step, never with each report: a change of
    // Ready is an Event (`status::event`).
    let short = message.split("; ").next().unwrap_or_default().to_owned();
    let condition = |type_: &str, (s, r): (&str, &str)| Condition {
        type_: type_.to_owned(),
        status: s.to_owned(),
        reason: r.to_owned(),
        message: if [READY, RECONCILING, STALLED].contains(&type_) {
            short.clone()
        } else {
            message.clone()
        },
        observed_generation: Some(generation),
        last_transition_time: current
            .and_then(|c| c.since(type_, s))
            .unwrap_or(now)
            .to_owned(),
    };
    if matches!(verdict, Verdict::Serving { .. }) {
        let kstatus = match rollout.phase {
            RolloutPhase::Healthy => None,
            RolloutPhase::Progressing | RolloutPhase::Paused => Some((
                ("False", reason::ROLLING_OUT),
                ("True", reason::ROLLING_OUT),
                ("False", reason::ROLLING_OUT),
            )),
            RolloutPhase::Degraded => Some((
                ("False", degraded_reason),
                ("False", degraded_reason),
                ("True", degraded_reason),
            )),
        };
        if let Some((ready, reconciling, stalled)) = kstatus {
            status.conditions = vec![
                condition(READY, ready),
                condition(RECONCILING, reconciling),
                condition(STALLED, stalled),
            ];
        }
    }
    status.conditions.extend([
        condition(PROGRESSING, progressing),
        condition(DEGRADED, degraded),
        condition(HEALTHY, healthy),
    ]);
    status.rollout = Some(rollout.clone());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::desired;
    use rebound_policy::FieldError;

    fn of<'a>(s: &'a RetryPolicyStatus, type_: &str) -> (&'a str, &'a str) {
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .expect("condition");
        (c.status.as_str(), c.reason.as_str())
    }

    fn decorated(phase: RolloutPhase, verdict: &Verdict) -> RetryPolicyStatus {
        let mut status = desired(3, verdict, None, None, "T", "cm");
        let rollout = RolloutStatus {
            phase,
            message: "step 1 of 2 at 10 %; bad jobs: …".to_owned(),
            ..RolloutStatus::default()
        };
        decorate(&mut status, &rollout, verdict, None, "T");
        status
    }

    #[test]
    fn kstatus_and_argo_conditions_follow_the_phase() {
        let serving = Verdict::Serving {
            serving: vec!["q".to_owned()],
        };
        let s = decorated(RolloutPhase::Progressing, &serving);
        assert_eq!(of(&s, READY), ("False", reason::ROLLING_OUT));
        assert_eq!(of(&s, RECONCILING), ("True", reason::ROLLING_OUT));
        assert_eq!(of(&s, STALLED).0, "False");
        assert_eq!(of(&s, PROGRESSING), ("True", reason::ROLLOUT_STEP));
        let ready = s.conditions.iter().find(|c| c.type_ == READY).unwrap();
        assert_eq!(ready.message, "step 1 of 2 at 10 %", "no figures in Ready");
        let s = decorated(RolloutPhase::Paused, &serving);
        assert_eq!(of(&s, PROGRESSING), ("True", reason::ROLLOUT_PAUSED));
        assert_eq!(of(&s, RECONCILING).0, "True");
        let s = decorated(RolloutPhase::Degraded, &serving);
        assert_eq!(of(&s, STALLED), ("True", reason::ABORTED));
        assert_eq!(of(&s, DEGRADED), ("True", reason::ABORTED));
        assert_eq!(of(&s, READY).0, "False");
        let s = decorated(RolloutPhase::Healthy, &serving);
        assert_eq!(of(&s, READY), ("True", "Compiled"));
        assert_eq!(of(&s, HEALTHY), ("True", reason::ROLLOUT_COMPLETE));
        assert_eq!(of(&s, PROGRESSING).0, "False");
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(3))
        );
    }

    #[test]
    fn a_policy_not_served_keeps_saying_why() {
        let invalid = Verdict::Invalid(vec![FieldError {
            field: "spec.backoff.cap".to_owned(),
            message: "below base".to_owned(),
        }]);
        let s = decorated(RolloutPhase::Progressing, &invalid);
        assert_eq!(of(&s, READY), ("False", "InvalidSpec"));
        assert_eq!(of(&s, STALLED), ("True", "InvalidSpec"));
        assert_eq!(of(&s, PROGRESSING).0, "True");
    }
}
