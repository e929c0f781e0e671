'use strict';
// Legacy Bull 4 workers on the real stack (sidecar over 127.0.0.1 TCP): the main cases.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const Bull = require('bull');
const { Registry } = require('prom-client');
const { decideLocal } = require('../..');
const { Stack, Events, retryPolicy } = require('./harness');
const { startWorker } = require('./fixtures/worker');

const QUEUES = ['bull-transient', 'bull-always', 'bull-dropped'];

let stack;
let worker;
const events = new Events();
const queues = {};
/** The application's registry: the Bull hook counts rebound_adapter_* here, as adapter="bull". */
const registry = new Registry();

before(async () => {
  stack = await Stack.start('bull');
  await stack.applyPolicy([
    retryPolicy('bull-transient', {
      queues: ['bull-transient'],
      backoff: { strategy: 'linear', base: '15ms', cap: '60ms', jitter: { kind: 'equal' } },
      maxAttempts: 5,
      terminal: { action: 'deadLetter', deadLetterQueue: 'bull-dead' },
    }),
    retryPolicy('bull-always', {
      queues: ['bull-always'],
      backoff: { strategy: 'constant', base: '10ms', jitter: { kind: 'none' } },
      maxAttempts: 3,
      nonRetryableErrors: ['Invalid*'],
      terminal: { action: 'deadLetter', deadLetterQueue: 'bull-dead' },
    }),
    retryPolicy('bull-dropped', {
      queues: ['bull-dropped'],
      backoff: { strategy: 'constant', base: '10ms', jitter: { kind: 'none' } },
      maxAttempts: 2,
      terminal: { action: 'drop' },
    }),
  ].join('\n---\n'));
  worker = await startWorker(
    { lib: 'bull', redisUrl: stack.redisUrl, target: stack.sidecar.tcp, queues: QUEUES, concurrency: 4, rebound: { registry } },
    events.push,
  );
  for (const q of [...QUEUES, 'bull-dead']) queues[q] = new Bull(q, stack.redisUrl);
});

after(async () => {
  await worker?.close();
  await Promise.all(Object.values(queues).map((q) => q.close()));
  await stack?.stop();
});

const runsOf = (key) => events.of('run', key).sort((a, b) => a.t - b.t);
const decisionsOf = (key) => events.of('decision', key).sort((a, b) => a.attempt - b.attempt);
const stateOf = async (queue, key) => (await queue.getJob(key))?.getState();

test('bull: a transient failure is retried inside the policy and completes', async (t) => {
  const keys = Array.from({ length: 5 }, (_, i) => `bt-${i}`);
  for (const key of keys) await worker.rebound.bull.add(queues['bull-transient'], 'job', { failRuns: 2 }, { key });
  await events.until('every job to complete', (e) => keys.every((k) => e.of('completed', k).length === 1));
  const { policy, resolved } = await worker.rebound.policy('bull-transient');
  const slack = [];
  for (const key of keys) {
    assert.equal(await stateOf(queues['bull-transient'], key), 'completed');
    const runs = runsOf(key);
    assert.equal(runs.length, 3);
    const decisions = decisionsOf(key);
    assert.deepEqual(decisions.map((d) => d.attempt), [1, 2]);
    for (const d of decisions) {
      assert.equal(d.decision, 'DECISION_RETRY');
      assert.equal(d.source, 'sidecar');
      // Equal jitter on a linear curve: [d/2, d] with d = min(cap, base·k).
      const full = Math.min(resolved.capMs, resolved.baseMs * d.attempt);
      assert.ok(d.delayMs >= Math.floor(full / 2) && d.delayMs <= full, `${key} attempt ${d.attempt}: ${d.delayMs} ms outside [${full / 2}, ${full}]`);
      assert.equal(d.delayMs, decideLocal(resolved, `${policy.namespace}/${policy.name}`, d.attempt, { jobId: key }).delayMs);
      const gap = runs[d.attempt].t - runs[d.attempt - 1].t;
      assert.ok(gap >= d.delayMs, `${key}: retry after ${gap} ms, before the ${d.delayMs} ms delay`);
      slack.push(gap - d.delayMs);
    }
  }
  slack.sort((a, b) => a - b);
  t.diagnostic(`gap minus answered delay: min ${slack[0]} ms, median ${slack[slack.length >> 1]} ms, max ${slack[slack.length - 1]} ms`);
});

