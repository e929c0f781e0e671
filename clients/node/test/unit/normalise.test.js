'use strict';
// What the adapter sends: the attempt normalised to the proto's 1-based "run that just
// failed", the stable job id, the error class and the pushback, as the sidecar receives them.
const test = require('node:test');
const assert = require('node:assert/strict');
const { createRebound } = require('../..');
const { normaliseAttempt, normaliseFailure, defaultErrorClass, defaultRetryAfterMs } = require('../../lib/rebound');
const { startAdvisor, grpc } = require('./advisor-server');

test('attempt normalisation', () => {
  // Both libraries pass the count including the failure being handled: kept as is.
  assert.equal(normaliseAttempt(1), 1);
  assert.equal(normaliseAttempt(7), 7);
  // Never 0 (INVALID_ARGUMENT at the sidecar), never above uint32.
  for (const bad of [0, -3, NaN, undefined, null, 'x']) assert.equal(normaliseAttempt(bad), 1, String(bad));
  assert.equal(normaliseAttempt(2.9), 2);
  assert.equal(normaliseAttempt('4'), 4);
  assert.equal(normaliseAttempt(2 ** 40), 4294967295);
});

test('default error class: a string code first, then the name', () => {
  const e = new Error('x');
  assert.equal(defaultErrorClass(e), 'Error');
  e.name = 'CardDeclined';
  assert.equal(defaultErrorClass(e), 'CardDeclined');
  e.code = 'ECONNRESET';
  assert.equal(defaultErrorClass(e), 'ECONNRESET');
  e.code = 503; // numeric codes are not classes
  assert.equal(defaultErrorClass(e), 'CardDeclined');
  assert.equal(defaultErrorClass(undefined), undefined);
  assert.equal(defaultErrorClass('a string'), undefined);
});

test('job id and error class limits count UTF-8 bytes, at the boundaries', () => {
  const f = (jobId, errorClass) => normaliseFailure({ queue: 'q', attempt: 1, jobId, errorClass });
  const three = '€'; // 3 UTF-8 bytes, 1 UTF-16 unit
  const four = '😀'; // 4 UTF-8 bytes, 2 UTF-16 units
  assert.equal(f('a'.repeat(512)).jobId, 'a'.repeat(512));
  assert.match(f('a'.repeat(513)).jobId, /^[0-9a-f]{64}$/);
  assert.equal(f(three.repeat(170) + 'ab').jobId, three.repeat(170) + 'ab'); // 512 bytes
  assert.match(f(three.repeat(171)).jobId, /^[0-9a-f]{64}$/); // 513 bytes
  assert.equal(f(four.repeat(128)).jobId, four.repeat(128)); // 512 bytes
  assert.match(f(four.repeat(128) + 'a').jobId, /^[0-9a-f]{64}$/);
  assert.equal(f('j', 'e'.repeat(253)).errorClass, 'e'.repeat(253));
  assert.equal(f('j', 'e'.repeat(254)).errorClass, 'e'.repeat(253));
  assert.equal(f('j', three.repeat(84) + 'x').errorClass, three.repeat(84) + 'x'); // 253 bytes
  // Cut before a character that would not fit whole.
  assert.equal(f('j', three.repeat(85)).errorClass, three.repeat(84));
  assert.equal(f('j', 'e'.repeat(250) + four).errorClass, 'e'.repeat(250));
});

test('default pushback: retryAfterMs, or Retry-After seconds / HTTP date', () => {
  const now = Date.UTC(2026, 0, 1, 12, 0, 0);
  assert.equal(defaultRetryAfterMs({ retryAfterMs: 1500 }, now), 1500);
  assert.equal(defaultRetryAfterMs({ retryAfter: 7 }, now), 7000);
  assert.equal(defaultRetryAfterMs({ retryAfter: ' 120 ' }, now), 120000);
  assert.equal(defaultRetryAfterMs({ retryAfter: 'Thu, 01 Jan 2026 12:00:30 GMT' }, now), 30000);
  // Without a clock given, an HTTP date is measured from now.
  const ahead = defaultRetryAfterMs({ retryAfter: new Date(Date.now() + 60000).toUTCString() });
  assert.ok(ahead > 55000 && ahead <= 60000, `${ahead}`);
  assert.equal(defaultRetryAfterMs({ retryAfter: 'Thu, 01 Jan 2026 11:00:00 GMT' }, now), 0);
  assert.equal(defaultRetryAfterMs({ retryAfter: 'soon' }, now), undefined);
  assert.equal(defaultRetryAfterMs(new Error('x'), now), undefined);
});

