'use strict';
// @rebound-dev/node: Rebound retry policies for BullMQ and Bull workers. See README.md.

const { Rebound, LIBRARY_ATTEMPTS, DEFAULT_POLICY } = require('./lib/rebound');
const { createBullMQAdapter } = require('./lib/bullmq');
const { createBullAdapter } = require('./lib/bull');
const { decideLocal } = require('./lib/decide');

/** Creates an adapter instance: one per process is enough (it holds one gRPC channel). */
function createRebound(options = {}) {
  const rebound = new Rebound(options);
  rebound.bullmq = createBullMQAdapter(rebound);
  rebound.bull = createBullAdapter(rebound);
  return rebound;
}

/** The idempotency key of a job enqueued through Rebound: its id. */
function keyOf(job) {
  return String(job.id);
}

module.exports = { createRebound, keyOf, LIBRARY_ATTEMPTS, DEFAULT_POLICY, decideLocal };
