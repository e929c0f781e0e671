//! The status a policy should have, as a pure function of what compiling its namespace did
//! to it and the status it has now.
//!
//! Conditions follow the kstatus conventions so `kubectl wait --for=condition=Ready`, Flux
//! and Argo CD understand them: `Ready`, plus `Reconciling` and `Stalled` (abnormal-true).
//! `lastTransitionTime` is carried over unless the condition's status flips, so a status
//! that did not change compares equal and is never written again.

use rebound_policy::compiled::LostQueue;
use rebound_policy::spec::{Condition, RolloutStatus, ScheduleSummary};
use rebound_policy::{FieldError, RetryPolicyStatus};

pub const READY: &str = "Ready";
pub const RECONCILING: &str = "Reconciling";
pub const STALLED: &str = "Stalled";

/// Condition and event reasons.
pub mod reason {
    pub const COMPILED: &str = "Compiled";
    pub const CONFLICT: &str = "Conflict";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const CONFIGMAP_NOT_OWNED: &str = "ConfigMapNotOwned";
    pub const DOCUMENT_TOO_LARGE: &str = "DocumentTooLarge";
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// The number of sidecars sharing the policy's retry budget changed.
    pub const SIDECARS_CHANGED: &str = "SidecarsChanged";
}

/// Longest condition message; a policy with many invalid fields gets the first ones.
const MAX_MESSAGE: usize = 1024;

/// What a reconcile keeps of a policy's current status: enough to carry
/// `lastTransitionTime` over, to tell whether an event is due and whether a write would
/// change anything, at a fraction of the status's size (the watch cache holds one per
/// policy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusSeen {
    /// Fingerprint of the whole status as its typed form serializes, conditions by type.
    whole: u64,
    observed_generation: Option<i64>,
    /// Fingerprint of Ready's (status, reason, message), if there is a Ready condition.
    ready: Option<u64>,
    /// Fingerprint of `summary.retryBudget`, if there is one.
    budget: Option<u64>,
    /// (type, status, lastTransitionTime) of each condition, separated by NUL, in one
    /// allocation (nine small ones per policy before). A condition with a NUL in one of
    /// them is left out: its time is not carried over, which costs one status write.
    transitions: Box<str>,
}

const SEPARATOR: char = '\0';

impl StatusSeen {
    pub fn of(status: &RetryPolicyStatus) -> Self {
        let ready = status
            .conditions
            .iter()
            .find(|c| c.type_ == READY)
            .map(|c| fingerprint(&(&c.status, &c.reason, &c.message)));
        let budget = status
            .summary
            .as_ref()
            .and_then(|s| s.retry_budget.as_ref())
            .map(fingerprint);
        // Conditions are a map keyed by type: their order carries nothing.
        let mut sorted: Vec<&Condition> = status.conditions.iter().collect();
        sorted.sort_by(|a, b| a.type_.cmp(&b.type_));
        Self {
            whole: fingerprint(&(
                status.observed_generation,
                &sorted,
                &status.summary,
                // A person's request is not ours to write.
                status.rollout.as_ref().map(|r| RolloutStatus {
                    request: None,
                    ..r.clone()
                }),
            )),
            observed_generation: status.observed_generation,
            ready,
            budget,
            transitions: status
                .conditions
                .iter()
                .map(|c| [&c.type_, &c.status, &c.last_transition_time])
                .filter(|fields| !fields.iter().any(|f| f.contains(SEPARATOR)))
                .flatten()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join("\0")
                .into(),
        }
    }

    /// When the condition `type_` last became `status`, if it has that status now.
    pub(crate) fn since(&self, type_: &str, status: &str) -> Option<&str> {
        let mut fields = self.transitions.split(SEPARATOR);
        while let (Some(t), Some(s), Some(since)) = (fields.next(), fields.next(), fields.next()) {
            if t == type_ {
                return (s == status).then_some(since);
            }
        }
        None
    }
}

/// A 64-bit fingerprint of a value's JSON form (in-process only: never stored or sent).
fn fingerprint<T: serde::Serialize + ?Sized>(value: &T) -> u64 {
    use std::hash::Hasher;
    struct Sink(std::collections::hash_map::DefaultHasher);
    impl std::io::Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.write(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut sink = Sink(std::collections::hash_map::DefaultHasher::new());
    // Serializing these plain structs into a sink that cannot fail cannot fail.
    let _ = serde_json::to_writer(&mut sink, value);
    sink.0.finish()
}

/// What happened to one policy in its namespace's reconcile.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// In the ConfigMap, serving all of its queues.
    Serving { serving: Vec<String> },
    /// In the ConfigMap, but other policies won some of its queues.
    Conflict {
        serving: Vec<String>,
        lost: Vec<LostQueue>,
    },
    /// Left out: the spec fails validation.
    Invalid(Vec<FieldError>),
    /// Valid, but the namespace's ConfigMap could not be written.
    Blocked(Blocked),
}

