'use strict';
// BullMQ 6: `settings.backoffStrategy(attemptsMade, type, err, job)`, called with the
// 1-based count including the failure being handled, only for jobs with
// `backoff: { type: <custom> }`; returning -1 sends the job to the failed set.

const crypto = require('node:crypto');
const { runHook, replayDeadLetter, withTimeout, WorkerLostError, PendingGiveUpError, PENDING_FIELD, REDIS_TIMEOUT_MS } = require('./hook');

const BACKOFF_TYPE = 'rebound';

/**
 * The application's copy of a peer library: with `npm install <path>` this package is a
 * symlink, and a plain require would resolve from the repository instead.
 */
function requireApp(name) {
  const path = require('node:path');
  const paths = [process.cwd()];
  if (require.main && require.main.filename) paths.unshift(path.dirname(require.main.filename));
  try {
    return require(require.resolve(name, { paths }));
  } catch {
    return require(name);
  }
}

/** `{ hget, hset, hdel, lockHeld }` on the job's Redis keys, or null when the backend is not Redis. */
function jobHash(job) {
  const q = job && job.queue;
  if (!q || typeof q.toKey !== 'function' || typeof q.getBackend !== 'function') return null;
  const key = q.toKey(job.id);
  const client = () => Promise.resolve(q.getBackend().client);
  return {
    async hdel(field) {
      const c = await client();
      if (c && typeof c.hdel === 'function') await c.hdel(key, field);
    },
    /** Whether this run still holds the job's lock (its worker's token); true when unknown. */
    async lockHeld() {
      const c = await client();
      if (!job.token || !c || typeof c.get !== 'function') return true;
      return (await c.get(`${key}:lock`)) === job.token;
    },
    async hget(field) {
      const c = await client();
      return c && typeof c.hget === 'function' ? c.hget(key, field) : null;
    },
    async hset(field, value) {
      const c = await client();
      if (c && typeof c.hset === 'function') await c.hset(key, { [field]: value });
    },
  };
}

function newKey(opts) {
  const key = opts && opts.key !== undefined ? String(opts.key) : crypto.randomUUID();
  if (key === '' || key.includes(':') || /^\d+$/.test(key)) {
    // BullMQ refuses custom ids with ':' and integer ids.
    throw new TypeError(`key: ${JSON.stringify(key)} must be non-empty, not an integer and without ':'`);
  }
  return key;
}

