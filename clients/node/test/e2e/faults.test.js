'use strict';
// The fault-injection scenarios (clients/conformance/faults.json) that list `bullmq`, on real
// BullMQ 6 workers (in the test process or processes of their own, SIGKILLed and SIGSTOPped),
// a real Redis per test (dev/redis.sh; ACLs, maxmemory, a TCP proxy that drops a reply) and
// a real rebound-sidecar serving clients/conformance/policies.yaml. Each test is named after
// its scenario id; test/unit/conformance-coverage.test.js fails when an id has no test here.
//
// For every job each test tallies where it ended (completed, pending retry or unacknowledged,
// dead letter) from Redis, and asserts: none lost, runs (counted by the job itself in Redis)
// within maxAttempts plus the window the README documents for the fault, one dead letter per
// give-up. Measured figures are printed with t.diagnostic.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn, execFileSync } = require('node:child_process');
const crypto = require('node:crypto');
const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');
const readline = require('node:readline');
const { Queue, Job } = require('bullmq');
const Redis = require('ioredis');
const { createRebound } = require('../..');
const { ConformanceSidecar, Events, REPO, waitFor, sleep, lastLine, redisDirs } = require('./harness');
const { startWorker, redisConnection } = require('./fixtures/worker');

const CONFORMANCE = path.join(REPO, 'clients', 'conformance');
const FAULTS = new Map(JSON.parse(fs.readFileSync(path.join(CONFORMANCE, 'faults.json'), 'utf8')).scenarios.map((s) => [s.id, s]));
const QUEUE = 'fixed-3-dlq';
const DEAD = 'fixed-3-dead';
const MAX_ATTEMPTS = 3; // policies.yaml, fixed-3-dlq
/** The adapter's documented at-least-once window per fault (README: "Guarantees under faults", with processor(fn)). */
const WINDOW = {
  'paused-past-every-timeout': 0,
  'killed-on-every-run': 0,
  'killed-while-deciding': 0,
  'killed-between-dead-letter-and-ack': 0,
  'dead-letter-write-refused': 0,
  'broker-out-of-memory': 0,
  'commit-reply-lost': 0,
  'sidecar-hung': 0,
  'replay-after-crashes': 0,
  'gives-up-twice': 0,
  'remove-on-fail-dead-letter-refused': 0,
};
const RUN_DIR = path.join(REPO, '.state', 'node-e2e', `faults-${crypto.randomBytes(3).toString('hex')}`);
/** Short locks, so a dead or paused worker's jobs are taken back within seconds. */
const LOCKS = { lockDurationMs: 2000, stalledIntervalMs: 1000 };

/** A test named after its fault scenario: `<id> [bullmq]: <what>`. */
function scenario(id, lib, what, fn, opts = {}) {
  assert.ok(FAULTS.has(id), `${id} is not in faults.json`);
  assert.ok(FAULTS.get(id).libraries.includes(lib), `${id} does not list ${lib}`);
  test(`${id} [${lib}]: ${what}`, { timeout: 240_000, ...opts }, (t) => fn(t, FAULTS.get(id).expect, WINDOW[id]));
}

// ---------------------------------------------------------------------------------------
// The sidecar: one for the file; a test that stops it continues it in its cleanup.

const sidecar = new ConformanceSidecar(RUN_DIR);

before(async () => {
  fs.mkdirSync(RUN_DIR, { recursive: true });
  await sidecar.start();
});
after(async () => {
  await sidecar.stop();
});

// ---------------------------------------------------------------------------------------
// One Redis per test, stopped by the test; producer, queue handles, workers, cleanup.

