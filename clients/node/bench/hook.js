#!/usr/bin/env node
'use strict';
// Benchmark (not a test): the hook's cost as the worker sees it.
//
//   node bench/hook.js [--sidecar PATH] [--policies FILE] [--calls N] [--rounds R] [--json FILE]
//
// Starts a rebound-sidecar (--sidecar, else REBOUND_SIDECAR, else
// $CARGO_TARGET_DIR/release/rebound-sidecar, default target/) on a free 127.0.0.1 port and a
// Unix socket, with --policies-file (default examples/policies/webhooks.yaml), then measures,
// from this one process, sequential calls on each transport:
//   check    a bare @grpc/grpc-js grpc.health.v1.Health/Check (the issue's "bare call")
//   decide   a bare Decide with the request the adapter sends, on a channel of its own
//   client   the same Decide through the adapter's own gRPC client (its channel options and
//            call wrapper), without the hook around it
//   hook     rebound.bullmq.backoffStrategy(...) end to end (normalisation, first-failure
//            bookkeeping in memory, Decide, answer mapping, counters, events)
// Each path warms up first (connections, JIT, the first-failure memory of every job). Then
// R rounds; in each, every path makes N/R calls in a block, in an order that rotates from
// round to round. A path's figure is the median of its round medians; a ratio is the
// median over rounds of the ratio of the two paths' medians in that round, so load that
// drifts during a run touches both sides of a ratio alike. The quartiles of the per-round
// ratios show the spread. "cpu" is this process's CPU time (all its threads: the client side
// alone) per call. Then the adapter in process (the gRPC call replaced by a resolved
// promise), and the fallback: decideLocal alone, and the whole hook with the
// sidecar unreachable.

const { spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { createRebound } = require('..');
const { PreparedPolicy, decidePrepared } = require('../lib/decide');
const { AdvisorClient, loadPackage, LOADER_OPTIONS } = require('../lib/client');

const REPO = path.resolve(__dirname, '..', '..', '..');
const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 ? args[i + 1] : dflt;
};
const TARGET_DIR = process.env.CARGO_TARGET_DIR ? path.resolve(REPO, process.env.CARGO_TARGET_DIR) : path.join(REPO, 'target');
const SIDECAR = opt('sidecar', process.env.REBOUND_SIDECAR || path.join(TARGET_DIR, 'release', 'rebound-sidecar'));
const POLICIES = opt('policies', path.join(REPO, 'examples', 'policies', 'webhooks.yaml'));
const CALLS = Number(opt('calls', 10000));
const ROUNDS = Number(opt('rounds', 20));
const JSON_OUT = opt('json', undefined);
const QUEUE = 'webhooks';
const JOBS = 1000;
/** A first failure a minute ago, as the adapter sends it (it remembers its own). */
const FIRST_FAILURE_MS = Date.now() - 60000;
/** Generous: a call stalled by an overloaded machine is a p99 sample, not a failed run. */
const DEADLINE_MS = 10000;

if (!(Number.isInteger(CALLS) && Number.isInteger(ROUNDS) && ROUNDS >= 2 && CALLS >= ROUNDS)) {
  throw new TypeError(`--calls ${CALLS} --rounds ${ROUNDS}: need whole numbers, rounds >= 2, calls >= rounds`);
}

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
    stub[method](req, { deadline: Date.now() + DEADLINE_MS }, (e, r) => (e ? reject(e) : resolve(r))),
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

const sorted = (xs) => Float64Array.from(xs).sort();
const quantile = (s, q) => s[Math.min(s.length - 1, Math.floor(q * s.length))];
const median = (xs) => quantile(sorted(xs), 0.5);

function fmt(x, width = 9) {
  return x.toFixed(1).padStart(width);
}
const pct = (r) => `${r >= 1 ? '+' : '−'}${Math.abs((r - 1) * 100).toFixed(1)}%`;

