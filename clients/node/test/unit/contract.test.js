'use strict';
// The adapter contract (docs/adapters.md) at unit level: a malformed REBOUND_TARGET refused
// at start naming it, the core object's name, the default policy equal to the shared file,
// and the policies of the worker's queues fetched when the Worker is created.
const { test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { Queue, Worker } = require('bullmq');
const Bull = require('bull');
const { Rebound, createRebound, DEFAULT_POLICY } = require('../..');
const { DEFAULT_IDENTITY } = require('../../lib/rebound');
const { CHANNEL_OPTIONS } = require('../../lib/client');
const { startAdvisor, closedPort, grpc } = require('./advisor-server');
const { startRedis, eventually } = require('./redis');
const { REPO } = require('./helpers');

function withEnv(vars, fn) {
  const saved = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
  Object.assign(process.env, vars);
  try {
    return fn();
  } finally {
    for (const [k, v] of Object.entries(saved)) if (v === undefined) delete process.env[k];
    else process.env[k] = v;
  }
}

test('a malformed REBOUND_TARGET is refused at start, naming REBOUND_TARGET', () => {
  for (const bad of ['http://127.0.0.1:1', ':7411', '127.0.0.1:', '127.0.0.1:99999', '127.0.0.1:0', 'unix:relative.sock', 'host']) {
    const err = withEnv({ REBOUND_TARGET: bad }, () => {
      try {
        createRebound({ logger: false });
      } catch (e) {
        return e;
      }
      return null;
    });
    assert.ok(err, `${bad} refused`);
    assert.equal(err.name, 'TypeError');
    assert.equal(err.code, 'REBOUND_BAD_TARGET', bad);
    assert.equal(err.variable, 'REBOUND_TARGET');
    assert.match(err.message, /^REBOUND_TARGET: /, bad);
  }
  // The option names itself, and REBOUND_TARGET too.
  assert.throws(() => createRebound({ target: 'http://x:1' }), (e) => e.code === 'REBOUND_BAD_TARGET' && /^target: .*REBOUND_TARGET/.test(e.message));
  for (const good of ['127.0.0.1:7411', 'localhost:1', '[::1]:65535', 'unix:///run/rebound/rebound.sock', 'unix:/tmp/x.sock']) {
    withEnv({ REBOUND_TARGET: good }, () => createRebound({ logger: false }).close());
  }
});

test('the core object is Rebound (createRebound makes one)', async () => {
  const a = new Rebound({ logger: false });
  const b = createRebound({ logger: false });
  try {
    assert.ok(b instanceof Rebound);
    for (const r of [a, b]) {
      assert.equal(typeof r.bullmq.settings, 'function');
      assert.equal(typeof r.bull.attach, 'function');
      assert.equal(typeof r.decide, 'function');
    }
  } finally {
    await a.close();
    await b.close();
  }
});

test('the gRPC channel reconnects within 1 s of the sidecar being back (bounded backoff)', () => {
  assert.ok(CHANNEL_OPTIONS['grpc.max_reconnect_backoff_ms'] <= 1000);
  assert.ok(CHANNEL_OPTIONS['grpc.initial_reconnect_backoff_ms'] <= 100);
});

const DEFAULT_FILE = path.join(REPO, 'clients', 'conformance', 'default-policy.json');
test('DEFAULT_POLICY equals clients/conformance/default-policy.json', { skip: !fs.existsSync(DEFAULT_FILE) && 'default-policy.json not in this checkout yet' }, () => {
  const doc = JSON.parse(fs.readFileSync(DEFAULT_FILE, 'utf8'));
  // The GetPolicy JSON form: the ResolvedPolicy fields, at the top or under `resolved`.
  const resolved = doc.resolved || doc.policy?.resolved || doc;
  const fields = Object.fromEntries(Object.keys(DEFAULT_POLICY).map((k) => [k, resolved[k]]));
  assert.deepEqual(fields, { ...DEFAULT_POLICY, scheduleMs: [...DEFAULT_POLICY.scheduleMs], nonRetryableErrors: [...DEFAULT_POLICY.nonRetryableErrors] });
  const identity = doc.identity ?? doc.jitterIdentity;
  if (identity !== undefined) assert.equal(identity, DEFAULT_IDENTITY);
});

const REF = { name: 'p', namespace: 'ns', generation: '1', config_hash: 'sha256:pre' };
const RESOLVED = { strategy: 'STRATEGY_CONSTANT', base_ms: 70, cap_ms: 70, jitter: 'JITTER_NONE', max_attempts: 3, terminal: 'DISPOSITION_DEAD_LETTER', dead_letter_queue: 'dead' };

test('BullMQ and Bull: the Worker\'s queue policy is fetched when the worker is created, before any job', async () => {
  const redis = startRedis();
  const server = await startAdvisor({ decide: () => ({ error: { code: grpc.status.UNAVAILABLE } }), getPolicy: () => ({ policy: REF, resolved: RESOLVED }) });
  const rebound = createRebound({ target: server.target, logger: false });
  const worker = new Worker('pre-mq', async () => {}, { connection: redis.connection, settings: rebound.bullmq.settings('pre-mq'), autorun: false });
  const bull = rebound.bull.attach(new Bull('pre-bull', redis.url));
  try {
    // Both queues asked (a call that timed out on a loaded machine is asked again).
    const asked = () => [...new Set(server.requests.GetPolicy.map((r) => r.queue))].sort();
    await eventually(() => asked().length === 2, 10000, 'GetPolicy for both queues');
    assert.deepEqual(asked(), ['pre-bull', 'pre-mq']);
    // So an outage decides from the real policy at once.
    const a = await rebound.decide({ queue: 'pre-mq', attempt: 1, jobId: 'j' });
    assert.deepEqual([a.source, a.policySource, a.delayMs], ['fallback', 'cached', 70]);
  } finally {
    await worker.close();
    await bull.close();
    await rebound.close();
    await server.close();
    redis.stop();
  }
});

test('sidecar down at start: the worker starts, one warning names the target, the policy is fetched once it is up', async (t) => {
  const port = await closedPort();
  const lines = [];
  const logger = { info: (f) => lines.push({ level: 'info', ...f }), warn: (f) => lines.push({ level: 'warn', ...f }), error: (f) => lines.push({ level: 'error', ...f }) };
  const rebound = createRebound({ target: `127.0.0.1:${port}`, logger });
  let server;
  try {
    rebound.bullmq.settings(['late-a', 'late-b']);
    await eventually(() => lines.some((l) => l.event === 'rebound.sidecar_unreachable'), 10000, 'the warning');
    const before = await rebound.decide({ queue: 'late-a', attempt: 1, jobId: 'j' });
    assert.deepEqual([before.source, before.policySource], ['fallback', 'default']);
    server = await startAdvisor({ decide: () => ({ error: { code: grpc.status.UNAVAILABLE } }), getPolicy: () => ({ policy: REF, resolved: RESOLVED }) }, { port });
    const upAt = Date.now();
    await eventually(async () => (await rebound.policy('late-b')) !== null && server.requests.GetPolicy.length >= 2, 10000, 'prefetched after the sidecar came up');
    const ms = Date.now() - upAt;
    const a = await rebound.decide({ queue: 'late-a', attempt: 1, jobId: 'j' });
    assert.deepEqual([a.source, a.policySource, a.delayMs], ['fallback', 'cached', 70]);
    const warnings = lines.filter((l) => l.event === 'rebound.sidecar_unreachable');
    assert.equal(warnings.length, 1);
    assert.equal(warnings[0].level, 'warn');
    assert.equal(warnings[0].target, `127.0.0.1:${port}`);
    assert.deepEqual(warnings[0].queues, ['late-a', 'late-b']);
    assert.ok(ms < 5000, `policies fetched ${ms} ms after the sidecar came up`);
    t.diagnostic(`prefetched ${ms} ms after the sidecar came up`);
  } finally {
    await rebound.close();
    await server?.close();
  }
});

test('prefetch: an answer that is not "unreachable" (NOT_FOUND, INVALID_ARGUMENT) is final: no warning, no retrying', async () => {
  const lines = [];
  const logger = { info: (f) => lines.push(f), warn: (f) => lines.push(f), error: (f) => lines.push(f) };
  const server = await startAdvisor({
    decide: () => ({ error: { code: grpc.status.UNAVAILABLE } }),
    getPolicy: (req) => ({ error: { code: req.queue === 'ungoverned' ? grpc.status.NOT_FOUND : grpc.status.INVALID_ARGUMENT, details: 'no' } }),
  });
  const rebound = createRebound({ target: server.target, logger });
  try {
    await rebound.prefetch(['ungoverned', 'x'.repeat(300)]);
    await new Promise((r) => setTimeout(r, 1200)); // two retry periods
    assert.equal(server.requests.GetPolicy.length, 2, 'asked once each');
    assert.deepEqual(lines.filter((l) => l.event === 'rebound.sidecar_unreachable'), []);
    assert.equal(rebound.unfetched.size, 0);
  } finally {
    await rebound.close();
    await server.close();
  }
});