async function setup(t) {
  const dir = path.join(RUN_DIR, `redis-${crypto.randomBytes(3).toString('hex')}`);
  redisDirs.add(dir);
  const redisUrl = lastLine(execFileSync(path.join(REPO, 'dev', 'redis.sh'), ['up', dir], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] }));
  const ctx = { redisUrl, redisDir: dir, events: new Events(), cleanups: [] };
  ctx.admin = new Redis(redisConnection(redisUrl));
  ctx.producer = createRebound({ target: sidecar.target, logger: false, deadlineMs: 5000 });
  const handles = new Map();
  ctx.queue = (name) => {
    if (!handles.has(name)) handles.set(name, new Queue(name, { connection: redisConnection(redisUrl) }));
    return handles.get(name);
  };
  ctx.add = (data, opts = {}) => ctx.producer.bullmq.add(ctx.queue(QUEUE), 'job', data, opts);
  /** In-process worker (closed by the cleanup). */
  ctx.worker = async (cfg = {}) => {
    const w = await startWorker({ lib: 'bullmq', redisUrl, target: sidecar.target, queues: [QUEUE], concurrency: 4, wrap: true, ...cfg }, ctx.events.push);
    ctx.cleanups.push(() => w.close());
    return w;
  };
  /** A worker process of its own, to SIGKILL or SIGSTOP. */
  ctx.spawnWorker = (cfg = {}) => {
    const full = { lib: 'bullmq', redisUrl, target: sidecar.target, queues: [QUEUE], concurrency: 4, wrap: true, ...LOCKS, ...cfg };
    const child = spawn(process.execPath, [path.join(__dirname, 'fixtures', 'worker.js')], {
      env: { ...process.env, REBOUND_E2E_WORKER: JSON.stringify(full) },
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
      if (child.exitCode === null && child.signalCode === null) {
        child.kill('SIGCONT');
        child.kill('SIGKILL');
      }
      await exited;
    });
    return { child, index, exited, ready: () => ctx.events.until(`worker ${index} ready`, (e) => e.list.some((x) => x.ev === 'ready' && x.worker === index)) };
  };
  t.after(async () => {
    for (const c of ctx.cleanups.reverse()) await c().catch(() => {});
    await ctx.producer.close();
    for (const q of handles.values()) await q.close().catch(() => {});
    ctx.admin.disconnect();
    execFileSync(path.join(REPO, 'dev', 'redis.sh'), ['down', dir], { stdio: 'ignore' });
    redisDirs.delete(dir);
  });
  return ctx;
}

const uniqueKey = (p) => `${p}-${crypto.randomBytes(4).toString('hex')}`;
const PENDING = new Set(['wait', 'waiting', 'delayed', 'active', 'prioritized', 'paused', 'waiting-children']);

/** The dead letters in the dead-letter queue, by source key. */
async function deadLetters(ctx) {
  const jobs = await ctx.queue(DEAD).getJobs(['wait', 'active', 'delayed', 'completed', 'failed', 'prioritized', 'paused'], 0, -1);
  const by = new Map();
  for (const j of jobs) {
    if (!j || j.data?.sourceQueue !== QUEUE) continue;
    by.set(j.data.key, [...(by.get(j.data.key) || []), j]);
  }
  return by;
}

/** Runs of a job, counted by the job itself (a Redis set of run ids, fixtures/worker.js). */
const runsOf = (ctx, key) => ctx.admin.scard(`rebound-e2e:runs:${QUEUE}:${key}`).then(Number);

/**
 * Where every job ended: completed, pending (a retry scheduled or waiting, or still
 * unacknowledged: active), dead letter (the job failed and its dead letter exists), or lost.
 */
async function tally(ctx, keys) {
  const dls = await deadLetters(ctx);
  const jobs = {};
  const count = { completed: 0, pending: 0, deadLetter: 0, lost: 0 };
  for (const key of keys) {
    const state = await ctx.queue(QUEUE).getJobState(key);
    const failedReason = state === 'failed' ? (await Job.fromId(ctx.queue(QUEUE), key))?.failedReason : undefined;
    const dl = dls.get(key) || [];
    const where = state === 'completed' ? 'completed' : PENDING.has(state) ? 'pending' : dl.length > 0 ? 'deadLetter' : 'lost';
    count[where]++;
    jobs[key] = { state, where, runs: await runsOf(ctx, key), deadLetters: dl.length, dlAttempts: dl.map((j) => j.data.attempts), failedReason };
  }
  return { count, jobs };
}

