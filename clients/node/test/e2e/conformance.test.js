'use strict';
// The adapter contract's scenarios (clients/conformance/scenarios.json, policies in
// policies.yaml) on real BullMQ 6 and Bull 4 workers, a real Redis (dev/redis.sh) per test
// and a real rebound-sidecar serving policies.yaml (namespace conformance). Each test's
// title starts with its scenario id; test/unit/conformance-coverage.test.js fails when an
// id of scenarios.json has no test here.
//
// Figures (reconnect times) are printed with t.diagnostic; only generous bounds are asserted.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn, execFileSync } = require('node:child_process');
const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const readline = require('node:readline');
const { Queue, Job } = require('bullmq');
const Bull = require('bull');
const { createRebound } = require('../..');
const { ConformanceSidecar, Events, REPO, waitFor, sleep, freePort, lastLine, redisDirs } = require('./harness');
const { startWorker, redisConnection } = require('./fixtures/worker');

const CONFORMANCE = path.join(REPO, 'clients', 'conformance');
const SCENARIOS = new Map(JSON.parse(fs.readFileSync(path.join(CONFORMANCE, 'scenarios.json'), 'utf8')).scenarios.map((s) => [s.id, s]));
const DEAD = 'fixed-3-dead';
const BULL_PREFIX = 'bull4'; // Bull 4 and BullMQ keep different layouts under a prefix
const RUN_DIR = path.join(REPO, '.state', 'node-e2e', `conformance-${crypto.randomBytes(3).toString('hex')}`);

// Read from the proto (the sidecar's names): a scenario's `reason` must be one of them.
const { loadPackage } = require('../../lib/client');
const REASONS = new Set(Object.keys(loadPackage().GiveUpReason.type.value.reduce((m, v) => ({ ...m, [v.name]: 1 }), {})));
/** The generous bound a test asserts on reconnect times (the design bound is 1–2 s). */
const assertedBound = (expect) => expect.assertBackToSidecarWithinMs ?? 5000;

/** A test named after its scenario: `<id> [<lib>]: <what>`. */
function scenario(id, lib, what, fn, opts = {}) {
  assert.ok(SCENARIOS.has(id), `${id} is not in scenarios.json`);
  test(`${id} [${lib}]: ${what}`, { timeout: 180_000, ...opts }, (t) => fn(t, SCENARIOS.get(id).expect));
}

// ---------------------------------------------------------------------------------------
// The sidecar: one for the file, on a fixed address; tests that kill it start it again.

const sidecar = new ConformanceSidecar(RUN_DIR);
async function ensureSidecar() {
  if (!sidecar.proc?.alive()) await sidecar.start();
}

before(async () => {
  fs.mkdirSync(RUN_DIR, { recursive: true });
  await sidecar.start();
});
after(async () => {
  await sidecar.stop();
});

// ---------------------------------------------------------------------------------------
// One Redis per test, stopped by the test (dev/redis.sh), and the libraries' queues on it.

function redisUp(dir, persist) {
  return lastLine(execFileSync(path.join(REPO, 'dev', 'redis.sh'), ['up', dir, ...(persist ? ['--persist'] : [])], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] }));
}
function redisDown(dir) {
  execFileSync(path.join(REPO, 'dev', 'redis.sh'), ['down', dir], { stdio: 'ignore' });
}

