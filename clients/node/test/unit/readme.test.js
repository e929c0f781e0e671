'use strict';
// The README as a new user follows it: the install block is run as written (npm pack, then
// npm install of the tarball) in an application directory of its own, a later plain
// `npm install` keeps the package working, and EVERY js block of the README, extracted from
// README.md as pasted, runs there against Redis and a RetryAdvisor server. A js block with
// no check below fails the suite.
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn, execFileSync } = require('node:child_process');
const fs = require('node:fs');
const http = require('node:http');
const path = require('node:path');
const readline = require('node:readline');
const { Queue } = require('bullmq');
const Bull = require('bull');
const { startAdvisor } = require('./advisor-server');
const { startRedis, eventually } = require('./redis');
const { REPO } = require('./helpers');

const PKG = path.resolve(__dirname, '..', '..');
const README = fs.readFileSync(path.join(PKG, 'README.md'), 'utf8');

/** Every fenced block: {lang, code, line}; a block indented in a list item loses its indent. */
function blocks(text) {
  const out = [];
  const re = /^( *)```(\w*)\n([\s\S]*?)^\1```/gm;
  for (let m; (m = re.exec(text)); ) {
    const indent = m[1].length;
    const code = m[3].split('\n').map((l) => l.slice(Math.min(indent, l.length - l.trimStart().length))).join('\n');
    out.push({ lang: m[2], code, line: text.slice(0, m.index).split('\n').length });
  }
  return out;
}
const ALL = blocks(README);
/** js blocks name their file on the first line: `// worker.js — node worker.js`. */
const JS = ALL.filter((b) => b.lang === 'js').map((b) => ({ ...b, file: (/^\/\/ (\S+\.js) — node \1/.exec(b.code) || [])[1] }));

const NPM_ENV = {
  npm_config_prefer_offline: 'true',
  npm_config_audit: 'false',
  npm_config_fund: 'false',
  npm_config_update_notifier: 'false',
  npm_config_loglevel: 'error',
};
let app;
before(() => {
  app = path.join(REPO, '.state', 'node-unit', `readme-app-${process.pid}`);
  fs.rmSync(app, { recursive: true, force: true });
  fs.mkdirSync(app, { recursive: true });
  fs.writeFileSync(path.join(app, 'package.json'), JSON.stringify({ name: 'readme-app', version: '1.0.0', private: true }, null, 2));
});
after(() => fs.rmSync(app, { recursive: true, force: true }));