/** The assertions every fault scenario shares, from its `expect`. */
function assertTally(t, { count, jobs }, expect, window, { ended = true } = {}) {
  t.diagnostic(`tally: ${JSON.stringify(count)}; runs ${JSON.stringify(Object.values(jobs).map((j) => j.runs))}; window ${window}`);
  assert.equal(count.lost, expect.jobsLost, `lost jobs: ${JSON.stringify(jobs)}`);
  if (ended) assert.equal(count.pending, 0, `jobs not ended: ${JSON.stringify(jobs)}`);
  assert.equal(expect.runsAtMost, 'maxAttempts+window');
  for (const [key, j] of Object.entries(jobs)) {
    assert.ok(j.runs <= MAX_ATTEMPTS + window, `${key}: ${j.runs} runs, over ${MAX_ATTEMPTS}+${window}`);
    if (j.where === 'deadLetter') assert.equal(j.deadLetters, expect.deadLettersPerGiveUp, `${key}: one dead letter per give-up`);
    if (j.where === 'completed' && expect.completedNotDeadLettered) assert.equal(j.deadLetters, 0, `${key}: completed and dead-lettered`);
  }
}

const ended = (ctx, keys, timeoutMs = 90_000) =>
  waitFor(`${keys.length} jobs to end`, async () => {
    for (const key of keys) if (PENDING.has(await ctx.queue(QUEUE).getJobState(key))) return false;
    return true;
  }, { timeoutMs, intervalMs: 100 });

/** A Redis ACL user for the workers; `refuseDeadLetters` makes the dead-letter queue read-only for it. */
async function workerUser(ctx) {
  await ctx.admin.call('ACL', 'SETUSER', 'worker', 'reset', 'on', '>worker-pw', '~*', '&*', '+@all');
  const u = new URL(ctx.redisUrl);
  u.username = 'worker';
  u.password = 'worker-pw';
  return {
    url: u.toString(),
    refuseDeadLetters: () => ctx.admin.call('ACL', 'SETUSER', 'worker', 'resetkeys', `~bull:${QUEUE}*`, '~rebound-e2e:*', `%R~bull:${DEAD}*`),
    allow: () => ctx.admin.call('ACL', 'SETUSER', 'worker', 'resetkeys', '~*'),
  };
}

// ---------------------------------------------------------------------------------------

scenario('gives-up-twice', 'bullmq', 'retried from the failed set, or its key enqueued again, a job that gives up again gets a second dead letter', async (t, expect, window) => {
  const ctx = await setup(t);
  const w = await ctx.worker();
  const retried = uniqueKey('twice-retry');
  const readded = uniqueKey('twice-readd');
  // Retried too, with the record of a pending give-up left behind as if clearing it had
  // failed after its dead letter was written: stale, so it must not stand for the new give-up.
  const stale = uniqueKey('twice-stale');
  const keys = [retried, readded, stale];
  for (const key of keys) await ctx.add({ failRuns: -1 }, { key });
  const deadEvents = () => ctx.events.of('deadLetter').length;
  await ctx.events.until('three give-ups', () => deadEvents() === 3);
  await ended(ctx, keys);
  const [first] = (await deadLetters(ctx)).get(stale);
  const marker = JSON.stringify({ deadLetterQueue: DEAD, id: first.id, payload: first.data });
  await ctx.admin.hset(ctx.queue(QUEUE).toKey(stale), 'rebound:giveUp', marker);
  // The library's own retry of a failed job; and the same key enqueued again once the failed job is removed.
  await (await Job.fromId(ctx.queue(QUEUE), retried)).retry('failed');
  await (await Job.fromId(ctx.queue(QUEUE), stale)).retry('failed');
  await (await Job.fromId(ctx.queue(QUEUE), readded)).remove();
  await ctx.add({ failRuns: -1 }, { key: readded });
  await ctx.events.until('six give-ups', () => deadEvents() === 6);
  await ended(ctx, keys);
  await sleep(300);
  const { count, jobs } = await tally(ctx, keys);
  t.diagnostic(JSON.stringify(jobs));
  assert.equal(count.lost, expect.jobsLost);
  for (const key of keys) assert.equal(jobs[key].deadLetters, expect.deadLetters, `${key}: a dead letter per give-up`);
  // Retried: one more run (BullMQ keeps its attempts count); enqueued again: maxAttempts more.
  assert.equal(jobs[retried].runs, MAX_ATTEMPTS + 1);
  assert.equal(jobs[stale].runs, MAX_ATTEMPTS + 1);
  assert.equal(jobs[readded].runs, 2 * MAX_ATTEMPTS);
  assert.equal(w.rebound.metrics().deadLettered, 6, 'the counter counts dead letters that exist');
  assert.equal(await ctx.queue(DEAD).count(), 6);
  assert.ok(window >= 0);
});

