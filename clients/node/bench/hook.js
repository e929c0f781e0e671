#!/usr/bin/env node
'use strict';
// Benchmark (not a test): the hook's cost as the worker sees it.
//
//   node bench/hook.js [--sidecar PATH] [--policies FILE] [--calls N] [--rounds R]
//
// Starts a rebound-sidecar (default: the repository's target/release/rebound-sidecar)
// on a free 127.0.0.1 port and a Unix socket, with --policies-file (default
// examples/policies/webhooks.yaml), then measures, from this one process, sequential calls:
//   bare     a bare @grpc/grpc-js grpc.health.v1.Health/Check
//   decide   a bare Decide call on the same kind of channel
//   adapter  rebound.bullmq.backoffStrategy(...) end to end (normalisation, first-failure
//            bookkeeping in memory, Decide, answer mapping, counters, events)
// over TCP and over the Unix socket, interleaved in rounds so drift hits all alike; then
// the fallback: decideLocal alone, and the whole hook with the sidecar unreachable.
// Prints p50 / p99 / mean in microseconds.

const { spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { createRebound } = require('..');
const { PreparedPolicy, decidePrepared } = require('../lib/decide');
const { loadPackage, LOADER_OPTIONS } = require('../lib/client');

const REPO = path.resolve(__dirname, '..', '..', '..');
const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 ? args[i + 1] : dflt;
};
const SIDECAR = opt('sidecar', path.join(process.env.CARGO_TARGET_DIR ? path.resolve(REPO, process.env.CARGO_TARGET_DIR) : path.join(REPO, 'target'), 'release', 'rebound-sidecar'));
const POLICIES = opt('policies', path.join(REPO, 'examples', 'policies', 'webhooks.yaml'));
const CALLS = Number(opt('calls', 2000));
const ROUNDS = Number(opt('rounds', 10));
const QUEUE = 'webhooks';

const health = grpc.loadPackageDefinition(protoLoader.loadSync(path.join(__dirname, 'health.proto'), LOADER_OPTIONS)).grpc
  .health.v1;

function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function unary(stub, method, req) {
  return new Promise((resolve, reject) =>
    stub[method](req, { deadline: Date.now() + 1000 }, (e, r) => (e ? reject(e) : resolve(r))),
  );
}

