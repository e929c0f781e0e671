//! What `rollout status` shows of a policy: one [`View`] per state read, the same for
//! text and JSON, and whether the wait is over.

use rebound_policy::{
    RetryPolicy,
    spec::{AnalysisStatus, Condition, RolloutPhase, RolloutRequest},
};
use serde::Serialize;

/// Where a policy stands, as far as a person waiting on it cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum State {
    /// The operator has not observed the current generation (or written no status yet).
    Waiting,
    /// A step is running.
    Progressing,
    /// A step waits for `promote` (or `abort`).
    Paused,
    /// Nothing pending: the current generation serves every job.
    Healthy,
    /// Rolled back (or, without `spec.rollout`, Stalled): the stable revision serves.
    Degraded,
}

impl State {
    /// Whether a watch stops here.
    pub fn is_final(self) -> bool {
        matches!(self, State::Healthy | State::Degraded)
    }
}

/// One state of the policy; the JSON form is documented in docs/cli.md.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct View {
    pub namespace: String,
    pub name: String,
    pub generation: Option<i64>,
    pub observed_generation: Option<i64>,
    pub state: State,
    /// `status.rollout.phase`; absent for a policy without `status.rollout`.
    pub phase: Option<RolloutPhase>,
    pub revision: Option<String>,
    pub stable_revision: Option<String>,
    /// Index of the current step (as `status.rollout.step`), while Progressing or Paused.
    pub step: Option<u32>,
    /// Steps in `spec.rollout`.
    pub step_count: Option<usize>,
    /// Percent of jobs `revision` serves: the step's weight, 100 when Healthy, 0 when
    /// rolled back.
    pub weight: Option<i32>,
    pub analysis: Option<Analysis>,
    pub message: String,
    /// `status.rollout.request` while the operator has not acted on it (its `id` is not
    /// `handledRequest`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending_request: Option<RolloutRequest>,
}

/// `status.rollout.analysis` with the two bad-job ratios worked out.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Analysis {
    #[serde(flatten)]
    pub figures: AnalysisStatus,
    /// Bad jobs (dead letters and drops) per failed job of the new revision; absent
    /// before its first failed job.
    pub bad_ratio_new: Option<f64>,
    pub bad_ratio_stable: Option<f64>,
}

impl From<&AnalysisStatus> for Analysis {
    fn from(a: &AnalysisStatus) -> Self {
        let ratio = |bad: i64, failed: i64| (failed > 0).then(|| bad as f64 / failed as f64);
        Analysis {
            figures: *a,
            bad_ratio_new: ratio(a.bad_new, a.failed_new),
            bad_ratio_stable: ratio(a.bad_stable, a.failed_stable),
        }
    }
}

impl View {
    /// The view of a policy as read from the API server.
    pub fn of(policy: &RetryPolicy) -> View {
        let meta = &policy.metadata;
        let status = policy.status.as_ref();
        let generation = meta.generation;
        let observed = status.and_then(|s| s.observed_generation);
        let mut view = View {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            generation,
            observed_generation: observed,
            state: State::Waiting,
            phase: None,
            revision: None,
            stable_revision: None,
            step: None,
            step_count: policy.spec.rollout.as_ref().map(|r| r.steps.len()),
            weight: None,
            analysis: None,
            message: String::new(),
            pending_request: None,
        };
        let current = observed.is_some() && observed == generation;
        let conditions = status.map(|s| &s.conditions[..]).unwrap_or_default();
        match status.and_then(|s| s.rollout.as_ref()) {
            Some(rollout) => {
                view.phase = Some(rollout.phase);
                view.revision = Some(rollout.revision.clone());
                view.stable_revision = Some(rollout.stable_revision.clone());
                view.analysis = rollout.analysis.as_ref().map(Analysis::from);
                view.message = rollout.message.clone();
                view.pending_request = rollout
                    .request
                    .clone()
                    .filter(|r| rollout.handled_request.as_deref() != Some(r.id.as_str()));
                let step = matches!(
                    rollout.phase,
                    RolloutPhase::Progressing | RolloutPhase::Paused
                )
                .then_some(rollout.step)
                .flatten();
                view.step = step;
                view.weight = match rollout.phase {
                    RolloutPhase::Healthy => Some(100),
                    RolloutPhase::Degraded => Some(0),
                    _ => step.and_then(|i| step_weight(policy, &rollout.steps, i)),
                };
                view.state = match rollout.phase {
                    _ if !current => State::Waiting,
                    RolloutPhase::Healthy => State::Healthy,
                    RolloutPhase::Progressing => State::Progressing,
                    RolloutPhase::Paused => State::Paused,
                    RolloutPhase::Degraded => State::Degraded,
                };
            }
            // A policy without a rollout: done when compiled, failed when Stalled.
            None if policy.spec.rollout.is_none() => {
                let is_true = |kind: &str| {
                    conditions.iter().find(|c| {
                        c.type_ == kind && c.status == "True" && c.observed_generation == generation
                    })
                };
                if let (true, Some(c)) = (current, is_true("Stalled")) {
                    view.state = State::Degraded;
                    view.message = says(c);
                } else if let (true, Some(c)) = (current, is_true("Ready")) {
                    view.state = State::Healthy;
                    view.message = c.message.clone();
                }
            }
            None => {}
        }
        if view.state == State::Waiting && view.message.is_empty() {
            view.message = match generation {
                Some(g) => format!("waiting for rebound-operator to observe generation {g}"),
                None => "waiting for rebound-operator".to_owned(),
            };
        }
        view
    }