/** Redis, a producer (its own Rebound), queue handles and cleanup for one test. */
async function setup(t, lib, { persist = false } = {}) {
  const dir = path.join(RUN_DIR, `redis-${crypto.randomBytes(3).toString('hex')}`);
  redisDirs.add(dir);
  const redisUrl = redisUp(dir, persist);
  const ctx = { lib, redisUrl, redisDir: dir, events: new Events(), cleanups: [] };
  ctx.producer = createRebound({ target: sidecar.target, logger: false });
  const handles = new Map();
  ctx.queue = (name) => {
    if (!handles.has(name)) {
      handles.set(name, lib === 'bull' ? new Bull(name, redisUrl, { prefix: BULL_PREFIX }) : new Queue(name, { connection: redisConnection(redisUrl) }));
    }
    return handles.get(name);
  };
  ctx.adapter = (rebound) => (lib === 'bull' ? rebound.bull : rebound.bullmq);
  ctx.add = (queueName, data, opts = {}) => ctx.adapter(ctx.producer).add(ctx.queue(queueName), 'job', data, opts);
  ctx.state = async (queueName, key) => {
    const q = ctx.queue(queueName);
    if (lib === 'bull') return (await q.getJob(key))?.getState() ?? 'unknown';
    return q.getJobState(key);
  };
  ctx.job = async (queueName, key) => (lib === 'bull' ? ctx.queue(queueName).getJob(key) : Job.fromId(ctx.queue(queueName), key));
  ctx.deadLetter = async (key, sourceQueue) => {
    const q = ctx.queue(DEAD);
    const jobs = lib === 'bull' ? await q.getWaiting() : await q.getJobs(['wait']);
    return jobs.find((j) => j.data.key === key && j.data.sourceQueue === sourceQueue) || null;
  };
  ctx.deadCount = async () => (lib === 'bull' ? (await ctx.queue(DEAD).getJobCounts()).waiting : ctx.queue(DEAD).count());
  ctx.worker = async (cfg) => {
    const w = await startWorker({ lib, redisUrl, target: sidecar.target, concurrency: 4, prefix: lib === 'bull' ? BULL_PREFIX : undefined, ...cfg }, ctx.events.push);
    ctx.cleanups.push(() => w.close());
    return w;
  };
  /** A worker process of its own (to SIGKILL, or to watch refuse to start). */
  ctx.spawnWorker = (cfg, env = {}) => {
    const full = { lib, redisUrl, concurrency: 4, prefix: lib === 'bull' ? BULL_PREFIX : undefined, ...cfg };
    const child = spawn(process.execPath, [path.join(__dirname, 'fixtures', 'worker.js')], {
      env: { ...process.env, ...env, REBOUND_E2E_WORKER: JSON.stringify(full) },
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    const index = (ctx.spawned = (ctx.spawned || 0) + 1);
    readline.createInterface({ input: child.stdout }).on('line', (line) => {
      try {
        ctx.events.push({ ...JSON.parse(line), worker: index });
      } catch {
        /* not an event line */
      }
    });
    const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
    ctx.cleanups.push(async () => {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
      await exited;
    });
    return { child, index, exited, ready: () => ctx.events.until(`worker ${index} ready`, (e) => e.list.some((x) => x.ev === 'ready' && x.worker === index)) };
  };
  t.after(async () => {
    for (const c of ctx.cleanups.reverse()) await c().catch(() => {});
    await ctx.producer.close();
    for (const q of handles.values()) await q.close().catch(() => {});
    redisDown(dir);
    redisDirs.delete(dir);
  });
  return ctx;
}

const runsOf = (ctx, key) => ctx.events.of('run', key).sort((a, b) => a.t - b.t);
const decisionsOf = (ctx, key) => ctx.events.of('decision', key).sort((a, b) => a.t - b.t);
const settled = (ctx, queueName, key, state) => waitFor(`${key} ${state}`, async () => (await ctx.state(queueName, key)) === state, { timeoutMs: 60_000, intervalMs: 25 });
const uniqueKey = (p) => `${p}-${crypto.randomBytes(4).toString('hex')}`;

for (const lib of ['bullmq', 'bull']) {
  // -------------------------------------------------------------------------------------
  scenario('retry-then-succeed', lib, 'two failures retried at the policy\'s delay, then completed', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    const w = await ctx.worker({ queues: ['fixed-3'] });
    const key = uniqueKey('rts');
    await ctx.add('fixed-3', { failRuns: 2 }, { key });
    await settled(ctx, 'fixed-3', key, expect.finalState);
    const runs = runsOf(ctx, key);
    assert.equal(runs.length, expect.runs);
    assert.deepEqual(runs.map((r) => r.jobId), Array(expect.runs).fill(key), 'the same job id every run');
    const { resolved } = await w.rebound.policy('fixed-3');
    const decisions = decisionsOf(ctx, key);
    assert.deepEqual(decisions.map((d) => [d.attempt, d.decision, d.source]), [[1, 'DECISION_RETRY', expect.source], [2, 'DECISION_RETRY', expect.source]]);
    for (const d of decisions) {
      assert.ok(d.delayMs <= resolved.capMs && d.delayMs === resolved.baseMs, `delay ${d.delayMs} (constant ${resolved.baseMs} ms)`);
      const gap = runs[d.attempt].t - runs[d.attempt - 1].t;
      assert.ok(gap >= d.delayMs, `run ${d.attempt + 1} started ${gap} ms after run ${d.attempt}, before the ${d.delayMs} ms delay`);
    }
  });

  // -------------------------------------------------------------------------------------
  scenario('exhausted-dead-letter', lib, 'maxAttempts runs, then the failed set and one dead letter with its data', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    await ctx.worker({ queues: ['fixed-3-dlq'] });
    const key = uniqueKey('edl');
    const data = { failRuns: -1, order: { id: 7, lines: ['a', 'b'] } };
    await ctx.add('fixed-3-dlq', data, { key });
    await settled(ctx, 'fixed-3-dlq', key, 'failed');
    await ctx.events.until('the dead-letter event', (e) => e.of('deadLetter', key).length);
    assert.equal(runsOf(ctx, key).length, expect.runs);
    assert.equal(await ctx.deadCount(), expect.deadLetters);
    const dl = await ctx.deadLetter(key, 'fixed-3-dlq');
    assert.ok(dl, 'the dead-letter job');
    // args, jobId, queue, reason, attempts
    assert.deepEqual(
      { args: dl.data.data, jobId: dl.data.sourceJobId, queue: dl.data.sourceQueue, reason: dl.data.reason, attempts: dl.data.attempts },
      { args: data, jobId: key, queue: 'fixed-3-dlq', reason: expect.reason ?? 'GIVE_UP_REASON_MAX_ATTEMPTS', attempts: expect.deadLetterAttempts },
    );
    assert.deepEqual(expect.deadLetterCarries, ['args', 'jobId', 'queue', 'reason', 'attempts']);
  });

  // -------------------------------------------------------------------------------------
  scenario('exhausted-drop-keeps-job', lib, 'drop leaves the job in the failed set, no dead letter', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    await ctx.worker({ queues: ['fixed-3-drop'] });
    const key = uniqueKey('drop');
    await ctx.add('fixed-3-drop', { failRuns: -1 }, { key });
    const [drop] = await ctx.events.until('the drop event', (e) => e.of('drop', key).length && e.of('drop', key));
    await settled(ctx, 'fixed-3-drop', key, 'failed');
    await sleep(300); // nothing removes it afterwards
    assert.equal(await ctx.state('fixed-3-drop', key), 'failed');
    assert.equal((await ctx.job('fixed-3-drop', key)).failedReason, `run 3 of ${key} failed on purpose`);
    assert.equal(drop.removed, false);
    assert.equal(runsOf(ctx, key).length, expect.runs);
    assert.equal(ctx.events.of('deadLetter', key).length, expect.deadLetters);
    assert.equal(await ctx.deadCount(), expect.deadLetters);
  });

  // -------------------------------------------------------------------------------------
  scenario('non-retryable-error', lib, 'a PermanentError gives up at the first failure into the dead-letter queue', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    await ctx.worker({ queues: ['fixed-3-dlq'] });
    const key = uniqueKey('nre');
    await ctx.add('fixed-3-dlq', { failRuns: -1, errorClass: 'PermanentError' }, { key });
    await settled(ctx, 'fixed-3-dlq', key, 'failed');
    await ctx.events.until('the dead-letter event', (e) => e.of('deadLetter', key).length);
    assert.equal(runsOf(ctx, key).length, expect.runs);
    const dl = await ctx.deadLetter(key, 'fixed-3-dlq');
    // The proto's name (an older scenarios.json spelled it GIVE_UP_REASON_NON_RETRYABLE_ERROR).
    const reason = REASONS.has(expect.reason) ? expect.reason : 'GIVE_UP_REASON_NON_RETRYABLE';
    if (reason !== expect.reason) t.diagnostic(`scenarios.json names ${expect.reason}, not a GiveUpReason of the proto; checked ${reason}`);
    assert.equal(dl.data.reason, reason);
    assert.equal(dl.data.error.class, 'PermanentError');
    assert.equal(dl.data.attempts, 1);
    assert.equal(await ctx.deadCount(), expect.deadLetters);
  });

  // -------------------------------------------------------------------------------------
  scenario('replayed-dead-letter', lib, 'replay (the README\'s command) runs the job once more under the same id, completed', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    const w = await ctx.worker({ queues: ['fixed-3-dlq'] });
    const key = uniqueKey('replay');
    await ctx.add('fixed-3-dlq', { failFirstRuns: 3 }, { key });
    await settled(ctx, 'fixed-3-dlq', key, 'failed');
    await ctx.events.until('the dead-letter event', (e) => e.of('deadLetter', key).length);
    const runsBefore = runsOf(ctx, key).length;
    assert.equal(runsBefore, 3);
    const dl = await ctx.deadLetter(key, 'fixed-3-dlq');
    // README: `await rebound.bullmq.replay(deadLetterJob, sourceQueue)` (Bull: rebound.bull.replay).
    const replayed = await ctx.adapter(w.rebound).replay(dl, ctx.queue('fixed-3-dlq'));
    assert.equal(replayed.key, key);
    assert.equal(String(replayed.job.id), key, 'the same job id');
    await settled(ctx, 'fixed-3-dlq', key, expect.finalState);
    assert.equal(runsOf(ctx, key).length - runsBefore, expect.replayRuns);
    assert.equal(runsOf(ctx, key).at(-1).jobId, key);
    assert.equal(await ctx.deadLetter(key, 'fixed-3-dlq'), null, 'the dead-letter job is removed');
  });

  // -------------------------------------------------------------------------------------
  scenario('default-policy-keeps-job', lib, 'no sidecar ever: attempt 10 gives up by the default policy, the job stays failed', async (t, expect) => {
    const ctx = await setup(t, lib);
    const nowhere = `127.0.0.1:${await freePort()}`;
    const offline = createRebound({ target: nowhere, logger: false });
    ctx.cleanups.push(() => offline.close());
    const key = uniqueKey('default');
    const queueName = 'no-sidecar';
    await ctx.adapter(offline).add(ctx.queue(queueName), 'job', { failRuns: -1 }, { key });
    // The job is at its 10th run: nine failures already counted by the library.
    const q = ctx.queue(queueName);
    const client = lib === 'bull' ? q.client : await q.getBackend().client;
    await client.hset(q.toKey(key), lib === 'bull' ? 'attemptsMade' : 'atm', '9');
    await ctx.worker({ queues: [queueName], target: nowhere });
    await settled(ctx, queueName, key, 'failed');
    const [d] = await ctx.events.until('the answer', (e) => e.of('decision', key).length && e.of('decision', key));
    assert.deepEqual(
      { attempt: d.attempt, decision: d.decision, disposition: d.disposition, policySource: d.policySource, source: d.source },
      { attempt: 10, decision: expect.decision, disposition: expect.disposition, policySource: expect.policySource, source: expect.source },
    );
    assert.equal(runsOf(ctx, key).length, 1);
    await sleep(300);
    assert.equal(await ctx.state(queueName, key), 'failed', 'kept in the failed set');
  });

  // -------------------------------------------------------------------------------------
  scenario('outage-every-process-uses-real-policy', lib, 'sidecar killed before any failure: every worker, also one created after the kill, decides from the fetched policy', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    // The worker learns the policy only by its start-up prefetch: it enqueues nothing.
    const w = await ctx.worker({ queues: ['fixed-3-dlq'] });
    await waitFor('the prefetched policy', async () => w.rebound.policies.has('fixed-3-dlq'));
    await sidecar.proc.stop('SIGKILL');
    // A worker started after the kill (a new Worker / attached queue in the process), then the first one stops.
    await w.addWorker('fixed-3-dlq');
    await w.workers[0].close();
    const key = uniqueKey('outage');
    await ctx.add('fixed-3-dlq', { failRuns: -1 }, { key });
    await settled(ctx, 'fixed-3-dlq', key, 'failed');
    await ctx.events.until('the dead-letter event', (e) => e.of('deadLetter', key).length);
    const decisions = decisionsOf(ctx, key);
    assert.equal(runsOf(ctx, key).length, expect.runs);
    assert.ok(decisions.every((d) => d.source === expect.source && d.policySource === expect.policySource), JSON.stringify(decisions.map((d) => [d.source, d.policySource])));
    assert.equal(await ctx.deadCount(), expect.deadLetters);
    // The same questions to the sidecar, back: the same answers.
    await sidecar.start();
    const asker = createRebound({ target: sidecar.target, logger: false, deadlineMs: 5000 });
    try {
      await waitFor('the sidecar serving', async () => (await asker.decide({ queue: 'fixed-3-dlq', attempt: 1, jobId: 'probe' })).source === 'sidecar');
      for (const d of decisions) {
        const a = await asker.decide({ queue: 'fixed-3-dlq', attempt: d.attempt, jobId: key, errorClass: 'TransientError' });
        assert.equal(a.source, 'sidecar');
        assert.deepEqual([a.decision, a.delayMs, a.disposition, a.deadLetterQueue, a.reason], [d.decision, d.delayMs, d.disposition, d.deadLetterQueue, d.reason]);
      }
    } finally {
      await asker.close();
    }
  });

  // -------------------------------------------------------------------------------------
  scenario('malformed-target-refused', lib, 'REBOUND_TARGET=http://… : the worker process refuses to start, naming it, and runs nothing', async (t, expect) => {
    const ctx = await setup(t, lib);
    await ensureSidecar();
    const key = uniqueKey('bad-target');
    await ctx.add('fixed-3', { failRuns: 0 }, { key });
    const s = SCENARIOS.get('malformed-target-refused');
    const w = ctx.spawnWorker({ queues: ['fixed-3'] }, { REBOUND_TARGET: s.target });
    const status = await w.exited;
    assert.equal(expect.workerStarts, false);
    assert.notEqual(status.code, 0);
    const [err] = ctx.events.of('startError');
    assert.ok(err, 'a structured start error');
    assert.deepEqual([err.name, err.code, err.variable], ['TypeError', 'REBOUND_BAD_TARGET', expect.errorNames]);
    assert.ok(err.message.startsWith(`${expect.errorNames}: `), err.message);
    assert.equal(ctx.events.of('ready').length, 0);
    assert.equal(ctx.events.of('run').length, expect.jobsRunBeforeRefusal);
    assert.equal(await ctx.state('fixed-3', key), 'waiting');
  });

  // -------------------------------------------------------------------------------------
  scenario('worker-sigkill', lib, 'a worker SIGKILLed mid-run: the job runs again under the same id, at most maxAttempts runs in all', async (t, expect) => {
    await ensureSidecar();
    const ctx = await setup(t, lib);
    const cfg = { queues: ['fixed-3-dlq'], target: sidecar.target, lockDurationMs: 2000, stalledIntervalMs: 1000 };
    const a = ctx.spawnWorker(cfg);
    await a.ready();
    const key = uniqueKey('sigkill');
    await ctx.add('fixed-3-dlq', { failRuns: -1, workMs: 1500 }, { key });
    await ctx.events.until('the first run', (e) => e.of('run', key).length === 1);
    a.child.kill('SIGKILL');
    await a.exited;
    const b = ctx.spawnWorker(cfg);
    await b.ready();
    await settled(ctx, 'fixed-3-dlq', key, 'failed');
    await ctx.events.until('the dead-letter event', (e) => e.of('deadLetter', key).length);
    const runs = runsOf(ctx, key);
    assert.equal(expect.jobRunsAgain, runs.some((r) => r.worker === b.index));
    assert.ok(runs.every((r) => r.jobId === key), 'the same job id');
    assert.ok(runs.length <= expect.runsAtMost, `${runs.length} runs`);
    assert.equal(runs.length, 3, 'the killed run counts as one of the policy\'s runs');
    const dl = await ctx.deadLetter(key, 'fixed-3-dlq');
    assert.equal(dl.data.attempts, runs.length);
    assert.equal(await ctx.deadCount(), 1, 'nothing lost: one dead letter');
  });
}

