'use strict';
// First-failure times this process has seen, so later attempts of a job skip Redis.

/** Entries remembered at most, over all queues. */
const MEMORY_LIMIT = 10000;

/**
 * queue → (job id → { attempt, ms }). Two levels rather than one Map keyed by
 * `queue + '\0' + jobId`: that key is a new string on every hook call, flattened and hashed
 * before the lookup, where the job id's own hash is cached by the engine (the in-process
 * figure of bench/hook.js).
 * Bounded: past MEMORY_LIMIT the oldest entry of the first queue seen is forgotten, and
 * that job's next attempt reads its first failure from Redis again.
 */
class FirstFailures {
  constructor(limit = MEMORY_LIMIT) {
    this.limit = limit;
    this.size = 0;
    this.queues = new Map();
  }

  get(queue, jobId) {
    const jobs = this.queues.get(queue);
    return jobs === undefined ? undefined : jobs.get(jobId);
  }

  set(queue, jobId, entry) {
    let jobs = this.queues.get(queue);
    if (jobs === undefined) {
      jobs = new Map();
      this.queues.set(queue, jobs);
    }
    if (!jobs.has(jobId)) {
      if (this.size >= this.limit) this.evictOne();
      this.size++;
    }
    jobs.set(jobId, entry);
  }

  delete(queue, jobId) {
    const jobs = this.queues.get(queue);
    if (jobs === undefined || !jobs.delete(jobId)) return;
    this.size--;
    if (jobs.size === 0) this.queues.delete(queue);
  }

  evictOne() {
    for (const [queue, jobs] of this.queues) {
      const oldest = jobs.keys().next();
      if (!oldest.done) return this.delete(queue, oldest.value);
    }
  }
}

module.exports = { FirstFailures, MEMORY_LIMIT };