/// Why a namespace's document was not written.
#[derive(Clone, Debug, PartialEq)]
pub enum Blocked {
    /// A ConfigMap of that name exists without our managed-by label.
    NotOwned { configmap: String },
    /// With this policy the namespace's document would not fit: it would take `bytes`
    /// in the terms of `limit` (JSON or gzip'd bytes), over `max`; the `served` policies
    /// that fit are written without it.
    TooLarge {
        limit: &'static str,
        bytes: usize,
        max: usize,
        served: usize,
    },
    /// The API server refused or failed the write; retried with backoff.
    ApplyFailed { message: String },
}

/// A Kubernetes Event to emit for a status change.
#[derive(Clone, Debug, PartialEq)]
pub struct EventNote {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// One condition: (status, reason, message).
struct Wanted {
    ready: (&'static str, &'static str, String),
    reconciling: (&'static str, &'static str, String),
    stalled: (&'static str, &'static str, String),
}

fn wanted(verdict: &Verdict, configmap: &str) -> Wanted {
    let settled = |reason: &'static str| ("False", reason, String::new());
    let stuck = |reason: &'static str, message: String| Wanted {
        ready: ("False", reason, message.clone()),
        reconciling: settled(reason),
        stalled: ("True", reason, message),
    };
    match verdict {
        Verdict::Serving { serving } => Wanted {
            ready: (
                "True",
                reason::COMPILED,
                format!(
                    "compiled into ConfigMap {configmap}; serving {}",
                    serving.join(", ")
                ),
            ),
            reconciling: settled(reason::COMPILED),
            stalled: settled(reason::COMPILED),
        },
        Verdict::Conflict { serving, lost } => {
            let lost: Vec<String> = lost
                .iter()
                .map(|l| {
                    format!(
                        "queue {:?} is served by RetryPolicy {:?}",
                        l.pattern, l.winner
                    )
                })
                .collect();
            let serving = if serving.is_empty() {
                "serving no queues".to_owned()
            } else {
                format!("still serving {}", serving.join(", "))
            };
            stuck(reason::CONFLICT, format!("{}; {serving}", lost.join("; ")))
        }
        Verdict::Invalid(errors) => {
            let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
            stuck(reason::INVALID_SPEC, all.join("; "))
        }
        Verdict::Blocked(Blocked::NotOwned { configmap }) => stuck(
            reason::CONFIGMAP_NOT_OWNED,
            format!(
                "ConfigMap {configmap} exists but is not managed by rebound-operator \
                 (label app.kubernetes.io/managed-by=rebound-operator missing); \
                 delete or rename it so the policies of this namespace can be written"
            ),
        ),
        Verdict::Blocked(Blocked::TooLarge {
            limit,
            bytes,
            max,
            served,
        }) => stuck(
            reason::DOCUMENT_TOO_LARGE,
            too_large_message(limit, *bytes, *max, *served, configmap),
        ),
        Verdict::Blocked(Blocked::ApplyFailed { message }) => Wanted {
            ready: ("False", reason::APPLY_FAILED, message.clone()),
            reconciling: ("True", reason::APPLY_FAILED, format!("retrying: {message}")),
            stalled: settled(reason::APPLY_FAILED),
        },
    }
}

/// The message of `DocumentTooLarge`, in the grammar `docs/operator.md` defines:
/// `<limit> limit exceeded: <bytes> > <max> bytes; serving <served> policies in ConfigMap
/// <name> without this one`, where `<limit>` is `json` (the document's JSON, against what a
/// sidecar inflates) or `compressed` (the gzip'd JSON, against what a ConfigMap holds).
pub fn too_large_message(
    limit: &str,
    bytes: usize,
    max: usize,
    served: usize,
    configmap: &str,
) -> String {
    format!(
        "{limit} limit exceeded: {bytes} > {max} bytes; serving {served} policies in \
         ConfigMap {configmap} without this one"
    )
}