async function measureTransport(label, target) {
  const checkStub = new health.Health(target, grpc.credentials.createInsecure());
  const advisor = new (loadPackage().RetryAdvisor)(target, grpc.credentials.createInsecure());
  const client = new AdvisorClient(target, DEADLINE_MS, 'target');
  const rebound = createRebound({ target, logger: false, deadlineMs: DEADLINE_MS });
  const err = Object.assign(new Error('HTTP 503'), { name: 'http.503' });
  const jobs = Array.from({ length: JOBS }, (_, i) => ({ id: `job-${i}`, queueName: QUEUE, name: 'deliver', data: {}, opts: {} }));
  // What the adapter sends for these jobs (attempt 2, first failure from its memory).
  const requests = jobs.map((j) => ({
    queue: QUEUE,
    attempt: 2,
    job_id: j.id,
    error_class: 'http.503',
    first_failure_unix_ms: FIRST_FAILURE_MS,
    retry_after_ms: 0,
  }));
  // Attempt 1 of every job: the adapter remembers its first failure, later attempts skip Redis.
  for (const j of jobs) await rebound.bullmq.backoffStrategy(1, 'rebound', err, j);
  let n = 0;
  const paths = {
    check: () => unary(checkStub, 'Check', { service: '' }),
    decide: () => unary(advisor, 'Decide', requests[n % JOBS]),
    client: () => client.decide(requests[n % JOBS]),
    hook: () => rebound.bullmq.backoffStrategy(2, 'rebound', err, jobs[n % JOBS]),
  };
  const names = Object.keys(paths);
  const warm = Math.max(1000, CALLS / 5);
  for (let i = 0; i < warm; i++, n++) for (const k of names) await paths[k]();
  const perRound = Object.fromEntries(names.map((k) => [k, []]));
  const all = Object.fromEntries(names.map((k) => [k, []]));
  const block = Math.floor(CALLS / ROUNDS);
  const times = new Float64Array(block);
  const cpu = Object.fromEntries(names.map((k) => [k, 0]));
  for (let r = 0; r < ROUNDS; r++) {
    // Each round starts with another path, so no path is always measured right after another.
    for (const k of names.slice(r % names.length).concat(names.slice(0, r % names.length))) {
      const fn = paths[k];
      const c0 = process.cpuUsage();
      for (let i = 0; i < block; i++, n++) {
        const t0 = process.hrtime.bigint();
        await fn();
        times[i] = Number(process.hrtime.bigint() - t0) / 1000;
      }
      const c = process.cpuUsage(c0);
      cpu[k] += c.user + c.system;
      perRound[k].push(median(times));
      all[k].push(...times);
    }
  }
  // A call past its deadline on an overloaded machine is answered locally (a few µs):
  // counted and shown, since such a run measured a little less than the sidecar's path.
  const { fallback } = rebound.metrics();
  const out = { paths: {}, ratios: {}, fallbacks: fallback };
  if (fallback.total !== 0) console.log(`${label}: the adapter fell back ${fallback.total} times: ${JSON.stringify(fallback)}`);
  for (const k of names) {
    const s = sorted(all[k]);
    out.paths[k] = { p50: median(perRound[k]), p99: quantile(s, 0.99), cpu: cpu[k] / s.length, calls: s.length };
    const p = out.paths[k];
    console.log(`${`${label} ${k}`.padEnd(14)}${fmt(p.p50)}${fmt(p.p99)}${fmt(p.cpu)}${String(p.calls).padStart(9)}`);
  }
  for (const [a, b] of [['hook', 'check'], ['hook', 'decide'], ['decide', 'check'], ['client', 'decide'], ['hook', 'client']]) {
    const rs = sorted(perRound[a].map((x, r) => x / perRound[b][r]));
    out.ratios[`${a}/${b}`] = { median: quantile(rs, 0.5), q1: quantile(rs, 0.25), q3: quantile(rs, 0.75) };
    const q = out.ratios[`${a}/${b}`];
    console.log(`${label} ${a} vs ${b} at p50: ${pct(q.median)} (rounds' quartiles ${pct(q.q1)} … ${pct(q.q3)})`);
  }
  checkStub.close();
  advisor.close();
  client.close();
  await rebound.close();
  return out;
}

/**
 * The adapter's own cost: the hook with the gRPC call replaced by a resolved promise of a
 * real answer's shape, against that promise alone.
 */
