'use strict';
// The hook logic both libraries share: first-failure bookkeeping, the decision, and the
// disposition on give-up. Library specifics come in as small functions.

const { normaliseAttempt } = require('./rebound');

/** The job-hash field that holds the first failure's time (ms since the epoch). */
const FIRST_FAILURE_FIELD = 'rebound:firstFailure';
/** A Redis that does not answer in this long leaves the first failure unknown for this call. */
const REDIS_TIMEOUT_MS = 2000;
/** A dead-letter write not confirmed in this long is tried again later (it may have landed). */
const DEAD_LETTER_TIMEOUT_MS = 5000;

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer in ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function thenable(value) {
  return value !== null && typeof value === 'object' && typeof value.then === 'function';
}

/**
 * A hook's result, bounded in time only when it is a promise: BullMQ's stall count is a
 * plain number, and a timer armed and cleared per call (with the race and the extra awaits
 * around it) was a measurable part of the adapter's own cost per decision.
 */
function settled(value, ms, what) {
  return thenable(value) ? withTimeout(Promise.resolve(value), ms, what) : value;
}

/**
 * The time of the job's first failure, kept in the job's own Redis hash.
 * Attempt 1 is the first failure (of this job's current life: a job retried by hand starts
 * again at 1) and writes it; later attempts read it. `redis` is
 * `{ hget(field) → Promise<string|null>, hset(field, value) → Promise }` or null.
 */
async function firstFailure(memory, queue, jobId, redis, attempt, now) {
  const known = memory.get(queue, jobId);
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
  memory.set(queue, jobId, { attempt, ms });
  return ms;
}

function errorSummary(err, errorClass) {
  return {
    name: err && typeof err.name === 'string' ? err.name : '',
    message: err && typeof err.message === 'string' ? err.message : String(err),
    class: errorClass ?? '',
  };
}

/**
 * The dead-letter job's id: the source queue, the key and the give-up (`giveUp`: the job's
 * enqueue time and the library's failure count when it gave up). One give-up always maps to
 * one id, so a write repeated after a lost reply or a kill adds nothing; a job that gives up
 * again (retried from the failed set, its key enqueued again) gets a dead letter of its own.
 */
function deadLetterJobId(queue, key, giveUp) {
  const parts = [queue, key, ...(giveUp === undefined || giveUp === null || giveUp === '' ? [] : [String(giveUp)])];
  return parts.map(encodeURIComponent).join('/').replace(/:/g, '%3A');
}

/**
 * The job-hash field holding a give-up whose dead letter is not written yet (JSON: the
 * dead-letter queue, id and record). While it is there the job is not finished: it is retried
 * with the policy's delay, and the next try writes this same dead letter.
 */
const PENDING_FIELD = 'rebound:giveUp';

/**
 * Thrown by the wrapped processor instead of running the job when its runs are already used
 * up by runs that died unanswered (a worker killed mid-run): the hook then decides for those
 * runs, not for this start, which did not run the job.
 */
class WorkerLostError extends Error {
  constructor(jobId, lostRuns) {
    super(`job ${jobId}: ${lostRuns} run(s) ended with their worker and used up the policy's attempts`);
    this.name = 'WorkerLost';
    this.code = 'REBOUND_WORKER_LOST';
    this.notRun = true;
  }
}

/**
 * Thrown by the wrapped processor for a job whose give-up waits for its dead letter to be
 * written. It carries the give-up's own error message, which stays the job's failedReason.
 */
class PendingGiveUpError extends Error {
  constructor(jobId, message) {
    super(message || `job ${jobId}: gave up, its dead letter is not written yet`);
    this.name = 'PendingGiveUp';
    this.code = 'REBOUND_PENDING_GIVE_UP';
    this.notRun = true;
    this.pendingGiveUp = true;
  }
}