scenario('remove-on-fail-dead-letter-refused', 'bullmq', 'removeOnFail and the dead-letter write refused: the job is kept, and dead-lettered once allowed', async (t, expect, window) => {
  const ctx = await setup(t);
  const user = await workerUser(ctx);
  await user.refuseDeadLetters();
  const w = await ctx.worker({ redisUrl: user.url });
  const keys = [uniqueKey('rof-a'), uniqueKey('rof-b')];
  for (const key of keys) await ctx.add({ failRuns: -1 }, { key, removeOnFail: true });
  await ctx.events.until('refused dead-letter writes', (e) => keys.every((k) => e.of('hookError', k).some((h) => h.where === 'deadLetter')));
  await sleep(500);
  const refused = await tally(ctx, keys);
  t.diagnostic(`while refused: ${JSON.stringify(refused.jobs)}`);
  assert.equal(refused.count.lost, expect.jobsLost, 'kept while the dead-letter write is refused');
  assert.equal(ctx.events.of('deadLetter').length, 0, 'no dead-letter event for a refused write');
  assert.equal(w.rebound.metrics().deadLettered, 0, 'not counted as dead-lettered');
  await user.allow();
  await ended(ctx, keys);
  await sleep(300);
  const done = await tally(ctx, keys);
  assertTally(t, done, expect, window);
  for (const key of keys) {
    assert.equal(done.jobs[key].deadLetters, expect.deadLettersAfterAllowed);
    assert.equal(done.jobs[key].state, 'unknown', 'removed (removeOnFail) once its dead letter exists');
  }
  assert.equal(w.rebound.metrics().deadLettered, keys.length);
});

scenario('dead-letter-write-refused', 'bullmq', 'the dead-letter write refused by a Redis ACL: never counted while refused, one dead letter once allowed, no extra run', async (t, expect, window) => {
  const ctx = await setup(t);
  const user = await workerUser(ctx);
  await user.refuseDeadLetters();
  const w = await ctx.worker({ redisUrl: user.url });
  const keys = [uniqueKey('refused-a'), uniqueKey('refused-b'), uniqueKey('refused-c')];
  const ok = uniqueKey('refused-ok');
  for (const key of keys) await ctx.add({ failRuns: -1 }, { key });
  await ctx.add({ failRuns: 2 }, { key: ok });
  await ctx.events.until('refused dead-letter writes', (e) => keys.every((k) => e.of('hookError', k).some((h) => h.where === 'deadLetter')));
  await sleep(1000); // several retries of the give-up while refused
  const refused = await tally(ctx, [...keys, ok]);
  t.diagnostic(`while refused: ${JSON.stringify(refused.count)}`);
  assert.equal(refused.count.lost, expect.jobsLost);
  assert.equal(expect.neverCountedAsDeadLetteredWhileRefused, true);
  assert.equal(ctx.events.of('deadLetter').length, 0);
  assert.equal(w.rebound.metrics().deadLettered, 0);
  assert.equal(await ctx.queue(DEAD).count(), 0);
  await user.allow();
  await ended(ctx, [...keys, ok]);
  await sleep(300);
  const done = await tally(ctx, [...keys, ok]);
  assertTally(t, done, expect, window);
  for (const key of keys) {
    assert.deepEqual([done.jobs[key].state, done.jobs[key].deadLetters], ['failed', expect.deadLettersAfterAllowed], key);
    assert.equal(done.jobs[key].failedReason, `run ${MAX_ATTEMPTS} of ${key} failed on purpose`, 'the give-up\'s own error');
    assert.deepEqual(done.jobs[key].dlAttempts, [MAX_ATTEMPTS]);
  }
  assert.equal(done.jobs[ok].where, 'completed');
  assert.equal(w.rebound.metrics().deadLettered, keys.length);
});

scenario('killed-between-dead-letter-and-ack', 'bullmq', 'SIGKILL after the dead-letter write, before the move to the failed set: one dead letter', async (t, expect, window) => {
  const ctx = await setup(t);
  const a = ctx.spawnWorker({ killOn: 'deadLetter' });
  await a.ready();
  const key = uniqueKey('kill-ack');
  await ctx.add({ failRuns: -1 }, { key });
  const status = await a.exited;
  assert.equal(status.signal, 'SIGKILL');
  assert.equal(await ctx.queue(QUEUE).getJobState(key), 'active', 'unacknowledged');
  assert.equal((await deadLetters(ctx)).get(key)?.length, 1, 'the dead letter was written');
  const b = ctx.spawnWorker();
  await b.ready();
  await ended(ctx, [key]);
  await sleep(300);
  const result = await tally(ctx, [key]);
  assertTally(t, result, expect, window);
  assert.equal(result.jobs[key].state, 'failed');
  assert.equal(result.jobs[key].deadLetters, expect.deadLetters);
});

