'use strict';
// The hook logic both libraries share: first-failure bookkeeping, the decision, and the
// disposition on give-up. Library specifics come in as small functions.

const { normaliseAttempt } = require('./rebound');

/** The job-hash field that holds the first failure's time (ms since the epoch). */
const FIRST_FAILURE_FIELD = 'rebound:firstFailure';
/** First-failure times remembered in memory, so later attempts in this process skip Redis. */
const MEMORY_LIMIT = 10000;
/** A Redis that does not answer in this long leaves the first failure unknown for this call. */
const REDIS_TIMEOUT_MS = 2000;

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer in ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/**
 * The time of the job's first failure, kept in the job's own Redis hash.
 * Attempt 1 is the first failure (of this job's current life: a job retried by hand starts
 * again at 1) and writes it; later attempts read it. `redis` is
 * `{ hget(field) → Promise<string|null>, hset(field, value) → Promise }` or null.
 */
async function firstFailure(memory, memKey, redis, attempt, now) {
  const known = memory.get(memKey);
  if (known && attempt >= known.attempt) return known.ms;
  let ms = now;
  if (redis) {
    if (attempt > 1) {
      const stored = await redis.hget(FIRST_FAILURE_FIELD);
      const n = Number(stored);
      if (stored !== null && Number.isFinite(n) && n >= 1e12) ms = n;
      else await redis.hset(FIRST_FAILURE_FIELD, String(ms));
    } else {
      await redis.hset(FIRST_FAILURE_FIELD, String(ms));
    }
  }
  if (memory.size >= MEMORY_LIMIT) memory.delete(memory.keys().next().value);
  memory.set(memKey, { attempt, ms });
  return ms;
}

function forget(memory, memKey) {
  memory.delete(memKey);
}

function errorSummary(err, errorClass) {
  return {
    name: err && typeof err.name === 'string' ? err.name : '',
    message: err && typeof err.message === 'string' ? err.message : String(err),
    class: errorClass ?? '',
  };
}

/** The dead-letter job's id: derived from the source queue and key, so it is written once. */
function deadLetterJobId(queue, key) {
  return `${encodeURIComponent(queue)}/${encodeURIComponent(key)}`.replace(/:/g, '%3A');
}

/**
 * Runs one hook call. Never rejects: every problem is absorbed, counted and logged.
 * spec: { queue, jobId, attemptsMade, stalledRuns(failures) → number | Promise<number>, err,
 *         name, data, redis, deadLetter(dlq, jobId, payload), drop(answer) → removed:boolean }
 * The attempt sent is the number of runs made: the library's count of failures including
 * this one, plus the runs cut short by a dead worker: runs the stalled check returned to the
 * queue AND that were started again (a stall counted while the run's own result still
 * landed, e.g. a lock that expired during a Redis outage, is no extra run).
 * Returns the delay in ms, or -1 to give up.
 */
