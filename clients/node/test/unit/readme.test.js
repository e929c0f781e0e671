'use strict';
// The README's quick start, pasted as is into a project of its own, runs: its job is
// asked about at every failure and ends in the failed set, and SIGINT stops it cleanly.
const { test } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { Queue } = require('bullmq');
const { startAdvisor } = require('./advisor-server');
const { startRedis, eventually } = require('./redis');

const PKG = path.resolve(__dirname, '..', '..');

function quickStart() {
  const readme = fs.readFileSync(path.join(PKG, 'README.md'), 'utf8');
  const section = readme.slice(readme.indexOf('## Quick start'));
  const m = /```js\n([\s\S]*?)```/.exec(section);
  assert.ok(m, 'a js block in the quick start');
  return m[1];
}

test('the README quick start runs as pasted', async () => {
  const redis = startRedis();
  const ref = { name: 'webhooks', namespace: 'demo', generation: '1', config_hash: 'sha256:q' };
  const server = await startAdvisor({
    decide: (req) =>
      req.attempt < 3
        ? { decision: 'DECISION_RETRY', delay_ms: '30', policy: ref }
        : { decision: 'DECISION_GIVE_UP', disposition: 'DISPOSITION_DROP', reason: 'GIVE_UP_REASON_MAX_ATTEMPTS', policy: ref },
  });
  // A project of its own, with the package and bullmq installed (linked) in node_modules.
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rebound-quickstart-'));
  fs.mkdirSync(path.join(dir, 'node_modules', '@rebound-dev'), { recursive: true });
  fs.symlinkSync(PKG, path.join(dir, 'node_modules', '@rebound-dev', 'node'));
  fs.symlinkSync(path.join(PKG, 'node_modules', 'bullmq'), path.join(dir, 'node_modules', 'bullmq'));
  fs.writeFileSync(path.join(dir, 'worker.js'), quickStart());
  const queue = new Queue('webhooks', { connection: redis.connection });
  const child = spawn(process.execPath, ['worker.js'], {
    cwd: dir,
    env: { ...process.env, REDIS_PORT: String(redis.connection.port), REBOUND_TARGET: server.target },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (d) => (stderr += d));
  let stdout = '';
  child.stdout.on('data', (d) => (stdout += d));
  const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  try {
    const asked = await eventually(() => {
      const r = server.requests.Decide;
      return r.length >= 3 && r;
    }, 30000, 'three Decide calls').catch((e) => {
      throw new Error(`${e.message}\nstdout: ${stdout}\nstderr: ${stderr}`);
    });
    assert.deepEqual(asked.map((r) => [r.queue, r.attempt]), [['webhooks', 1], ['webhooks', 2], ['webhooks', 3]]);
    const key = asked[0].job_id;
    assert.match(key, /^[0-9a-f-]{36}$/);
    await eventually(async () => (await queue.getJobState(key)) === 'unknown', 30000, 'dropped job removed');
    child.kill('SIGINT');
    assert.deepEqual(await exited, { code: 0, signal: null }, stderr);
  } finally {
    child.kill('SIGKILL');
    await queue.obliterate({ force: true });
    await queue.close();
    await server.close();
    redis.stop();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