scenario('killed-on-every-run', 'bullmq', 'every run SIGKILLs its worker: the killed runs count, the job is dead-lettered after maxAttempts runs', async (t, expect, window) => {
  const ctx = await setup(t);
  const key = uniqueKey('oom');
  await ctx.add({ killWorker: true }, { key });
  let spawned = 0;
  while (PENDING.has(await ctx.queue(QUEUE).getJobState(key))) {
    assert.ok(spawned < MAX_ATTEMPTS + window + 3, `still ${await ctx.queue(QUEUE).getJobState(key)} after ${spawned} workers`);
    const w = ctx.spawnWorker();
    spawned++;
    // Either the run kills it, or the job ends without a run (given up at start).
    await Promise.race([w.exited, waitFor('the job to end', async () => !PENDING.has(await ctx.queue(QUEUE).getJobState(key)), { timeoutMs: 30_000, intervalMs: 100 })]);
  }
  await sleep(300);
  const result = await tally(ctx, [key]);
  t.diagnostic(`${spawned} worker processes`);
  assertTally(t, result, expect, window);
  const j = result.jobs[key];
  assert.equal(expect.finalState, 'deadLetter');
  assert.equal(j.where, 'deadLetter');
  assert.ok(j.runs <= MAX_ATTEMPTS + window, `ends within ${MAX_ATTEMPTS}+${window} runs`);
  assert.equal(expect.everyUnansweredRunCounted, true);
  assert.equal(j.runs, MAX_ATTEMPTS, 'every killed run counted');
  assert.equal(expect.deadLetterAttemptsEqualsRuns, true);
  assert.deepEqual(j.dlAttempts, [j.runs]);
});

scenario('killed-while-deciding', 'bullmq', 'sidecar hung and the worker SIGKILLed while its hook waits: the run counts, nothing lost', async (t, expect, window) => {
  const ctx = await setup(t);
  // A deadline longer than the test's wait, so the hook is still waiting when the worker dies.
  const a = ctx.spawnWorker({ rebound: { deadlineMs: 60_000 } });
  await a.ready();
  const key = uniqueKey('deciding');
  process.kill(sidecar.proc.pid, 'SIGSTOP');
  ctx.cleanups.push(async () => process.kill(sidecar.proc.pid, 'SIGCONT'));
  try {
    await ctx.add({ failRuns: -1 }, { key });
    await waitFor('the first run', async () => (await runsOf(ctx, key)) === 1);
    await sleep(500); // the run failed; the hook waits for the sidecar
    a.child.kill('SIGKILL');
    await a.exited;
  } finally {
    process.kill(sidecar.proc.pid, 'SIGCONT');
  }
  const b = ctx.spawnWorker();
  await b.ready();
  await ended(ctx, [key]);
  await sleep(300);
  const result = await tally(ctx, [key]);
  assertTally(t, result, expect, window);
  assert.equal(expect.everyUnansweredRunCounted, true);
  assert.equal(result.jobs[key].runs, MAX_ATTEMPTS, 'the run killed while deciding counts');
  assert.deepEqual(result.jobs[key].dlAttempts, [MAX_ATTEMPTS]);
});

