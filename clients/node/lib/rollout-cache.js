'use strict';
// GetPolicy's rollout as the fallback keeps it: prepared once when the policy is cached, so
// the fallback picks, per job, the revision the sidecar picks.
const { PreparedRollout, armPrepared, CANARY } = require('./assign');
const { resolvedFromWire } = require('./client');
const { PreparedPolicy } = require('./decide');

/**
 * `rebound.v1.Rollout` (keepCase, longs as strings) prepared under the policy's identity
 * (the canary shares the stable revision's jitter seed, as in the sidecar); null without one.
 */
function prepareRollout(wire, identity) {
  if (!wire || !wire.canary) return null;
  const steps = (wire.steps || []).map((s) => ({ weight: s.weight, startUnixMs: s.start_unix_ms }));
  return {
    assign: new PreparedRollout(wire.revision, steps),
    canary: new PreparedPolicy(resolvedFromWire(wire.canary), identity),
    revision: wire.revision,
    stableRevision: wire.stable_revision,
  };
}

/**
 * The revision that answers a job of a cached policy: `{prepared, revision}` (revision ''
 * without a rollout). The first failure is clamped to now, as the sidecar clamps it.
 */
function pick(cached, jobId, firstFailureUnixMs, nowUnixMs) {
  const rollout = cached.rollout;
  if (!rollout) return { prepared: cached.prepared, revision: '' };
  const first = firstFailureUnixMs === undefined ? 0 : Math.min(firstFailureUnixMs, nowUnixMs);
  if (armPrepared(rollout.assign, jobId, first, nowUnixMs).arm === CANARY) {
    return { prepared: rollout.canary, revision: rollout.revision };
  }
  return { prepared: cached.prepared, revision: rollout.stableRevision };
}

module.exports = { prepareRollout, pick };
