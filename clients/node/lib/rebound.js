'use strict';
// The adapter's core: asks the sidecar, falls back to the local port of `decide` with the
// last policy fetched (or the default), counts, emits and logs. Library glue lives in
// bullmq.js and bull.js.

const crypto = require('node:crypto');
const { EventEmitter } = require('node:events');
const { AdvisorClient, resolvedFromWire, policyRefFromWire, grpc } = require('./client');
const { PreparedPolicy, decidePrepared, delayForRetry, draws } = require('./decide');
const { AdapterMetrics, NO_METRICS } = require('./metrics');
const { prepareRollout, pick } = require('./rollout-cache');
const { FirstFailures } = require('./first-failures');

/** Above every valid maxAttempts (10000), so the job library's own limit never decides. */
const LIBRARY_ATTEMPTS = 10001;

/** What a RetryPolicy with an empty spec resolves to (the policy crate's defaults). */
const DEFAULT_POLICY = Object.freeze({
  strategy: 'STRATEGY_EXPONENTIAL',
  baseMs: 1000,
  multiplier: 2,
  capMs: 600000,
  jitter: 'JITTER_FULL',
  jitterRatio: 0,
  scheduleMs: Object.freeze([]),
  maxAttempts: 10,
  maxRetryDurationMs: 0,
  nonRetryableErrors: Object.freeze([]),
  terminal: 'DISPOSITION_DROP',
  deadLetterQueue: '',
});
/** Seeds the default policy's jitter. */
const DEFAULT_IDENTITY = 'rebound/default';
const EMPTY_REF = Object.freeze({ name: '', namespace: '', generation: '0', configHash: '' });

const MAX_JOB_ID_BYTES = 512;
const MAX_ERROR_CLASS_BYTES = 253;
/** Fallback log lines: at most one per queue and cause in this many ms. */
const LOG_EVERY_MS = 60000;
/** The delay answered when even the fallback fails (it should not): retry in 5 s. */
const LAST_RESORT_DELAY_MS = 5000;

/** What a call on a channel in TRANSIENT_FAILURE would fail with. */
const CHANNEL_DOWN = Object.freeze({ code: grpc.status.UNAVAILABLE, details: 'channel in TRANSIENT_FAILURE' });

const OUTCOME = {
  GIVE_UP_REASON_MAX_ATTEMPTS: 'give_up_max_attempts',
  GIVE_UP_REASON_DEADLINE: 'give_up_deadline',
  GIVE_UP_REASON_NON_RETRYABLE: 'give_up_non_retryable',
};

function jsonLogger() {
  const line = (level) => (fields, msg) => {
    try {
      process.stderr.write(`${JSON.stringify({ time: new Date().toISOString(), level, msg, ...fields })}\n`);
    } catch {
      // a logger must never break the hook
    }
  };
  return { info: line('info'), warn: line('warn'), error: line('error') };
}
const SILENT = { info() {}, warn() {}, error() {} };

/** Default error class: a string `code` (ECONNRESET, smtp.550), else the error's name. */
function defaultErrorClass(err) {
  if (err && typeof err.code === 'string' && err.code !== '') return err.code;
  if (err && typeof err.name === 'string' && err.name !== '') return err.name;
  return undefined;
}

/** Default pushback: `err.retryAfterMs` in ms, else `err.retryAfter` as a Retry-After value. */
function defaultRetryAfterMs(err, nowMs) {
  if (!err || typeof err !== 'object') return undefined;
  if (typeof err.retryAfterMs === 'number') return err.retryAfterMs;
  const v = err.retryAfter;
  if (typeof v === 'number') return v * 1000;
  if (typeof v === 'string' && v.trim() !== '') {
    const s = v.trim();
    if (/^\d+$/.test(s)) return Number(s) * 1000;
    const at = Date.parse(s);
    // The clock is read only for an HTTP date, not on every hook call.
    if (Number.isFinite(at)) return Math.max(0, at - (nowMs ?? Date.now()));
  }
  return undefined;
}

