'use strict';
// @rebound-dev/node: Rebound retry policies for BullMQ and Bull workers. See README.md.

const { ReboundCore, LIBRARY_ATTEMPTS, DEFAULT_POLICY } = require('./lib/rebound');
const { createBullMQAdapter } = require('./lib/bullmq');
const { createBullAdapter } = require('./lib/bull');
const { decideLocal } = require('./lib/decide');
const { arm } = require('./lib/assign');

/**
 * The adapter: one per process is enough (it holds one gRPC channel). `rebound.bullmq`
 * and `rebound.bull` carry the two libraries' hooks.
 */
class Rebound extends ReboundCore {
  constructor(options = {}) {
    super(options);
    this.bullmq = createBullMQAdapter(this);
    this.bull = createBullAdapter(this);
  }
}

/** `new Rebound(options)`. */
function createRebound(options = {}) {
  return new Rebound(options);
}

/** The idempotency key of a job enqueued through Rebound: its id. */
function keyOf(job) {
  return String(job.id);
}

module.exports = { Rebound, createRebound, keyOf, LIBRARY_ATTEMPTS, DEFAULT_POLICY, decideLocal, arm };
