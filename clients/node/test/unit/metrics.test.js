'use strict';
// The rebound_adapter_* counters in the application's prom-client Registry, read back from
// its text exposition: fallbacks against a closed port, a drop, an absorbed hook fault, two
// instances adding up in one registry, and nothing registered without a registry.
const test = require('node:test');
const assert = require('node:assert/strict');
const { Registry } = require('prom-client');
const { createRebound } = require('../..');
const { closedPort } = require('./advisor-server');

/** Parses the text exposition into { 'name{a="x",b="y"}': value } (labels sorted). */
async function samples(registry) {
  const out = {};
  for (const line of (await registry.metrics()).split('\n')) {
    if (line === '' || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    assert.ok(m, `exposition line: ${line}`);
    const labels = [...(m[2] || '').matchAll(/([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g)].map(([, k, v]) => `${k}="${v}"`).sort();
    out[`${m[1]}{${labels.join(',')}}`] = Number(m[3]);
  }
  return out;
}

function job(id) {
  return { id, queueName: 'payments', name: 'charge', data: {}, opts: {} };
}

test('closed port: fallbacks by reason and policy source, a drop, every series from the first use', async () => {
  const registry = new Registry();
  const rebound = createRebound({ target: `127.0.0.1:${await closedPort()}`, logger: false, registry });
  try {
    assert.deepEqual(await samples(registry), {}, 'no series before the hook is used');
    // The default policy allows 10 attempts and drops: 9 retries, then one give-up (drop).
    for (let attempt = 1; attempt <= 10; attempt++) {
      await rebound.bullmq.backoffStrategy(attempt, 'rebound', new Error('boom'), job('job-1'));
    }
    const s = await samples(registry);
    const want = {
      'rebound_adapter_decisions_total{adapter="bullmq",source="sidecar"}': 0,
      'rebound_adapter_decisions_total{adapter="bullmq",source="fallback"}': 10,
      'rebound_adapter_terminal_total{adapter="bullmq",disposition="dead_letter"}': 0,
      'rebound_adapter_terminal_total{adapter="bullmq",disposition="drop"}': 1,
      'rebound_adapter_hook_errors_total{adapter="bullmq"}': 0,
    };
    for (const reason of ['unavailable', 'deadline_exceeded', 'not_found', 'other']) {
      for (const ps of ['cached', 'default']) {
        want[`rebound_adapter_fallbacks_total{adapter="bullmq",policy_source="${ps}",reason="${reason}"}`] = reason === 'unavailable' && ps === 'default' ? 10 : 0;
      }
    }
    const wantSorted = Object.fromEntries(Object.entries(want).map(([k, v]) => [k.replace(/\{(.*)\}/, (_, l) => `{${l.split(',').sort().join(',')}}`), v]));
    assert.deepEqual(s, wantSorted);
  } finally {
    await rebound.close();
  }
});

test('a fault absorbed by the hook counts in hook_errors_total; a direct decide() counts in metrics() only', async () => {
  const registry = new Registry();
  const rebound = createRebound({
    target: `127.0.0.1:${await closedPort()}`,
    logger: false,
    registry,
    errorClass: () => {
      throw new Error('mapper bug');
    },
  });
  try {
    await rebound.bullmq.backoffStrategy(1, 'rebound', new Error('boom'), job('job-2'));
    await rebound.decide({ queue: 'payments', attempt: 1, jobId: 'job-3' });
    const s = await samples(registry);
    assert.equal(s['rebound_adapter_hook_errors_total{adapter="bullmq"}'], 1);
    assert.equal(s['rebound_adapter_decisions_total{adapter="bullmq",source="fallback"}'], 1);
    assert.equal(rebound.metrics().fallback.total, 2);
  } finally {
    await rebound.close();
  }
});

test('two instances in one registry add up; decide() with adapter "bull" counts as bull', async () => {
  const registry = new Registry();
  const target = `127.0.0.1:${await closedPort()}`;
  const a = createRebound({ target, logger: false, registry });
  const b = createRebound({ target, logger: false, registry });
  try {
    await a.bullmq.backoffStrategy(1, 'rebound', new Error('boom'), job('a-1'));
    await b.bullmq.backoffStrategy(1, 'rebound', new Error('boom'), job('b-1'));
    await b.decide({ queue: 'bull-q', attempt: 1, jobId: 'c-1' }, { adapter: 'bull' });
    const s = await samples(registry);
    assert.equal(s['rebound_adapter_decisions_total{adapter="bullmq",source="fallback"}'], 2);
    assert.equal(s['rebound_adapter_decisions_total{adapter="bull",source="fallback"}'], 1);
  } finally {
    await a.close();
    await b.close();
  }
});

test('a registry that is not one, or a name taken by another kind of metric, fails naming the field', async () => {
  assert.throws(() => createRebound({ logger: false, registry: {} }), /^TypeError: registry: must be a prom-client Registry/);
  const { Gauge } = require('prom-client');
  const registry = new Registry();
  new Gauge({ name: 'rebound_adapter_decisions_total', help: 'taken', registers: [registry] });
  assert.throws(() => createRebound({ logger: false, registry }), /^TypeError: registry: rebound_adapter_decisions_total is registered already/);
});