async function runHook(rebound, spec) {
  const queue = spec.queue;
  const jobId = spec.jobId === undefined || spec.jobId === null ? '' : String(spec.jobId);
  let attempt = normaliseAttempt(spec.attemptsMade);
  try {
    try {
      const stalled = spec.stalledRuns ? Number(await withTimeout(Promise.resolve(spec.stalledRuns(attempt)), REDIS_TIMEOUT_MS, 'stalled runs')) : 0;
      if (Number.isInteger(stalled) && stalled > 0) attempt = normaliseAttempt(attempt + stalled);
    } catch (e) {
      rebound.hookError(queue, jobId, 'stalledRuns', e);
    }
    const now = Date.now();
    const memKey = `${queue}\u0000${jobId}`;
    let ff;
    try {
      const known = rebound.firstFailures.get(memKey);
      if (jobId === '') ff = undefined;
      else if (known && attempt >= known.attempt) ff = known.ms; // no Redis round trip
      else {
        ff = await withTimeout(firstFailure(rebound.firstFailures, memKey, spec.redis, attempt, now), REDIS_TIMEOUT_MS, 'first failure');
      }
    } catch (e) {
      rebound.hookError(queue, jobId, 'firstFailure', e);
    }
    const errorClass = rebound.errorClassOf(spec.err);
    const answer = await rebound.decide({
      queue,
      attempt,
      jobId,
      errorClass,
      firstFailureUnixMs: ff,
      retryAfterMs: rebound.retryAfterOf(spec.err),
    });
    if (answer.decision === 'DECISION_RETRY') return answer.delayMs;

    forget(rebound.firstFailures, memKey);
    if (answer.disposition === 'DISPOSITION_DEAD_LETTER' && answer.deadLetterQueue) {
      const dlqJobId = deadLetterJobId(queue, jobId);
      const payload = {
        format: 'rebound.dev/dead-letter/v1',
        sourceQueue: queue,
        sourceJobId: jobId,
        name: spec.name ?? '',
        data: spec.data ?? null,
        key: jobId,
        attempt,
        attempts: attempt,
        reason: answer.reason,
        reasonMessage: answer.reasonMessage,
        error: errorSummary(spec.err, errorClass),
        firstFailureUnixMs: ff ?? 0,
        deadLetteredAtUnixMs: Date.now(),
        policy: answer.policy,
        source: answer.source,
      };
      try {
        await spec.deadLetter(answer.deadLetterQueue, dlqJobId, payload);
        rebound.counters.deadLettered++;
        rebound.safeEmit('deadLetter', {
          queue,
          jobId,
          key: jobId,
          deadLetterQueue: answer.deadLetterQueue,
          deadLetterJobId: dlqJobId,
          reason: answer.reason,
        });
      } catch (e) {
        // The job stays in the failed set (never removed): nothing is lost.
        rebound.hookError(queue, jobId, 'deadLetter', e);
      }
    } else {
      // Drop. A give-up by the built-in default policy only leaves the job failed.
      const remove = rebound.dropRemoves && answer.policySource !== 'default';
      let removed = false;
      try {
        removed = remove ? await spec.drop(answer) : false;
      } catch (e) {
        rebound.hookError(queue, jobId, 'drop', e);
      }
      rebound.counters.dropped++;
      rebound.safeEmit('drop', { queue, jobId, key: jobId, reason: answer.reason, removed });
    }
    return -1;
  } catch (e) {
    // A fault in the adapter itself: still the policy's answer (computed locally), never
    // the library's own retries and never an exception out of the hook.
    rebound.hookError(queue, jobId, 'hook', e);
    const answer = rebound.localAnswer({ queue, attempt, jobId }, e);
    return answer.decision === 'DECISION_RETRY' ? answer.delayMs : -1;
  }
}

/**
 * Puts a dead-lettered job back on its source queue with the same key (BullMQ and Bull).
 * Safe to run again after a crash: the dead-letter job is removed last, and a source job
 * that is live again (not failed or completed) is left alone.
 */
async function replayDeadLetter(add, deadLetterJob, queue, opts) {
  const d = deadLetterJob && deadLetterJob.data;
  if (!d || d.format !== 'rebound.dev/dead-letter/v1') {
    throw new TypeError('deadLetterJob: not a Rebound dead-letter job (data.format)');
  }
  if (!queue || queue.name !== d.sourceQueue) {
    throw new TypeError(`queue: the job came from ${JSON.stringify(d.sourceQueue)}, not ${JSON.stringify(queue && queue.name)}`);
  }
  let job = await queue.getJob(d.key);
  const state = job ? await job.getState() : 'unknown';
  if (state === 'failed' || state === 'completed') {
    await job.remove();
    job = undefined;
  }
  if (!job) job = (await add(queue, d.name, d.data, { ...opts, key: d.key })).job;
  await deadLetterJob.remove();
  return { job, key: d.key };
}

module.exports = { runHook, replayDeadLetter, firstFailure, deadLetterJobId, FIRST_FAILURE_FIELD };
