'use strict';
// The webhook worker: POSTs each event to its endpoint with the event's idempotency key in
// the Idempotency-Key header. There is no retry code here: a failure is thrown, and the
// RetryPolicy (policy.yaml, through the Rebound sidecar) decides when to try again and
// when to give up into the dead-letter queue.
//
//   REDIS_URL=redis://127.0.0.1:6379 REBOUND_TARGET=127.0.0.1:7411 node worker.js

const { Worker } = require('bullmq');
const { Rebound, keyOf } = require('@rebound-dev/node');

const QUEUE = 'webhook-delivery';

function connection(redisUrl) {
  const u = new URL(redisUrl);
  return { host: u.hostname, port: Number(u.port || 6379), maxRetriesPerRequest: null };
}

/** An HTTP answer the receiver did not accept, as an error the policy can classify. */
function deliveryError(res) {
  const err = new Error(`receiver answered HTTP ${res.status}`);
  // 410: the endpoint is gone; the policy lists it as non-retryable.
  err.name = res.status === 410 ? 'InvalidEndpoint' : `http.${res.status}`;
  const retryAfter = res.headers.get('retry-after');
  if (retryAfter) err.retryAfter = retryAfter; // the adapter turns it into the pushback
  return err;
}

/** Error class: the HTTP class above, a timeout, or the socket error's code (ECONNREFUSED). */
function errorClass(err) {
  if (err?.name === 'TimeoutError' || err?.name === 'AbortError') return 'Timeout';
  return err?.cause?.code || (typeof err?.code === 'string' ? err.code : err?.name);
}

/**
 * Starts the worker. `rebound` defaults to a new adapter for REBOUND_TARGET; `onAttempt`
 * is told what each attempt saw ({key, attempt, status, errorClass}). Returns the BullMQ
 * Worker and the adapter.
 */
function startWorker({ redisUrl, rebound, timeoutMs = 1000, concurrency = 16, onAttempt = () => {} } = {}) {
  rebound ||= new Rebound({ errorClass });
  const worker = new Worker(
    QUEUE,
    // Runs killed with their worker count as attempts (the adapter's fault guarantees).
    rebound.bullmq.processor(async (job) => {
      const seen = { key: keyOf(job), attempt: job.attemptsMade + 1, status: 0, errorClass: '' };
      try {
        const res = await fetch(job.data.url, {
          method: 'POST',
          headers: { 'content-type': 'application/json', 'idempotency-key': keyOf(job) },
          body: JSON.stringify(job.data.event),
          signal: AbortSignal.timeout(timeoutMs),
        });
        await res.arrayBuffer();
        seen.status = res.status;
        if (!res.ok) throw deliveryError(res);
        return { status: res.status };
      } catch (err) {
        seen.errorClass = errorClass(err);
        throw err;
      } finally {
        onAttempt(seen);
      }
    }),
    // The queue's policy is fetched now, as the Worker is created (the fallback's copy).
    { connection: connection(redisUrl), concurrency, settings: rebound.bullmq.settings(QUEUE) },
  );
  return { worker, rebound };
}

module.exports = { QUEUE, startWorker, connection, errorClass };

if (require.main === module) {
  const { worker, rebound } = startWorker({ redisUrl: process.env.REDIS_URL || 'redis://127.0.0.1:6379' });
  rebound.on('decision', (d) => console.log(JSON.stringify({ event: 'decision', key: d.jobId, attempt: d.attempt, decision: d.decision, delayMs: d.delayMs, source: d.source, policySource: d.policySource })));
  rebound.on('deadLetter', (d) => console.log(JSON.stringify({ event: 'deadLetter', key: d.key, queue: d.deadLetterQueue, reason: d.reason })));
  worker.on('completed', (job) => console.log(JSON.stringify({ event: 'delivered', key: keyOf(job) })));
  process.once('SIGTERM', () => worker.close().then(() => rebound.close()));
  process.once('SIGINT', () => worker.close().then(() => rebound.close()));
}