// ---------------------------------------------------------------------------------------
// The rest: the sidecar and Redis going away, and faults, on both libraries.

for (const lib of ['bullmq', 'bull']) {
scenario('sidecar-down-at-start', lib, 'the worker starts without a sidecar, says so naming the target, and uses the sidecar once it is up', async (t, expect) => {
  const ctx = await setup(t, lib);
  if (sidecar.proc?.alive()) await sidecar.proc.stop('SIGKILL');
  const w = await ctx.worker({ queues: ['fixed-3'], logEvents: true });
  assert.equal(expect.workerStarts, true);
  const warn = await ctx.events.until('the warning', (e) => e.of('log').find((l) => l.event === 'rebound.sidecar_unreachable'));
  assert.equal(warn.level, 'warn');
  assert.equal(warn.target, sidecar.target, 'the log line names the target');
  const early = uniqueKey('early');
  await ctx.add('fixed-3', { failRuns: 1 }, { key: early });
  const [d0] = await ctx.events.until('an answer before the sidecar', (e) => e.of('decision', early).length && e.of('decision', early));
  assert.deepEqual([d0.source, d0.policySource], ['fallback', expect.policySource ?? 'default']);
  const upAt = await sidecar.start();
  const loaded = await ctx.events.until('the policy fetched after the sidecar came up', (e) => e.of('log').find((l) => l.event === 'rebound.prefetched' && l.queue === 'fixed-3'), { timeoutMs: 30_000 });
  const ms = loaded.t - upAt;
  t.diagnostic(`sidecar listening → policy fetched: ${ms} ms (design bound ${expect.backToSidecarWithinMs} ms)`);
  assert.ok(ms <= assertedBound(expect), `${ms} ms`);
  const late = uniqueKey('late');
  await ctx.add('fixed-3', { failRuns: 1 }, { key: late });
  await settled(ctx, 'fixed-3', late, 'completed');
  const [d1] = decisionsOf(ctx, late);
  assert.deepEqual([d1.source, d1.policySource], ['sidecar', expect.thenPolicySource ?? 'sidecar']);
  assert.equal(w.rebound.policies.get('fixed-3').ref.name, 'fixed-3');
});
}