/// The status to write, given the current one (for `lastTransitionTime`) and `now`
/// (RFC 3339).
pub fn desired(
    generation: i64,
    verdict: &Verdict,
    summary: Option<&ScheduleSummary>,
    current: Option<&StatusSeen>,
    now: &str,
    configmap: &str,
) -> RetryPolicyStatus {
    let w = wanted(verdict, configmap);
    let condition = |type_: &str, (status, reason, message): (&str, &str, String)| {
        let since = current
            .and_then(|c| c.since(type_, status))
            .unwrap_or(now)
            .to_owned();
        Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message: truncate(message),
            observed_generation: Some(generation),
            last_transition_time: since,
        }
    };
    let summary = match verdict {
        Verdict::Invalid(_) => None,
        Verdict::Serving { serving } | Verdict::Conflict { serving, .. } => {
            summary.cloned().map(|s| ScheduleSummary {
                serving_queues: serving.clone(),
                queues: serving.join(", "),
                ..s
            })
        }
        Verdict::Blocked(_) => summary.cloned(),
    };
    RetryPolicyStatus {
        observed_generation: Some(generation),
        conditions: vec![
            condition(READY, w.ready),
            condition(RECONCILING, w.reconciling),
            condition(STALLED, w.stalled),
        ],
        summary,
        rollout: None,
    }
}

/// The event that tells people about a status change: when the generation or what the
/// Ready condition says changes. Nothing while the status stays the same, so resyncs and
/// restarts emit nothing.
pub fn event(
    verdict: &Verdict,
    previous: Option<&StatusSeen>,
    desired: &RetryPolicyStatus,
) -> Option<EventNote> {
    let ready = |s: &RetryPolicyStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == READY)
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    let seen = StatusSeen::of(desired);
    let changed = previous
        .is_none_or(|p| p.observed_generation != seen.observed_generation || p.ready != seen.ready);
    if !changed {
        // The same spec and verdict, but the budget is now shared by another number of
        // sidecars: a Pod came or went.
        let shared = desired
            .summary
            .as_ref()
            .and_then(|s| s.retry_budget.clone());
        if let Some(shared) = shared.filter(|_| previous.and_then(|p| p.budget) != seen.budget) {
            return Some(EventNote {
                warning: false,
                reason: reason::SIDECARS_CHANGED,
                note: format!("retry budget {shared}"),
            });
        }
        return None;
    }
    let note = ready(desired).map(|(_, _, m)| m).unwrap_or_default();
    let (warning, reason) = match verdict {
        Verdict::Serving { .. } => (false, reason::COMPILED),
        Verdict::Conflict { .. } => (true, reason::CONFLICT),
        Verdict::Invalid(_) => (true, reason::INVALID_SPEC),
        Verdict::Blocked(Blocked::NotOwned { .. }) => (true, reason::CONFIGMAP_NOT_OWNED),
        Verdict::Blocked(Blocked::TooLarge { .. }) => (true, reason::DOCUMENT_TOO_LARGE),
        Verdict::Blocked(Blocked::ApplyFailed { .. }) => (true, reason::APPLY_FAILED),
    };
    Some(EventNote {
        warning,
        reason,
        note,
    })
}

fn truncate(mut message: String) -> String {
    if message.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE - 3;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    message
}