scenario('replay-after-crashes', 'bullmq', 'runs killed, then given up; the README\'s replay runs it once more under the same id', async (t, expect, window) => {
  const ctx = await setup(t);
  const key = uniqueKey('replay');
  // Runs 1 and 2 kill their worker; run 3 fails; a later run succeeds.
  await ctx.add({ killFirstRuns: 2, failFirstRuns: 3 }, { key });
  for (let i = 0; i < 2; i++) {
    const w = ctx.spawnWorker();
    await w.exited;
  }
  const w = await ctx.worker(LOCKS);
  await ended(ctx, [key]);
  const before = await tally(ctx, [key]);
  assertTally(t, before, expect, window);
  assert.equal(before.jobs[key].runs, MAX_ATTEMPTS);
  const [dl] = (await deadLetters(ctx)).get(key);
  // README: `await rebound.bullmq.replay(deadLetterJob, sourceQueue)`.
  const replayed = await w.rebound.bullmq.replay(dl, ctx.queue(QUEUE));
  assert.equal(expect.sameJobId, String(replayed.job.id) === key);
  await waitFor('completed', async () => (await ctx.queue(QUEUE).getJobState(key)) === 'completed');
  assert.equal((await runsOf(ctx, key)) - MAX_ATTEMPTS, expect.replayRuns);
  assert.equal((await deadLetters(ctx)).get(key), undefined, 'the dead letter is removed');
});

scenario('sidecar-hung', 'bullmq', 'the sidecar SIGSTOPped for 20 s while 80 jobs fail: the fallback decides, none lost', async (t, expect, window) => {
  const ctx = await setup(t);
  const w = await ctx.worker({ concurrency: 8, rebound: { deadlineMs: 250 } });
  await waitFor('the prefetched policy', async () => w.rebound.policies.has(QUEUE));
  const keys = Array.from({ length: 80 }, (_, i) => uniqueKey(`hung-${i}`));
  const stoppedAt = Date.now();
  process.kill(sidecar.proc.pid, 'SIGSTOP');
  try {
    for (const [i, key] of keys.entries()) await ctx.add(i % 8 === 0 ? { failRuns: 1 } : { failRuns: -1 }, { key });
    await Promise.race([ended(ctx, keys, 20_000).catch(() => {}), sleep(20_000)]);
    await sleep(Math.max(0, 20_000 - (Date.now() - stoppedAt)));
  } finally {
    process.kill(sidecar.proc.pid, 'SIGCONT');
  }
  await ended(ctx, keys);
  await sleep(300);
  const result = await tally(ctx, keys);
  assertTally(t, result, expect, window);
  const during = ctx.events.of('decision').filter((d) => d.t < stoppedAt + 20_000);
  assert.ok(during.length >= keys.length, `${during.length} answers while hung`);
  assert.ok(during.every((d) => d.source === expect.source), 'every answer while hung from the fallback');
  assert.equal(result.count.deadLetter, 70);
  assert.equal(result.count.completed, 10);
});

scenario('paused-past-every-timeout', 'bullmq', 'a worker SIGSTOPped past the lock and stalled interval, then SIGCONT: none lost, a completed job never dead-lettered', async (t, expect, window) => {
  const ctx = await setup(t);
  const a = ctx.spawnWorker({ concurrency: 4 });
  await a.ready();
  const failing = [uniqueKey('paused-a'), uniqueKey('paused-b'), uniqueKey('paused-c')];
  const lastRun = uniqueKey('paused-last');
  for (const key of failing) await ctx.add({ failRuns: -1, workMs: 5000 }, { key });
  // The succeeding job is on its last attempt (BullMQ's count set before it is taken): its
  // run in the paused worker fails, the run that replaces it succeeds.
  await ctx.add({ failFirstRuns: 1, workMs: 5000 }, { key: lastRun, delay: 1000 });
  await ctx.admin.hset(ctx.queue(QUEUE).toKey(lastRun), 'atm', String(MAX_ATTEMPTS - 1));
  const keys = [...failing, lastRun];
  await waitFor('the paused worker to run all four', async () => (await Promise.all(keys.map((k) => runsOf(ctx, k)))).every((n) => n === 1));
  a.child.kill('SIGSTOP');
  const b = ctx.spawnWorker({ concurrency: 4 });
  await b.ready();
  await sleep(LOCKS.lockDurationMs + 3 * LOCKS.stalledIntervalMs + 2000);
  a.child.kill('SIGCONT');
  await ended(ctx, keys);
  await sleep(1000); // the resumed worker's late answers
  const result = await tally(ctx, keys);
  assertTally(t, result, expect, window);
  assert.equal(result.jobs[lastRun].where, 'completed');
  for (const key of failing) assert.equal(result.jobs[key].where, 'deadLetter');
  // The resumed worker's give-up of the job that completed elsewhere: refused by the lock check.
  assert.ok(ctx.events.of('hookError', lastRun).some((h) => h.where === 'lockLost' && h.worker === a.index), 'the paused run wrote no dead letter');
});

