'use strict';
// The stall count the hook adds to the attempt: a plain number (BullMQ, Bull) is taken as
// it is, a promise is awaited, and one that never settles is given up on after the Redis
// timeout (the attempt then stays the library's count, and the problem is counted).
const test = require('node:test');
const assert = require('node:assert/strict');
const { createRebound } = require('../..');
const { runHook } = require('../../lib/hook');
const { closedPort } = require('./advisor-server');

function spec(stalledRuns) {
  const err = Object.assign(new Error('boom'), { name: 'TransientError' });
  return { adapter: 'bullmq', queue: 'payments', jobId: 'job-1', attemptsMade: 2, stalledRuns, err };
}

test('a stall count as a number, a promise, or a promise that never settles', async () => {
  const rebound = createRebound({ target: `127.0.0.1:${await closedPort()}`, logger: false });
  const attempts = [];
  rebound.on('decision', (d) => attempts.push(d.attempt));
  try {
    await runHook(rebound, spec(() => 1));
    await runHook(rebound, spec(() => Promise.resolve(1)));
    assert.deepEqual(attempts, [3, 3]);
    assert.equal(rebound.metrics().hookErrors, 0);

    await runHook(rebound, spec(() => new Promise(() => {})));
    assert.deepEqual(attempts, [3, 3, 2]);
    assert.equal(rebound.metrics().hookErrors, 1);
  } finally {
    await rebound.close();
  }
});