test('the Decide request carries attempt, job id, error class, first failure and pushback', async () => {
  const server = await startAdvisor({
    decide: (req) => ({
      decision: 'DECISION_RETRY',
      delay_ms: String(1000 + req.attempt),
      policy: { name: 'p', namespace: 'ns', generation: '2', config_hash: 'sha256:b' },
    }),
  });
  const rebound = createRebound({
    target: server.target,
    logger: false,
    errorClass: (err) => (err.status ? `http.${err.status}` : undefined),
  });
  try {
    const job = { id: 'key-1', queueName: 'webhooks', name: 'deliver', data: {}, opts: {} };
    const err = Object.assign(new Error('HTTP 429'), { status: 429, retryAfter: '3' });
    const before = Date.now();
    assert.equal(await rebound.bullmq.backoffStrategy(1, 'rebound', err, job), 1001);
    assert.equal(await rebound.bullmq.backoffStrategy(2, 'rebound', new Error('plain'), job), 1002);
    const long = { ...job, id: 'k'.repeat(600) };
    await rebound.bullmq.backoffStrategy(1, 'rebound', Object.assign(new Error(), { status: 500 }), long);
    const [a, b, c] = server.requests.Decide;
    assert.equal(a.queue, 'webhooks');
    assert.equal(a.attempt, 1);
    assert.equal(a.job_id, 'key-1');
    assert.equal(a.error_class, 'http.429');
    assert.equal(a.retry_after_ms, '3000');
    const ff = Number(a.first_failure_unix_ms);
    assert.ok(ff >= before && ff <= Date.now(), `first failure ${ff}`);
    // The second attempt sends the same first failure, no class (mapper gave none), no pushback.
    assert.equal(b.attempt, 2);
    assert.equal(b.first_failure_unix_ms, a.first_failure_unix_ms);
    assert.equal(b.error_class, '');
    assert.equal(b.retry_after_ms, '0');
    // A job id over 512 bytes is sent as its SHA-256, so the sidecar never refuses it.
    assert.match(c.job_id, /^[0-9a-f]{64}$/);
    const m = rebound.metrics();
    assert.equal(m.decisions.retry, 3);
    assert.equal(m.fallback.total, 0);
  } finally {
    await rebound.close();
    await server.close();
  }
});

test('the sidecar answering INVALID_ARGUMENT still gets an answer (fallback, cause other)', async () => {
  const server = await startAdvisor({
    decide: () => ({ error: { code: grpc.status.INVALID_ARGUMENT, details: 'first_failure_unix_ms: in the future' } }),
  });
  const rebound = createRebound({ target: server.target, logger: false });
  try {
    const a = await rebound.decide({ queue: 'q', attempt: 2, jobId: 'j' });
    assert.equal(a.source, 'fallback');
    assert.equal(rebound.metrics().fallback.other, 1);
  } finally {
    await rebound.close();
    await server.close();
  }
});

test('options are checked and name the field', () => {
  assert.throws(() => createRebound({ deadlineMs: 0 }), /^TypeError: deadlineMs:/);
  assert.throws(() => createRebound({ target: 'http://x' }), /^TypeError: target:/);
  assert.throws(() => createRebound({ errorClass: 'Code' }), /^TypeError: errorClass:/);
  assert.throws(() => createRebound({ defaultPolicy: { baseMs: 1 } }), /^TypeError: defaultPolicy\.capMs:/);
  const { DEFAULT_POLICY } = require('../..');
  assert.throws(() => createRebound({ defaultPolicy: { ...DEFAULT_POLICY, strategy: 'STRATEGY_FAST' } }), /^TypeError: defaultPolicy\.strategy:/);
});

test('a Unix socket target: Decide and GetPolicy answered over it', async () => {
  const fs = require('node:fs');
  const os = require('node:os');
  const path = require('node:path');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rebound-uds-'));
  const ref = { name: 'p', namespace: 'ns', generation: '1', config_hash: 'sha256:u' };
  const server = await startAdvisor(
    {
      decide: () => ({ decision: 'DECISION_RETRY', delay_ms: '1234', policy: ref }),
      getPolicy: () => ({ policy: ref, resolved: { strategy: 'STRATEGY_CONSTANT', base_ms: 5, cap_ms: 5, jitter: 'JITTER_NONE', max_attempts: 3, terminal: 'DISPOSITION_DROP' } }),
    },
    { uds: path.join(dir, 'rebound.sock') },
  );
  const rebound = createRebound({ target: server.target, logger: false });
  try {
    assert.match(server.target, /^unix:\/\/\//);
    const a = await rebound.decide({ queue: 'q', attempt: 1, jobId: 'j' });
    assert.equal(a.source, 'sidecar');
    assert.equal(a.delayMs, 1234);
    assert.equal((await rebound.policy('q')).resolved.maxAttempts, 3);
  } finally {
    await rebound.close();
    await server.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