scenario('broker-out-of-memory', 'bullmq', 'Redis at maxmemory (noeviction) while jobs fail and give up, then freed: none lost, one dead letter each', async (t, expect, window) => {
  const ctx = await setup(t);
  await ctx.worker({ concurrency: 4, ...LOCKS });
  const keys = Array.from({ length: 12 }, (_, i) => uniqueKey(`oom-${i}`));
  for (const key of keys) await ctx.add({ failRuns: -1, workMs: 50 }, { key });
  await waitFor('first failures', async () => (await runsOf(ctx, keys[0])) >= 1);
  const used = Number(/used_memory:(\d+)/.exec(await ctx.admin.info('memory'))[1]);
  await ctx.admin.config('SET', 'maxmemory-policy', 'noeviction');
  await ctx.admin.config('SET', 'maxmemory', String(used));
  await sleep(4000);
  await ctx.admin.config('SET', 'maxmemory', '0');
  await ended(ctx, keys);
  await sleep(500);
  const result = await tally(ctx, keys);
  assertTally(t, result, expect, window);
  // The job's own run count is a Redis write, refused while Redis is full: the worker's
  // starts of the job (events of the in-process worker) bound the runs instead.
  const starts = keys.map((key) => ctx.events.of('start', key).length);
  t.diagnostic(`starts per job: ${JSON.stringify(starts)}; dead-letter attempts: ${JSON.stringify(keys.map((k) => result.jobs[k].dlAttempts))}`);
  for (const [i, key] of keys.entries()) {
    assert.ok(starts[i] <= MAX_ATTEMPTS + window, `${key}: ${starts[i]} starts`);
    assert.deepEqual(result.jobs[key].dlAttempts, [MAX_ATTEMPTS], `${key}: given up at the policy's last attempt`);
  }
});

scenario('commit-reply-lost', 'bullmq', 'a proxy drops the reply to the give-up write after Redis applied it: one dead letter', async (t, expect, window) => {
  const ctx = await setup(t);
  const redisPort = Number(new URL(ctx.redisUrl).port);
  const key = uniqueKey('reply-lost');
  // The proxy forwards both ways. After each give-up write it waits until Redis applied it,
  // then closes both connections instead of forwarding the reply, once each: the script
  // call adding the dead letter (it names the dead-letter queue's keys), then the one moving
  // the job to the failed set (it carries the last run's error, and names no dead-letter key).
  const lastError = `run ${MAX_ATTEMPTS} of ${key} failed on purpose`;
  const writes = [(text) => text.includes(`bull:${DEAD}:`), (text) => text.includes(lastError) && !text.includes(`bull:${DEAD}:`)];
  const dropped = writes.map(() => 0);
  const sockets = new Set();
  const proxy = net.createServer((client) => {
    const upstream = net.connect({ host: '127.0.0.1', port: redisPort });
    sockets.add(client).add(upstream);
    let dropping = false;
    let sent = ''; // what the client sent since the last reply
    client.on('data', (buf) => {
      sent += buf.toString('latin1');
      const i = writes.findIndex((matches, n) => dropped[n] === 0 && matches(sent));
      if (i >= 0) {
        dropped[i]++;
        dropping = true;
      }
      upstream.write(buf);
    });
    upstream.on('data', (buf) => {
      if (dropping) {
        client.destroy();
        upstream.destroy();
        return;
      }
      sent = '';
      client.write(buf);
    });
    const close = () => {
      client.destroy();
      upstream.destroy();
    };
    client.on('error', close).on('close', close);
    upstream.on('error', close).on('close', close);
  });
  await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  ctx.cleanups.push(async () => {
    for (const s of sockets) s.destroy();
    await new Promise((resolve) => proxy.close(resolve));
  });
  const w = await ctx.worker({ redisUrl: `redis://127.0.0.1:${proxy.address().port}` });
  await ctx.add({ failRuns: -1 }, { key });
  await ended(ctx, [key]);
  await sleep(500);
  assert.deepEqual(dropped, [1, 1], 'the replies to the dead-letter write and to the move to the failed set were dropped');
  const result = await tally(ctx, [key]);
  assertTally(t, result, expect, window);
  assert.equal(result.jobs[key].deadLetters, expect.deadLetters);
  assert.ok(w.rebound.metrics().deadLettered <= 1);
});