/// The current time as Kubernetes writes it in conditions (RFC 3339, whole seconds).
pub fn now_rfc3339() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(now.as_second())
        .map(|t| t.to_string())
        .unwrap_or_else(|_| now.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serving() -> Verdict {
        Verdict::Serving {
            serving: vec!["emails".to_owned()],
        }
    }

    fn ready(s: &RetryPolicyStatus) -> &Condition {
        s.conditions
            .iter()
            .find(|c| c.type_ == READY)
            .expect("Ready condition")
    }

    #[test]
    fn ready_policy_is_ready_and_not_stalled() {
        let s = desired(2, &serving(), None, None, "T1", "cm");
        assert_eq!(s.observed_generation, Some(2));
        assert_eq!(ready(&s).status, "True");
        assert_eq!(ready(&s).observed_generation, Some(2));
        assert!(
            s.conditions
                .iter()
                .filter(|c| c.type_ != READY)
                .all(|c| c.status == "False")
        );
    }

    #[test]
    fn transitions_are_read_back_per_condition() {
        let mut s = desired(2, &serving(), None, None, "T1", "cm");
        let seen = StatusSeen::of(&s);
        assert_eq!(seen.since(READY, "True"), Some("T1"));
        assert_eq!(seen.since(READY, "False"), None);
        assert_eq!(seen.since(STALLED, "False"), Some("T1"));
        assert_eq!(seen.since("Other", "True"), None);
        let none = StatusSeen::of(&RetryPolicyStatus::default());
        assert_eq!(none.since(READY, "True"), None);
        // A condition with the separator in a field is left out; the others are kept.
        for c in s.conditions.iter_mut().filter(|c| c.type_ == READY) {
            c.last_transition_time = "T1\0True".to_owned();
        }
        let odd = StatusSeen::of(&s);
        assert_eq!(odd.since(READY, "True"), None);
        assert_eq!(odd.since(RECONCILING, "False"), Some("T1"));
    }

    #[test]
    fn unchanged_status_is_equal_and_keeps_its_transition_time() {
        let first = desired(2, &serving(), None, None, "T1", "cm");
        let again = desired(
            2,
            &serving(),
            None,
            Some(&StatusSeen::of(&first)),
            "T2",
            "cm",
        );
        assert_eq!(first, again);
        assert_eq!(
            event(&serving(), Some(&StatusSeen::of(&first)), &again),
            None
        );
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let first = desired(2, &serving(), None, None, "T1", "cm");
        let invalid = Verdict::Invalid(vec![FieldError {
            field: "spec.backoff.cap".to_owned(),
            message: "cap must be at least base".to_owned(),
        }]);
        let second = desired(3, &invalid, None, Some(&StatusSeen::of(&first)), "T2", "cm");
        assert_eq!(ready(&second).status, "False");
        assert_eq!(ready(&second).last_transition_time, "T2");
        assert_eq!(ready(&second).reason, reason::INVALID_SPEC);
        // Reconciling stays False: its transition time does not move.
        let rec = |s: &RetryPolicyStatus| {
            s.conditions
                .iter()
                .find(|c| c.type_ == RECONCILING)
                .map(|c| c.last_transition_time.clone())
        };
        assert_eq!(rec(&second), Some("T1".to_owned()));
        let note = event(&invalid, Some(&StatusSeen::of(&first)), &second).expect("event");
        assert!(note.warning);
        assert_eq!(note.reason, reason::INVALID_SPEC);
        assert!(second.summary.is_none());
    }

    #[test]
    fn conflict_names_the_winner_and_stalls() {
        let v = Verdict::Conflict {
            serving: vec![],
            lost: vec![LostQueue {
                pattern: "emails".to_owned(),
                winner: "older".to_owned(),
            }],
        };
        let s = desired(1, &v, None, None, "T", "cm");
        assert!(ready(&s).message.contains("\"older\""));
        let stalled = s.conditions.iter().find(|c| c.type_ == STALLED);
        assert_eq!(stalled.map(|c| c.status.as_str()), Some("True"));
    }

    #[test]
    fn a_new_generation_emits_compiled_once() {
        let first = desired(1, &serving(), None, None, "T", "cm");
        let second = desired(
            2,
            &serving(),
            None,
            Some(&StatusSeen::of(&first)),
            "T",
            "cm",
        );
        let note = event(&serving(), Some(&StatusSeen::of(&first)), &second).expect("event");
        assert_eq!(note.reason, reason::COMPILED);
        assert!(!note.warning);
    }

    #[test]
    fn another_sidecar_count_emits_sidecars_changed() {
        let budget = |text: &str| ScheduleSummary {
            retry_budget: Some(text.to_owned()),
            ..ScheduleSummary::default()
        };
        let three = budget("5/s, burst 1 (200ms slots) for 3 sidecars");
        let first = desired(1, &serving(), Some(&three), None, "T", "cm");
        let again = desired(
            1,
            &serving(),
            Some(&three),
            Some(&StatusSeen::of(&first)),
            "T",
            "cm",
        );
        assert_eq!(
            event(&serving(), Some(&StatusSeen::of(&first)), &again),
            None
        );
        let two = budget("5/s, burst 1 (200ms slots) for 2 sidecars");
        let fewer = desired(
            1,
            &serving(),
            Some(&two),
            Some(&StatusSeen::of(&first)),
            "T",
            "cm",
        );
        let note = event(&serving(), Some(&StatusSeen::of(&first)), &fewer).expect("event");
        assert_eq!(note.reason, reason::SIDECARS_CHANGED);
        assert!(!note.warning);
        // A new generation is announced as Compiled, whatever the count.
        let next = desired(
            2,
            &serving(),
            Some(&three),
            Some(&StatusSeen::of(&fewer)),
            "T",
            "cm",
        );
        let note = event(&serving(), Some(&StatusSeen::of(&fewer)), &next).expect("event");
        assert_eq!(note.reason, reason::COMPILED);
    }

    #[test]
    fn too_large_names_the_limit_that_was_passed() {
        let json = Verdict::Blocked(Blocked::TooLarge {
            limit: "json",
            bytes: 9_073_895,
            max: 8_388_608,
            served: 35,
        });
        let s = desired(1, &json, None, None, "T", "cm");
        assert_eq!(ready(&s).reason, reason::DOCUMENT_TOO_LARGE);
        let words: Vec<&str> = ready(&s).message.split_whitespace().collect();
        assert_eq!(
            words[..6],
            ["json", "limit", "exceeded:", "9073895", ">", "8388608"]
        );
        assert_eq!(words[8], "35");
    }

    #[test]
    fn long_messages_are_truncated_on_a_char_boundary() {
        let long = "é".repeat(2000);
        let t = truncate(long);
        assert!(t.len() <= MAX_MESSAGE);
        assert!(t.ends_with("..."));
    }
}
