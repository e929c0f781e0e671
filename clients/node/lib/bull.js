'use strict';
// Bull 4: `settings.backoffStrategies[type](attemptsMade, err, options)`, called after the
// failure was counted (1-based), with `options` = the job's `backoff.options`; no job and
// no queue are passed, so the adapter attaches to the queue and the job id travels in
// `backoff.options`. Returning -1 sends the job to the failed set.

const { randomUUID } = require('node:crypto');
const { runHook, replayDeadLetter, PENDING_FIELD } = require('./hook');
const { BACKOFF_TYPE, newKey } = require('./bullmq');

/** The job-hash field counting the job's starts (Bull 4 has no attemptsStarted). */
const STARTS_FIELD = 'rebound:starts';
/** The job-hash field holding the id of the start counted last. */
const LAST_START_FIELD = 'rebound:lastStart';

// Counts a start once: ioredis sends a command again when Redis went away before its reply,
// and a plain HINCRBY sent twice would count one start as two (and cost the job a run).
const COUNT_START = `if redis.call('HGET', KEYS[1], ARGV[2]) == ARGV[3] then
  return tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)`;

/** Adds the start `startId` to the job hash `key`'s count, once however often it is sent. */
function countStart(client, key, startId) {
  return client.eval(COUNT_START, 1, key, STARTS_FIELD, LAST_START_FIELD, startId);
}

function createBullAdapter(rebound) {
  const deadLetterQueues = new Map();
  rebound.closers.push(async () => {
    await Promise.allSettled([...deadLetterQueues.values()].map((q) => q.close()));
  });

  function deadLetterQueue(queue, name) {
    const id = `${queue.keyPrefix}\u0000${name}`;
    let q = deadLetterQueues.get(id);
    if (!q) {
      const { host, port, db, password, username, path, tls, family } = queue.client.options;
      // The same Redis and prefix as the source queue, through Bull's own constructor.
      const Queue = queue.constructor;
      q = new Queue(name, {
        redis: { host, port, db, password, username, path, tls, family },
        prefix: queue.keyPrefix,
      });
      q.on('error', (e) => rebound.hookError(name, '', 'deadLetterQueue', e, 'bull'));
      deadLetterQueues.set(id, q);
    }
    return q;
  }

  function attach(queue) {
    const drops = new Set();
    queue.settings.backoffStrategies = {
      ...queue.settings.backoffStrategies,
      [BACKOFF_TYPE]: (attemptsMade, err, options) => {
        const jobId = options && options.jobId !== undefined ? String(options.jobId) : '';
        return runHook(rebound, {
        adapter: 'bull',
          queue: queue.name,
          jobId,
          attemptsMade,
          // Runs cut short by a dead worker: stalls Bull counted (`stalledCounter`) that led to
          // another start (counted by the 'active' listener below, this run included).
          stalledRuns: async (failures) => {
            if (jobId === '') return 0;
            const [stalled, started] = await queue.client.hmget(queue.toKey(jobId), 'stalledCounter', STARTS_FIELD);
            return Math.min(Number(stalled) || 0, Math.max(0, (Number(started) || 0) - failures));
          },
          err,
          // name and data are read from Redis only if the job is dead-lettered
          redis: jobId === '' ? null : bullJobHash(queue, jobId),
          // Bull's failure count at this give-up, of this enqueue of the key (hook.js).
          giveUpId: async () => `${await queue.client.hget(queue.toKey(jobId), 'timestamp')}.${attemptsMade}`,
          pending: jobId === '' ? undefined : {
            get: () => queue.client.hget(queue.toKey(jobId), PENDING_FIELD),
            set: (value) => queue.client.hset(queue.toKey(jobId), PENDING_FIELD, value),
            clear: () => queue.client.hdel(queue.toKey(jobId), PENDING_FIELD),
          },
          async deadLetter(dlq, dlqJobId, payload) {
            // The hook sees no job: read its name and data from Redis.
            const job = await queue.getJob(jobId);
            if (job) {
              payload.name = job.name;
              payload.data = job.data;
            }
            await deadLetterQueue(queue, dlq).add(payload.name || 'dead-letter', payload, {
              jobId: dlqJobId,
              removeOnComplete: false,
              removeOnFail: false,
            });
          },
          async drop() {
            // Bounded: an entry whose 'failed' event never comes is forgotten eventually.
            if (drops.size >= 10000) drops.delete(drops.values().next().value);
            drops.add(jobId);
            return true;
          },
        });
      },
    };
    // Every start of a job by this queue instance, counted in the job's hash (Bull keeps
    // no such count): a stalled run that was started again counts as a run.
    queue.on('active', (job) => {
      if (!job || job.id === undefined) return;
      countStart(queue.client, queue.toKey(job.id), randomUUID()).catch((e) => rebound.hookError(queue.name, String(job.id), 'starts', e, 'bull'));
    });
    // Bull emits 'failed' on the worker right after its move-to-failed script ran.
    queue.on('failed', (job) => {
      const id = String(job.id);
      if (!drops.delete(id)) return;
      job.remove().catch((e) => rebound.hookError(queue.name, id, 'drop', e, 'bull'));
    });
    // The queue's policy now, before any job fails (the fallback's copy during an outage).
    rebound.prefetch(queue.name, 'bull');
    return queue;
  }

  async function jobOptions(queueName, opts = {}) {
    const key = newKey(opts);
    const { key: _ignored, ...rest } = opts;
    await rebound.warm(queueName);
    return {
      ...rest,
      jobId: key,
      attempts: rebound.libraryAttempts(queueName),
      backoff: { type: BACKOFF_TYPE, options: { jobId: key } },
    };
  }

  async function add(queue, name, data, opts = {}) {
    const jobOpts = await jobOptions(queue.name, opts);
    const job = await queue.add(name, data, jobOpts);
    return { job, key: jobOpts.jobId };
  }

  /** Puts a dead-lettered job back on its source queue with the same key; removes the dead-letter job last. */
  const replay = (deadLetterJob, queue, opts = {}) => replayDeadLetter(add, deadLetterJob, queue, opts);

  return { attach, jobOptions, add, replay };
}

function bullJobHash(queue, jobId) {
  const key = queue.toKey(jobId);
  return {
    hget: (field) => queue.client.hget(key, field),
    hset: (field, value) => queue.client.hset(key, field, value),
  };
}

module.exports = { createBullAdapter, countStart };
