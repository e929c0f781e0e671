'use strict';
// A flaky webhook receiver, as real ones are: it fails (503), accepts an event and then
// answers too late (the sender times out and retries what was already applied), pushes
// back with 429 + Retry-After, and has endpoints that are gone (410) or down for good.
// It applies each event once by its Idempotency-Key and records every request.
//
// Which of these happens is drawn from a hash of (seed, event id, request number), so a run
// is reproducible whatever keys the producer drew. Listens on 127.0.0.1 only.

const http = require('node:http');
const crypto = require('node:crypto');

/** A number in [0, 1) from a hash of the parts (deterministic). */
function draw(...parts) {
  return crypto.createHash('sha256').update(parts.join('\0')).digest().readUInt32BE(0) / 2 ** 32;
}

/**
 * What the endpoint of an event does: 'gone' (410 always), 'down' (503 always), else
 * 'flaky'. Exposed so a test can tell which events must end in the dead-letter queue.
 */
function planOf(seed, eventId, { goneRate = 0.03, downRate = 0.05 } = {}) {
  const r = draw(seed, eventId, 'plan');
  if (r < goneRate) return 'gone';
  if (r < goneRate + downRate) return 'down';
  return 'flaky';
}

/**
 * createReceiver({port, seed, failRate, acceptThenHangRate, tooManyRate, hangMs, retryAfter})
 * → {url, requests, applied, close()}. `requests` lists every request in arrival order
 * ({key, eventId, n, outcome, t}); `applied` maps key → the event applied for it.
 */
async function createReceiver(options = {}) {
  const o = {
    port: 0,
    seed: 'rebound', failRate: 0.2, acceptThenHangRate: 0.1, tooManyRate: 0.1, hangMs: 600, retryAfter: '1', ...options,
  };
  const requests = [];
  const applied = new Map();
  const seen = new Map(); // key → requests so far
  const hanging = new Set();

  const server = http.createServer((req, res) => {
    let body = '';
    req.setEncoding('utf8');
    req.on('data', (d) => (body += d));
    req.on('end', () => {
      const key = req.headers['idempotency-key'];
      let event = null;
      try {
        event = JSON.parse(body);
      } catch {
        /* answered 400 below */
      }
      if (!key || !event) {
        res.writeHead(400).end('an Idempotency-Key header and a JSON body are needed');
        return;
      }
      const n = (seen.get(key) || 0) + 1;
      seen.set(key, n);
      const record = (outcome) => requests.push({ key, eventId: event.id, n, outcome, t: Date.now() });

      if (applied.has(key)) {
        record('duplicate'); // already applied: acknowledge, change nothing
        res.writeHead(200, { 'content-type': 'application/json' }).end('{"duplicate":true}');
        return;
      }
      const plan = planOf(o.seed, event.id, o);
      if (plan === 'gone') {
        record('gone');
        res.writeHead(410).end('endpoint removed');
        return;
      }
      if (plan === 'down') {
        record('down');
        res.writeHead(503).end('down');
        return;
      }
      const r = draw(o.seed, event.id, n);
      if (r < o.failRate) {
        record('failed');
        res.writeHead(503).end('try later');
      } else if (r < o.failRate + o.tooManyRate) {
        record('too-many');
        res.writeHead(429, { 'retry-after': o.retryAfter }).end('slow down');
      } else if (r < o.failRate + o.tooManyRate + o.acceptThenHangRate) {
        // Applied, but the answer comes after the sender has given up on this request.
        applied.set(key, event);
        record('accepted-then-hung');
        const timer = setTimeout(() => {
          hanging.delete(timer);
          res.writeHead(200).end('{"late":true}');
        }, o.hangMs);
        hanging.add(timer);
      } else {
        applied.set(key, event);
        record('applied');
        res.writeHead(200, { 'content-type': 'application/json' }).end('{"ok":true}');
      }
    });
  });
  await new Promise((resolve) => server.listen(o.port, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}/hooks`,
    seed: o.seed,
    options: o,
    requests,
    applied,
    async close() {
      for (const t of hanging) clearTimeout(t);
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

module.exports = { createReceiver, planOf };

// node receiver.js [PORT]: prints its URL, then one JSON line per request.
if (require.main === module) {
  createReceiver({ port: Number(process.argv[2] || 0) }).then((r) => {
    console.log(r.url);
    const push = r.requests.push.bind(r.requests);
    r.requests.push = (x) => (console.log(JSON.stringify(x)), push(x));
  });
}
