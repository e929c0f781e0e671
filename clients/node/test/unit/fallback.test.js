'use strict';
// The hook never throws and answers like the sidecar when the sidecar cannot: a real
// grpc-js client against a closed port, a missing socket, a server answering UNAVAILABLE
// (NOT_SERVING) and one too slow for the deadline.
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { createRebound, DEFAULT_POLICY, decideLocal } = require('../..');
const { startAdvisor, resolvedToWire, closedPort, grpc } = require('./advisor-server');
const { VECTORS } = require('./helpers');

const NOT_SERVING = { error: { code: grpc.status.UNAVAILABLE, details: 'no configuration loaded yet' } };
const POLICY = {
  strategy: 'STRATEGY_EXPONENTIAL', baseMs: 200, multiplier: 1.5, capMs: 60000, jitter: 'JITTER_EQUAL',
  jitterRatio: 0, scheduleMs: [], maxAttempts: 6, maxRetryDurationMs: 0, nonRetryableErrors: ['InvalidAccount'],
  terminal: 'DISPOSITION_DEAD_LETTER', deadLetterQueue: 'payments-dead',
};
const REF = { name: 'payments', namespace: 'team-a', generation: '4', config_hash: 'sha256:aaaa' };

/** A BullMQ-shaped job with no Redis behind it (the hook keeps first failures in memory). */
function job(id, queueName = 'payments') {
  return { id, queueName, name: 'charge', data: { amount: 1 }, opts: {} };
}
function failure(name = 'TransientError') {
  const e = new Error('boom');
  e.name = name;
  return e;
}

test('closed port: the hook answers from the default policy and counts the fallback', async () => {
  const rebound = createRebound({ target: `127.0.0.1:${await closedPort()}`, logger: false });
  const events = [];
  rebound.on('fallback', (e) => events.push(e));
  try {
    for (const attempt of [1, 2, 3, 9, 10, 11]) {
      const delay = await rebound.bullmq.backoffStrategy(attempt, 'rebound', failure(), job('job-1'));
      const want = decideLocal(DEFAULT_POLICY, 'rebound/default', attempt, { jobId: 'job-1' });
      assert.equal(delay, want.decision === 'DECISION_RETRY' ? want.delayMs : -1, `attempt ${attempt}`);
    }
    const m = rebound.metrics();
    assert.equal(m.fallback.total, 6);
    assert.equal(m.fallback.unavailable, 6);
    assert.equal(m.fallback.default_policy, 6);
    assert.equal(m.decisions.retry, 4);
    assert.equal(m.decisions.give_up_max_attempts, 2);
    assert.equal(m.hookErrors, 0);
    assert.deepEqual(
      events.map((e) => [e.cause, e.code, e.policySource, e.jobId]),
      Array(6).fill(['unavailable', grpc.status.UNAVAILABLE, 'default', 'job-1']),
    );
  } finally {
    await rebound.close();
  }
});

test('closed port: a look ahead (record: false) answers the same, neither counted nor emitted', async () => {
  const rebound = createRebound({ target: `127.0.0.1:${await closedPort()}`, logger: false });
  const events = [];
  for (const ev of ['decision', 'fallback']) rebound.on(ev, (e) => events.push(e));
  try {
    const peek = await rebound.decide({ queue: 'q', attempt: 10, jobId: 'job-1' }, { record: false });
    assert.equal(peek.decision, 'DECISION_GIVE_UP');
    assert.deepEqual(events, []);
    assert.deepEqual(rebound.metrics().fallback.total, 0);
    assert.deepEqual(rebound.metrics().decisions.give_up_max_attempts, 0);
    const real = await rebound.decide({ queue: 'q', attempt: 10, jobId: 'job-1' });
    assert.deepEqual([real.decision, real.reason], [peek.decision, peek.reason]);
    assert.equal(events.length, 2);
  } finally {
    await rebound.close();
  }
});

test('missing Unix socket: the hook answers and never rejects', async () => {
  const sock = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'rebound-')), 'none.sock');
  const rebound = createRebound({ target: `unix://${sock}`, logger: false });
  try {
    const delay = await rebound.bullmq.backoffStrategy(2, 'rebound', failure(), job('job-2'));
    assert.equal(delay, decideLocal(DEFAULT_POLICY, 'rebound/default', 2, { jobId: 'job-2' }).delayMs);
    assert.equal(rebound.metrics().fallback.unavailable, 1);
  } finally {
    await rebound.close();
  }
});

