//! The sidecar's tally of a rollout's evidence: per policy and new revision, jobs (not
//! attempts) by step and revision, each job counted once per kind, held in coarse time
//! buckets of first failure until their fate is known.
//!
//! Memory is fixed: at most [`MAX_EVIDENCE_JOB_IDS`] remembered ids for the whole book and
//! [`MAX_PENDING_BUCKETS`] buckets per policy, whatever the job ids and times. Each
//! [`EvidenceBook::record`] is a few hash operations (bucket merges amortised O(1)).

use std::{
    collections::{HashMap, HashSet, VecDeque},
    hash::{BuildHasherDefault, Hasher},
};

use crate::{
    decide::{hash_bytes, mix64},
    limits::{
        EVIDENCE_ID_RETENTION_MS, MAX_EVIDENCE_JOB_IDS, MAX_PENDING_BUCKETS, MAX_ROLLOUT_STEPS,
    },
    rollout::{analysis::StepCounts, assign::Arm},
};

use super::{PolicyEvidence, StepEvidence};

/// Pending buckets per maturity: a job matures at most a sixteenth of the maturity late.
const BUCKETS_PER_MATURITY: u64 = 16;
/// Shortest bucket, so a tiny maturity does not make a bucket per millisecond.
const MIN_BUCKET_MS: u64 = 250;

/// One decision of a job of a policy in rollout, as the sidecar saw it.
#[derive(Clone, Copy, Debug)]
pub struct Observation<'a> {
    pub policy: &'a str,
    /// The new revision's id (the rollout's, whichever arm answered).
    pub revision: &'a str,
    /// The arm that answered, as the table selected it.
    pub arm: Arm,
    /// Index of the started step in effect at the job's first failure ([`crate::rollout::assign::Exposure::step_at`]; jobs before the first step get the stable
    /// revision and are no evidence).
    pub step: usize,
    /// That step's weight.
    pub weight: u32,
    /// The job's first failure, already clamped to the sidecar's clock (else now).
    pub first_failure_ms: u64,
    /// Not empty: requests without a job id are not counted.
    pub job_id: &'a str,
    /// The decision was for attempt 1: the job failed at least once.
    pub first_attempt: bool,
    /// The decision gave the job up (dead letter or drop, any reason).
    pub gives_up: bool,
    pub now_ms: u64,
}

/// What [`EvidenceBook::record`] did with an observation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Kinds counted (failed, bad): 0, 1 or 2.
    pub counted: u8,
    /// Kinds already counted for this job.
    pub repeated: u8,
    /// Kinds not counted because every remembered id is younger than the retention.
    pub refused: u8,
}

/// Every policy in rollout a sidecar answers, and the job ids it remembers.
#[derive(Debug, Default)]
pub struct EvidenceBook {
    policies: HashMap<String, PolicyCounter>,
    ids: RecentIds,
}

impl EvidenceBook {
    /// Counts one decision. `maturity` (see [`super::maturity_ms`]) is called only when the
    /// policy's revision is new to the book: a new revision is new evidence, and the
    /// previous revision's counts are dropped.
    pub fn record(
        &mut self,
        o: &Observation<'_>,
        maturity: impl FnOnce() -> Option<u64>,
    ) -> Recorded {
        let mut done = Recorded::default();
        if o.job_id.is_empty() || o.step >= MAX_ROLLOUT_STEPS {
            return done;
        }
        let kinds = [(Kind::Failed, o.first_attempt), (Kind::Bad, o.gives_up)];
        if !kinds.iter().any(|(_, on)| *on) {
            return done;
        }
        let counter = match self.policies.get_mut(o.policy) {
            Some(c) if c.revision == o.revision => c,
            _ => {
                let fresh = PolicyCounter::new(o.revision, maturity());
                self.policies.insert(o.policy.to_owned(), fresh);
                match self.policies.get_mut(o.policy) {
                    Some(c) => c,
                    None => return done,
                }
            }
        };
        counter.advance(o.now_ms);
        let job = hash_bytes(o.job_id.as_bytes());
        for (kind, on) in kinds {
            if !on {
                continue;
            }
            let key = mix64(job ^ counter.salt ^ kind.salt());
            match self.ids.insert(key, o.now_ms) {
                IdOutcome::Inserted => {
                    counter.add(o, kind);
                    done.counted += 1;
                }
                IdOutcome::Repeated => done.repeated += 1,
                IdOutcome::Full => done.refused += 1,
            }
        }
        done
    }

