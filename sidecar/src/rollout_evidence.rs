//! What this sidecar counts of the rollouts it answers for (docs/sidecar.md, "Rollout
//! evidence"): per policy in rollout, jobs by step and revision, failed (attempt 1) and
//! bad (given up), each once per kind; published in the fleet Lease on each renewal for
//! the operator to sum. Counting is on only with a fleet Lease: without one nothing could
//! carry the counts.

use std::{
    collections::hash_map::RandomState,
    hash::{BuildHasher, Hasher},
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use prometheus_client::{
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use rebound_policy::{
    PolicyTable,
    compiled::{RolloutEntry, TableEntry},
    decide::mix64,
    rollout::{
        assign::Arm,
        evidence::{
            EvidenceBook, EvidenceReport, MAX_EVIDENCE_BYTES, MAX_EVIDENCE_POLICIES, Observation,
            PolicyEvidence, maturity_ms,
        },
    },
};

type Labels = [(&'static str, &'static str); 2];

/// What [`RolloutEvidence::observe`] needs of an answered request.
#[derive(Clone, Copy, Debug)]
pub struct Answered<'a> {
    pub job_id: Option<&'a str>,
    pub attempt: u32,
    /// As checked: at most the sidecar's now.
    pub first_failure_ms: Option<u64>,
    /// The answer gave the job up.
    pub gives_up: bool,
}

/// The process's rollout counts and their metric handles.
pub struct RolloutEvidence {
    enabled: AtomicBool,
    epoch: String,
    book: Mutex<EvidenceBook>,
    /// `rebound_sidecar_rollout_jobs_total{arm, kind}`.
    counted: [Counter; 4],
    /// Not counted: `repeated` (a replay) or `full` (the id set full of recent ids).
    repeated: Counter,
    full: Counter,
    /// Policies left out of a report to keep it under [`MAX_EVIDENCE_BYTES`].
    dropped: Counter,
}

impl std::fmt::Debug for RolloutEvidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutEvidence")
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl RolloutEvidence {
    /// Off until [`Self::enable`]; with a random epoch and its series in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let jobs = Family::<Labels, Counter>::default();
        registry.register(
            "rollout_jobs",
            "Jobs of policies in rollout counted as evidence, by revision (arm: canary, stable) and kind (failed: attempt 1 decided; bad: given up)",
            jobs.clone(),
        );
        let series = |arm, kind| jobs.get_or_create(&[("arm", arm), ("kind", kind)]).clone();
        let not_counted = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "rollout_jobs_not_counted",
            "Rollout decisions not counted: repeated (a replay of a job already counted), full (every remembered job id is recent)",
            not_counted.clone(),
        );
        let dropped = Counter::default();
        registry.register(
            "rollout_evidence_dropped",
            "Policies left out of a Lease report to keep it under its size limit (those with the fewest jobs first)",
            dropped.clone(),
        );
        // Each handle in its own statement: a family's read guard still held while the
        // next series is created would deadlock on the family's lock.
        let counted = [
            series("stable", "failed"),
            series("stable", "bad"),
            series("canary", "failed"),
            series("canary", "bad"),
        ];
        let repeated = not_counted.get_or_create(&[("reason", "repeated")]).clone();
        let full = not_counted.get_or_create(&[("reason", "full")]).clone();
        Self {
            enabled: AtomicBool::new(false),
            epoch: new_epoch(),
            book: Mutex::new(EvidenceBook::default()),
            counted,
            repeated,
            full,
            dropped,
        }
    }

    /// Starts counting: called when the fleet Lease that carries the counts is held.
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Relaxed);
    }

    /// 16 hex digits, random per process: the operator keeps one report per epoch.
    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    fn book(&self) -> std::sync::MutexGuard<'_, EvidenceBook> {
        // Each record is a few map updates: a panic cannot leave a count half-made.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one answered decision of a policy in rollout: its attempt 1 as failed, a
    /// give-up as bad, in the step of the job's first failure. Requests without a job id
    /// (always the stable revision) are not counted.
    pub fn observe(
        &self,
        entry: &TableEntry,
        rollout: &RolloutEntry,
        arm: Arm,
        q: &Answered<'_>,
        now_ms: u64,
    ) {
        let (first_attempt, gives_up) = (q.attempt == 1, q.gives_up);
        if !(first_attempt || gives_up) || !self.enabled.load(Ordering::Relaxed) {
            return;
        }
        let Some(job_id) = q.job_id else { return };
        let first_failure_ms = q.first_failure_ms.unwrap_or(now_ms);
        let Some((step, weight)) = rollout.exposure.step_at(first_failure_ms) else {
            return;
        };
        let o = Observation {
            policy: entry.name(),
            revision: rollout.exposure.revision(),
            arm,
            step,
            weight,
            first_failure_ms,
            job_id,
            first_attempt,
            gives_up,
            now_ms,
        };
        let recorded = self.book().record(&o, || {
            maturity_ms(&entry.resolved(), rollout.canary.params())
        });
        if recorded.counted > 0 {
            let base = if arm == Arm::Canary { 2 } else { 0 };
            let kinds = [first_attempt, gives_up];
            let mut left = recorded.counted;
            // Counted kinds are the first `counted` of those on, in order (failed, bad).
            for (k, on) in kinds.into_iter().enumerate() {
                if on && left > 0 {
                    self.counted[base + k].inc();
                    left -= 1;
                }
            }
        }
        self.repeated.inc_by(u64::from(recorded.repeated));
        self.full.inc_by(u64::from(recorded.refused));
    }

    /// The report for the Lease annotation, as JSON: every policy in rollout in `table`
    /// (counts of a revision no longer rolled out are dropped), fitted under
    /// [`MAX_EVIDENCE_BYTES`]. `None` when off or when nothing is in rollout.
    pub fn report(&self, table: Option<&PolicyTable>, now_ms: u64) -> Option<String> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        let mut policies = {
            let mut book = self.book();
            if let Some(table) = table {
                book.retain(|name, revision| in_rollout(table, name, revision));
            }
            book.report(now_ms)
        };
        // A policy in rollout with nothing counted yet is reported too: a new epoch shows
        // at once, from zero.
        for entry in table.map_or(&[][..], PolicyTable::entries) {
            let Some(rollout) = entry.rollout.as_deref() else {
                continue;
            };
            let revision = rollout.exposure.revision();
            if !policies
                .iter()
                .any(|p| p.policy == entry.name() && p.revision == revision)
            {
                policies.push(PolicyEvidence {
                    policy: entry.name().to_owned(),
                    revision: revision.to_owned(),
                    steps: Vec::new(),
                });
            }
        }
        let (report, dropped) = fit(&self.epoch, policies);
        self.dropped.inc_by(dropped);
        report
    }
}