test('NOT_SERVING: the fallback uses the policy fetched with GetPolicy, seeded by namespace/name', async () => {
  const server = await startAdvisor({
    decide: () => NOT_SERVING,
    getPolicy: () => ({ policy: REF, resolved: resolvedToWire(POLICY) }),
  });
  const rebound = createRebound({ target: server.target, logger: false });
  try {
    assert.deepEqual((await rebound.policy('payments')).resolved, POLICY);
    const seen = [];
    const decisions = [];
    rebound.on('decision', (d) => decisions.push(d.decision));
    for (const attempt of [1, 2, 5, 6]) {
      const delay = await rebound.bullmq.backoffStrategy(attempt, 'rebound', failure(), job('job-3'));
      const want = decideLocal(POLICY, 'team-a/payments', attempt, { jobId: 'job-3' });
      seen.push(delay);
      if (want.decision === 'DECISION_RETRY') assert.equal(delay, want.delayMs);
    }
    assert.deepEqual(decisions, ['DECISION_RETRY', 'DECISION_RETRY', 'DECISION_RETRY', 'DECISION_GIVE_UP']);
    // The give-up found no Redis behind this job: the dead-letter write failed, so the job is
    // not finished: it is retried after the policy's delay for that attempt, not counted.
    assert.ok(seen.at(-1) > 0, `${seen.at(-1)}`);
    assert.equal(seen.at(-1), rebound.pendingDelayMs('payments', 'job-3', 6));
    const m = rebound.metrics();
    assert.equal(m.fallback.unavailable, 4);
    assert.equal(m.fallback.default_policy, 0);
    assert.equal(m.deadLettered, 0);
    assert.equal(m.hookErrors, 1);
  } finally {
    await rebound.close();
    await server.close();
  }
});

test('a sidecar slower than the deadline: the answer comes from the fallback', async () => {
  const server = await startAdvisor({
    decide: () => ({ sleepMs: 5000 }),
    getPolicy: () => ({ policy: REF, resolved: resolvedToWire(POLICY) }),
  });
  const rebound = createRebound({ target: server.target, deadlineMs: 100, logger: false });
  try {
    await rebound.policy('payments');
    const answer = await rebound.decide({ queue: 'payments', attempt: 2, jobId: 'job-4' });
    assert.equal(answer.source, 'fallback');
    assert.equal(answer.policySource, 'cached');
    assert.deepEqual(answer.policy, { name: 'payments', namespace: 'team-a', generation: '4', configHash: 'sha256:aaaa' });
    assert.equal(answer.delayMs, decideLocal(POLICY, 'team-a/payments', 2, { jobId: 'job-4' }).delayMs);
    assert.equal(rebound.metrics().fallback.deadline_exceeded, 1);
  } finally {
    await rebound.close();
    server.forceClose();
  }
});

test('NOT_FOUND: no policy governs the queue; the default policy answers', async () => {
  const server = await startAdvisor({
    decide: () => ({ error: { code: grpc.status.NOT_FOUND, details: 'queue "x": no RetryPolicy' } }),
  });
  const rebound = createRebound({ target: server.target, logger: false });
  try {
    const a = await rebound.decide({ queue: 'x', attempt: 1, jobId: 'j' });
    assert.equal(a.policySource, 'default');
    assert.equal(a.delayMs, decideLocal(DEFAULT_POLICY, 'rebound/default', 1, { jobId: 'j' }).delayMs);
    assert.equal(rebound.metrics().fallback.not_found, 1);
  } finally {
    await rebound.close();
    await server.close();
  }
});

test('the hook never rejects: throwing mappers, listeners and a missing job', async () => {
  const rebound = createRebound({
    target: `127.0.0.1:${await closedPort()}`,
    logger: false,
    errorClass: () => {
      throw new Error('mapper bug');
    },
    retryAfterMs: () => {
      throw new Error('mapper bug');
    },
  });
  rebound.on('decision', () => {
    throw new Error('listener bug');
  });
  try {
    const a = await rebound.bullmq.backoffStrategy(1, 'rebound', failure(), job('job-5'));
    assert.equal(a, decideLocal(DEFAULT_POLICY, 'rebound/default', 1, { jobId: 'job-5' }).delayMs);
    const b = await rebound.bullmq.backoffStrategy(1, 'rebound', undefined, undefined);
    assert.equal(typeof b, 'number');
    assert.ok(b >= 0);
    assert.equal(rebound.metrics().hookErrors, 4); // two mappers, twice each
  } finally {
    await rebound.close();
  }
});

