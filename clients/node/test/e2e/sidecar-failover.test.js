'use strict';
// The sidecar is killed while a BullMQ worker is retrying jobs: the adapter answers from
// its local fallback with the sidecar's own answers, no job is stuck or lost, and answers
// come from the sidecar again once it is back.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { Queue } = require('bullmq');
const { Registry } = require('prom-client');
const { Stack, Events, retryPolicy, sleep, waitFor } = require('./harness');
const { startWorker, redisConnection } = require('./fixtures/worker');

const QUEUE = 'flaky';
const MAX_ATTEMPTS = 6;

let stack;
let worker;
let queue;
let dead;
const events = new Events();
/** The application's registry: the adapter's rebound_adapter_* counters land here. */
const registry = new Registry();

/** The value of one series of `name` in the registry (prom-client's own API), 0 if absent. */
async function sample(name, labels) {
  const metric = (await registry.getMetricsAsJSON()).find((m) => m.name === name);
  const v = metric && metric.values.find((x) => Object.entries(labels).every(([k, want]) => x.labels[k] === want));
  return v ? v.value : 0;
}

before(async () => {
  stack = await Stack.start('failover');
  const spec = (queue) => ({
    queues: [queue],
    backoff: { strategy: 'exponential', base: '20ms', multiplier: 2, cap: '150ms', jitter: { kind: 'full' } },
    maxAttempts: MAX_ATTEMPTS,
    terminal: { action: 'deadLetter', deadLetterQueue: `${queue}-dead` },
  });
  await stack.applyPolicy([retryPolicy('flaky', spec(QUEUE)), retryPolicy('frozen', spec('frozen'))].join('\n---\n'));
  queue = new Queue(QUEUE, { connection: redisConnection(stack.redisUrl) });
  dead = new Queue('flaky-dead', { connection: redisConnection(stack.redisUrl) });
  worker = await startWorker(
    { lib: 'bullmq', redisUrl: stack.redisUrl, target: stack.sidecar.tcp, queues: [QUEUE], concurrency: 8, rebound: { registry } },
    events.push,
  );
});

after(async () => {
  await worker?.close();
  await queue?.close();
  await dead?.close();
  await stack?.stop();
});

let enqueued = 0;
const keys = [];
/** `n` jobs, a few of which always fail; `workMs` spreads the runs over time. */
async function enqueue(n) {
  for (let i = 0; i < n; i++, enqueued++) {
    const key = `job-${enqueued}`;
    keys.push(key);
    const failRuns = enqueued % 5 === 4 ? -1 : 3;
    await worker.rebound.bullmq.add(queue, 'job', { failRuns, workMs: 5 }, { key });
  }
}