/** Cuts a string to at most `max` UTF-8 bytes without splitting a character. */
function truncateUtf8(text, max) {
  // A UTF-16 code unit is at most 3 UTF-8 bytes: short strings need no count.
  if (text.length * 3 <= max || Buffer.byteLength(text) <= max) return text;
  let out = '';
  let bytes = 0;
  for (const ch of text) {
    const n = Buffer.byteLength(ch);
    if (bytes + n > max) break;
    out += ch;
    bytes += n;
  }
  return out;
}

/** The attempt the proto expects: the 1-based number of the run that just failed. */
function normaliseAttempt(n) {
  const a = Math.trunc(Number(n));
  if (!Number.isFinite(a) || a < 1) return 1;
  return Math.min(a, 4294967295);
}

/** Normalises one failure so the sidecar and the fallback see exactly the same question. */
function normaliseFailure(f) {
  const out = { queue: String(f.queue), attempt: normaliseAttempt(f.attempt) };
  if (f.jobId !== undefined && f.jobId !== null && String(f.jobId) !== '') {
    const id = String(f.jobId);
    out.jobId = id.length * 3 > MAX_JOB_ID_BYTES && Buffer.byteLength(id) > MAX_JOB_ID_BYTES ? crypto.createHash('sha256').update(id).digest('hex') : id;
  }
  if (typeof f.errorClass === 'string' && f.errorClass !== '') {
    out.errorClass = truncateUtf8(f.errorClass, MAX_ERROR_CLASS_BYTES);
  }
  const ff = Number(f.firstFailureUnixMs);
  if (Number.isFinite(ff) && ff >= 1e12) out.firstFailureUnixMs = Math.trunc(ff);
  const ra = Number(f.retryAfterMs);
  if (Number.isFinite(ra) && ra > 0) out.retryAfterMs = Math.min(Math.ceil(ra), Number.MAX_SAFE_INTEGER);
  return out;
}

function causeOf(err) {
  switch (err && err.code) {
    case grpc.status.UNAVAILABLE:
      return 'unavailable';
    case grpc.status.DEADLINE_EXCEEDED:
      return 'deadline_exceeded';
    case grpc.status.NOT_FOUND:
      return 'not_found';
    default:
      return 'other';
  }
}

function checkOptions(o) {
  const positive = (name, v) => {
    if (v !== undefined && !(Number.isFinite(v) && v > 0)) {
      throw new TypeError(`${name}: must be a positive number of milliseconds, got ${v}`);
    }
  };
  positive('deadlineMs', o.deadlineMs);
  positive('refreshIntervalMs', o.refreshIntervalMs);
  for (const f of ['errorClass', 'retryAfterMs']) {
    if (o[f] !== undefined && typeof o[f] !== 'function') throw new TypeError(`${f}: must be a function`);
  }
  if (o.defaultPolicy !== undefined) {
    // Fails on a policy decideLocal cannot use, naming the field.
    const p = o.defaultPolicy;
    for (const f of ['baseMs', 'capMs', 'maxAttempts', 'multiplier', 'jitterRatio', 'maxRetryDurationMs']) {
      if (typeof p[f] !== 'number' || !Number.isFinite(p[f]) || p[f] < 0) {
        throw new TypeError(`defaultPolicy.${f}: must be a non-negative number`);
      }
    }
    for (const f of ['scheduleMs', 'nonRetryableErrors']) {
      if (!Array.isArray(p[f])) throw new TypeError(`defaultPolicy.${f}: must be an array`);
    }
    for (const f of ['strategy', 'jitter', 'terminal']) {
      if (typeof p[f] !== 'string') throw new TypeError(`defaultPolicy.${f}: must be a proto enum value name`);
    }
    try {
      decidePrepared(new PreparedPolicy(p, DEFAULT_IDENTITY), 1, { jobId: 'check' });
    } catch (e) {
      throw new TypeError(`defaultPolicy.${String(e.message).replace(/^policy\./, '')}`);
    }
  }
}

/** While a prefetched queue has no policy because the sidecar was unreachable: try again this often. */
const PREFETCH_RETRY_MS = 500;

