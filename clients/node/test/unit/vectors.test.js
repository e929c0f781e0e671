'use strict';
// The local fallback must answer every case of the policy crate's vectors exactly.
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const { VECTORS } = require('./helpers');
const { decideLocal } = require('../../lib/decide');

const file = JSON.parse(fs.readFileSync(VECTORS, 'utf8'));

function context(c) {
  const ctx = {};
  if (c.jobId !== undefined) ctx.jobId = c.jobId;
  if (c.errorClass !== undefined) ctx.errorClass = c.errorClass;
  for (const f of ['firstFailureUnixMs', 'nowUnixMs', 'retryAfterMs']) {
    if (c[f] !== undefined) ctx[f] = BigInt(c[f]);
  }
  return ctx;
}

test('vector file format', () => {
  assert.equal(file.format, 'rebound.dev/decide-vectors/v1');
  assert.ok(file.cases.length > 500, `only ${file.cases.length} cases`);
});

test('every vector: decideLocal gives the expected answer exactly', () => {
  const failures = [];
  for (const c of file.cases) {
    const got = decideLocal(c.policy, c.identity, c.attempt, context(c.context));
    try {
      assert.deepStrictEqual(got, c.expected);
    } catch (e) {
      failures.push(`${c.name}: got ${JSON.stringify(got)}, want ${JSON.stringify(c.expected)}`);
    }
  }
  assert.deepStrictEqual(failures.slice(0, 20), [], `${failures.length} of ${file.cases.length} cases differ`);
});

test('the vectors cover every strategy, jitter kind and give-up reason', () => {
  const seen = new Set();
  for (const c of file.cases) {
    seen.add(c.policy.strategy);
    seen.add(c.policy.jitter);
    seen.add(c.expected.reason);
    seen.add(c.context.jobId === undefined ? 'nojob' : 'job');
  }
  for (const want of [
    'STRATEGY_EXPONENTIAL', 'STRATEGY_LINEAR', 'STRATEGY_CONSTANT', 'STRATEGY_DECORRELATED',
    'STRATEGY_SCHEDULE', 'JITTER_NONE', 'JITTER_FULL', 'JITTER_EQUAL', 'JITTER_PROPORTIONAL',
    'GIVE_UP_REASON_MAX_ATTEMPTS', 'GIVE_UP_REASON_DEADLINE', 'GIVE_UP_REASON_NON_RETRYABLE',
    'job', 'nojob',
  ]) {
    assert.ok(seen.has(want), `no vector with ${want}`);
  }
});
