'use strict';
// The whole story in one process: a flaky receiver, the worker, the producer; enqueues
// EVENTS events, waits until every one is delivered or dead-lettered, and tells what
// happened (attempts, the delays the policy chose, the dead letters).
//
//   REDIS_URL=redis://127.0.0.1:PORT REBOUND_TARGET=127.0.0.1:7411 EVENTS=40 node run.js
//
// With REPORT_FILE=path it also writes the totals as JSON there (`summary`), for scripts.
//
// Needs a sidecar that serves policy.yaml (dev/demo.sh sets all of it up).

const { Queue } = require('bullmq');
const { Rebound } = require('@rebound-dev/node');
const { createReceiver } = require('./receiver');
const { QUEUE, startWorker, connection, errorClass } = require('./worker');
const { enqueue } = require('./producer');

const DEAD = 'webhook-delivery-dead';
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Runs `count` deliveries against a new receiver. Resolves to a report:
 * {sent: [{key, eventId}], attempts (what the worker saw), requests (what the receiver
 *  saw), applied, decisions, deadLetters, deadJobs, delivered, durationMs, metrics,
 *  receiverOptions, counts}.
 */
async function runDelivery({ redisUrl, target, count = 300, seed = 'rebound', receiver: receiverOptions = {}, timeoutMs = 1000, deadlineMs, settleTimeoutMs = 180_000 }) {
  const receiver = await createReceiver({ seed, hangMs: 2 * timeoutMs, ...receiverOptions });
  const rebound = new Rebound({ target, errorClass, logger: false, deadlineMs });
  const attempts = [];
  const decisions = [];
  const deadLetters = [];
  const delivered = new Set();
  rebound.on('decision', (d) => decisions.push({ ...d, t: Date.now() }));
  rebound.on('deadLetter', (d) => deadLetters.push(d));
  const queue = new Queue(QUEUE, { connection: connection(redisUrl) });
  const dead = new Queue(DEAD, { connection: connection(redisUrl) });
  await queue.obliterate({ force: true }); // a fresh run, also when the demo is run again
  await dead.obliterate({ force: true });
  const { worker } = startWorker({ redisUrl, rebound, timeoutMs, onAttempt: (a) => attempts.push(a) });
  worker.on('completed', (job) => delivered.add(String(job.id)));
  try {
    const started = Date.now();
    const sent = await enqueue({ queue, rebound, url: receiver.url, count });
    const dlKeys = () => new Set(deadLetters.map((d) => d.key));
    while (!sent.every((s) => delivered.has(s.key) || dlKeys().has(s.key))) {
      if (Date.now() - started > settleTimeoutMs) throw new Error(`not every event settled within ${settleTimeoutMs} ms`);
      await sleep(20);
    }
    // The hook answered; wait until BullMQ has moved the given-up jobs to the failed set.
    for (const key of dlKeys()) {
      while ((await queue.getJobState(key)) !== 'failed') await sleep(10);
    }
    const durationMs = Date.now() - started;
    const deadJobs = (await dead.getJobs(['wait', 'paused', 'delayed', 'prioritized'])).map((j) => ({ id: j.id, name: j.name, data: j.data }));
    return {
      sent,
      attempts,
      requests: receiver.requests.slice(),
      applied: new Map(receiver.applied),
      decisions,
      deadLetters,
      deadJobs,
      delivered,
      durationMs,
      metrics: rebound.metrics(),
      receiverOptions: receiver.options,
      counts: await queue.getJobCounts('wait', 'active', 'delayed', 'completed', 'failed'),
    };
  } finally {
    await worker.close();
    await queue.close();
    await dead.close();
    await rebound.close();
    await receiver.close();
  }
}

/** One attempt as the worker saw it, with what the receiver did with it. */
function attemptText(seen, request) {
  if (!seen) return 'not run';
  if (seen.errorClass === 'Timeout') {
    return request && ['accepted-then-hung', 'applied'].includes(request.outcome) ? 'timed out (the receiver had applied it)' : 'timed out';
  }
  if (seen.status === 200) return request?.outcome === 'duplicate' ? 'duplicate, acknowledged' : 'delivered';
  if (seen.status === 429) return '429 Retry-After';
  if (seen.status === 410) return '410 gone';
  if (seen.status) return request?.outcome === 'down' ? `${seen.status} (endpoint down)` : String(seen.status);
  return seen.errorClass;
}

