'use strict';
// The hook with real BullMQ and Bull workers on a real Redis (dev/redis.sh), asking a
// real grpc-js RetryAdvisor server whose answers the test sets per queue: the attempts
// the libraries pass, the first-failure time kept in the job's hash, the dead-letter
// record (written once), drop, and the library's own attempt limit never deciding.
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { Queue, Worker, Job } = require('bullmq');
const Bull = require('bull');
const { createRebound, LIBRARY_ATTEMPTS } = require('../..');
const { FIRST_FAILURE_FIELD, deadLetterJobId } = require('../../lib/hook');
const { startAdvisor } = require('./advisor-server');
const { startRedis, eventually } = require('./redis');

const REF = { name: 'p', namespace: 'ns', generation: '1', config_hash: 'sha256:c' };
const retry = (ms) => ({ decision: 'DECISION_RETRY', delay_ms: String(ms), policy: REF });
const giveUp = (disposition, dlq, reason = 'GIVE_UP_REASON_MAX_ATTEMPTS') => ({
  decision: 'DECISION_GIVE_UP',
  disposition,
  dead_letter_queue: dlq,
  reason,
  reason_message: 'attempt 4 of 4 failed (maxAttempts)',
  policy: REF,
});

/** queue → (request) → answer: retry 20 ms until `last`, then `end`. */
const plans = new Map();
let redis;
let server;

before(async () => {
  redis = startRedis();
  server = await startAdvisor({ decide: (req) => plans.get(req.queue)(req) });
});
after(async () => {
  await server.close();
  redis.stop();
});

function failing(runs) {
  return async (job) => {
    if (runs < 0 || job.attemptsMade < runs) {
      const e = new Error(`run ${job.attemptsMade + 1} failed`);
      e.name = 'TransientError';
      throw e;
    }
    return 'ok';
  };
}

test('BullMQ: attempts 1..4, one first-failure time, dead letter written once, failed set', async () => {
  plans.set('mq-dead', (req) => (req.attempt < 4 ? retry(20) : giveUp('DISPOSITION_DEAD_LETTER', 'mq-dead-dlq')));
  const rebound = createRebound({ target: server.target, logger: false });
  const queue = new Queue('mq-dead', { connection: redis.connection });
  const dlq = new Queue('mq-dead-dlq', { connection: redis.connection });
  const worker = new Worker('mq-dead', failing(-1), { connection: redis.connection, settings: rebound.bullmq.settings() });
  try {
    const { job, key } = await rebound.bullmq.add(queue, 'charge', { amount: 42 });
    assert.equal(job.id, key);
    assert.equal(job.opts.attempts, LIBRARY_ATTEMPTS);
    assert.deepEqual(job.opts.backoff, { type: 'rebound' });
    await eventually(async () => (await queue.getJobState(key)) === 'failed', 20000, 'failed state');
    const requests = server.requests.Decide.filter((r) => r.queue === 'mq-dead');
    assert.deepEqual(requests.map((r) => r.attempt), [1, 2, 3, 4]);
    assert.deepEqual(new Set(requests.map((r) => r.job_id)), new Set([key]));
    assert.equal(new Set(requests.map((r) => r.first_failure_unix_ms)).size, 1);
    const client = await queue.getBackend().client;
    assert.equal(await client.hget(queue.toKey(key), FIRST_FAILURE_FIELD), requests[0].first_failure_unix_ms);

    // One give-up, one dead letter: its id names the queue, the key and the give-up.
    const [dead, ...more] = (await dlq.getJobs(['wait'])).filter((j) => j.data.key === key);
    assert.equal(more.length, 0);
    assert.equal(dead.id, deadLetterJobId('mq-dead', key, `${job.timestamp}.4`));
    assert.ok(dead, 'dead-letter job');
    assert.equal(dead.name, 'charge');
    assert.deepEqual(
      { ...dead.data, deadLetteredAtUnixMs: 0 },
      {
        format: 'rebound.dev/dead-letter/v1',
        sourceQueue: 'mq-dead',
        sourceJobId: key,
        name: 'charge',
        data: { amount: 42 },
        key,
        attempt: 4,
        attempts: 4,
        reason: 'GIVE_UP_REASON_MAX_ATTEMPTS',
        reasonMessage: 'attempt 4 of 4 failed (maxAttempts)',
        error: { name: 'TransientError', message: 'run 4 failed', class: 'TransientError' },
        firstFailureUnixMs: Number(requests[0].first_failure_unix_ms),
        deadLetteredAtUnixMs: 0,
        policy: { name: 'p', namespace: 'ns', generation: '1', configHash: 'sha256:c' },
        source: 'sidecar',
      },
    );
    const failed = await Job.fromId(queue, key);
    assert.equal(failed.attemptsMade, 4);
    assert.equal(failed.failedReason, 'run 4 failed');

    // The hook asked again for the same failure: the same answer, still one dead letter.
    const err = Object.assign(new Error('run 4 failed'), { name: 'TransientError' });
    assert.equal(await rebound.bullmq.backoffStrategy(4, 'rebound', err, failed), -1);
    assert.equal(await dlq.count(), 1);
    assert.equal(rebound.metrics().deadLettered, 2); // counted per hook call; one job

    // Replay: the same key back on the source queue, the dead-letter job gone; the worker
    // runs it again (and the policy sends it to the dead-letter queue again).
    await worker.pause();
    const replayed = await rebound.bullmq.replay(dead, queue);
    assert.equal(replayed.key, key);
    assert.equal(replayed.job.id, key);
    assert.deepEqual(replayed.job.data, { amount: 42 });
    assert.equal(await queue.getJobState(key), 'waiting');
    assert.equal(await dlq.count(), 0);
    await assert.rejects(rebound.bullmq.replay({ data: { format: 'x' } }, queue), /^TypeError: deadLetterJob:/);
  } finally {
    await worker.close();
    await rebound.close();
    await queue.obliterate({ force: true });
    await dlq.obliterate({ force: true });
    await queue.close();
    await dlq.close();
  }
});