test('sidecar killed mid-run: fallback answers equal the sidecar, nothing stuck or lost', async (t) => {
  const since = (t0, source) => (e) => e.of('decision').filter((d) => d.t > t0 && d.source === source).length;

  await enqueue(15);
  await events.until('sidecar answers', (e) => since(0, 'sidecar')(e) >= 15);

  const killedAt = Date.now();
  await stack.killSidecar('SIGKILL');
  await enqueue(15);
  await events.until('fallback answers', (e) => since(killedAt, 'fallback')(e) >= 20);
  assert.ok(events.of('fallback').every((f) => f.policySource === 'cached'), 'the fallback used the fetched policy, not the default');

  await sleep(200);
  const restartedAt = Date.now();
  await stack.startSidecar({ waitServing: true });
  await enqueue(15);
  const back = await events.until('sidecar answers again', (e) => e.of('decision').find((d) => d.t > restartedAt && d.source === 'sidecar'), { timeoutMs: 120_000 });
  t.diagnostic(`sidecar restarted → first answer from it again: ${back.t - restartedAt} ms`);
  // Why answers after the restart began were still local: not listening yet, or listening
  // without a configuration (the ConfigMap not loaded yet), or the channel's backoff.
  const late = events.of('fallback').filter((f) => f.t > restartedAt);
  const byDetails = late.reduce((m, f) => ((m[`${f.cause}: ${f.details}`] = (m[`${f.cause}: ${f.details}`] || 0) + 1), m), {});
  t.diagnostic(`fallback answers after the restart began: ${late.length} ${JSON.stringify(byDetails)}`);

  await events.until('every job completed or dead-lettered', (e) => keys.every((k) => e.of('completed', k).length === 1 || e.of('deadLetter', k).length >= 1), { timeoutMs: 120_000 });
  await events.until('the dead-lettered jobs to fail', async (e) => {
    for (const k of keys) if (e.of('deadLetter', k).length && (await queue.getJobState(k)) !== 'failed') return false;
    return true;
  });

  // The Prometheus counters say what the events say: who answered, why the fallback did,
  // from which policy, and the dead letters.
  const fallbackAnswers = events.of('decision').filter((d) => d.source === 'fallback');
  const adapter = 'bullmq';
  const sidecarAnswers = events.of('decision').filter((d) => d.source === 'sidecar').length;
  assert.equal(await sample('rebound_adapter_decisions_total', { adapter, source: 'sidecar' }), sidecarAnswers);
  assert.equal(await sample('rebound_adapter_decisions_total', { adapter, source: 'fallback' }), fallbackAnswers.length);
  const unavailableCached = events.of('fallback').filter((f) => f.cause === 'unavailable' && f.policySource === 'cached').length;
  assert.ok(unavailableCached > 0, 'the killed sidecar is unreachable');
  assert.equal(await sample('rebound_adapter_fallbacks_total', { adapter, reason: 'unavailable', policy_source: 'cached' }), unavailableCached);
  assert.equal(await sample('rebound_adapter_fallbacks_total', { adapter, reason: 'unavailable', policy_source: 'default' }), 0);
  assert.equal(await sample('rebound_adapter_terminal_total', { adapter, disposition: 'dead_letter' }), keys.filter((_, i) => i % 5 === 4).length);
  assert.equal(await sample('rebound_adapter_terminal_total', { adapter, disposition: 'drop' }), 0);
  assert.equal(await sample('rebound_adapter_hook_errors_total', { adapter }), 0);

  // Every fallback answer is the answer the sidecar gives for the same failure.
  assert.ok(fallbackAnswers.length >= 20);
  for (const f of fallbackAnswers) {
    const a = await worker.rebound.decide({ queue: QUEUE, attempt: f.attempt, jobId: f.jobId, errorClass: 'TransientError' });
    assert.equal(a.source, 'sidecar');
    assert.deepEqual(
      { decision: a.decision, delayMs: a.delayMs, disposition: a.disposition, deadLetterQueue: a.deadLetterQueue, reason: a.reason },
      { decision: f.decision, delayMs: f.delayMs, disposition: f.disposition, deadLetterQueue: f.deadLetterQueue, reason: f.reason },
      `${f.jobId} attempt ${f.attempt}`,
    );
  }

  // Nothing stuck, nothing lost, nothing twice.
  const counts = await queue.getJobCounts('wait', 'active', 'delayed', 'completed', 'failed');
  const alwaysFailing = keys.filter((_, i) => i % 5 === 4);
  assert.deepEqual(counts, { wait: 0, active: 0, delayed: 0, completed: keys.length - alwaysFailing.length, failed: alwaysFailing.length });
  assert.equal(await dead.count(), alwaysFailing.length);
  for (const key of alwaysFailing) {
    assert.equal(events.of('run', key).length, MAX_ATTEMPTS, `${key} ran exactly maxAttempts times across the outage`);
    const [dl] = events.of('deadLetter', key);
    assert.equal((await dead.getJob(dl.deadLetterJobId)).data.key, key);
  }
  const m = worker.rebound.metrics();
  assert.equal(m.hookErrors, 0);
  assert.equal(m.fallback.total, fallbackAnswers.length);
  t.diagnostic(`${events.of('decision').length} answers: ${fallbackAnswers.length} from the fallback (causes ${JSON.stringify(m.fallback)})`);
});

test('sidecar frozen (SIGSTOP): answers past the deadline come from the fallback, equal, then from the sidecar again', async (t) => {
  const frozenEvents = new Events();
  const w = await startWorker(
    { lib: 'bullmq', redisUrl: stack.redisUrl, target: stack.sidecar.uds, queues: ['frozen'], concurrency: 8, rebound: { deadlineMs: 200 } },
    frozenEvents.push,
  );
  const q = new Queue('frozen', { connection: redisConnection(stack.redisUrl) });
  t.after(async () => {
    if (stack.sidecarProc.alive()) stack.signalSidecar('SIGCONT');
    await w.close();
    await q.close();
  });
  const frozenKeys = [];
  const add = async (n) => {
    for (let i = 0; i < n; i++) {
      const key = `frozen-${frozenKeys.length}`;
      frozenKeys.push(key);
      await w.rebound.bullmq.add(q, 'job', { failRuns: 3 }, { key });
    }
  };
  await add(8);
  await frozenEvents.until('sidecar answers', (e) => e.of('decision').filter((d) => d.source === 'sidecar').length >= 5);
  stack.signalSidecar('SIGSTOP');
  const stoppedAt = Date.now();
  await add(8);
  await frozenEvents.until('answers past the deadline', (e) => e.of('fallback').filter((f) => f.cause === 'deadline_exceeded').length >= 8);
  stack.signalSidecar('SIGCONT');
  const resumedAt = Date.now();
  await add(4);
  const back = await frozenEvents.until('the sidecar answering again', (e) => e.of('decision').find((d) => d.t > resumedAt && d.source === 'sidecar'));
  await waitFor('every frozen job to complete', async () => {
    for (const k of frozenKeys) if ((await q.getJobState(k)) !== 'completed') return false;
    return true;
  });
  const fallbacks = frozenEvents.of('decision').filter((d) => d.source === 'fallback');
  for (const f of fallbacks) {
    const a = await w.rebound.decide({ queue: 'frozen', attempt: f.attempt, jobId: f.jobId, errorClass: 'TransientError' });
    assert.equal(a.source, 'sidecar');
    assert.equal(a.delayMs, f.delayMs, `${f.jobId} attempt ${f.attempt}`);
    assert.equal(a.decision, f.decision);
  }
  assert.ok(fallbacks.every((f) => f.t >= stoppedAt));
  t.diagnostic(`${fallbacks.length} answers from the fallback while frozen; sidecar again ${back.t - resumedAt} ms after SIGCONT`);
});