async function measureInProcess() {
  const rebound = createRebound({ target: `127.0.0.1:${await freePort()}`, logger: false });
  const answer = {
    decision: 'DECISION_RETRY', delay_ms: '1234', disposition: 'DISPOSITION_UNSPECIFIED', dead_letter_queue: '',
    reason: 'GIVE_UP_REASON_UNSPECIFIED', reason_message: '', budget_stretched: false, budget_delay_ms: '0',
    policy: { name: 'webhooks', namespace: 'bench', generation: '1', config_hash: 'sha256:bench' }, revision: '',
  };
  rebound.client.decide = () => Promise.resolve(answer);
  rebound.client.down = () => false;
  rebound.client.getPolicy = () => new Promise(() => {}); // one refresh in flight, never answered
  const err = Object.assign(new Error('HTTP 503'), { name: 'http.503' });
  const jobs = Array.from({ length: JOBS }, (_, i) => ({ id: `job-${i}`, queueName: QUEUE, name: 'deliver', data: {}, opts: {} }));
  for (const j of jobs) await rebound.bullmq.backoffStrategy(1, 'rebound', err, j);
  const bare = () => new Promise((resolve) => Promise.resolve(answer).then(resolve));
  const calls = 200000;
  const perRound = { hook: [], promise: [] };
  for (let r = 0; r < 11; r++) {
    for (const [k, fn] of [['hook', (i) => rebound.bullmq.backoffStrategy(2, 'rebound', err, jobs[i % JOBS])], ['promise', bare]]) {
      const t0 = process.hrtime.bigint();
      for (let i = 0; i < calls / 10; i++) await fn(i);
      if (r > 0) perRound[k].push(Number(process.hrtime.bigint() - t0) / (calls / 10) / 1000); // round 0 warms up
    }
  }
  await rebound.close();
  const out = { hook: median(perRound.hook), promise: median(perRound.promise) };
  console.log(`in process: hook ${out.hook.toFixed(2)} µs a call, a resolved promise ${out.promise.toFixed(2)} µs (median of 10 rounds)`);
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
    local.push(Number(process.hrtime.bigint() - t0) / 1000);
  }
  const rebound = createRebound({ target: `127.0.0.1:${await freePort()}`, logger: false });
  const err = Object.assign(new Error('HTTP 503'), { name: 'http.503' });
  const jobs = Array.from({ length: JOBS }, (_, i) => ({ id: `job-${i}`, queueName: QUEUE, name: 'deliver', data: {}, opts: {} }));
  const hook = [];
  for (let i = 0; i < 20000; i++) {
    const t0 = process.hrtime.bigint();
    await rebound.bullmq.backoffStrategy(2, 'rebound', err, jobs[i % JOBS]);
    hook.push(Number(process.hrtime.bigint() - t0) / 1000);
  }
  await rebound.close();
  const out = {};
  for (const [name, xs] of [['decideLocal', local], ['unreachable', hook]]) {
    const s = sorted(xs.slice(5000));
    out[name] = { p50: quantile(s, 0.5), p99: quantile(s, 0.99), calls: s.length };
    console.log(`${`fallback ${name}`.padEnd(22)}${fmt(out[name].p50)}${fmt(out[name].p99)}${String(s.length).padStart(9)}`);
  }
  return out;
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
    const load = os.loadavg()[0];
    console.log(`node ${process.version}, ${os.cpus().length} CPUs (${os.cpus()[0].model}), load ${load.toFixed(2)}`);
    console.log(`${CALLS} calls per path and transport in ${ROUNDS} rounds; p50: median of round medians`);
    console.log(`${''.padEnd(14)}${'p50 µs'.padStart(9)}${'p99 µs'.padStart(9)}${'cpu µs'.padStart(9)}${'calls'.padStart(9)}`);
    const result = { node: process.version, load, calls: CALLS, rounds: ROUNDS };
    result.tcp = await measureTransport('tcp', `127.0.0.1:${port}`);
    result.uds = await measureTransport('uds', `unix://${sock}`);
    result.inProcess = await measureInProcess();
    result.fallback = await measureFallback();
    result.loadAfter = os.loadavg()[0];
    if (JSON_OUT) fs.writeFileSync(JSON_OUT, `${JSON.stringify(result, null, 1)}\n`);
  } finally {
    child.kill('SIGTERM');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e);
  process.exitCode = 1;
});