test('BullMQ: the first-failure time survives a new process (read back from the job hash)', async () => {
  plans.set('mq-ff', () => retry(60000));
  const a = createRebound({ target: server.target, logger: false });
  const b = createRebound({ target: server.target, logger: false }); // another process: empty memory
  const queue = new Queue('mq-ff', { connection: redis.connection });
  const worker = new Worker('mq-ff', failing(-1), { connection: redis.connection, settings: a.bullmq.settings() });
  try {
    const { key } = await a.bullmq.add(queue, 'x', {});
    await eventually(async () => (await queue.getJobState(key)) === 'delayed', 20000, 'delayed');
    await worker.close();
    const job = await Job.fromId(queue, key);
    await b.bullmq.backoffStrategy(2, 'rebound', new Error('again'), job);
    const [first, second] = server.requests.Decide.filter((r) => r.queue === 'mq-ff');
    assert.equal(first.attempt, 1);
    assert.equal(second.attempt, 2);
    assert.equal(second.first_failure_unix_ms, first.first_failure_unix_ms);
  } finally {
    await a.close();
    await b.close();
    await queue.obliterate({ force: true });
    await queue.close();
  }
});

test('BullMQ: drop leaves the job in the failed set; dropRemoves: true (opt-in) removes it', async () => {
  plans.set('mq-drop', () => giveUp('DISPOSITION_DROP', '', 'GIVE_UP_REASON_NON_RETRYABLE'));
  for (const dropRemoves of [undefined, false, true]) {
    const rebound = createRebound({ target: server.target, logger: false, dropRemoves });
    const queue = new Queue('mq-drop', { connection: redis.connection });
    const failedIds = [];
    const worker = new Worker('mq-drop', failing(-1), { connection: redis.connection, settings: rebound.bullmq.settings() });
    worker.on('failed', (job) => failedIds.push(job.id));
    try {
      const { key } = await rebound.bullmq.add(queue, 'x', {});
      await eventually(() => failedIds.includes(key), 20000, 'failed event');
      const state = await queue.getJobState(key);
      assert.equal(state, dropRemoves ? 'unknown' : 'failed', `dropRemoves ${dropRemoves}`);
      if (!dropRemoves) assert.equal((await Job.fromId(queue, key)).failedReason, 'run 1 failed');
      assert.equal(rebound.metrics().dropped, 1);
      // A non-retryable give-up at the first failure: one run, one question.
      assert.equal(server.requests.Decide.filter((r) => r.queue === 'mq-drop' && r.job_id === key).length, 1);
    } finally {
      await worker.close();
      await rebound.close();
      await queue.obliterate({ force: true });
      await queue.close();
    }
  }
});

