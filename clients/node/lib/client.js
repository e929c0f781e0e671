'use strict';
// The gRPC client of rebound.v1.RetryAdvisor, loaded from the proto shipped in the package.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.join(__dirname, '..', 'proto', 'rebound', 'v1', 'advisor.proto');

// keepCase: the proto's snake_case names (the sidecar's); longs: String, so 64-bit fields
// never lose precision (durations are converted to Number where they are known to fit);
// enums: String (the value names); defaults: unset fields present as 0 / "" / [].
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

let cachedPackage;
function loadPackage() {
  if (!cachedPackage) {
    const def = protoLoader.loadSync(PROTO, LOADER_OPTIONS);
    cachedPackage = grpc.loadPackageDefinition(def).rebound.v1;
  }
  return cachedPackage;
}

/** Reconnect quickly after the sidecar comes back (grpc-js backs off up to 120 s by default). */
const CHANNEL_OPTIONS = {
  'grpc.initial_reconnect_backoff_ms': 100,
  'grpc.max_reconnect_backoff_ms': 1000,
  'grpc.enable_retries': 0,
  'grpc.keepalive_time_ms': 30000,
};

/**
 * Accepts `unix:///abs/path.sock`, `unix:/abs/path`, `host:port` (port 1–65535); refuses
 * anything else with a TypeError naming REBOUND_TARGET (where the address usually comes
 * from), so a worker fails at start-up, before any job runs.
 */
function checkTarget(target, from = 'target') {
  const refuse = (why) => {
    const err = new TypeError(`${from}: ${JSON.stringify(target)} ${why} (REBOUND_TARGET or the target option: "unix:///path/to.sock" or "127.0.0.1:PORT")`);
    err.code = 'REBOUND_BAD_TARGET';
    err.variable = 'REBOUND_TARGET';
    return err;
  };
  if (typeof target !== 'string' || target === '') throw refuse('is empty or not a string');
  if (target.startsWith('unix:')) {
    if (!/^unix:(\/\/)?\/[^\0]+$/.test(target)) throw refuse('is not an absolute socket path');
    return target;
  }
  const m = /^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$/.exec(target);
  if (!m) throw refuse('is not "unix:///path" or "host:port"');
  const port = Number(m[2]);
  if (port < 1 || port > 65535) throw refuse(`has port ${port}, outside 1–65535`);
  return target;
}

class AdvisorClient {
  constructor(target, deadlineMs, from) {
    const pkg = loadPackage();
    this.deadlineMs = deadlineMs;
    this.stub = new pkg.RetryAdvisor(checkTarget(target, from), grpc.credentials.createInsecure(), CHANNEL_OPTIONS);
  }

  call(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, { deadline: Date.now() + this.deadlineMs }, (err, res) =>
        err ? reject(err) : resolve(res),
      );
    });
  }

  decide(request) {
    return this.call('Decide', request);
  }

  /**
   * True while the channel is in TRANSIENT_FAILURE: a call would fail at once with
   * UNAVAILABLE (calls do not wait for ready), so the caller can skip it. Asking also
   * kicks a reconnection attempt, so the channel comes back as soon as the sidecar does.
   */
  down() {
    const channel = this.stub.getChannel();
    // A READY channel has nothing to kick: the common case reads the state and returns.
    if (channel.getConnectivityState(false) === grpc.connectivityState.READY) return false;
    return channel.getConnectivityState(true) === grpc.connectivityState.TRANSIENT_FAILURE;
  }

  getPolicy(queue) {
    return this.call('GetPolicy', { queue });
  }

  close() {
    this.stub.close();
  }
}

/** `rebound.v1.ResolvedPolicy` (keepCase, longs as strings) → the JSON shape decideLocal reads. */
function resolvedFromWire(r) {
  return {
    strategy: r.strategy,
    baseMs: Number(r.base_ms),
    multiplier: r.multiplier,
    capMs: Number(r.cap_ms),
    jitter: r.jitter,
    jitterRatio: r.jitter_ratio,
    scheduleMs: r.schedule_ms.map(Number),
    maxAttempts: r.max_attempts,
    maxRetryDurationMs: Number(r.max_retry_duration_ms),
    nonRetryableErrors: [...r.non_retryable_errors],
    terminal: r.terminal,
    deadLetterQueue: r.dead_letter_queue,
  };
}

function policyRefFromWire(p) {
  if (!p) return { name: '', namespace: '', generation: '0', configHash: '' };
  return { name: p.name, namespace: p.namespace, generation: String(p.generation), configHash: p.config_hash };
}

module.exports = { AdvisorClient, checkTarget, CHANNEL_OPTIONS, loadPackage, resolvedFromWire, policyRefFromWire, LOADER_OPTIONS, PROTO, grpc };