fn in_rollout(table: &PolicyTable, name: &str, revision: &str) -> bool {
    table.entries().iter().any(|e| {
        e.name() == name
            && e.rollout
                .as_deref()
                .is_some_and(|r| r.exposure.revision() == revision)
    })
}

/// The JSON report with the most important policies (most jobs seen) that fit, and how
/// many were left out.
fn fit(epoch: &str, mut policies: Vec<PolicyEvidence>) -> (Option<String>, u64) {
    if policies.is_empty() {
        return (None, 0);
    }
    let weight = |p: &PolicyEvidence| -> u64 {
        p.steps
            .iter()
            .map(|s| s.seen.failed_all.saturating_add(s.seen.bad_all))
            .fold(0, u64::saturating_add)
    };
    policies.sort_by(|a, b| weight(b).cmp(&weight(a)).then(a.policy.cmp(&b.policy)));
    let envelope = serde_json::to_string(&EvidenceReport {
        epoch: epoch.to_owned(),
        policies: Vec::new(),
    })
    .map_or(0, |s| s.len());
    let mut size = envelope;
    let mut kept = Vec::new();
    let mut dropped = 0u64;
    for p in policies {
        let len = serde_json::to_string(&p).map_or(usize::MAX, |s| s.len());
        // One comma between entries.
        if kept.len() < MAX_EVIDENCE_POLICIES && size.saturating_add(len + 1) <= MAX_EVIDENCE_BYTES
        {
            size += len + 1;
            kept.push(p);
        } else {
            dropped += 1;
        }
    }
    if kept.is_empty() {
        return (None, dropped);
    }
    kept.sort_by(|a, b| a.policy.cmp(&b.policy));
    let report = EvidenceReport {
        epoch: epoch.to_owned(),
        policies: kept,
    };
    (serde_json::to_string(&report).ok(), dropped)
}

/// 16 hex digits from the OS's randomness (behind `RandomState`), the clock and the pid.
fn new_epoch() -> String {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    format!("{:016x}", mix64(hasher.finish()))
}

#[cfg(test)]
mod tests {
    use rebound_policy::{
        digest,
        rollout::analysis::StepCounts,
        rollout::evidence::{PolicyEvidence, StepEvidence},
    };

    use super::*;

    fn policy(name: String, jobs: u64) -> PolicyEvidence {
        let counts = StepCounts {
            weight: 10,
            failed_all: jobs,
            ..StepCounts::default()
        };
        PolicyEvidence {
            policy: name,
            revision: digest::sha256_id(b"r"),
            steps: (0..10)
                .map(|step| StepEvidence {
                    step,
                    mature: counts,
                    seen: counts,
                })
                .collect(),
        }
    }

    #[test]
    fn an_oversized_report_keeps_the_policies_with_most_jobs() {
        let policies: Vec<_> = (0..200)
            .map(|i| policy(format!("policy-{i:03}"), i))
            .collect();
        let (text, dropped) = fit("0123456789abcdef", policies);
        let text = text.expect("a report");
        assert!(text.len() <= MAX_EVIDENCE_BYTES);
        let report = EvidenceReport::parse(&text).expect("valid");
        assert_eq!(report.policies.len() as u64 + dropped, 200);
        assert!(dropped > 0);
        // The kept ones are the largest.
        let smallest_kept = report
            .policies
            .iter()
            .map(|p| p.steps[0].seen.failed_all)
            .min()
            .expect("kept some");
        assert_eq!(smallest_kept, dropped);
    }

    #[test]
    fn epochs_are_16_hex_digits_and_differ() {
        let (a, b) = (new_epoch(), new_epoch());
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
