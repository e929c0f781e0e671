//! The evidence of one rollout, summed over sidecar epochs.
//!
//! Each sidecar process (epoch) reports cumulative counts per (policy, revision) in its
//! Lease. `status.rollout.evidence` keeps the last report of every epoch seen, so the sum
//! survives an operator restart; a report of an epoch already kept replaces it (never
//! added twice), and a sidecar that is gone leaves its last report in the sum. Past
//! [`MAX_EPOCHS`] entries, those of epochs no longer reporting merge into one `retired`
//! entry; if every entry still reports, reports of further epochs are left out (both
//! arms alike: the analysis sees fewer jobs, never biased ones).

use std::sync::Arc;

use rebound_policy::rollout::analysis::StepCounts;
use rebound_policy::rollout::evidence::{EvidenceReport, MAX_EVIDENCE_COUNT, StepEvidence};
use rebound_policy::spec::{
    EpochEvidence, EpochStep, MAX_EPOCHS, RETIRED_EPOCH, RolloutPhase, RolloutStatus,
};

/// Per step (index = step), the summed counts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summed {
    pub mature: Vec<StepCounts>,
    pub seen: Vec<StepCounts>,
}

/// Puts the live reports of `policy`'s current revision into its status.
pub fn merge(status: &mut RolloutStatus, policy: &str, reports: &[Arc<EvidenceReport>]) {
    if !matches!(
        status.phase,
        RolloutPhase::Progressing | RolloutPhase::Paused | RolloutPhase::Degraded
    ) {
        return;
    }
    let live: Vec<(&str, Vec<EpochStep>)> = reports
        .iter()
        .filter_map(|r| {
            let p = r.policy(policy, &status.revision)?;
            Some((r.epoch.as_str(), p.steps.iter().map(epoch_step).collect()))
        })
        .collect();
    let mut forgotten = Vec::new();
    for (epoch, steps) in &live {
        match status.evidence.iter_mut().find(|e| e.epoch == *epoch) {
            Some(kept) if shrank(&kept.steps, steps) => {
                // The epoch's counter started again (the sidecar dropped it while its
                // document briefly lacked the rollout). After a `retry` that is the
                // fresh start the baseline stood for; otherwise what it had counted is
                // still evidence of this rollout, kept beside the new counts.
                if kept.baseline.is_empty() {
                    forgotten.push(std::mem::take(&mut kept.steps));
                }
                kept.baseline.clear();
                kept.steps.clone_from(steps);
            }
            Some(kept) => kept.steps.clone_from(steps),
            None => status.evidence.push(EpochEvidence {
                epoch: (*epoch).to_owned(),
                steps: steps.clone(),
                baseline: Vec::new(),
            }),
        }
    }
    for steps in forgotten {
        add_into(&mut retired_entry(&mut status.evidence).steps, &steps);
    }
    if status.evidence.len() > MAX_EPOCHS {
        // An epoch still renewing its Lease is not gone, even if its report left this
        // policy out (over its size limit): retiring it and then taking its next report
        // as a new epoch would count it twice.
        retire(&mut status.evidence, |epoch| {
            reports.iter().any(|r| r.epoch == epoch)
        });
    }
}

/// Whether `now` has fewer of any count than `held`: counts of one counter only grow.
fn shrank(held: &[EpochStep], now: &[EpochStep]) -> bool {
    held.iter().any(|h| {
        let n = now.iter().find(|n| n.step == h.step);
        (0..4).any(|i| {
            n.map_or(0, |n| n.mature[i]) < h.mature[i] || n.map_or(0, |n| n.seen[i]) < h.seen[i]
        })
    })
}

/// An empty `retired` entry.
fn retired() -> EpochEvidence {
    EpochEvidence {
        epoch: RETIRED_EPOCH.to_owned(),
        ..EpochEvidence::default()
    }
}

/// The `retired` entry, added if missing.
fn retired_entry(entries: &mut Vec<EpochEvidence>) -> &mut EpochEvidence {
    let at = match entries.iter().position(|e| e.epoch == RETIRED_EPOCH) {
        Some(at) => at,
        None => {
            entries.push(retired());
            entries.len() - 1
        }
    };
    &mut entries[at]
}

/// Merges the entries of epochs that no longer report into `retired`, then keeps at most
/// [`MAX_EPOCHS`] entries besides it.
fn retire(entries: &mut Vec<EpochEvidence>, reporting: impl Fn(&str) -> bool) {
    let (gone, mut kept): (Vec<EpochEvidence>, Vec<EpochEvidence>) = std::mem::take(entries)
        .into_iter()
        .partition(|e| e.epoch == RETIRED_EPOCH || !reporting(&e.epoch));
    let mut retired = retired();
    for e in gone {
        add_into(&mut retired.steps, &e.steps);
        add_into(&mut retired.baseline, &e.baseline);
    }
    kept.truncate(MAX_EPOCHS);
    if !retired.steps.is_empty() {
        kept.push(retired);
    }
    *entries = kept;
}

fn add_into(sum: &mut Vec<EpochStep>, steps: &[EpochStep]) {
    for s in steps {
        match sum.iter_mut().find(|t| t.step == s.step) {
            Some(t) => {
                // Capped: `status` holds integers the API server reads exactly.
                for i in 0..4 {
                    t.mature[i] = t.mature[i]
                        .saturating_add(s.mature[i])
                        .min(MAX_EVIDENCE_COUNT);
                    t.seen[i] = t.seen[i].saturating_add(s.seen[i]).min(MAX_EVIDENCE_COUNT);
                }
            }
            None => sum.push(*s),
        }
    }
}

