'use strict';
// BullMQ workers on the real stack: policies applied with kubectl, answered by the real
// sidecar over its Unix socket, jobs in a real Redis.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { Queue, Job } = require('bullmq');
const { decideLocal } = require('../..');
const { Stack, Events, retryPolicy } = require('./harness');
const { startWorker, redisConnection } = require('./fixtures/worker');

const POLICIES = [
  retryPolicy('transient', {
    queues: ['transient'],
    backoff: { strategy: 'exponential', base: '20ms', multiplier: 2, cap: '120ms', jitter: { kind: 'full' } },
    maxAttempts: 6,
    terminal: { action: 'deadLetter', deadLetterQueue: 'transient-dead' },
  }),
  retryPolicy('always', {
    queues: ['always'],
    backoff: { strategy: 'constant', base: '10ms', jitter: { kind: 'none' } },
    maxAttempts: 4,
    nonRetryableErrors: ['InvalidEndpoint'],
    terminal: { action: 'deadLetter', deadLetterQueue: 'always-dead' },
  }),
  retryPolicy('dropped', {
    queues: ['dropped'],
    backoff: { strategy: 'constant', base: '10ms', jitter: { kind: 'none' } },
    maxAttempts: 3,
    terminal: { action: 'drop' },
  }),
];
const QUEUES = ['transient', 'always', 'dropped', 'changing'];

let stack;
let worker;
const events = new Events();
const queues = {};

before(async () => {
  stack = await Stack.start('bullmq');
  await stack.applyPolicy(POLICIES.join('\n---\n'));
  for (const q of [...QUEUES, 'transient-dead', 'always-dead', 'changing-dead']) {
    queues[q] = new Queue(q, { connection: redisConnection(stack.redisUrl) });
  }
  worker = await startWorker(
    { lib: 'bullmq', redisUrl: stack.redisUrl, target: stack.sidecar.uds, queues: QUEUES, concurrency: 8 },
    events.push,
  );
});

after(async () => {
  await worker?.close();
  await Promise.all(Object.values(queues).map((q) => q.close()));
  await stack?.stop();
});

const runsOf = (key) => events.of('run', key).sort((a, b) => a.t - b.t);
const decisionsOf = (key) => events.of('decision', key).sort((a, b) => a.attempt - b.attempt);

test('a transient failure is retried with delays inside the policy and completes', async (t) => {
  const failRuns = 3;
  const keys = Array.from({ length: 6 }, (_, i) => `transient-${i}`);
  for (const key of keys) await worker.rebound.bullmq.add(queues.transient, 'job', { failRuns }, { key });
  await events.until('every transient job to complete', (e) => keys.every((k) => e.of('completed', k).length === 1));

  const { policy, resolved } = await worker.rebound.policy('transient');
  const identity = `${policy.namespace}/${policy.name}`;
  assert.equal(policy.namespace, stack.namespace);
  const slack = [];
  for (const key of keys) {
    assert.equal(await queues.transient.getJobState(key), 'completed');
    const runs = runsOf(key);
    assert.equal(runs.length, failRuns + 1, `${key}: one run per failure plus the successful one`);
    const decisions = decisionsOf(key);
    assert.deepEqual(decisions.map((d) => d.attempt), [1, 2, 3], `${key}: the hook was asked once per failure, 1-based`);
    for (const d of decisions) {
      assert.equal(d.decision, 'DECISION_RETRY');
      assert.equal(d.source, 'sidecar');
      assert.equal(d.policy.name, 'transient');
      // Full jitter: uniform(0, min(cap, base·2^(k-1))).
      const bound = Math.min(resolved.capMs, resolved.baseMs * 2 ** (d.attempt - 1));
      assert.ok(d.delayMs >= 0 && d.delayMs <= bound, `${key} attempt ${d.attempt}: ${d.delayMs} ms outside [0, ${bound}]`);
      // The same number the policy crate's function gives for this job id.
      assert.equal(d.delayMs, decideLocal(resolved, identity, d.attempt, { jobId: key }).delayMs);
      const gap = runs[d.attempt].t - runs[d.attempt - 1].t;
      assert.ok(gap >= d.delayMs, `${key}: run ${d.attempt + 1} started ${gap} ms after run ${d.attempt}, before the ${d.delayMs} ms delay`);
      slack.push(gap - d.delayMs);
    }
  }
  slack.sort((a, b) => a - b);
  t.diagnostic(`gap minus answered delay over ${slack.length} retries: min ${slack[0]} ms, median ${slack[slack.length >> 1]} ms, max ${slack[slack.length - 1]} ms`);
});