class ReboundCore extends EventEmitter {
  constructor(options = {}) {
    super();
    checkOptions(options);
    const fromEnv = options.target === undefined && process.env.REBOUND_TARGET !== undefined;
    this.target = options.target ?? (fromEnv ? process.env.REBOUND_TARGET : '127.0.0.1:7411');
    this.deadlineMs = options.deadlineMs ?? 250;
    this.refreshIntervalMs = options.refreshIntervalMs ?? 30000;
    this.mapErrorClass = options.errorClass || defaultErrorClass;
    this.mapRetryAfter = options.retryAfterMs || defaultRetryAfterMs;
    // Drop leaves the job in the library's failed set (the contract); removing it is opt-in.
    this.dropRemoves = options.dropRemoves ?? false;
    this.logger = options.logger === false ? SILENT : options.logger || jsonLogger();
    this.defaultPrepared = new PreparedPolicy(options.defaultPolicy || DEFAULT_POLICY, DEFAULT_IDENTITY);
    /** The `rebound_adapter_*` counters, in the application's prom-client Registry if given. */
    this.prom = options.registry === undefined || options.registry === null ? NO_METRICS : new AdapterMetrics(options.registry);
    this.client = new AdvisorClient(this.target, this.deadlineMs, fromEnv ? 'REBOUND_TARGET' : 'target');
    /** Prefetched queues whose GetPolicy could not reach the sidecar: fetched again on reconnect. */
    this.unfetched = new Set();
    this.prefetchTimer = null;
    this.warnedUnreachable = false;
    /** queue → { ref, resolved, prepared } (the last GetPolicy answer) */
    this.policies = new Map();
    /** queues seen, refreshed in the background */
    this.queues = new Set();
    this.inflight = new Map();
    this.lastLog = new Map();
    this.closed = false;
    this.counters = {
      decisions: { retry: 0, give_up_max_attempts: 0, give_up_deadline: 0, give_up_non_retryable: 0 },
      fallback: { total: 0, unavailable: 0, deadline_exceeded: 0, not_found: 0, other: 0, default_policy: 0 },
      deadLettered: 0,
      dropped: 0,
      hookErrors: 0,
    };
    this.timer = setInterval(() => this.refreshAll(), this.refreshIntervalMs);
    this.timer.unref();
    this.closers = [];
    /** (queue, jobId) → { attempt, ms }: first failures seen by this process */
    this.firstFailures = new FirstFailures();
  }

  /** Emits without letting a listener's exception reach the hook. */
  safeEmit(event, payload) {
    try {
      this.emit(event, payload);
    } catch (err) {
      this.logger.error({ event: 'rebound.listener_error', listener: event, error: String(err) }, 'an event listener threw');
    }
  }

  /** `adapter` (bullmq, bull) labels the Prometheus count; none for the application's own calls. */
  hookError(queue, jobId, where, error, adapter) {
    this.counters.hookErrors++;
    if (adapter) this.prom.hookError(adapter);
    this.logger.error({ event: 'rebound.hook_error', queue, jobId, where, error: String(error && error.message) }, 'hook problem absorbed');
    this.safeEmit('hookError', { queue, jobId, where, error });
  }

  errorClassOf(err, adapter) {
    try {
      const c = this.mapErrorClass(err);
      return typeof c === 'string' && c !== '' ? c : undefined;
    } catch (e) {
      this.hookError('', '', 'errorClass', e, adapter);
      return undefined;
    }
  }

  retryAfterOf(err, adapter) {
    try {
      const v = this.mapRetryAfter(err);
      return typeof v === 'number' && Number.isFinite(v) && v > 0 ? v : undefined;
    } catch (e) {
      this.hookError('', '', 'retryAfterMs', e, adapter);
      return undefined;
    }
  }

