'use strict';
// The fallback's port of the rollout assignment picks the revision the sidecar picks: every
// case of the policy crate's assign-vectors.json, and the table of malformed input that
// every adapter answers alike.
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const { ASSIGN_VECTORS } = require('./helpers');
const { arm, armPrepared, PreparedRollout } = require('../../lib/assign');
const pkg = require('../..');

const file = JSON.parse(fs.readFileSync(ASSIGN_VECTORS, 'utf8'));

const REVISION = 'sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c';
// In bucket 0 for REVISION: a port that read malformed steps anyway would answer CANARY.
const JOB = 'job-186587197682';
const FIRST = 1800000600000n;
const NOW = 1800086400000n;
const S0 = '1800000000000';
const S1 = '1800000600000';
const steps = (...pairs) => pairs.map(([weight, startUnixMs]) => ({ weight, startUnixMs }));

test('vector file format', () => {
  assert.equal(file.format, 'rebound.dev/assign-vectors/v1');
  assert.ok(file.cases.length > 100, `only ${file.cases.length} cases`);
});

test('every vector: arm gives the expected arm and bucket exactly', () => {
  const failures = [];
  for (const c of file.cases) {
    const first = c.firstFailureUnixMs === undefined ? undefined : BigInt(c.firstFailureUnixMs);
    const got = arm(c.revision, c.steps, c.jobId, first, BigInt(c.nowUnixMs));
    try {
      assert.deepStrictEqual(got, c.expected);
    } catch {
      failures.push(`${c.name}: got ${JSON.stringify(got)}, want ${JSON.stringify(c.expected)}`);
    }
  }
  assert.deepStrictEqual(failures.slice(0, 20), [], `${failures.length} of ${file.cases.length} cases differ`);
});

test('a rollout prepared once answers every job of its cases as the one-shot form does', () => {
  const prepared = new Map();
  for (const c of file.cases) {
    const key = JSON.stringify([c.revision, c.steps]);
    if (!prepared.has(key)) prepared.set(key, new PreparedRollout(c.revision, c.steps));
    const first = c.firstFailureUnixMs === undefined ? undefined : BigInt(c.firstFailureUnixMs);
    assert.deepStrictEqual(armPrepared(prepared.get(key), c.jobId, first, BigInt(c.nowUnixMs)), c.expected, c.name);
  }
  assert.ok(prepared.size >= 5, `only ${prepared.size} rollouts prepared`);
});

test('times as Numbers and decimal strings give the same answers as BigInts', () => {
  for (const c of file.cases) {
    const asNumbers = arm(c.revision, c.steps.map((s) => ({ weight: s.weight, startUnixMs: Number(s.startUnixMs) })),
      c.jobId, c.firstFailureUnixMs === undefined ? undefined : Number(c.firstFailureUnixMs), Number(c.nowUnixMs));
    assert.deepStrictEqual(asNumbers, c.expected, c.name);
    assert.deepStrictEqual(arm(c.revision, c.steps, c.jobId, c.firstFailureUnixMs, c.nowUnixMs), c.expected, c.name);
  }
});

test('the vectors cover both arms, missing and empty job ids, non-ASCII ids, unknown first failures', () => {
  const seen = new Set();
  const revisions = new Set();
  for (const c of file.cases) {
    seen.add(c.expected.arm);
    if (c.jobId === undefined) seen.add('nojob');
    else if (c.jobId === '') seen.add('emptyjob');
    else if (/[^\x00-\x7f]/.test(c.jobId)) seen.add('nonascii');
    if (c.firstFailureUnixMs === undefined && c.jobId) seen.add('bynow');
    revisions.add(c.revision);
  }
  for (const want of ['STABLE', 'CANARY', 'nojob', 'emptyjob', 'nonascii', 'bynow']) {
    assert.ok(seen.has(want), `no vector with ${want}`);
  }
  assert.ok(revisions.size >= 2, 'a single revision: the salt is not exercised');
});