    /// Keeps only the policies `keep(policy, revision)` says are still in rollout.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &str) -> bool) {
        self.policies.retain(|name, c| keep(name, &c.revision));
    }

    /// The counts of every policy at `now_ms`, by policy name.
    pub fn report(&mut self, now_ms: u64) -> Vec<PolicyEvidence> {
        let mut out: Vec<PolicyEvidence> = self
            .policies
            .iter_mut()
            .map(|(name, c)| {
                c.advance(now_ms);
                c.evidence(name)
            })
            .collect();
        out.sort_by(|a, b| a.policy.cmp(&b.policy));
        out
    }

    /// Remembered job ids (never over [`MAX_EVIDENCE_JOB_IDS`]).
    pub fn remembered_ids(&self) -> usize {
        self.ids.order.len()
    }

    /// Room the id set has allocated (for the memory bound).
    pub fn ids_capacity(&self) -> usize {
        self.ids.set.capacity().max(self.ids.order.capacity())
    }

    /// Time buckets held, over all policies (never over [`MAX_PENDING_BUCKETS`] each).
    pub fn pending_buckets(&self) -> usize {
        self.policies.values().map(|c| c.pending.len()).sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Failed,
    Bad,
}

impl Kind {
    /// Keeps a job's two kinds apart in the one id set.
    fn salt(self) -> u64 {
        match self {
            Kind::Failed => 0x6661_696c_6564_0000,
            Kind::Bad => 0x6261_6400_0000_0000,
        }
    }
}

/// Jobs of one step and the share on the new revision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally {
    failed_new: u64,
    failed_all: u64,
    bad_new: u64,
    bad_all: u64,
}

impl Tally {
    fn add(&mut self, kind: Kind, arm: Arm) {
        let new = u64::from(arm == Arm::Canary);
        let (on_new, all) = match kind {
            Kind::Failed => (&mut self.failed_new, &mut self.failed_all),
            Kind::Bad => (&mut self.bad_new, &mut self.bad_all),
        };
        *on_new = on_new.saturating_add(new);
        *all = all.saturating_add(1);
    }

    fn merge(&mut self, other: &Tally) {
        self.failed_new = self.failed_new.saturating_add(other.failed_new);
        self.failed_all = self.failed_all.saturating_add(other.failed_all);
        self.bad_new = self.bad_new.saturating_add(other.bad_new);
        self.bad_all = self.bad_all.saturating_add(other.bad_all);
    }

    fn counts(&self, weight: u32) -> StepCounts {
        StepCounts {
            weight,
            failed_new: self.failed_new,
            failed_all: self.failed_all,
            bad_new: self.bad_new,
            bad_all: self.bad_all,
        }
    }
}

/// First failures in `[index·width, (index+1)·width)`, by step.
#[derive(Clone, Debug)]
struct Bucket {
    index: u64,
    steps: [Tally; MAX_ROLLOUT_STEPS],
}

/// One policy's counts for one new revision.
#[derive(Debug)]
struct PolicyCounter {
    revision: String,
    /// Keeps this revision's job ids apart from other policies' in the id set.
    salt: u64,
    maturity_ms: Option<u64>,
    bucket_ms: u64,
    weights: [u32; MAX_ROLLOUT_STEPS],
    seen: [Tally; MAX_ROLLOUT_STEPS],
    mature: [Tally; MAX_ROLLOUT_STEPS],
    /// Ascending by index.
    pending: VecDeque<Bucket>,
}

impl PolicyCounter {
    fn new(revision: &str, maturity_ms: Option<u64>) -> Self {
        Self {
            revision: revision.to_owned(),
            salt: hash_bytes(revision.as_bytes()),
            maturity_ms,
            bucket_ms: maturity_ms.map_or(MIN_BUCKET_MS, |m| {
                (m / BUCKETS_PER_MATURITY).max(MIN_BUCKET_MS)
            }),
            weights: [0; MAX_ROLLOUT_STEPS],
            seen: [Tally::default(); MAX_ROLLOUT_STEPS],
            mature: [Tally::default(); MAX_ROLLOUT_STEPS],
            pending: VecDeque::new(),
        }
    }