  /**
   * Asks the sidecar; answers from the fallback when it cannot. Never rejects. With
   * `record: false` the answer is neither counted nor emitted (a look ahead, not a decision).
   * `adapter` (bullmq, bull: the hook that asks) labels the Prometheus counters; an answer
   * without it is counted in metrics() only.
   */
  async decide(failure, { record = true, adapter } = {}) {
    let f;
    try {
      f = normaliseFailure(failure);
    } catch (e) {
      f = { queue: String(failure && failure.queue), attempt: 1 };
    }
    this.noteQueue(f.queue);
    let answer;
    try {
      if (this.client.down()) throw CHANNEL_DOWN;
      const res = await this.client.decide({
        queue: f.queue,
        attempt: f.attempt,
        job_id: f.jobId ?? '',
        error_class: f.errorClass ?? '',
        first_failure_unix_ms: f.firstFailureUnixMs ?? 0,
        retry_after_ms: f.retryAfterMs ?? 0,
      });
      answer = {
        decision: res.decision,
        delayMs: res.decision === 'DECISION_RETRY' ? Number(res.delay_ms) : 0,
        disposition: res.disposition,
        deadLetterQueue: res.dead_letter_queue,
        reason: res.reason,
        reasonMessage: res.reason_message,
        budgetStretched: Boolean(res.budget_stretched),
        budgetDelayMs: Number(res.budget_delay_ms ?? 0),
        policy: policyRefFromWire(res.policy),
        source: 'sidecar',
        policySource: 'sidecar',
        revision: res.revision ?? '',
      };
      const cached = this.policies.get(f.queue);
      if (!cached || cached.ref.configHash !== answer.policy.configHash) this.refresh(f.queue);
    } catch (err) {
      answer = this.fallback(f, err, record, adapter);
    }
    if (record) {
      this.count(answer, adapter);
      // The payload is built only for a listener: most workers have none.
      if (this.listenerCount('decision') > 0) this.safeEmit('decision', { queue: f.queue, jobId: f.jobId ?? '', attempt: f.attempt, ...answer });
    }
    return answer;
  }

  /**
   * The policy's delay before another try of a give-up whose dead letter could not be
   * written: the queue's curve at `attempt` (cached policy, else the default), with the
   * job's own jitter, so the sidecar's and the fallback's schedules stay one.
   */
  pendingDelayMs(queue, jobId, attempt, adapter) {
    const cached = this.policies.get(queue);
    const prepared = cached ? cached.prepared : this.defaultPrepared;
    try {
      const id = jobId === '' ? undefined : jobId;
      return Math.max(1, delayForRetry(prepared.params, normaliseAttempt(attempt), null, draws(id, prepared.identitySeed)));
    } catch (e) {
      this.hookError(queue, jobId, 'pendingDelay', e, adapter);
      return LAST_RESORT_DELAY_MS;
    }
  }