fn epoch_step(s: &StepEvidence) -> EpochStep {
    let four = |c: &StepCounts| [c.failed_new, c.failed_all, c.bad_new, c.bad_all];
    EpochStep {
        step: s.step,
        mature: four(&s.mature),
        seen: four(&s.seen),
    }
}

/// The evidence of every epoch, less what each had at a `retry`, per step.
pub fn summed(entries: &[EpochEvidence]) -> Summed {
    let mut out = Summed::default();
    for e in entries {
        for s in &e.steps {
            let base = e.baseline.iter().find(|b| b.step == s.step);
            let k = s.step as usize;
            if k >= rebound_policy::limits::MAX_ROLLOUT_STEPS {
                continue;
            }
            if out.mature.len() <= k {
                out.mature.resize(k + 1, StepCounts::default());
                out.seen.resize(k + 1, StepCounts::default());
            }
            add(&mut out.mature[k], s.mature, base.map(|b| b.mature));
            add(&mut out.seen[k], s.seen, base.map(|b| b.seen));
        }
    }
    out
}

fn add(sum: &mut StepCounts, counts: [u64; 4], base: Option<[u64; 4]>) {
    let base = base.unwrap_or_default();
    let d = |i: usize| counts[i].saturating_sub(base[i]);
    sum.failed_new = sum.failed_new.saturating_add(d(0));
    sum.failed_all = sum.failed_all.saturating_add(d(1));
    sum.bad_new = sum.bad_new.saturating_add(d(2));
    sum.bad_all = sum.bad_all.saturating_add(d(3));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rebound_policy::rollout::evidence::PolicyEvidence;

    const REVISION: &str =
        "sha256:0000000000000000000000000000000000000000000000000000000000000001";

    fn report(epoch: &str, failed: u64) -> Arc<EvidenceReport> {
        let counts = StepCounts {
            weight: 10,
            failed_new: failed / 10,
            failed_all: failed,
            bad_new: 1,
            bad_all: 2,
        };
        Arc::new(EvidenceReport {
            epoch: epoch.to_owned(),
            policies: vec![PolicyEvidence {
                policy: "p".to_owned(),
                revision: REVISION.to_owned(),
                steps: vec![StepEvidence {
                    step: 0,
                    mature: counts,
                    seen: counts,
                }],
            }],
        })
    }

    fn rolling() -> RolloutStatus {
        RolloutStatus {
            phase: RolloutPhase::Progressing,
            revision: REVISION.to_owned(),
            ..RolloutStatus::default()
        }
    }

    #[test]
    fn a_report_of_an_epoch_replaces_its_last_and_gone_epochs_stay() {
        let mut status = rolling();
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 100)]);
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 150)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 150);
        // The first sidecar is gone (its Lease too); a second one reports.
        merge(&mut status, "p", &[report("bbbbbbbbbbbbbbbb", 40)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 190);
        // Another policy's or another revision's counts are not evidence.
        merge(&mut status, "q", &[report("cccccccccccccccc", 1000)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 190);
    }

    #[test]
    fn past_the_bound_gone_epochs_merge_into_retired_without_loss() {
        let mut status = rolling();
        for i in 0..MAX_EPOCHS as u64 + 5 {
            merge(&mut status, "p", &[report(&format!("{i:016x}"), 10)]);
        }
        assert!(status.evidence.len() <= MAX_EPOCHS + 1);
        let total = (MAX_EPOCHS as u64 + 5) * 10;
        assert_eq!(summed(&status.evidence).mature[0].failed_all, total);
    }

    #[test]
    fn after_a_retry_a_counter_that_started_again_is_fresh_evidence() {
        // The sidecar dropped its counter when the rollout was rolled back; after the
        // retry it counts from zero: the baseline of the aborted run no longer applies.
        let mut status = rolling();
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 100)]);
        status.evidence[0].baseline = status.evidence[0].steps.clone();
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 30)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 30);
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 130)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 130);
    }

    #[test]
    fn a_counter_that_started_again_within_a_run_loses_nothing_held() {
        let mut status = rolling();
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 100)]);
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 20)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 120);
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 25)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 125);
    }

    #[test]
    fn an_epoch_still_renewing_is_not_retired_and_never_counted_twice() {
        let mut status = rolling();
        merge(&mut status, "p", &[report("ffffffffffffffff", 7)]);
        // Its Lease still renews, but its report leaves this policy out (over its size
        // limit) while 64 other sidecars come and go.
        let silent = Arc::new(EvidenceReport {
            epoch: "ffffffffffffffff".to_owned(),
            policies: Vec::new(),
        });
        for i in 0..MAX_EPOCHS as u64 {
            let other = report(&format!("{i:016x}"), 10);
            merge(&mut status, "p", &[silent.clone(), other]);
        }
        merge(&mut status, "p", &[report("ffffffffffffffff", 9)]);
        let total = MAX_EPOCHS as u64 * 10 + 9;
        assert_eq!(summed(&status.evidence).mature[0].failed_all, total);
    }

    #[test]
    fn a_baseline_is_subtracted() {
        let mut status = rolling();
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 100)]);
        status.evidence[0].baseline = status.evidence[0].steps.clone();
        merge(&mut status, "p", &[report("aaaaaaaaaaaaaaaa", 130)]);
        assert_eq!(summed(&status.evidence).mature[0].failed_all, 30);
    }
}
