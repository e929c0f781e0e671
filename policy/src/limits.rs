//! Every bound on a policy, in one place: the CRD schema, the Rust validator and the
//! retry-budget scheduler read them from here.
//!
//! The bounds of the text formats themselves (duration length and range, name length)
//! stay with their parsers in [`crate::duration`] and [`crate::pattern`].

pub const MAX_QUEUES: usize = 64;
pub const MAX_ERROR_CLASSES: usize = 64;
pub const MAX_SCHEDULE: usize = 100;
pub const MAX_ATTEMPTS: u32 = 10_000;
pub const MAX_MULTIPLIER: f64 = 100.0;

pub const MAX_RATE_PER_SECOND: u32 = 100_000;
pub const MAX_BURST: u32 = 100_000;
pub const DEFAULT_BURST: u32 = 1;
/// Longest slot: a burst may not cover more than a minute of the rate.
pub const MAX_SLOT_SECONDS: u32 = 60;
/// How far ahead a policy without `maxRetryDuration` may book: the longest duration a
/// policy can state (8760h). A retry that would run later gives up with `Deadline`.
pub const MAX_BOOK_AHEAD_MS: u64 = crate::duration::MAX_DURATION_MS;
/// Steps of a rollout: enough for any exposure ladder, few enough for a cheap CEL rule.
pub const MAX_ROLLOUT_STEPS: usize = 10;
/// A step's weight in percent: never none and never all of the jobs.
pub const MIN_ROLLOUT_WEIGHT: u32 = 1;
pub const MAX_ROLLOUT_WEIGHT: u32 = 99;
/// `analysis.maxRelativeIncrease`: a new bad-job ratio up to 11× the stable one tolerated.
pub const MAX_RELATIVE_INCREASE: f64 = 10.0;
/// `analysis.alpha`, the false-abort bound.
pub const MIN_ALPHA: f64 = 0.001;
pub const MAX_ALPHA: f64 = 0.2;
/// `analysis.minFailedJobs`.
pub const MAX_MIN_FAILED_JOBS: u32 = 10_000_000;
/// Answers remembered per policy for repeated questions.
pub const MEMO_CAPACITY: usize = 65_536;
/// Runs of booked slots held per policy; at it, the smallest gaps are merged as full.
pub const MAX_RUNS: usize = 16_384;
/// Job ids a sidecar remembers to count each rollout job once per kind (8 bytes each, with
/// a time stamp): about 2 MiB in all, whatever the traffic.
pub const MAX_EVIDENCE_JOB_IDS: usize = 65_536;
/// How long a remembered job id is kept at least: a replayed hook call comes within
/// seconds. At [`MAX_EVIDENCE_JOB_IDS`] ids younger than this, new jobs are not counted
/// (both revisions alike) rather than risk counting a replay twice.
pub const EVIDENCE_ID_RETENTION_MS: u64 = 60_000;
/// Time buckets of first failures waiting to mature, per policy in rollout.
pub const MAX_PENDING_BUCKETS: usize = 64;
