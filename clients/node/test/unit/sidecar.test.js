'use strict';
// Against a real rebound-sidecar on the example policies: every answer of the local
// fallback (the policy fetched with GetPolicy, decideLocal) equals the sidecar's for the
// same question. Uses REBOUND_SIDECAR, else the {release,debug} build in $CARGO_TARGET_DIR (default target/);
// skipped when none is built (the end-to-end suite builds and runs one).
const { test } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { createRebound, decideLocal } = require('../..');
const { REPO } = require('./helpers');
const { closedPort } = require('./advisor-server');
const { eventually } = require('./redis');

const TARGET_DIR = process.env.CARGO_TARGET_DIR ? path.resolve(REPO, process.env.CARGO_TARGET_DIR) : path.join(REPO, 'target');
const BIN = [process.env.REBOUND_SIDECAR, ...['release', 'debug'].map((p) => path.join(TARGET_DIR, p, 'rebound-sidecar'))].find(
  (p) => p && fs.existsSync(p),
);

test('the fallback answers exactly like a real sidecar', { skip: !BIN && 'no rebound-sidecar binary built' }, async () => {
  const dir = path.join(REPO, 'examples', 'policies');
  const files = fs.readdirSync(dir).filter((f) => f.endsWith('.yaml')).flatMap((f) => ['--policies-file', path.join(dir, f)]);
  const port = await closedPort();
  const child = spawn(BIN, [...files, '--namespace', 'unit', '--listen', `127.0.0.1:${port}`, '--no-admin'], { stdio: 'ignore' });
  const rebound = createRebound({ target: `127.0.0.1:${port}`, logger: false, deadlineMs: 2000 });
  try {
    await eventually(async () => (await rebound.decide({ queue: 'webhooks', attempt: 1, jobId: 'up' })).source === 'sidecar', 20000, 'sidecar up');
    const fallbacksBefore = rebound.metrics().fallback.total; // while it started
    let compared = 0;
    for (const queue of ['webhooks', 'webhooks-eu', 'email', 'newsletter', 'payments.charge', 'anything-else']) {
      const { policy, resolved } = await rebound.policy(queue);
      for (let j = 0; j < 40; j++) {
        for (const attempt of [1, 2, 3, 5, 8, 12, 25, 30]) {
          const jobId = `job-${j}-ü`;
          const errorClass = j % 7 === 0 ? 'HardBounce' : 'http.503';
          const retryAfterMs = j % 5 === 0 ? 4000 : undefined;
          const a = await rebound.decide({ queue, attempt, jobId, errorClass, retryAfterMs });
          assert.equal(a.source, 'sidecar');
          const local = decideLocal(resolved, `${policy.namespace}/${policy.name}`, attempt, { jobId, errorClass, retryAfterMs });
          assert.deepEqual(
            [a.decision, a.delayMs, a.disposition, a.deadLetterQueue, a.reason, a.reasonMessage],
            [local.decision, local.delayMs, local.disposition, local.deadLetterQueue, local.reason, local.reasonMessage],
            `${queue} ${jobId} attempt ${attempt}`,
          );
          compared++;
        }
      }
    }
    assert.equal(compared, 6 * 40 * 8);
    assert.equal(rebound.metrics().fallback.total, fallbacksBefore);
  } finally {
    await rebound.close();
    child.kill('SIGTERM');
  }
});