function createBullMQAdapter(rebound) {
  const deadLetterQueues = new Map();

  function deadLetterQueue(job, name) {
    if (!job || !job.queue || !job.queue.opts || !job.queue.opts.connection) {
      throw new Error('the job carries no queue connection to reach the dead-letter queue');
    }
    const opts = job.queue.opts;
    const id = `${opts.prefix ?? 'bull'}\u0000${name}`;
    let q = deadLetterQueues.get(id);
    if (!q) {
      const { Queue } = requireApp('bullmq');
      q = new Queue(name, { connection: opts.connection, prefix: opts.prefix });
      q.on('error', (e) => rebound.hookError(name, '', 'deadLetterQueue', e, 'bullmq'));
      deadLetterQueues.set(id, q);
    }
    return q;
  }
  rebound.closers.push(async () => {
    await Promise.allSettled([...deadLetterQueues.values()].map((q) => q.close()));
  });

  /**
   * Pending give-ups this process could not record in Redis (a full Redis refuses the write
   * as it refused the dead letter): kept here too, so the job's next start in this process
   * writes the dead letter instead of running the job again. Bounded.
   */
  const pendingHere = new Map();

  /**
   * The job's pending give-up (hook.js PENDING_FIELD), in its hash or, failing that, in this
   * process. One whose dead letter exists is stale (the clean-up after the write failed) and
   * is cleared, so a later give-up of the job, after `job.retry('failed')`, gets a dead letter
   * of its own and the job runs again first.
   */
  function pendingGiveUp(job, hash) {
    const here = `${job.queueName}\u0000${job.id}\u0000${job.timestamp}`;
    return {
      async get() {
        const text = (await hash.hget(PENDING_FIELD)) || pendingHere.get(here);
        if (!text) return null;
        let marker;
        try {
          marker = JSON.parse(text);
        } catch {
          return text; // unreadable: the hook decides afresh
        }
        let written = false;
        try {
          written = Boolean(marker && marker.deadLetterQueue && marker.id && (await deadLetterQueue(job, marker.deadLetterQueue).getJob(marker.id)));
        } catch (e) {
          rebound.hookError(job.queueName, String(job.id), 'pendingGiveUp', e, 'bullmq'); // unknown: still pending
        }
        if (!written) return text;
        pendingHere.delete(here);
        await hash.hdel(PENDING_FIELD);
        return null;
      },
      async set(value) {
        if (pendingHere.size >= 10000) pendingHere.delete(pendingHere.keys().next().value);
        pendingHere.set(here, value);
        await hash.hset(PENDING_FIELD, value);
      },
      async clear() {
        pendingHere.delete(here);
        await hash.hdel(PENDING_FIELD);
      },
    };
  }

  async function backoffStrategy(attemptsMade, type, err, job) {
    const hash = jobHash(job);
    return runHook(rebound, {
      adapter: 'bullmq',
      queue: job && job.queueName,
      jobId: job && job.id,
      attemptsMade,
      // Runs cut short by a dead worker: stalls BullMQ counted (`stc`) that led to another
      // start (`ats` counts every start, this run included).
      stalledRuns: (failures) => {
        const stalled = job && Number.isInteger(job.stalledCounter) ? job.stalledCounter : 0;
        const started = job && Number.isInteger(job.attemptsStarted) ? job.attemptsStarted : 0;
        return Math.min(stalled, Math.max(0, started - failures));
      },
      err,
      name: job && job.name,
      data: job && job.data,
      redis: hash,
      // BullMQ's failure count at this give-up, of this enqueue of the key: the same for a
      // retried hook call and for the run after a kill, another for every later give-up.
      giveUpId: () => `${job && job.timestamp}.${attemptsMade}`,
      pending: hash && pendingGiveUp(job, hash),
      lockHeld: hash ? () => hash.lockHeld() : undefined,
      async deadLetter(dlq, dlqJobId, payload) {
        // A job id that exists already makes add() a no-op: a repeated call adds nothing.
        await deadLetterQueue(job, dlq).add(payload.name || 'dead-letter', payload, {
          jobId: dlqJobId,
          removeOnComplete: false,
          removeOnFail: false,
        });
      },
      async drop() {
        // BullMQ reads job.opts.removeOnFail after the hook returns, in the same script
        // that moves the job to the failed set: it is removed atomically.
        job.opts.removeOnFail = true;
        return true;
      },
    });
  }

  async function jobOptions(queueName, opts = {}) {
    const key = newKey(opts);
    const { key: _ignored, ...rest } = opts;
    // The first enqueue for a queue fetches its policy (bounded by the deadline, never
    // failing the enqueue); later ones use the cache the background refresh keeps.
    await rebound.warm(queueName);
    return {
      ...rest,
      jobId: key,
      attempts: rebound.libraryAttempts(queueName),
      backoff: { type: BACKOFF_TYPE },
    };
  }

  async function add(queue, name, data, opts = {}) {
    const jobOpts = await jobOptions(queue.name, opts);
    const job = await queue.add(name, data, jobOpts);
    return { job, key: jobOpts.jobId };
  }

  /**
   * Wraps the Worker's processor (a function) so runs that died with their worker (SIGKILL,
   * OOM) end the job too: before the job runs, runs that ended unanswered are counted, and
   * when they used up the policy's attempts the job gives up (dead letter) without running
   * again. A job whose dead-letter write failed writes it before anything else, without
   * running. Without the wrapper a job that kills every worker runs until `maxStalledCount`.
   */
  function processor(fn) {
    if (typeof fn !== 'function') throw new TypeError('processor: must be a function (a sandboxed processor file cannot be wrapped)');
    return async function reboundProcessor(job, token, signal) {
      const hash = jobHash(job);
      let pending = null;
      try {
        pending = hash ? await withTimeout(pendingGiveUp(job, hash).get(), REDIS_TIMEOUT_MS, 'pending give-up') : null;
      } catch (e) {
        rebound.hookError(job.queueName, String(job.id), 'pendingGiveUp', e, 'bullmq');
      }
      if (pending) {
        let message;
        try {
          message = JSON.parse(pending).payload.error.message;
        } catch {
          message = undefined; // unreadable: the hook decides afresh
        }
        throw new PendingGiveUpError(job.id, message);
      }
      const lost = unansweredRuns(job);
      if (lost > 0) {
        const answer = await rebound.decide(
          { queue: job.queueName, attempt: job.attemptsMade + lost, jobId: job.id, errorClass: 'WorkerLost' },
          { record: false },
        );
        if (answer.decision === 'DECISION_GIVE_UP') throw new WorkerLostError(job.id, lost);
      }
      return fn(job, token, signal);
    };
  }

  /** Puts a dead-lettered job back on its source queue with the same key (hook.js). */
  const replay = (deadLetterJob, queue, opts = {}) => replayDeadLetter(add, deadLetterJob, queue, opts);

  /**
   * The Worker's `settings`. Given the Worker's queue name(s), it also fetches their
   * policies now, as the Worker is created (before any job fails), for the fallback.
   */
  function settings(queues) {
    if (queues !== undefined) rebound.prefetch(queues, 'bullmq');
    return { backoffStrategy };
  }

  return {
    backoffStrategy,
    settings,
    jobOptions,
    add,
    replay,
    processor,
  };
}

/**
 * Runs of `job` that ended without an answer (their worker died): stalls BullMQ counted that
 * were followed by another start, beyond the failures it recorded. This start not included.
 */
function unansweredRuns(job) {
  const stalled = Number.isInteger(job.stalledCounter) ? job.stalledCounter : 0;
  const started = Number.isInteger(job.attemptsStarted) ? job.attemptsStarted : 0;
  const failed = Number.isInteger(job.attemptsMade) ? job.attemptsMade : 0;
  return Math.min(stalled, Math.max(0, started - 1 - failed));
}

module.exports = { createBullMQAdapter, BACKOFF_TYPE, newKey };