    fn is_mature(&self, first_failure_ms: u64, now_ms: u64) -> bool {
        self.maturity_ms
            .is_some_and(|m| first_failure_ms.saturating_add(m) <= now_ms)
    }

    /// Merges the buckets whose every job is mature at `now_ms`.
    fn advance(&mut self, now_ms: u64) {
        while let Some(front) = self.pending.front() {
            let last = front.index.saturating_add(1).saturating_mul(self.bucket_ms) - 1;
            if !self.is_mature(last, now_ms) {
                return;
            }
            if let Some(bucket) = self.pending.pop_front() {
                self.merge(&bucket);
            }
        }
    }

    fn merge(&mut self, bucket: &Bucket) {
        for (into, from) in self.mature.iter_mut().zip(&bucket.steps) {
            into.merge(from);
        }
    }

    fn add(&mut self, o: &Observation<'_>, kind: Kind) {
        self.weights[o.step] = o.weight;
        self.seen[o.step].add(kind, o.arm);
        if self.maturity_ms.is_none() {
            return;
        }
        // A first failure later than now is taken as now (the sidecar clamps it already).
        let t = o.first_failure_ms.min(o.now_ms);
        if self.is_mature(t, o.now_ms) {
            self.mature[o.step].add(kind, o.arm);
            return;
        }
        let index = t / self.bucket_ms;
        let at = self.pending.partition_point(|b| b.index < index);
        if self.pending.get(at).is_none_or(|b| b.index != index) {
            self.pending.insert(
                at,
                Bucket {
                    index,
                    steps: [Tally::default(); MAX_ROLLOUT_STEPS],
                },
            );
        }
        if let Some(bucket) = self.pending.get_mut(at) {
            bucket.steps[o.step].add(kind, o.arm);
        }
        // Only a clock that jumps back and forth gets here: the oldest bucket then counts
        // as mature a little early rather than memory growing.
        while self.pending.len() > MAX_PENDING_BUCKETS {
            if let Some(oldest) = self.pending.pop_front() {
                self.merge(&oldest);
            }
        }
    }

    fn evidence(&self, policy: &str) -> PolicyEvidence {
        let steps = (0..MAX_ROLLOUT_STEPS)
            .filter(|&s| self.seen[s] != Tally::default())
            .map(|s| StepEvidence {
                step: s as u32,
                mature: self.mature[s].counts(self.weights[s]),
                seen: self.seen[s].counts(self.weights[s]),
            })
            .collect();
        PolicyEvidence {
            policy: policy.to_owned(),
            revision: self.revision.clone(),
            steps,
        }
    }
}

/// Keys are mixed hashes already: hashing them again would only cost time.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

enum IdOutcome {
    Inserted,
    Repeated,
    Full,
}

/// The last [`MAX_EVIDENCE_JOB_IDS`] (job, kind) keys counted, oldest first. A key is
/// forgotten only once it is older than [`EVIDENCE_ID_RETENTION_MS`], so a replay within
/// that time is never counted twice; when the set is full of younger keys, new jobs are not
/// counted, which under-counts both revisions alike (assignment is by an unrelated hash).
#[derive(Debug, Default)]
struct RecentIds {
    order: VecDeque<(u64, u64)>,
    set: HashSet<u64, BuildHasherDefault<PassThrough>>,
}

impl std::fmt::Debug for PassThrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PassThrough")
    }
}

impl RecentIds {
    fn insert(&mut self, key: u64, now_ms: u64) -> IdOutcome {
        if self.set.contains(&key) {
            return IdOutcome::Repeated;
        }
        if self.order.len() >= MAX_EVIDENCE_JOB_IDS {
            match self.order.front() {
                Some(&(old, stamp)) if now_ms.saturating_sub(stamp) >= EVIDENCE_ID_RETENTION_MS => {
                    self.order.pop_front();
                    self.set.remove(&old);
                }
                _ => return IdOutcome::Full,
            }
        }
        self.order.push_back((key, now_ms));
        self.set.insert(key);
        IdOutcome::Inserted
    }
}