for (const lib of ['bullmq', 'bull']) {
scenario('adapter-error-never-hands-to-library', lib, 'a sidecar error answer and a fault inside the adapter: the policy decides locally, the hook never throws', async (t, expect) => {
  await ensureSidecar();
  const ctx = await setup(t, lib);
  // 1. The sidecar answers INVALID_ARGUMENT (a queue name over its 253 bytes).
  const longQueue = `q${'x'.repeat(253)}`;
  await ctx.worker({ queues: [longQueue] });
  const a = uniqueKey('sidecar-error');
  await ctx.add(longQueue, { failRuns: 1 }, { key: a });
  await settled(ctx, longQueue, a, 'completed');
  const fa = ctx.events.of('fallback', a);
  assert.equal(fa.length, 1);
  assert.deepEqual([fa[0].cause, fa[0].code], ['other', 3], 'INVALID_ARGUMENT from the sidecar');
  assert.equal(decisionsOf(ctx, a)[0].source, expect.decidedBy);
  assert.equal(runsOf(ctx, a).length, 2);

  // 2. A fault inside the adapter (its decide throws): the hook's own catch decides from the
  //    fetched policy; the library's own retry handling never sees an exception.
  const w = await ctx.worker({ queues: ['fixed-3-dlq'] });
  await waitFor('the prefetched policy', async () => w.rebound.policies.has('fixed-3-dlq'));
  w.rebound.decide = async () => {
    throw new TypeError('injected fault');
  };
  const b = uniqueKey('adapter-fault');
  await ctx.add('fixed-3-dlq', { failRuns: -1 }, { key: b });
  await settled(ctx, 'fixed-3-dlq', b, 'failed');
  const db = decisionsOf(ctx, b);
  assert.deepEqual(db.map((d) => [d.attempt, d.decision, d.source, d.policySource]), [
    [1, 'DECISION_RETRY', expect.decidedBy, 'cached'],
    [2, 'DECISION_RETRY', expect.decidedBy, 'cached'],
    [3, 'DECISION_GIVE_UP', expect.decidedBy, 'cached'],
  ]);
  assert.equal(runsOf(ctx, b).length, 3, 'the policy\'s maxAttempts, not the library\'s own attempts');
  assert.equal(expect.libraryDefaultRetries, 0);
  assert.equal(expect.hookRaises, false);
  assert.equal(ctx.events.of('hookError', b).length, 3, 'each fault absorbed and counted');
  assert.equal(ctx.events.of('workerError').length, 0);
});
}

