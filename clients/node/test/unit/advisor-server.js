'use strict';
// A real grpc-js server of rebound.v1.RetryAdvisor for tests of the client's error paths
// (NOT_SERVING, slow answers) and of what the adapter sends. `behaviour` decides per call.

const grpc = require('@grpc/grpc-js');
const { loadPackage } = require('../../lib/client');

/**
 * behaviour: { decide(req) → answer | {error: {code, details}} | {sleepMs},
 *              getPolicy(req) → answer | {error} }
 * `port`: bind this port again (a sidecar restarted on its address); default a free one.
 * Resolves to { target, requests: {Decide: [], GetPolicy: []}, close() }.
 */
async function startAdvisor(behaviour, { uds, port: fixedPort } = {}) {
  const pkg = loadPackage();
  const server = new grpc.Server();
  const requests = { Decide: [], GetPolicy: [] };
  const handler = (name, fn) => (call, callback) => {
    requests[name].push(call.request);
    const out = fn(call.request);
    const send = () => (out && out.error ? callback(out.error) : callback(null, out));
    if (out && out.sleepMs) {
      const t = setTimeout(() => callback({ code: grpc.status.UNAVAILABLE, details: 'slept' }), out.sleepMs);
      call.on('cancelled', () => clearTimeout(t));
    } else send();
  };
  server.addService(pkg.RetryAdvisor.service, {
    Decide: handler('Decide', behaviour.decide),
    GetPolicy: handler('GetPolicy', behaviour.getPolicy || (() => ({ error: { code: grpc.status.NOT_FOUND, details: 'queue: none' } }))),
    DecideBatch: (call, cb) => cb({ code: grpc.status.UNIMPLEMENTED }),
  });
  const address = uds ? `unix://${uds}` : `127.0.0.1:${fixedPort || 0}`;
  const port = await new Promise((resolve, reject) =>
    server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
  );
  return {
    target: uds ? `unix://${uds}` : `127.0.0.1:${port}`,
    requests,
    close: () => new Promise((resolve) => server.tryShutdown(() => resolve())),
    forceClose: () => server.forceShutdown(),
  };
}

/** A ResolvedPolicy in proto3 JSON names → the wire message (keepCase). */
function resolvedToWire(p) {
  return {
    strategy: p.strategy,
    base_ms: p.baseMs,
    multiplier: p.multiplier,
    cap_ms: p.capMs,
    jitter: p.jitter,
    jitter_ratio: p.jitterRatio,
    schedule_ms: p.scheduleMs,
    max_attempts: p.maxAttempts,
    max_retry_duration_ms: p.maxRetryDurationMs,
    non_retryable_errors: p.nonRetryableErrors,
    terminal: p.terminal,
    dead_letter_queue: p.deadLetterQueue,
  };
}

/** A free TCP port on 127.0.0.1 with nothing listening (bound, then released). */
async function closedPort() {
  const net = require('node:net');
  return new Promise((resolve) => {
    const s = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

module.exports = { startAdvisor, resolvedToWire, closedPort, grpc };