test('a job that always fails runs maxAttempts times and lands in the dead-letter queue', async () => {
  const key = 'always-1';
  const data = { failRuns: -1, order: { id: 7, lines: ['a', 'b'] } };
  await worker.rebound.bullmq.add(queues.always, 'charge', data, { key });
  const [dl] = await events.until('the dead-letter event', (e) => e.of('deadLetter', key).length && e.of('deadLetter', key));
  await events.until('the source job to fail', async () => (await queues.always.getJobState(key)) === 'failed');

  assert.equal(runsOf(key).length, 4, 'exactly maxAttempts runs');
  assert.deepEqual(decisionsOf(key).map((d) => d.decision), ['DECISION_RETRY', 'DECISION_RETRY', 'DECISION_RETRY', 'DECISION_GIVE_UP']);
  assert.equal(dl.deadLetterQueue, 'always-dead');
  assert.equal(dl.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  const dead = await queues['always-dead'].getJob(dl.deadLetterJobId);
  assert.ok(dead, 'the dead-letter job exists');
  assert.equal(dead.name, 'charge');
  assert.equal(dead.data.format, 'rebound.dev/dead-letter/v1');
  assert.equal(dead.data.sourceQueue, 'always');
  assert.equal(dead.data.sourceJobId, key);
  assert.equal(dead.data.key, key);
  assert.deepEqual(dead.data.data, data);
  assert.equal(dead.data.attempt, 4);
  assert.equal(dead.data.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  assert.equal(dead.data.error.class, 'TransientError');
  assert.equal(dead.data.policy.name, 'always');
  assert.equal(dead.data.source, 'sidecar');
  assert.ok(dead.data.firstFailureUnixMs <= dead.data.deadLetteredAtUnixMs);
  // The first failure happened after the first run started and before its answer.
  assert.ok(dead.data.firstFailureUnixMs >= runsOf(key)[0].t && dead.data.firstFailureUnixMs <= decisionsOf(key)[0].t);
  // The source job ends in BullMQ's failed set, as its users expect.
  assert.equal(await queues.always.getJobState(key), 'failed');
  assert.equal(await queues['always-dead'].count(), 1);
});

test('a non-retryable error class ends the job at its first failure', async () => {
  const key = 'invalid-endpoint-1';
  await worker.rebound.bullmq.add(queues.always, 'charge', { failRuns: -1, errorClass: 'InvalidEndpoint' }, { key });
  const [dl] = await events.until('the dead-letter event', (e) => e.of('deadLetter', key).length && e.of('deadLetter', key));
  await events.until('the source job to fail', async () => (await queues.always.getJobState(key)) === 'failed');
  assert.equal(runsOf(key).length, 1);
  assert.equal(dl.reason, 'GIVE_UP_REASON_NON_RETRYABLE');
  const dead = await queues['always-dead'].getJob(dl.deadLetterJobId);
  assert.equal(dead.data.reason, 'GIVE_UP_REASON_NON_RETRYABLE');
  assert.equal(dead.data.attempt, 1);
  assert.equal(dead.data.error.class, 'InvalidEndpoint');
});

test('a drop policy leaves the job in the failed set at the end', async () => {
  const key = 'drop-1';
  const dropped = worker.rebound.metrics().dropped;
  await worker.rebound.bullmq.add(queues.dropped, 'job', { failRuns: -1 }, { key });
  const [drop] = await events.until('the drop event', (e) => e.of('drop', key).length && e.of('drop', key));
  await events.until('the job to fail', async () => (await queues.dropped.getJobState(key)) === 'failed');
  assert.equal(runsOf(key).length, 3, 'exactly maxAttempts runs');
  assert.equal(drop.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  assert.equal(drop.removed, false);
  assert.equal((await queues.dropped.getJob(key)).failedReason, `run 3 of ${key} failed on purpose`);
  assert.equal(await queues.dropped.getFailedCount(), 1);
  assert.equal(events.of('deadLetter', key).length, 0);
  assert.equal(worker.rebound.metrics().dropped, dropped + 1);
});

test('the hook asked twice for the same failure gives the same delay', async () => {
  const key = 'transient-0';
  const job = await Job.fromId(queues.transient, key);
  const err = Object.assign(new Error('again'), { name: 'TransientError' });
  const answered = decisionsOf(key);
  for (const attemptsMade of [1, 2, 3]) {
    const first = await worker.rebound.bullmq.backoffStrategy(attemptsMade, 'rebound', err, job);
    const second = await worker.rebound.bullmq.backoffStrategy(attemptsMade, 'rebound', err, job);
    assert.equal(first, second);
    assert.equal(first, answered[attemptsMade - 1].delayMs, 'and the same as when the job really failed');
  }
});

test('a policy changed with kubectl apply governs the failures after it', async (t) => {
  const changing = (spec) => retryPolicy('changing', {
    queues: ['changing'],
    backoff: { strategy: 'constant', jitter: { kind: 'none' }, ...spec.backoff },
    maxAttempts: spec.maxAttempts,
    terminal: { action: 'deadLetter', deadLetterQueue: 'changing-dead' },
  });
  await stack.applyPolicy(changing({ backoff: { base: '30ms' }, maxAttempts: 1000 }));
  const key = 'changing-1';
  await worker.rebound.bullmq.add(queues.changing, 'job', { failRuns: -1 }, { key });
  await events.until('three retries under the first policy', (e) => e.of('decision', key).length >= 3);

  const second = await stack.applyPolicy(changing({ backoff: { base: '70ms' }, maxAttempts: 1000 }), { wait: false });
  const firstNew = await events.until('an answer from the new policy', (e) => e.of('decision', key).find((d) => d.delayMs === 70));
  const propagationMs = firstNew.t - second.appliedAt;
  t.diagnostic(`kubectl apply started → first failure answered by the new policy: ${firstNew.t - second.startedAt} ms (${propagationMs} ms after kubectl returned)`);
  assert.equal(firstNew.policy.generation, String(second.generations.changing));
  assert.ok(propagationMs < 30_000, `the change took ${propagationMs} ms to reach the worker`);
  const decisions = events.of('decision', key);
  const cut = decisions.indexOf(firstNew);
  assert.ok(decisions.slice(0, cut).every((d) => d.delayMs === 30 && d.source === 'sidecar'));
  await events.until('two more answers', (e) => e.of('decision', key).length >= cut + 3);
  assert.ok(events.of('decision', key).slice(cut).every((d) => d.delayMs === 70), 'no answer from the old policy after the new one');

  // A lower maxAttempts ends the job at its next failure.
  const third = await stack.applyPolicy(changing({ backoff: { base: '70ms' }, maxAttempts: 2 }), { wait: false });
  const [dl] = await events.until('the dead-letter event', (e) => e.of('deadLetter', key).length && e.of('deadLetter', key));
  assert.equal(dl.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  const dead = await queues['changing-dead'].getJob(dl.deadLetterJobId);
  assert.equal(dead.data.policy.generation, String(third.generations.changing));
  assert.equal(await queues.changing.getJobState(key), 'failed');
});
