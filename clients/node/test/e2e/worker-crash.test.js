'use strict';
// Worker processes SIGKILLed between a failure and its retry, and in the middle of a run:
// every job is still completed or dead-lettered (at-least-once), none disappears.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const path = require('node:path');
const readline = require('node:readline');
const { Queue } = require('bullmq');
const { Stack, Events, retryPolicy, waitFor } = require('./harness');
const { redisConnection } = require('./fixtures/worker');

const MAX_ATTEMPTS = 4;

let stack;
before(async () => {
  stack = await Stack.start('crash');
});
after(async () => {
  await stack?.stop();
});

for (const lib of ['bullmq', 'bull']) {
  const QUEUE = `crashy-${lib}`;
  const DEAD = `${QUEUE}-dead`;
  let queue;
  let dead;
  let producer; // the package, for enqueueing
  const events = new Events();
  const procs = [];

  /** A worker process of its own; its JSON-line events go to `events`, tagged with its index. */
  function spawnWorker() {
    const cfg = {
      lib, redisUrl: stack.redisUrl, target: stack.sidecar.uds, queues: [QUEUE], concurrency: 4,
      // Short locks so the jobs a killed worker held come back within a second or two.
      lockDurationMs: 1000, stalledIntervalMs: 500,
    };
    const child = spawn(process.execPath, [path.join(__dirname, 'fixtures/worker.js')], {
      env: { ...process.env, REBOUND_E2E_WORKER: JSON.stringify(cfg) },
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    const index = procs.length;
    procs.push(child);
    readline.createInterface({ input: child.stdout }).on('line', (line) => {
      try {
        events.push({ ...JSON.parse(line), worker: index });
      } catch {
        /* not an event line */
      }
    });
    return { child, index, ready: events.until(`worker ${index} ready`, (e) => e.list.some((x) => x.ev === 'ready' && x.worker === index)) };
  }

  const sigkill = (child) => new Promise((resolve) => {
    child.once('exit', resolve);
    child.kill('SIGKILL');
  });

  test(`${lib}: workers killed between a failure and its retry and during a run lose no job`, { concurrency: false }, async (t) => {
    t.after(async () => {
      for (const p of procs) if (p.exitCode === null && p.signalCode === null) await sigkill(p);
      await producer?.close();
      await queue?.close();
      await dead?.close();
    });
    await stack.applyPolicy(retryPolicy(QUEUE, {
      queues: [QUEUE],
      backoff: { strategy: 'constant', base: '150ms', jitter: { kind: 'none' } },
      maxAttempts: MAX_ATTEMPTS,
      terminal: { action: 'deadLetter', deadLetterQueue: DEAD },
    }));
    const { createRebound } = require('../..');
    producer = createRebound({ target: stack.sidecar.uds, logger: false });
    if (lib === 'bull') {
      const Bull = require('bull');
      queue = producer.bull.attach(new Bull(QUEUE, stack.redisUrl));
      dead = new Bull(DEAD, stack.redisUrl);
    } else {
      queue = new Queue(QUEUE, { connection: redisConnection(stack.redisUrl) });
      dead = new Queue(DEAD, { connection: redisConnection(stack.redisUrl) });
    }
    const adapter = lib === 'bull' ? producer.bull : producer.bullmq;
    const keys = [];
    for (let i = 0; i < 40; i++) {
      const key = `job-${i}`;
      keys.push(key);
      await adapter.add(queue, 'job', { failRuns: i % 8 === 7 ? -1 : 2, workMs: 40 }, { key });
    }
    const alwaysFailing = keys.filter((_, i) => i % 8 === 7);

    // 1. Killed between failures and their retries: jobs sit in the delayed set.
    const a = spawnWorker();
    await a.ready;
    await events.until('retries scheduled by worker 0', (e) => e.of('decision').filter((d) => d.worker === 0 && d.decision === 'DECISION_RETRY').length >= 6);
    await waitFor('a retry waiting in the delayed set', async () => (await queue.getDelayedCount()) > 0, { intervalMs: 5 });
    await sigkill(a.child);
    // Counted after the kill: with no worker alive, nothing moves them.
    const delayedAtKill = await queue.getDelayedCount();

    // 2. Killed in the middle of runs: jobs are active, locked by a dead worker.
    const b = spawnWorker();
    await b.ready;
    await events.until('worker 1 running jobs', (e) => e.of('run').filter((r) => r.worker === 1).length >= 6);
    await waitFor('a job in the middle of a run', async () => (await queue.getActiveCount()) > 0, { intervalMs: 5 });
    await sigkill(b.child);
    const activeAtKill = await queue.getActiveCount();
    t.diagnostic(`killed worker 0 leaving ${delayedAtKill} jobs delayed, worker 1 leaving ${activeAtKill} jobs active`);
    assert.ok(delayedAtKill > 0, 'worker 0 died between a failure and its retry');
    assert.ok(activeAtKill > 0, 'worker 1 died during runs');

    // 3. A new worker finishes everything.
    const c = spawnWorker();
    await c.ready;
    const state = async (key) => (lib === 'bull' ? (await queue.getJob(key))?.getState() : queue.getJobState(key));
    await waitFor('every job completed or failed', async () => {
      for (const key of keys) if (!['completed', 'failed'].includes(await state(key))) return false;
      return true;
    }, { timeoutMs: 120_000, intervalMs: 100 });

    for (const key of keys) {
      const s = await state(key);
      if (alwaysFailing.includes(key)) {
        assert.equal(s, 'failed', key);
        const dl = (lib === 'bull' ? await dead.getWaiting() : await dead.getJobs(['wait'])).find((j) => j.data.key === key);
        assert.ok(dl, `${key} is in the dead-letter queue`);
        assert.equal(dl.data.key, key);
        assert.equal(dl.data.attempt, MAX_ATTEMPTS);
      } else {
        assert.equal(s, 'completed', key);
        // At least once: a run cut short by SIGKILL is run again.
        assert.ok(events.of('run', key).length >= 3, `${key} ran ${events.of('run', key).length} times`);
      }
    }
    const counts = lib === 'bull' ? await queue.getJobCounts() : await queue.getJobCounts('wait', 'active', 'delayed');
    assert.equal(counts.waiting ?? counts.wait, 0);
    assert.equal(counts.active, 0);
    assert.equal(counts.delayed, 0);
    const deadCount = lib === 'bull' ? (await dead.getJobCounts()).waiting : await dead.count();
    assert.equal(deadCount, alwaysFailing.length, 'one dead letter per exhausted job');
    const reruns = keys.reduce((n, k) => n + events.of('run', k).length, 0) - keys.reduce((n, k) => n + (alwaysFailing.includes(k) ? MAX_ATTEMPTS : 3), 0);
    t.diagnostic(`${reruns} runs repeated after the kills (at-least-once)`);
  });
}