test('the same failure asked twice gives the same delay (sidecar down)', async () => {
  const rebound = createRebound({ target: `127.0.0.1:${await closedPort()}`, logger: false });
  try {
    for (const attempt of [1, 2, 3, 4]) {
      const j = job(`job-${attempt}-twice`);
      const first = await rebound.bullmq.backoffStrategy(attempt, 'rebound', failure(), j);
      const second = await rebound.bullmq.backoffStrategy(attempt, 'rebound', failure(), j);
      assert.equal(first, second);
    }
  } finally {
    await rebound.close();
  }
});

test('every vector through the adapter fallback: GetPolicy then NOT_SERVING gives the expected answer', async () => {
  const { cases } = JSON.parse(fs.readFileSync(VECTORS, 'utf8'));
  // The fallback uses the worker's clock, so cases that fix "now" are checked by vectors.test.js only.
  const usable = cases.filter((c) => c.context.nowUnixMs === undefined && c.context.firstFailureUnixMs === undefined);
  assert.ok(usable.length > 300, `${usable.length} usable cases`);
  const policies = new Map();
  for (const c of usable) {
    const key = `${c.identity}\u0000${JSON.stringify(c.policy)}`;
    if (!policies.has(key)) policies.set(key, { queue: `q${policies.size}`, c });
  }
  const byQueue = new Map([...policies.values()].map((v) => [v.queue, v.c]));
  const server = await startAdvisor({
    decide: () => NOT_SERVING,
    getPolicy: (req) => {
      const c = byQueue.get(req.queue);
      const [namespace, name] = c.identity.split('/');
      return { policy: { name, namespace, generation: '1', config_hash: 'sha256:v' }, resolved: resolvedToWire(c.policy) };
    },
  });
  const rebound = createRebound({ target: server.target, logger: false });
  try {
    const failures = [];
    for (const c of usable) {
      const { queue } = policies.get(`${c.identity}\u0000${JSON.stringify(c.policy)}`);
      await rebound.policy(queue);
      const a = await rebound.decide({
        queue,
        attempt: c.attempt,
        jobId: c.context.jobId,
        errorClass: c.context.errorClass,
        retryAfterMs: c.context.retryAfterMs,
      });
      assert.equal(a.source, 'fallback');
      const got = { decision: a.decision, delayMs: a.delayMs, disposition: a.disposition, deadLetterQueue: a.deadLetterQueue, reason: a.reason, reasonMessage: a.reasonMessage };
      try {
        assert.deepStrictEqual(got, c.expected);
      } catch {
        failures.push(`${c.name}: got ${JSON.stringify(got)}`);
      }
    }
    assert.deepEqual(failures.slice(0, 10), [], `${failures.length} of ${usable.length} differ`);
    assert.equal(rebound.metrics().fallback.default_policy, 0);
  } finally {
    await rebound.close();
    await server.close();
  }
});

test('the sidecar back on its port: answers come from it again', async () => {
  const answer = { decision: 'DECISION_RETRY', delay_ms: '4321', policy: { name: 'p', namespace: 'ns', generation: '1', config_hash: 'sha256:d' } };
  let server = await startAdvisor({ decide: () => answer });
  const port = Number(server.target.split(':').pop());
  const rebound = createRebound({ target: server.target, logger: false });
  try {
    assert.equal((await rebound.decide({ queue: 'q', attempt: 1, jobId: 'j' })).source, 'sidecar');
    server.forceClose();
    // Down: every answer from the fallback.
    const { eventually } = require('./redis');
    await eventually(async () => (await rebound.decide({ queue: 'q', attempt: 1, jobId: 'j' })).source === 'fallback', 10000, 'fallback');
    // Back on the same port: the channel reconnects without a restart of the worker.
    server = await startAdvisor({ decide: () => answer }, { port });
    const back = await eventually(async () => {
      const a = await rebound.decide({ queue: 'q', attempt: 1, jobId: 'j' });
      return a.source === 'sidecar' && a;
    }, 10000, 'the sidecar again');
    assert.equal(back.delayMs, 4321);
  } finally {
    await rebound.close();
    server.forceClose();
  }
});