async function readPending(rebound, spec, queue, jobId) {
  if (!spec.pending) return null;
  try {
    const text = await withTimeout(Promise.resolve(spec.pending.get()), REDIS_TIMEOUT_MS, 'pending give-up');
    if (!text) return null;
    const marker = JSON.parse(text);
    return marker && marker.id && marker.deadLetterQueue && marker.payload ? marker : null;
  } catch (e) {
    rebound.hookError(queue, jobId, 'pendingGiveUp', e, spec.adapter);
    return null;
  }
}

/**
 * Writes a give-up's dead letter. Counted and emitted only once it exists. When the write
 * fails the job is not finished: the give-up is kept in the job hash and the job retried
 * after the policy's delay (so `removeOnFail` cannot remove a job whose dead letter is
 * missing); the next try writes the same dead letter.
 */
async function settleGiveUp(rebound, spec, queue, jobId, attempt, marker) {
  try {
    if (spec.lockHeld) {
      const held = await withTimeout(Promise.resolve(spec.lockHeld()), REDIS_TIMEOUT_MS, 'lock check');
      if (held === false) {
        // A run that outlived its lock (a paused worker): the job was taken back and another
        // run decides. The library refuses this run's result too.
        rebound.hookError(queue, jobId, 'lockLost', new Error('the job is no longer this run\'s: no dead letter from it'), spec.adapter);
        return -1;
      }
    }
    // Bounded: a write that never answers is retried like a refused one (same id, so a late
    // success and the retry make one dead letter).
    await withTimeout(Promise.resolve(spec.deadLetter(marker.deadLetterQueue, marker.id, marker.payload)), DEAD_LETTER_TIMEOUT_MS, 'dead-letter write');
  } catch (e) {
    rebound.hookError(queue, jobId, 'deadLetter', e, spec.adapter);
    if (spec.pending) {
      try {
        await withTimeout(Promise.resolve(spec.pending.set(JSON.stringify(marker))), REDIS_TIMEOUT_MS, 'pending give-up');
      } catch (e2) {
        rebound.hookError(queue, jobId, 'pendingGiveUp', e2, spec.adapter);
      }
    }
    return rebound.pendingDelayMs(queue, jobId, attempt, spec.adapter);
  }
  if (spec.pending) {
    try {
      await withTimeout(Promise.resolve(spec.pending.clear()), REDIS_TIMEOUT_MS, 'pending give-up');
    } catch (e) {
      rebound.hookError(queue, jobId, 'pendingGiveUp', e, spec.adapter);
    }
  }
  rebound.terminal(spec.adapter, 'dead_letter');
  rebound.safeEmit('deadLetter', {
    queue,
    jobId,
    key: jobId,
    deadLetterQueue: marker.deadLetterQueue,
    deadLetterJobId: marker.id,
    reason: marker.payload.reason,
  });
  return -1;
}

/**
 * Runs one hook call. Never rejects: every problem is absorbed, counted and logged.
 * spec: { adapter (bullmq, bull: the Prometheus label), queue, jobId, attemptsMade,
 *         stalledRuns(failures) → number | Promise<number>, err,
 *         name, data, redis, deadLetter(dlq, jobId, payload), drop(answer) → removed:boolean,
 *         giveUpId() → string (identifies this give-up), pending: { get, set, clear } (the
 *         job hash's PENDING_FIELD), lockHeld() → boolean (this run still holds the job) }
 * The attempt sent is the number of runs made: the library's count of failures including
 * this one, plus the runs cut short by a dead worker: runs the stalled check returned to the
 * queue AND that were started again (a stall counted while the run's own result still
 * landed, e.g. a lock that expired during a Redis outage, is no extra run). A start that did
 * not run the job (`err.notRun`, from the wrapped processor) is not a run.
 * Returns the delay in ms, or -1 to give up.
 */