  /** The local answer: the cached policy, else the default. */
  fallback(f, err, record = true, adapter = undefined) {
    const cause = causeOf(err);
    const code = err && typeof err.code === 'number' ? err.code : null;
    if (cause === 'not_found') this.policies.delete(f.queue);
    const cached = this.policies.get(f.queue);
    const nowUnixMs = Date.now();
    const firstFailureUnixMs = f.firstFailureUnixMs === undefined ? undefined : Math.min(f.firstFailureUnixMs, nowUnixMs);
    const { prepared, revision } = cached ? pick(cached, f.jobId, firstFailureUnixMs, nowUnixMs) : { prepared: this.defaultPrepared, revision: '' };
    let answer;
    try {
      answer = decidePrepared(prepared, f.attempt, {
        jobId: f.jobId,
        errorClass: f.errorClass,
        firstFailureUnixMs,
        nowUnixMs,
        retryAfterMs: f.retryAfterMs,
      });
    } catch (e) {
      this.hookError(f.queue, f.jobId ?? '', 'fallback', e, adapter);
      answer = {
        decision: 'DECISION_RETRY',
        delayMs: LAST_RESORT_DELAY_MS,
        disposition: 'DISPOSITION_UNSPECIFIED',
        deadLetterQueue: '',
        reason: 'GIVE_UP_REASON_UNSPECIFIED',
        reasonMessage: '',
      };
    }
    // A retry budget is one sidecar's schedule: a local answer is never stretched.
    answer.budgetStretched = false;
    answer.budgetDelayMs = 0;
    answer.policy = cached ? cached.ref : EMPTY_REF;
    answer.source = 'fallback';
    answer.policySource = cached ? 'cached' : 'default';
    answer.revision = revision;
    if (!record) return answer;
    const fb = this.counters.fallback;
    fb.total++;
    fb[cause]++;
    if (!cached) fb.default_policy++;
    if (adapter) this.prom.fallback(adapter, cause, answer.policySource);
    // The status message tells "not listening" from "listening, no configuration loaded yet".
    const details = err && typeof err.details === 'string' ? err.details : String((err && err.message) || '');
    const event = { queue: f.queue, jobId: f.jobId ?? '', attempt: f.attempt, cause, code, details, policySource: answer.policySource };
    const logKey = `${f.queue}\u0000${cause}`;
    const now = Date.now();
    if (!(now - (this.lastLog.get(logKey) ?? -Infinity) < LOG_EVERY_MS)) {
      this.lastLog.set(logKey, now);
      this.logger.warn(
        { event: 'rebound.fallback', queue: f.queue, cause, code, details, policySource: answer.policySource, target: this.target },
        'sidecar did not answer; decided locally',
      );
    }
    this.safeEmit('fallback', event);
    return answer;
  }

  /** A fallback answer without asking the sidecar (a fault inside the adapter). Never throws. */
  localAnswer(failure, error, adapter) {
    let f;
    try {
      f = normaliseFailure(failure);
    } catch {
      f = { queue: String(failure && failure.queue), attempt: 1 };
    }
    const answer = this.fallback(f, error, true, adapter);
    this.count(answer, adapter);
    this.safeEmit('decision', { queue: f.queue, jobId: f.jobId ?? '', attempt: f.attempt, ...answer });
    return answer;
  }

  count(answer, adapter) {
    if (adapter) this.prom.decision(adapter, answer.source);
    const d = this.counters.decisions;
    if (answer.decision === 'DECISION_RETRY') d.retry++;
    else if (OUTCOME[answer.reason]) d[OUTCOME[answer.reason]]++;
  }

  /** A job the hook of `adapter` finished: `dead_letter` or `drop`. */
  terminal(adapter, disposition) {
    if (disposition === 'dead_letter') this.counters.deadLettered++;
    else this.counters.dropped++;
    if (adapter) this.prom.terminalJob(adapter, disposition);
  }

  noteQueue(queue) {
    if (!this.queues.has(queue)) {
      this.queues.add(queue);
      this.refresh(queue);
    }
  }

  /** Fetches a queue's policy with GetPolicy (one call in flight per queue). Never rejects. */
  refresh(queue) {
    if (this.closed) return Promise.resolve();
    if (this.inflight.has(queue)) return this.inflight.get(queue);
    const p = this.client
      .getPolicy(queue)
      .then((res) => {
        const ref = policyRefFromWire(res.policy);
        const cached = this.policies.get(queue);
        if (cached && cached.ref.configHash === ref.configHash && cached.ref.name === ref.name) return;
        const resolved = resolvedFromWire(res.resolved);
        const identity = `${ref.namespace}/${ref.name}`;
        const prepared = new PreparedPolicy(resolved, identity);
        this.policies.set(queue, { ref, resolved, prepared, rollout: prepareRollout(res.rollout, identity) });
        this.logger.info({ event: 'rebound.policy', queue, policy: ref.name, namespace: ref.namespace, configHash: ref.configHash }, 'fallback policy cached');
      })
      .catch((err) => {
        const cause = causeOf(err);
        if (cause === 'not_found') this.policies.delete(queue);
        return cause;
      })
      .finally(() => this.inflight.delete(queue));
    this.inflight.set(queue, p);
    return p;
  }

  refreshAll() {
    for (const q of this.queues) this.refresh(q);
  }