for (const lib of ['bullmq', 'bull']) {
scenario('sidecar-restart-reconnects', lib, 'sidecar SIGKILLed and restarted three times while jobs fail: back on the sidecar quickly, no job lost', async (t, expect) => {
  await ensureSidecar();
  const ctx = await setup(t, lib);
  await ctx.worker({ queues: ['fixed-3'], concurrency: 8 });
  const keys = [];
  let feeding = true;
  const feed = (async () => {
    while (feeding) {
      const key = uniqueKey('restart');
      keys.push(key);
      await ctx.add('fixed-3', { failRuns: 2 }, { key });
      await sleep(40);
    }
  })();
  const figures = [];
  try {
    await ctx.events.until('sidecar answers', (e) => e.of('decision').filter((d) => d.source === 'sidecar').length >= 10);
    for (const downMs of [300, 1500, 4000]) {
      const killedAt = Date.now();
      await sidecar.proc.stop('SIGKILL');
      await ctx.events.until('fallback answers', (e) => e.of('decision').some((d) => d.t > killedAt && d.source === 'fallback'));
      await sleep(downMs);
      const upAt = await sidecar.start();
      const back = await ctx.events.until('an answer from the sidecar again', (e) => e.of('decision').find((d) => d.t > upAt && d.source === 'sidecar'), { timeoutMs: 60_000 });
      figures.push({ downMs, backMs: back.t - upAt });
    }
  } finally {
    feeding = false;
    await feed;
  }
  t.diagnostic(`sidecar listening again → first answer from it: ${figures.map((f) => `${f.backMs} ms after ${f.downMs} ms down`).join(', ')} (design bound ${expect.backToSidecarWithinMs} ms)`);
  for (const f of figures) assert.ok(f.backMs <= assertedBound(expect), `${f.backMs} ms after ${f.downMs} ms down`);
  for (const key of keys) await settled(ctx, 'fixed-3', key, 'completed');
  const raw = lib === 'bull' ? await ctx.queue('fixed-3').getJobCounts() : await ctx.queue('fixed-3').getJobCounts('wait', 'active', 'delayed', 'completed', 'failed');
  const counts = { wait: raw.wait ?? raw.waiting, active: raw.active, delayed: raw.delayed, completed: raw.completed, failed: raw.failed };
  assert.deepEqual(counts, { wait: 0, active: 0, delayed: 0, completed: keys.length, failed: 0 }, 'no job lost');
  assert.equal(expect.jobsLost, 0);
  for (const key of keys) assert.equal(runsOf(ctx, key).length, 3, key);
});
}