/** What happened, for people: a few events attempt by attempt, then the totals. */
function describe(report, { show = 8 } = {}) {
  const lines = [];
  const byKey = (list, field = 'key') => list.reduce((m, x) => m.set(x[field], [...(m.get(x[field]) || []), x]), new Map());
  const requests = byKey(report.requests);
  const decisions = byKey(report.decisions, 'jobId');
  const attempts = byKey(report.attempts);
  const story = (s) => {
    const reqs = requests.get(s.key) || [];
    const ds = decisions.get(s.key) || [];
    const seen = (attempts.get(s.key) || []).sort((a, b) => a.attempt - b.attempt);
    const parts = seen.map((a) => {
      const d = ds.find((x) => x.attempt === a.attempt);
      let text = `${a.attempt}: ${attemptText(a, reqs.find((r) => r.n === a.attempt))}`;
      if (d?.decision === 'DECISION_RETRY') text += ` → retry in ${d.delayMs} ms`;
      if (d?.decision === 'DECISION_GIVE_UP') text += ` → ${d.reasonMessage || d.reason} → ${d.deadLetterQueue || 'dropped'}`;
      return text;
    });
    return `  ${s.eventId.padEnd(8)} key ${s.key.slice(0, 8)}…  ${parts.join(' · ')}`;
  };
  const interesting = report.sent.filter((s) => (requests.get(s.key) || []).length > 1);
  const pick = [
    ...interesting.filter((s) => (requests.get(s.key) || []).some((r) => r.outcome === 'accepted-then-hung')).slice(0, 2),
    ...interesting.filter((s) => (requests.get(s.key) || []).some((r) => r.outcome === 'too-many')).slice(0, 2),
    // One dead letter per reason (a removed endpoint, an exhausted one).
    ...[...new Map(report.deadLetters.map((d) => [d.reason, d.key])).values()].map((k) => report.sent.find((s) => s.key === k)),
    ...interesting.slice(0, show),
  ];
  const shown = [...new Map(pick.map((s) => [s.key, s])).values()].slice(0, show);
  lines.push('Some events, attempt by attempt (delays chosen by the RetryPolicy through the sidecar):');
  for (const s of shown) lines.push(story(s));

  const outcomes = report.requests.reduce((m, r) => ((m[r.outcome] = (m[r.outcome] || 0) + 1), m), {});
  const reasons = report.deadLetters.reduce((m, d) => ((m[d.reason] = (m[d.reason] || 0) + 1), m), {});
  const retries = report.decisions.filter((d) => d.decision === 'DECISION_RETRY').map((d) => d.delayMs).sort((a, b) => a - b);
  const sources = report.decisions.reduce((m, d) => ((m[d.source] = (m[d.source] || 0) + 1), m), {});
  lines.push('');
  lines.push(`${report.sent.length} events in ${(report.durationMs / 1000).toFixed(1)} s: ${report.delivered.size} delivered, ${report.deadLetters.length} dead-lettered (${Object.entries(reasons).map(([r, n]) => `${n} ${r.replace('GIVE_UP_REASON_', '').toLowerCase()}`).join(', ') || 'none'})`);
  lines.push(`${report.requests.length} POSTs: ${Object.entries(outcomes).map(([o, n]) => `${n} ${o}`).join(', ')}`);
  lines.push(`effects applied by the receiver: ${report.applied.size} (one per key; ${outcomes.duplicate || 0} duplicate deliveries recognised by their key)`);
  if (retries.length) lines.push(`${retries.length} retries, delays ${retries[0]}–${retries[retries.length - 1]} ms (median ${retries[retries.length >> 1]} ms); answers by ${Object.entries(sources).map(([s, n]) => `${s}: ${n}`).join(', ')}`);
  for (const j of report.deadJobs.slice(0, 3)) lines.push(`dead letter ${j.id}: ${j.data.data.event.id}, attempt ${j.data.attempt}, ${j.data.reasonMessage}`);
  return lines.join('\n');
}

/** The totals of a report as plain JSON: what a script checks after a run. */
function summary(report) {
  const count = (list, field) => list.reduce((m, x) => ((m[x[field]] = (m[x[field]] || 0) + 1), m), {});
  return {
    events: report.sent.length,
    delivered: report.delivered.size,
    deadLettered: report.deadLetters.length,
    deadLetterReasons: count(report.deadLetters, 'reason'),
    deadLetterJobs: report.deadJobs.length,
    posts: count(report.requests, 'outcome'),
    applied: report.applied.size,
    decisions: count(report.decisions, 'decision'),
    decisionSources: count(report.decisions, 'source'),
    counts: report.counts,
    durationMs: report.durationMs,
  };
}

module.exports = { runDelivery, describe, summary, DEAD };

if (require.main === module) {
  runDelivery({
    redisUrl: process.env.REDIS_URL || 'redis://127.0.0.1:6379',
    target: process.env.REBOUND_TARGET,
    count: Number(process.env.EVENTS || 40),
  }).then(
    (report) => {
      console.log(describe(report));
      if (process.env.REPORT_FILE) require('node:fs').writeFileSync(process.env.REPORT_FILE, `${JSON.stringify(summary(report))}\n`);
    },
    (err) => {
      console.error(err);
      process.exit(1);
    },
  );
}