    /// Text for people, one block per state.
    pub fn text(&self) -> String {
        let mut out = format!("RetryPolicy {}/{}", self.namespace, self.name);
        if let Some(g) = self.generation {
            out.push_str(&format!(" (generation {g}"));
            match self.observed_generation {
                Some(o) => out.push_str(&format!(", observed {o})")),
                None => out.push_str(", not observed yet)"),
            }
        }
        out.push('\n');
        let phase = match self.phase {
            Some(p) if self.state == State::Waiting => format!("Waiting (last phase {p:?})"),
            _ => format!("{:?}", self.state),
        };
        out.push_str(&format!("Phase:     {phase}\n"));
        if let Some(revision) = &self.revision {
            let stable = self.stable_revision.as_deref().unwrap_or_default();
            out.push_str(&format!(
                "Revision:  {} (stable {})\n",
                short(revision),
                short(stable)
            ));
        }
        if let (Some(i), Some(n)) = (self.step, self.step_count) {
            let weight = self.weight.map(|w| format!(", weight {w}%"));
            out.push_str(&format!(
                "Step:      {}/{n}{}\n",
                i + 1,
                weight.unwrap_or_default()
            ));
        }
        if let Some(a) = &self.analysis {
            out.push_str(&format!("Analysis:  {}\n", analysis_text(a)));
        }
        if !self.message.is_empty() {
            out.push_str(&format!("Message:   {}\n", self.message));
        }
        if let Some(r) = &self.pending_request {
            out.push_str(&format!(
                "Request:   {:?} of {} (id {}), not acted on yet\n",
                r.action,
                short(&r.revision),
                r.id
            ));
        }
        out
    }
}

/// The weight of started step `i`, else of the spec's step `i`.
fn step_weight(
    policy: &RetryPolicy,
    started: &[rebound_policy::spec::StartedStep],
    i: u32,
) -> Option<i32> {
    let i = i as usize;
    started.get(i).map(|s| s.weight).or_else(|| {
        let steps = &policy.spec.rollout.as_ref()?.steps;
        steps.get(i).and_then(|s| i32::try_from(s.weight).ok())
    })
}

fn says(c: &Condition) -> String {
    format!("{}: {}", c.reason, c.message)
}

/// `sha256:` and the first 12 hex digits: enough to tell revisions apart.
pub fn short(revision: &str) -> &str {
    let end = revision.find(':').map_or(12, |i| i + 13);
    revision.get(..end).unwrap_or(revision)
}

fn analysis_text(a: &Analysis) -> String {
    let ratio = |r: Option<f64>, bad: i64, failed: i64| match r {
        Some(r) => format!("{:.2}% ({bad} of {failed})", r * 100.0),
        None => "n/a (no failed job yet)".to_owned(),
    };
    format!(
        "{:?}: bad-job ratio new {} vs stable {}; e-value {:.2} (threshold {:.2}); \
         step sample {} failed jobs (minimum {})",
        a.figures.verdict,
        ratio(a.bad_ratio_new, a.figures.bad_new, a.figures.failed_new),
        ratio(
            a.bad_ratio_stable,
            a.figures.bad_stable,
            a.figures.failed_stable
        ),
        a.figures.e_value,
        a.figures.threshold,
        a.figures.step_failed_jobs,
        a.figures.min_failed_jobs,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rebound_policy::spec::{RetryPolicyStatus, RolloutStatus, StartedStep};

    fn policy(generation: i64, observed: i64, rollout: Option<RolloutStatus>) -> RetryPolicy {
        let mut p: RetryPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
            "metadata": {"name": "p", "namespace": "ns", "generation": generation},
            "spec": {"queues": ["q"], "maxAttempts": 5, "backoff": {"base": "1s", "cap": "1m"},
                     "rollout": {"steps": [{"weight": 10}, {"weight": 50, "pause": "1m"}]}}
        }))
        .expect("a policy");
        p.status = Some(RetryPolicyStatus {
            observed_generation: Some(observed),
            rollout,
            ..Default::default()
        });
        p
    }

    fn rollout(phase: RolloutPhase, step: Option<u32>) -> RolloutStatus {
        RolloutStatus {
            phase,
            revision: "sha256:0123456789abcdef0123".into(),
            stable_revision: "sha256:fedcba9876543210fedc".into(),
            step,
            steps: vec![
                StartedStep {
                    weight: 10,
                    start_unix_ms: 1,
                },
                StartedStep {
                    weight: 50,
                    start_unix_ms: 2,
                },
            ],
            analysis: Some(AnalysisStatus {
                failed_new: 4,
                bad_new: 1,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn phases_and_generations() {
        let v = View::of(&policy(
            2,
            2,
            Some(rollout(RolloutPhase::Progressing, Some(1))),
        ));
        assert_eq!(
            (v.state, v.step, v.weight),
            (State::Progressing, Some(1), Some(50))
        );
        assert_eq!(v.analysis.and_then(|a| a.bad_ratio_new), Some(0.25));
        let v = View::of(&policy(3, 2, Some(rollout(RolloutPhase::Healthy, None))));
        assert_eq!(v.state, State::Waiting, "an old generation is not done");
        let v = View::of(&policy(3, 3, Some(rollout(RolloutPhase::Degraded, None))));
        assert_eq!((v.state, v.weight), (State::Degraded, Some(0)));
        let v = View::of(&policy(3, 3, None));
        assert_eq!(
            v.state,
            State::Waiting,
            "spec.rollout without status.rollout"
        );
    }

    #[test]
    fn short_revisions() {
        assert_eq!(short("sha256:0123456789abcdef"), "sha256:0123456789ab");
        assert_eq!(short("sha256:01"), "sha256:01");
        assert_eq!(short(""), "");
    }
}