test('bull: always failing → exactly maxAttempts runs, then the dead-letter queue', async () => {
  const key = 'ba-1';
  const data = { failRuns: -1, invoice: 'INV-9' };
  await worker.rebound.bull.add(queues['bull-always'], 'bill', data, { key });
  const [dl] = await events.until('the dead-letter event', (e) => e.of('deadLetter', key).length && e.of('deadLetter', key));
  await events.until('the source job to fail', async () => (await stateOf(queues['bull-always'], key)) === 'failed');
  assert.equal(runsOf(key).length, 3);
  assert.equal(dl.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  const dead = await queues['bull-dead'].getJob(dl.deadLetterJobId);
  assert.ok(dead);
  assert.equal(dead.data.sourceQueue, 'bull-always');
  assert.equal(dead.data.key, key);
  assert.deepEqual(dead.data.data, data);
  assert.equal(dead.data.attempt, 3);
  assert.equal(dead.data.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  assert.equal(await stateOf(queues['bull-always'], key), 'failed');
});

test('bull: a non-retryable error class ends at the first failure', async () => {
  const key = 'ba-2';
  await worker.rebound.bull.add(queues['bull-always'], 'bill', { failRuns: -1, errorClass: 'InvalidAccount' }, { key });
  const [dl] = await events.until('the dead-letter event', (e) => e.of('deadLetter', key).length && e.of('deadLetter', key));
  assert.equal(runsOf(key).length, 1);
  assert.equal(dl.reason, 'GIVE_UP_REASON_NON_RETRYABLE');
  assert.equal((await queues['bull-dead'].getJob(dl.deadLetterJobId)).data.error.class, 'InvalidAccount');
});

test('bull: a drop policy leaves the job in the failed set', async () => {
  const key = 'bd-1';
  await worker.rebound.bull.add(queues['bull-dropped'], 'job', { failRuns: -1 }, { key });
  const [drop] = await events.until('the drop event', (e) => e.of('drop', key).length && e.of('drop', key));
  await events.until('the job to fail', async () => (await stateOf(queues['bull-dropped'], key)) === 'failed');
  assert.equal(runsOf(key).length, 2);
  assert.equal(drop.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');
  assert.equal(drop.removed, false);
  assert.equal(events.of('deadLetter', key).length, 0);
});

test('bull: the Prometheus counters say what the events say, as adapter="bull"', async () => {
  const series = (await registry.getMetricsAsJSON()).flatMap((m) => m.values.map((v) => ({ name: m.name, ...v })));
  const value = (name, labels) => {
    const v = series.find((x) => x.name === name && Object.entries(labels).every(([k, want]) => x.labels[k] === want));
    return v ? v.value : undefined;
  };
  assert.ok(series.length > 0 && series.every((x) => x.labels.adapter === 'bull'), 'only adapter="bull" series');
  const decisions = events.of('decision');
  assert.ok(decisions.length > 0);
  assert.equal(value('rebound_adapter_decisions_total', { source: 'sidecar' }), decisions.filter((d) => d.source === 'sidecar').length);
  assert.equal(value('rebound_adapter_decisions_total', { source: 'fallback' }), decisions.filter((d) => d.source === 'fallback').length);
  assert.equal(value('rebound_adapter_terminal_total', { disposition: 'dead_letter' }), events.of('deadLetter').length);
  assert.equal(value('rebound_adapter_terminal_total', { disposition: 'drop' }), events.of('drop').length);
  assert.ok(events.of('drop').length > 0 && events.of('deadLetter').length > 0, 'both dispositions happened');
  assert.equal(value('rebound_adapter_hook_errors_total', {}), events.of('hookError').length);
});