test('Bull 4: attempts 1..3 with the job id from backoff.options, dead letter, drop keeps the job failed', async () => {
  plans.set('bull-dead', (req) => (req.attempt < 3 ? retry(20) : giveUp('DISPOSITION_DEAD_LETTER', 'bull-dead-dlq')));
  plans.set('bull-drop', () => giveUp('DISPOSITION_DROP', ''));
  const rebound = createRebound({ target: server.target, logger: false });
  const dead = rebound.bull.attach(new Bull('bull-dead', redis.url));
  const drop = rebound.bull.attach(new Bull('bull-drop', redis.url));
  const dlq = new Bull('bull-dead-dlq', redis.url);
  dead.process(failing(-1));
  drop.process(failing(-1));
  try {
    const { job, key } = await rebound.bull.add(dead, 'bill', { n: 7 });
    assert.equal(job.id, key);
    assert.equal(job.opts.attempts, LIBRARY_ATTEMPTS);
    await eventually(async () => (await dead.getJob(key))?.finishedOn, 20000, 'bull job failed');
    const requests = server.requests.Decide.filter((r) => r.queue === 'bull-dead');
    assert.deepEqual(requests.map((r) => r.attempt), [1, 2, 3]);
    assert.deepEqual(new Set(requests.map((r) => r.job_id)), new Set([key]));
    assert.equal(new Set(requests.map((r) => r.first_failure_unix_ms)).size, 1);
    assert.equal(await (await dead.getJob(key)).getState(), 'failed');
    const record = await dlq.getJob(deadLetterJobId('bull-dead', key, `${job.timestamp}.3`));
    assert.ok(record, 'dead-letter job');
    assert.equal(record.name, 'bill');
    assert.deepEqual(record.data.data, { n: 7 });
    assert.equal(record.data.key, key);
    assert.equal(record.data.attempt, 3);
    assert.equal(record.data.reason, 'GIVE_UP_REASON_MAX_ATTEMPTS');

    const dropped = await rebound.bull.add(drop, 'x', {});
    await eventually(() => rebound.metrics().dropped === 1, 20000, 'drop');
    await eventually(async () => (await (await drop.getJob(dropped.key))?.getState()) === 'failed', 20000, 'dropped job in the failed set');
    await new Promise((r) => setTimeout(r, 200)); // the 'failed' listener had its chance to remove it
    assert.equal(await (await drop.getJob(dropped.key)).getState(), 'failed');
  } finally {
    await rebound.close();
    for (const q of [dead, drop, dlq]) {
      await q.obliterate({ force: true });
      await q.close();
    }
  }
});

test('Bull 4: a start sent again after a lost reply counts once', async () => {
  const { countStart } = require('../../lib/bull');
  const Redis = require('ioredis');
  const client = new Redis(redis.connection);
  const key = 'bull:count-start:1';
  try {
    // ioredis sends a command again when Redis closed the connection before replying; the
    // same start arriving twice must not cost the job a run.
    assert.equal(await countStart(client, key, 'start-a'), 1);
    assert.equal(await countStart(client, key, 'start-a'), 1);
    assert.equal(await countStart(client, key, 'start-b'), 2);
    assert.equal(await client.hget(key, 'rebound:starts'), '2');
  } finally {
    client.disconnect();
  }
});
