'use strict';
// A port of the policy crate's rollout assignment (policy/src/rollout/assign.rs): which
// revision of a policy in rollout answers a job. The fallback must pick the revision the
// sidecar picks, so it reproduces every case of policy/testdata/assign-vectors.json; the
// algorithm is specified in policy/testdata/README.md ("Rollout assignment vectors").
// 64-bit values are BigInt, as in decide.js, whose hashes this reuses.

const { fnv1a64, mix64 } = require('./decide');

/** The revision that served before the rollout (GetPolicy's policy). */
const STABLE = 'STABLE';
/** The revision being rolled out (the rollout's canary). */
const CANARY = 'CANARY';
/** `spec::limits::MAX_ROLLOUT_STEPS` and `MAX_ROLLOUT_WEIGHT`: a valid rollout stays within them. */
const MAX_ROLLOUT_STEPS = 10;
const MAX_ROLLOUT_WEIGHT = 99;
const U64_MAX = (1n << 64n) - 1n;

/**
 * A uint64 as BigInt from a BigInt, a safe non-negative integer Number or a decimal string
 * (proto3 JSON, proto-loader's `longs: String`); `null` for anything else.
 */
function u64(v) {
  let n;
  if (typeof v === 'bigint') n = v;
  else if (typeof v === 'number' && Number.isSafeInteger(v)) n = BigInt(v);
  else if (typeof v === 'string' && /^[0-9]{1,20}$/.test(v)) n = BigInt(v);
  else return null;
  return n >= 0n && n <= U64_MAX ? n : null;
}

/**
 * A string that is valid Unicode: TextEncoder would hash a lone surrogate as U+FFFD, which
 * no other port does and no sidecar accepts.
 */
function isText(v) {
  return typeof v === 'string' && v.isWellFormed();
}

/**
 * The started steps as `[weight, startBigInt]` pairs, or `null` unless they are what a valid
 * rollout holds: an array of at most 10, weights integers in 1..99 strictly increasing,
 * starts uint64s non-decreasing. The sidecar refuses anything else, so the fallback serves
 * the stable revision rather than guess.
 */
function wellFormed(steps) {
  if (!Array.isArray(steps) || steps.length > MAX_ROLLOUT_STEPS) return null;
  const out = [];
  for (const step of steps) {
    if (step === null || typeof step !== 'object') return null;
    const weight = step.weight;
    const start = u64(step.startUnixMs);
    if (!Number.isInteger(weight) || weight < 1 || weight > MAX_ROLLOUT_WEIGHT || start === null) return null;
    const before = out[out.length - 1];
    if (before !== undefined && (weight <= before[0] || start < before[1])) return null;
    out.push([weight, start]);
  }
  return out;
}

/**
 * A rollout ready for repeated assignments: the revision's hash and the check of its steps
 * done once, when GetPolicy's answer is loaded, not on every job. `revision` is the new
 * revision's id (it salts the hash); `steps` the steps started so far (`{weight,
 * startUnixMs}`, as GetPolicy's rollout gives them).
 */
class PreparedRollout {
  constructor(revision, steps) {
    /** `fnv1a64(revision)`, or null when it is not a valid string (every job then STABLE, no bucket). */
    this.salt = isText(revision) ? fnv1a64(revision) : null;
    /** `[weight, startBigInt]` pairs, or null when malformed (every job then STABLE). */
    this.steps = wellFormed(steps);
  }
}

/**
 * armPrepared(prepared, jobId, firstFailureUnixMs, nowUnixMs): the revision that answers a
 * job, `{arm: 'STABLE' | 'CANARY', bucket}`, the shape of the vectors' `expected`.
 *
 * `bucket` (0..99) is present exactly when there is a job id (a non-empty string). CANARY
 * iff the bucket is below the weight of the last step started at or before the job's first
 * failure; an unknown first failure (`undefined`, `null` or 0, as the protocol sends it)
 * places the job by `nowUnixMs`. Times are BigInt, Number or decimal strings. Malformed
 * input (steps, times, a non-string revision) gives STABLE, and an id that is not valid
 * Unicode (a lone surrogate) counts as no job id; it never throws.
 */
function armPrepared(prepared, jobId, firstFailureUnixMs, nowUnixMs) {
  if (!isText(jobId) || jobId === '' || prepared.salt === null) return { arm: STABLE };
  const bucket = Number(mix64(fnv1a64(jobId) ^ prepared.salt) % 100n);
  const first = firstFailureUnixMs === undefined || firstFailureUnixMs === null ? 0n : u64(firstFailureUnixMs);
  const t = first === 0n ? u64(nowUnixMs) : first;
  if (prepared.steps === null || t === null) return { arm: STABLE, bucket };
  let weight = 0;
  // Starts are non-decreasing, so the steps started by t are a prefix.
  for (const [w, start] of prepared.steps) {
    if (start > t) break;
    weight = w;
  }
  return { arm: bucket < weight ? CANARY : STABLE, bucket };
}

/** One-shot form: `arm(revision, steps, jobId, firstFailureUnixMs, nowUnixMs)`. */
function arm(revision, steps, jobId, firstFailureUnixMs, nowUnixMs) {
  return armPrepared(new PreparedRollout(revision, steps), jobId, firstFailureUnixMs, nowUnixMs);
}

module.exports = { arm, armPrepared, PreparedRollout, STABLE, CANARY };