  /**
   * Loads the policy of every queue the worker consumes, at start (before any job fails),
   * so that during a later outage the fallback decides from the namespace's real policy
   * (`policySource: cached`). With the sidecar unreachable it logs one warning naming the
   * target and fetches again as soon as the sidecar is back. Never rejects; resolves once
   * every queue was asked once.
   */
  async prefetch(queues, adapter) {
    try {
      await this.prefetchQueues(queues);
    } catch (e) {
      // A logger that throws, say: never an unhandled rejection out of Worker creation.
      this.hookError('', '', 'prefetch', e, adapter);
    }
  }

  async prefetchQueues(queues) {
    const list = [...new Set([].concat(queues).filter((q) => typeof q === 'string' && q !== ''))];
    if (this.closed || list.length === 0) return;
    for (const q of list) this.queues.add(q);
    const causes = await Promise.all(list.map((q) => this.refresh(q)));
    // Unreachable (not running, not listening yet, too slow): fetched again once it answers.
    // Any other answer (NOT_FOUND: no policy governs the queue; an error) is the answer.
    const missed = list.filter((q, i) => !this.policies.has(q) && (causes[i] === 'unavailable' || causes[i] === 'deadline_exceeded'));
    if (missed.length === 0) return;
    for (const q of missed) this.unfetched.add(q);
    if (!this.warnedUnreachable) {
      this.warnedUnreachable = true;
      this.logger.warn(
        { event: 'rebound.sidecar_unreachable', target: this.target, queues: missed, cause: causes[list.indexOf(missed[0])] },
        'the sidecar did not answer at start; deciding from the default policy until it does',
      );
    }
    this.armPrefetchRetry();
  }

  armPrefetchRetry() {
    if (this.prefetchTimer || this.closed) return;
    this.prefetchTimer = setInterval(() => {
      if (this.closed || this.unfetched.size === 0) {
        clearInterval(this.prefetchTimer);
        this.prefetchTimer = null;
        return;
      }
      // down() also asks a channel in TRANSIENT_FAILURE to reconnect (bounded backoff, ≤ 1 s).
      if (this.client.down()) return;
      for (const q of [...this.unfetched]) {
        this.refresh(q).then((cause) => {
          if (this.policies.has(q) || (cause !== 'unavailable' && cause !== 'deadline_exceeded')) {
            if (this.unfetched.delete(q) && this.policies.has(q)) {
              this.logger.info({ event: 'rebound.prefetched', queue: q, target: this.target }, 'policy loaded after the sidecar came back');
            }
          }
        });
      }
    }, PREFETCH_RETRY_MS);
    this.prefetchTimer.unref();
  }

  /** Fetches a queue's policy the first time the queue is seen; later calls return at once. */
  async warm(queue) {
    if (this.queues.has(queue)) return;
    this.noteQueue(queue);
    await this.inflight.get(queue);
  }

  async policy(queue) {
    this.queues.add(queue);
    if (!this.policies.has(queue)) await this.refresh(queue);
    const c = this.policies.get(queue);
    return c ? { policy: c.ref, resolved: c.resolved } : null;
  }

  /** The attempts limit for a new job: above the policy's maxAttempts, and above every valid one. */
  libraryAttempts(queue) {
    const c = this.policies.get(queue);
    return Math.max(LIBRARY_ATTEMPTS, c ? c.resolved.maxAttempts + 1 : 0);
  }

  metrics() {
    return structuredClone(this.counters);
  }

  async close() {
    if (this.closed) return;
    this.closed = true;
    clearInterval(this.timer);
    if (this.prefetchTimer) clearInterval(this.prefetchTimer);
    await Promise.allSettled(this.closers.map((c) => c()));
    this.client.close();
  }
}

module.exports = {
  ReboundCore,
  LIBRARY_ATTEMPTS,
  DEFAULT_POLICY,
  DEFAULT_IDENTITY,
  LAST_RESORT_DELAY_MS,
  normaliseAttempt,
  normaliseFailure,
  defaultErrorClass,
  defaultRetryAfterMs,
};