for (const lib of ['bullmq', 'bull']) {
scenario('broker-restart', lib, 'Redis stopped and started again mid-run: no job lost, none past maxAttempts', async (t, expect) => {
  await ensureSidecar();
  const ctx = await setup(t, lib, { persist: true });
  await ctx.worker({ queues: ['fixed-3-dlq'], concurrency: 4, lockDurationMs: 3000, stalledIntervalMs: 1000 });
  const keys = [];
  for (let i = 0; i < 24; i++) {
    const key = `broker-${i}`;
    keys.push(key);
    await ctx.add('fixed-3-dlq', { failFirstRuns: i % 4 === 3 ? 99 : 2, workMs: 20 }, { key });
  }
  const always = keys.filter((_, i) => i % 4 === 3);
  await ctx.events.until('some retries', (e) => e.of('decision').length >= 10);
  // Stop Redis (SIGTERM: it writes its append-only file), wait, start it again on the same port and data.
  const pid = Number(fs.readFileSync(path.join(ctx.redisDir, 'redis.pid'), 'utf8'));
  process.kill(pid, 'SIGTERM');
  await waitFor('Redis to stop', () => {
    try {
      process.kill(pid, 0);
      return false;
    } catch {
      return true;
    }
  });
  await sleep(1000);
  assert.equal(redisUp(ctx.redisDir, true), ctx.redisUrl);
  // The starts the library recorded: BullMQ's `attemptsStarted`, Bull's `rebound:starts`
  // (counted by the adapter when the worker takes the job).
  const startsOf = async (key) => {
    const q = ctx.queue('fixed-3-dlq');
    if (lib === 'bull') return Number(await q.client.hget(q.toKey(key), 'rebound:starts'));
    return (await ctx.job('fixed-3-dlq', key)).attemptsStarted;
  };
  const stallsOf = async (key) => {
    const q = ctx.queue('fixed-3-dlq');
    if (lib === 'bull') return Number(await q.client.hget(q.toKey(key), 'stalledCounter'));
    return (await ctx.job('fixed-3-dlq', key)).stalledCounter;
  };
  const explain = async (which) => {
    const states = {};
    for (const key of which) {
      states[key] = {
        state: await ctx.state('fixed-3-dlq', key),
        starts: await startsOf(key),
        stalled: await stallsOf(key),
        runs: runsOf(ctx, key).map((r) => [r.run, r.attemptsMade, r.t]),
        decisions: decisionsOf(ctx, key).map((d) => [d.attempt, d.decision, d.source, d.t]),
        hookErrors: ctx.events.of('hookError', key).map((h) => `${h.where}: ${h.error}`),
      };
    }
    t.diagnostic(`${JSON.stringify(states)}; worker errors: ${JSON.stringify(ctx.events.of('workerError').slice(0, 5))}`);
  };
  try {
    for (const key of keys) {
      await waitFor(`${key} completed or failed`, async () => ['completed', 'failed'].includes(await ctx.state('fixed-3-dlq', key)), { timeoutMs: 60_000, intervalMs: 25 });
    }
  } catch (e) {
    await explain(keys);
    throw e;
  }
  // Every job had exactly maxAttempts starts, none past it. A start whose reply Redis never
  // sent (BullMQ took the job just as Redis stopped) never reached the processor, yet it is
  // one of the job's starts: BullMQ counts it in attemptsStarted, and its stall looks like a
  // run killed with its worker. At most one such start per worker slot.
  const lost = {};
  for (const key of keys) {
    try {
      const starts = await startsOf(key);
      const runs = runsOf(ctx, key).length;
      assert.equal(starts, 3, `${key}: starts`);
      assert.ok(runs <= starts, `${key}: ${runs} runs, ${starts} starts`);
      if (runs < starts) {
        lost[key] = starts - runs;
        assert.ok((await stallsOf(key)) >= lost[key], `${key}: a start that never ran is a stall`);
      }
      const completes = !always.includes(key) && runs === 3;
      assert.equal(await ctx.state('fixed-3-dlq', key), completes ? 'completed' : 'failed', key);
    } catch (e) {
      await explain([key]);
      throw e;
    }
  }
  const lostStarts = Object.values(lost).reduce((a, b) => a + b, 0);
  t.diagnostic(`starts that never reached the processor: ${JSON.stringify(lost)}`);
  assert.ok(lostStarts <= 4, `${lostStarts} lost starts, more than the worker's concurrency`);
  const failed = [];
  for (const key of keys) if ((await ctx.state('fixed-3-dlq', key)) === 'failed') failed.push(key);
  assert.equal(await ctx.deadCount(), failed.length, 'one dead letter per exhausted job');
  assert.equal(expect.jobsLost, 0);
  assert.equal(expect.runsAtMostMaxAttempts, true);
});
}