async function waitServing(target) {
  const stub = new health.Health(target, grpc.credentials.createInsecure());
  for (let i = 0; i < 200; i++) {
    try {
      const r = await unary(stub, 'Check', { service: '' });
      if (r.status === 'SERVING') return stub.close();
    } catch {
      // not up yet
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`sidecar at ${target} never became SERVING`);
}

function stats(samplesNs) {
  const s = Float64Array.from(samplesNs, (x) => Number(x) / 1000).sort();
  const at = (q) => s[Math.min(s.length - 1, Math.floor(q * s.length))];
  const mean = s.reduce((a, b) => a + b, 0) / s.length;
  return { p50: at(0.5), p99: at(0.99), mean, n: s.length };
}

async function time(samples, fn) {
  const t0 = process.hrtime.bigint();
  await fn();
  samples.push(process.hrtime.bigint() - t0);
}

function row(name, st) {
  const f = (x) => x.toFixed(1).padStart(9);
  console.log(`${name.padEnd(34)}${f(st.p50)}${f(st.p99)}${f(st.mean)}${String(st.n).padStart(9)}`);
}

async function measureTransport(label, target) {
  const healthStub = new health.Health(target, grpc.credentials.createInsecure());
  const advisor = new (loadPackage().RetryAdvisor)(target, grpc.credentials.createInsecure());
  const rebound = createRebound({ target, logger: false });
  const err = Object.assign(new Error('HTTP 503'), { name: 'http.503' });
  const jobs = Array.from({ length: 1000 }, (_, i) => ({ id: `job-${i}`, queueName: QUEUE, name: 'deliver', data: {}, opts: {} }));
  const samples = { bare: [], decide: [], adapter: [] };
  let n = 0;
  const one = {
    bare: () => unary(healthStub, 'Check', { service: '' }),
    decide: () => unary(advisor, 'Decide', { queue: QUEUE, attempt: 2, job_id: jobs[n % 1000].id, error_class: 'http.503' }),
    adapter: () => rebound.bullmq.backoffStrategy(2, 'rebound', err, jobs[n % 1000]),
  };
  // Warm up every path (connections, JIT, the first-failure memory of every job).
  for (let i = 0; i < 2000; i++, n++) for (const k of Object.keys(one)) await one[k]();
  const names = Object.keys(one);
  for (let r = 0; r < ROUNDS; r++) {
    // Each round starts with another path, so no path is always measured last.
    for (const k of names.slice(r % names.length).concat(names.slice(0, r % names.length))) {
      for (let i = 0; i < CALLS / ROUNDS; i++, n++) await time(samples[k], one[k]);
    }
  }
  if (rebound.metrics().fallback.total !== 0) throw new Error(`${label}: the adapter fell back`);
  const out = {};
  for (const k of Object.keys(samples)) {
    out[k] = stats(samples[k]);
    row(`${label} ${k}`, out[k]);
  }
  console.log(`${label} adapter vs bare at p50: ${((out.adapter.p50 / out.bare.p50 - 1) * 100).toFixed(1)}%`);
  healthStub.close();
  advisor.close();
  await rebound.close();
  return out;
}

async function measureFallback() {
  const policy = {
    strategy: 'STRATEGY_EXPONENTIAL', baseMs: 2000, multiplier: 2, capMs: 900000, jitter: 'JITTER_FULL',
    jitterRatio: 0, scheduleMs: [], maxAttempts: 25, maxRetryDurationMs: 86400000,
    nonRetryableErrors: ['InvalidEndpoint', 'http.410'], terminal: 'DISPOSITION_DEAD_LETTER', deadLetterQueue: 'webhooks-dead',
  };
  const prepared = new PreparedPolicy(policy, 'bench/webhooks');
  const local = [];
  const now = Date.now();
  for (let i = 0; i < 20000; i++) {
    const t0 = process.hrtime.bigint();
    decidePrepared(prepared, 1 + (i % 24), { jobId: `3f0c9a4e-${i % 1000}-4e3a-9c1e-2b7d5f8a0c31`, errorClass: 'http.503', firstFailureUnixMs: now - 60000, nowUnixMs: now });
    local.push(process.hrtime.bigint() - t0);
  }
  row('fallback decideLocal', stats(local.slice(5000)));

  const rebound = createRebound({ target: `127.0.0.1:${await freePort()}`, logger: false });
  const err = Object.assign(new Error('HTTP 503'), { name: 'http.503' });
  const jobs = Array.from({ length: 1000 }, (_, i) => ({ id: `job-${i}`, queueName: QUEUE, name: 'deliver', data: {}, opts: {} }));
  const hook = [];
  for (let i = 0; i < 20000; i++) {
    await time(hook, () => rebound.bullmq.backoffStrategy(2, 'rebound', err, jobs[i % 1000]));
  }
  row('fallback hook, sidecar unreachable', stats(hook.slice(5000)));
  await rebound.close();
}

async function main() {
  if (!fs.existsSync(SIDECAR)) throw new Error(`no sidecar binary at ${SIDECAR}: cargo build --release -p rebound-sidecar`);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rebound-bench-'));
  const sock = path.join(dir, 'rebound.sock');
  const port = await freePort();
  const child = spawn(
    SIDECAR,
    ['--policies-file', POLICIES, '--namespace', 'bench', '--listen', `127.0.0.1:${port}`, '--uds', sock, '--no-admin'],
    { stdio: ['ignore', 'ignore', 'inherit'], env: { ...process.env, RUST_LOG: 'warn' } },
  );
  try {
    await waitServing(`127.0.0.1:${port}`);
    console.log(`node ${process.version}, ${os.cpus().length} CPUs (${os.cpus()[0].model}), load ${os.loadavg()[0].toFixed(2)}`);
    console.log(`${''.padEnd(34)}${'p50 µs'.padStart(9)}${'p99 µs'.padStart(9)}${'mean µs'.padStart(9)}${'calls'.padStart(9)}`);
    await measureTransport('tcp', `127.0.0.1:${port}`);
    await measureTransport('uds', `unix://${sock}`);
    await measureFallback();
  } finally {
    child.kill('SIGTERM');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e);
  process.exitCode = 1;
});