test('a retry budget: stretched answers say so, and the delay is the policy\'s plus the stretch', { skip: !BIN && 'no rebound-sidecar binary built' }, async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rebound-budget-'));
  const file = path.join(dir, 'budgeted.yaml');
  // One retry a second: three failures answered within a few ms share at most two slots.
  fs.writeFileSync(
    file,
    [
      'apiVersion: rebound.dev/v1alpha1',
      'kind: RetryPolicy',
      'metadata: {name: budgeted}',
      'spec:',
      '  queues: ["budgeted"]',
      '  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}',
      '  maxAttempts: 5',
      '  retryBudget: {ratePerSecond: 1, burst: 1}',
      '',
    ].join('\n'),
  );
  const port = await closedPort();
  const child = spawn(BIN, ['--policies-file', file, '--namespace', 'unit', '--listen', `127.0.0.1:${port}`, '--no-admin'], { stdio: 'ignore' });
  const rebound = createRebound({ target: `127.0.0.1:${port}`, logger: false, deadlineMs: 2000 });
  try {
    await eventually(async () => (await rebound.policy('budgeted'))?.policy.name === 'budgeted', 20000, 'sidecar up');
    const answers = [];
    let askedC = 0;
    for (const jobId of ['a', 'b', 'c']) {
      askedC = Date.now();
      answers.push(await rebound.decide({ queue: 'budgeted', attempt: 1, jobId }));
    }
    for (const a of answers) {
      assert.equal(a.source, 'sidecar');
      assert.equal(a.decision, 'DECISION_RETRY');
      assert.equal(a.delayMs, 100 + a.budgetDelayMs);
      assert.equal(a.budgetStretched, a.budgetDelayMs > 0);
      assert.ok(a.budgetDelayMs <= 2000, `${a.budgetDelayMs} ms is past the next two slots`);
    }
    assert.ok(answers.filter((a) => a.budgetStretched).length >= 1, 'three retries in two slots of one');
    // The same failure asked again: the same run time (its delay counted from now), no new slot.
    const again = await rebound.decide({ queue: 'budgeted', attempt: 1, jobId: 'c' });
    const between = Date.now() - askedC;
    assert.equal(again.budgetStretched, answers[2].budgetStretched);
    assert.ok(again.delayMs <= answers[2].delayMs && answers[2].delayMs - again.delayMs <= between + 1, `${again.delayMs} vs ${answers[2].delayMs}`);
  } finally {
    await rebound.close();
    child.kill('SIGTERM');
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('a policy in rollout: with the sidecar killed, every job keeps its revision and its answers', { skip: !BIN && 'no rebound-sidecar binary built' }, async () => {
  // Stable: 25 attempts from 1 s, then a dead letter; canary: 2 attempts from 300 ms, then a
  // drop; steps of 20 % (from 2023-11-14) and 50 % (from 2025-06-15).
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rebound-rollout-'));
  fs.copyFileSync(path.join(REPO, 'clients', 'conformance', 'rollout-policies.json'), path.join(dir, 'policies.json'));
  const port = await closedPort();
  const child = spawn(BIN, ['--policies-dir', dir, '--namespace', 'shop', '--listen', `127.0.0.1:${port}`, '--no-admin'], { stdio: 'ignore' });
  const exited = new Promise((resolve) => child.once('exit', resolve));
  const rebound = createRebound({ target: `127.0.0.1:${port}`, logger: false, deadlineMs: 2000 });
  try {
    await eventually(async () => (await rebound.policy('payments'))?.policy.name === 'payments', 20000, 'sidecar up');
    // Before the first step, in the 20 % step, in the 50 % step, unknown (placed by now).
    const firsts = [1_690_000_000_000, 1_720_000_000_000, 1_760_000_000_000, undefined];
    const failures = Array.from({ length: 200 }, (_, i) => ({
      queue: 'payments',
      attempt: 1 + (i % 3),
      jobId: `job-${i}`,
      firstFailureUnixMs: firsts[i % 4],
    }));
    const verdict = (a) => [a.decision, a.delayMs, a.disposition, a.deadLetterQueue, a.reason, a.revision];
    const want = [];
    for (const f of failures) {
      const a = await rebound.decide(f);
      assert.equal(a.source, 'sidecar');
      want.push(verdict(a));
    }
    const revisions = new Set(want.map((v) => v[5]));
    assert.equal(revisions.size, 2, `both revisions among the jobs: ${[...revisions]}`);
    assert.ok(!revisions.has(''), 'every answer names its revision');
    child.kill('SIGKILL');
    await exited;
    let answers = 0;
    let revs = 0;
    for (const [i, f] of failures.entries()) {
      const a = await rebound.decide(f);
      assert.equal(a.source, 'fallback');
      assert.equal(a.policySource, 'cached');
      const got = verdict(a);
      if (JSON.stringify(got.slice(0, 5)) !== JSON.stringify(want[i].slice(0, 5))) answers++;
      if (got[5] !== want[i][5]) revs++;
    }
    assert.deepEqual({ answers, revs }, { answers: 0, revs: 0 }, `of ${failures.length} jobs, fallback answers and revisions that differ from the sidecar's`);
  } finally {
    await rebound.close();
    child.kill('SIGKILL');
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