test('malformed input gives STABLE and never throws', () => {
  const control = arm(REVISION, steps([10, S0], [50, S1]), JOB, FIRST, NOW);
  assert.deepStrictEqual(control, { arm: 'CANARY', bucket: 0 });
  const eleven = steps(...Array.from({ length: 11 }, (_, i) => [i + 1, S0]));
  const stableInBucket0 = {
    'weight 0': steps([0, S0]),
    'weight 100': steps([100, S0]),
    'weights equal': steps([10, S0], [10, S1]),
    'weights decreasing': steps([50, S0], [10, S1]),
    'starts decreasing': steps([10, S1], [50, S0]),
    '11 steps': eleven,
    'weight 10.5': steps([10.5, S0]),
    'weight "10"': steps(['10', S0]),
    'weight true': steps([true, S0]),
    'weight missing': [{ startUnixMs: S0 }],
    'start -1': steps([10, -1]),
    'start "abc"': steps([10, 'abc']),
    'start 2^64': steps([10, '18446744073709551616']),
    'start missing': [{ weight: 10 }],
    'steps null': null,
    'steps an object': { weight: 10, startUnixMs: S0 },
    'a step not an object': [10],
  };
  for (const [name, s] of Object.entries(stableInBucket0)) {
    assert.deepStrictEqual(arm(REVISION, s, JOB, FIRST, NOW), { arm: 'STABLE', bucket: 0 }, name);
  }
  const good = steps([10, S0]);
  assert.deepStrictEqual(arm(REVISION, good, JOB, 'abc', NOW), { arm: 'STABLE', bucket: 0 }, 'first failure "abc"');
  assert.deepStrictEqual(arm(REVISION, good, JOB, undefined, 'abc'), { arm: 'STABLE', bucket: 0 }, 'now "abc"');
  assert.deepStrictEqual(arm(REVISION, good, JOB, -5, NOW), { arm: 'STABLE', bucket: 0 }, 'first failure -5');
  assert.deepStrictEqual(arm(null, good, JOB, FIRST, NOW), { arm: 'STABLE' }, 'revision null');
  assert.deepStrictEqual(arm(42, good, JOB, FIRST, NOW), { arm: 'STABLE' }, 'revision 42');
  assert.deepStrictEqual(arm(REVISION, good, 42, FIRST, NOW), { arm: 'STABLE' }, 'job id 42');
  assert.deepStrictEqual(arm(REVISION, good, 'job-\ud800', FIRST, NOW), { arm: 'STABLE' }, 'job id with a lone surrogate');
  assert.deepStrictEqual(arm('sha256:\udc00', good, JOB, FIRST, NOW), { arm: 'STABLE' }, 'revision with a lone surrogate');
});

test('any mix of odd arguments (fixed seed) gives a well-formed answer', () => {
  const pool = [undefined, null, '', 'x', 'abc', '\ud800', -1, 0, 0n, 1.5, NaN, Infinity, 2 ** 64, '18446744073709551616',
    REVISION, JOB, S0, FIRST, NOW, [], {}, [null], [{}], steps([10, S0]), steps([10, S0], [50, S1]), true];
  let seed = 12345;
  const pick = () => {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
    return pool[seed % pool.length];
  };
  for (let i = 0; i < 5000; i++) {
    const got = arm(pick(), pick(), pick(), pick(), pick());
    assert.ok(got.arm === 'STABLE' || got.arm === 'CANARY', JSON.stringify(got));
    assert.ok(got.bucket === undefined || (Number.isInteger(got.bucket) && got.bucket >= 0 && got.bucket < 100));
  }
});

test('an unknown first failure (0, as the protocol sends it) places the job by now', () => {
  const s = steps([10, S0]);
  for (const unknown of [0, 0n, '0', null, undefined]) {
    assert.equal(arm(REVISION, s, JOB, unknown, BigInt(S0)).arm, 'CANARY', `${unknown} in the step`);
    assert.equal(arm(REVISION, s, JOB, unknown, BigInt(S0) - 1n).arm, 'STABLE', `${unknown} before the step`);
  }
});

test('arm is exported from the package', () => {
  assert.equal(pkg.arm, arm);
});