async function runHook(rebound, spec) {
  const queue = spec.queue;
  const jobId = spec.jobId === undefined || spec.jobId === null ? '' : String(spec.jobId);
  const notRun = Boolean(spec.err && spec.err.notRun === true);
  let attempt = normaliseAttempt(spec.attemptsMade);
  try {
    try {
      let counted = spec.stalledRuns ? settled(spec.stalledRuns(attempt), REDIS_TIMEOUT_MS, 'stalled runs') : 0;
      // A plain number is used as it is: awaiting it would only yield to the event loop.
      if (thenable(counted)) counted = await counted;
      const stalled = Number(counted);
      if (Number.isInteger(stalled) && stalled > 0) attempt = normaliseAttempt(attempt + stalled);
    } catch (e) {
      rebound.hookError(queue, jobId, 'stalledRuns', e, spec.adapter);
    }
    if (notRun) attempt = normaliseAttempt(attempt - 1);
    if (spec.err && spec.err.pendingGiveUp === true) {
      const marker = await readPending(rebound, spec, queue, jobId);
      if (marker) return await settleGiveUp(rebound, spec, queue, jobId, attempt, marker);
    }
    let ff;
    try {
      const known = rebound.firstFailures.get(queue, jobId);
      if (jobId === '') ff = undefined;
      else if (known && attempt >= known.attempt) ff = known.ms; // no Redis round trip
      else {
        ff = await withTimeout(firstFailure(rebound.firstFailures, queue, jobId, spec.redis, attempt, Date.now()), REDIS_TIMEOUT_MS, 'first failure');
      }
    } catch (e) {
      rebound.hookError(queue, jobId, 'firstFailure', e, spec.adapter);
    }
    const errorClass = spec.err instanceof WorkerLostError ? spec.err.name : rebound.errorClassOf(spec.err, spec.adapter);
    const answer = await rebound.decide({
      queue,
      attempt,
      jobId,
      errorClass,
      firstFailureUnixMs: ff,
      retryAfterMs: rebound.retryAfterOf(spec.err, spec.adapter),
    }, { adapter: spec.adapter });
    if (answer.decision === 'DECISION_RETRY') return answer.delayMs;

    rebound.firstFailures.delete(queue, jobId);
    if (answer.disposition === 'DISPOSITION_DEAD_LETTER' && answer.deadLetterQueue) {
      // A give-up already pending (its dead letter refused, then the job ran again without
      // the wrapped processor) keeps its one dead letter.
      let marker = await readPending(rebound, spec, queue, jobId);
      if (!marker) {
        let giveUp;
        try {
          giveUp = spec.giveUpId ? await withTimeout(Promise.resolve(spec.giveUpId()), REDIS_TIMEOUT_MS, 'give-up id') : undefined;
        } catch (e) {
          rebound.hookError(queue, jobId, 'giveUpId', e, spec.adapter);
          giveUp = `a${normaliseAttempt(spec.attemptsMade)}`;
        }
        marker = {
          deadLetterQueue: answer.deadLetterQueue,
          id: deadLetterJobId(queue, jobId, giveUp),
          payload: {
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
          },
        };
      }
      return await settleGiveUp(rebound, spec, queue, jobId, attempt, marker);
    }
    // Drop. A give-up by the built-in default policy only leaves the job failed.
    const remove = rebound.dropRemoves && answer.policySource !== 'default';
    let removed = false;
    try {
      removed = remove ? await spec.drop(answer) : false;
    } catch (e) {
      rebound.hookError(queue, jobId, 'drop', e, spec.adapter);
    }
    rebound.terminal(spec.adapter, 'drop');
    rebound.safeEmit('drop', { queue, jobId, key: jobId, reason: answer.reason, removed });
    return -1;
  } catch (e) {
    // A fault in the adapter itself: still the policy's answer (computed locally), never
    // the library's own retries and never an exception out of the hook.
    rebound.hookError(queue, jobId, 'hook', e, spec.adapter);
    const answer = rebound.localAnswer({ queue, attempt, jobId }, e, spec.adapter);
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

module.exports = {
  runHook,
  replayDeadLetter,
  firstFailure,
  deadLetterJobId,
  withTimeout,
  WorkerLostError,
  PendingGiveUpError,
  FIRST_FAILURE_FIELD,
  PENDING_FIELD,
  REDIS_TIMEOUT_MS,
};