const sh = (script) => execFileSync('bash', ['-euo', 'pipefail', '-c', script], { cwd: app, env: { ...process.env, ...NPM_ENV }, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

test('install as the README says (npm pack, the tarball), and a later plain npm install keeps it working', { timeout: 300_000 }, () => {
  const install = ALL.find((b) => b.lang === 'sh' && /\bnpm install\b/.test(b.code) && b.line < README.indexOf('## Quick start'));
  assert.ok(install, 'an install block before the quick start');
  sh(install.code.replaceAll('/path/to/rebound', REPO));
  sh('npm install bull'); // the README's Bull 4 snippet below
  sh('npm install prom-client'); // the README's Metrics snippet
  sh('npm install'); // a plain install later on: the package must survive it
  const installed = path.join(app, 'node_modules', '@rebound-dev', 'node');
  assert.equal(fs.lstatSync(installed).isSymbolicLink(), false, 'a copy, not a symlink to the repository');
  const deps = JSON.parse(fs.readFileSync(path.join(app, 'package.json'), 'utf8')).dependencies;
  assert.match(deps['@rebound-dev/node'], /^file:.*\.tgz$/);
  const resolved = sh(`node -e "require('@rebound-dev/node'); console.log(require.resolve('@grpc/grpc-js'))"`).trim();
  assert.ok(resolved.startsWith(path.join(app, 'node_modules')), resolved);
  sh('npm ci'); // and from the lockfile
  sh(`node -e "require('@rebound-dev/node')"`);
});

test('every js block of the README has a check here', () => {
  assert.deepEqual(JS.map((b) => b.file).sort(), Object.keys(CHECKS).sort());
});

/** Runs a README block as `node <file>` in the app directory; lines of stdout parsed as JSON when they are. */
function runBlock(block, env) {
  fs.writeFileSync(path.join(app, block.file), block.code);
  const child = spawn(process.execPath, [block.file], { cwd: app, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  const out = { stdout: [], stderr: '', child };
  readline.createInterface({ input: child.stdout }).on('line', (l) => out.stdout.push(l));
  child.stderr.on('data', (d) => (out.stderr += d));
  out.exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  return out;
}

const REF = { name: 'webhooks', namespace: 'demo', generation: '1', config_hash: 'sha256:q' };
const threeThenDrop = (req) =>
  req.attempt < 3
    ? { decision: 'DECISION_RETRY', delay_ms: '30', policy: REF }
    : { decision: 'DECISION_GIVE_UP', disposition: 'DISPOSITION_DROP', reason: 'GIVE_UP_REASON_MAX_ATTEMPTS', policy: REF };

/** The two workers: asked at every failure, 1..3, with the fetch error's class; the job ends in the failed set. */
async function checkWorker(block, stateOf) {
  const redis = startRedis();
  const server = await startAdvisor({ decide: threeThenDrop });
  const run = runBlock(block, { REDIS_PORT: String(redis.connection.port), REBOUND_TARGET: server.target });
  const ctx = () => `\nstdout: ${run.stdout.join('\n')}\nstderr: ${run.stderr}`;
  try {
    const asked = await eventually(() => server.requests.Decide.length >= 3 && server.requests.Decide, 30000, 'three Decide calls').catch((e) => {
      throw new Error(e.message + ctx());
    });
    assert.deepEqual(asked.map((r) => [r.queue, r.attempt]), [['webhooks', 1], ['webhooks', 2], ['webhooks', 3]], ctx());
    // fetch() to a closed port throws a TypeError: the job's own failure, every run (not a missing handler).
    assert.deepEqual(asked.map((r) => r.error_class), ['TypeError', 'TypeError', 'TypeError'], ctx());
    const key = asked[0].job_id;
    assert.match(key, /^[0-9a-f-]{36}$/);
    assert.ok(server.requests.GetPolicy.some((r) => r.queue === 'webhooks'), 'the policy was fetched');
    // drop: the job stays in the failed set.
    await eventually(async () => (await stateOf(redis, key)) === 'failed', 30000, 'the job in the failed set');
    run.child.kill('SIGINT');
    assert.deepEqual(await run.exited, { code: 0, signal: null }, ctx());
  } finally {
    run.child.kill('SIGKILL');
    await server.close();
    redis.stop();
  }
}

/** A TCP port on 127.0.0.1 that nothing listens on right now. */
function freePort() {
  return new Promise((resolve, reject) => {
    const server = require('node:net').createServer();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** GET http://127.0.0.1:port/metrics, parsed: { 'name{a="x",...}': value } with labels in exposition order. */
function scrape(port) {
  return new Promise((resolve, reject) => {
    http
      .get({ host: '127.0.0.1', port, path: '/metrics' }, (res) => {
        let text = '';
        res.on('data', (d) => (text += d));
        res.on('end', () => {
          const out = {};
          for (const line of text.split('\n')) {
            const m = /^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$/.exec(line);
            if (m) out[`${m[1]}${m[2] || ''}`] = Number(m[3]);
          }
          resolve(out);
        });
      })
      .on('error', reject);
  });
}

const CHECKS = {
  'metrics.js': async (block) => {
    const redis = startRedis();
    const server = await startAdvisor({ decide: threeThenDrop });
    const port = await freePort();
    const run = runBlock(block, { REDIS_PORT: String(redis.connection.port), REBOUND_TARGET: server.target, METRICS_PORT: String(port) });
    try {
      // Three answers from the sidecar, the third a drop: counted in the served registry.
      const s = await eventually(async () => {
        const got = await scrape(port).catch(() => ({}));
        return got['rebound_adapter_terminal_total{adapter="bullmq",disposition="drop"}'] === 1 && got;
      }, 30000, 'the drop counted').catch((e) => {
        throw new Error(`${e.message}\n${run.stderr}`);
      });
      assert.equal(s['rebound_adapter_decisions_total{adapter="bullmq",source="sidecar"}'], 3);
      assert.equal(s['rebound_adapter_decisions_total{adapter="bullmq",source="fallback"}'], 0);
      assert.equal(s['rebound_adapter_hook_errors_total{adapter="bullmq"}'], 0);
      run.child.kill('SIGINT');
      assert.deepEqual(await run.exited, { code: 0, signal: null }, run.stderr);
    } finally {
      run.child.kill('SIGKILL');
      await server.close();
      redis.stop();
    }
  },
  'worker.js': (block) =>
    checkWorker(block, async (redis, key) => {
      const q = new Queue('webhooks', { connection: redis.connection });
      try {
        return await q.getJobState(key);
      } finally {
        await q.close();
      }
    }),
  'bull-worker.js': (block) =>
    checkWorker(block, async (redis, key) => {
      const q = new Bull('webhooks', redis.url);
      try {
        return await (await q.getJob(key))?.getState();
      } finally {
        await q.close();
      }
    }),
  'receiver.js': async (block) => {
    const redis = startRedis();
    const run = runBlock(block, { REDIS_PORT: String(redis.connection.port), PORT: '0' });
    try {
      const { listening } = await eventually(() => run.stdout.map((l) => JSON.parse(l)).find((l) => l.listening), 20000, 'listening').catch((e) => {
        throw new Error(`${e.message}\n${run.stderr}`);
      });
      const post = (key, body) =>
        new Promise((resolve, reject) => {
          const req = http.request(listening, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' } }, (res) => {
            let text = '';
            res.on('data', (d) => (text += d));
            res.on('end', () => resolve({ status: res.statusCode, body: JSON.parse(text) }));
          });
          req.on('error', reject);
          req.end(body);
        });
      const event = JSON.stringify({ type: 'invoice.paid', id: 42 });
      assert.deepEqual(await post('k-1', event), { status: 200, body: { applied: true } });
      assert.deepEqual(await post('k-1', event), { status: 200, body: { applied: false } }, 'a repeated delivery: acknowledged, not applied');
      assert.deepEqual(await post('k-2', event), { status: 200, body: { applied: true } });
      const Redis = require('ioredis');
      const r = new Redis(redis.connection);
      try {
        assert.deepEqual(await r.lrange('effects', 0, -1), [event, event]);
      } finally {
        r.disconnect();
      }
      run.child.kill('SIGINT');
      assert.deepEqual(await run.exited, { code: 0, signal: null }, run.stderr);
    } finally {
      run.child.kill('SIGKILL');
      redis.stop();
    }
  },
};

for (const block of JS) {
  test(`README block at line ${block.line} (${block.file || 'no file name on its first line'}) runs as pasted`, { timeout: 120_000 }, async () => {
    assert.ok(block.file, 'the first line names the file: // name.js — node name.js');
    assert.ok(CHECKS[block.file], `no check for ${block.file}`);
    assert.ok(fs.existsSync(path.join(app, 'node_modules', '@rebound-dev', 'node')), 'installed by the install test');
    await CHECKS[block.file](block);
  });
}

test('the README\'s JSON blocks parse, and the dead letter shows every field of DeadLetter', () => {
  const json = ALL.filter((b) => b.lang === 'json');
  assert.ok(json.length >= 1);
  for (const b of json) JSON.parse(b.code);
  const dl = JSON.parse(json.find((b) => b.code.includes('rebound.dev/dead-letter/v1')).code);
  const dts = fs.readFileSync(path.join(PKG, 'index.d.ts'), 'utf8');
  const iface = /export interface DeadLetter<[^>]*> \{([\s\S]*?)\n\}/.exec(dts)[1];
  const fields = [...iface.matchAll(/^ {2}(\w+):/gm)].map((m) => m[1]);
  assert.deepEqual(Object.keys(dl).sort(), fields.sort());
});
