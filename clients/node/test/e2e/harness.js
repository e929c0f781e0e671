'use strict';
// The real stack for the end-to-end tests, started the way it runs in a cluster:
//
//   local kube-apiserver + etcd (dev/cluster-up.sh, shared like the Rust tests' cluster)
//   → RetryPolicy CRD → `rebound-operator --namespaces NS` (the workspace binary)
//   → ConfigMap NS/rebound-policies → `rebound-sidecar --configmap NS/rebound-policies`
//   with the credentials of a service account that may read only that ConfigMap
//   → the worker's gRPC calls (TCP 127.0.0.1 and a Unix socket).
//   Redis: dev/redis.sh, on a free port of 127.0.0.1.
//
// Environment, as for the Rust tests (dev/README.md):
//   REBOUND_KUBECONFIG         use this cluster as it is (nothing is started or stopped)
//   REBOUND_CLUSTER_STATE_DIR  state dir of the shared cluster (default .state/cluster)
//   REBOUND_KUBECTL            kubectl to run
//   REBOUND_BIN_DIR            dir with rebound-operator and rebound-sidecar (default:
//                              `cargo build` them and use cargo's target dir)
// Every process is stopped by its PID in stop(), and on exit of the test process.

const { spawn, execFileSync } = require('node:child_process');
const crypto = require('node:crypto');
const fs = require('node:fs');
const http = require('node:http');
const net = require('node:net');
const path = require('node:path');

const REPO = path.resolve(__dirname, '../../../..');
const FIELD_MANAGER = 'rebound-tests';

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Runs a program to completion; returns stdout. Throws with stdout/stderr on failure. */
function run(cmd, args, { input, env, cwd } = {}) {
  try {
    return execFileSync(cmd, args, {
      input,
      env: { ...process.env, ...env },
      cwd: cwd || REPO,
      encoding: 'utf8',
      stdio: ['pipe', 'pipe', 'pipe'],
      maxBuffer: 64 << 20,
    });
  } catch (e) {
    const err = new Error(`${cmd} ${args.join(' ')} failed (${e.status ?? e.signal}):\n${e.stdout || ''}\n${e.stderr || ''}`);
    err.stdout = e.stdout;
    err.stderr = e.stderr;
    throw err;
  }
}

const lastLine = (text) => text.trim().split('\n').pop().trim();

/** A TCP port on 127.0.0.1 that nothing listens on right now. */
function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** GET http://127.0.0.1:port/path → body text. */
function httpGet(port, urlPath) {
  return new Promise((resolve, reject) => {
    const req = http.get({ host: '127.0.0.1', port, path: urlPath, timeout: 2000 }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (d) => (body += d));
      res.on('end', () => resolve(body));
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
  });
}

/** Prometheus text → [{name, labels, value}]. */
function parseMetrics(text) {
  const out = [];
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[3] || '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

/** Polls `fn` until it returns a truthy value; throws `what` after `timeoutMs`. */
async function waitFor(what, fn, { timeoutMs = 60_000, intervalMs = 20 } = {}) {
  const start = Date.now();
  let lastErr;
  while (Date.now() - start < timeoutMs) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      lastErr = e;
    }
    await sleep(intervalMs);
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${lastErr ? `: ${lastErr.message}` : ''}`);
}

// Processes started by this test process, killed on exit whatever happens; the Redis
// servers (daemons, not children) of stacks not stopped are stopped by their script.
const children = new Set();
const redisDirs = new Set();
process.on('exit', () => {
  for (const child of children) {
    try {
      child.kill('SIGKILL');
    } catch {
      /* already gone */
    }
  }
  for (const dir of redisDirs) {
    try {
      execFileSync(path.join(REPO, 'dev/redis.sh'), ['down', dir], { stdio: 'ignore' });
    } catch {
      /* best effort */
    }
  }
});
for (const signal of ['SIGINT', 'SIGTERM']) process.once(signal, () => process.exit(128 + (signal === 'SIGINT' ? 2 : 15)));

/** A long-running program with its output in a log file; stopped by PID. */
class Proc {
  constructor(name, cmd, args, { env, logFile, stdio } = {}) {
    this.name = name;
    this.logFile = logFile;
    const log = fs.openSync(logFile, 'a');
    this.child = spawn(cmd, args, {
      env: { ...process.env, ...env },
      stdio: stdio || ['ignore', log, log],
      cwd: REPO,
    });
    fs.closeSync(log);
    this.pid = this.child.pid;
    this.exited = new Promise((resolve) => {
      this.child.on('exit', (code, signal) => {
        children.delete(this.child);
        resolve({ code, signal });
      });
    });
    children.add(this.child);
  }

  alive() {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  /** Sends `signal` (SIGTERM by default) to the PID and waits for the exit (SIGKILL after 10 s). */
  async stop(signal = 'SIGTERM') {
    if (!this.alive()) return this.exited;
    process.kill(this.pid, signal);
    const timer = setTimeout(() => this.alive() && process.kill(this.pid, 'SIGKILL'), 10_000);
    const status = await this.exited;
    clearTimeout(timer);
    return status;
  }

  logTail(lines = 30) {
    try {
      return fs.readFileSync(this.logFile, 'utf8').trim().split('\n').slice(-lines).join('\n');
    } catch {
      return '';
    }
  }
}

/** The shared cluster: started or reused once per test process. */
let clusterPromise;
function cluster() {
  clusterPromise ||= (async () => {
    let binDir = null;
    try {
      binDir = lastLine(run(path.join(REPO, 'dev/build-control-plane.sh'), ['--print-bin-dir']));
    } catch {
      /* no cache yet: cluster-up.sh builds it */
    }
    let kubeconfig;
    let stateDir = null;
    if (process.env.REBOUND_KUBECONFIG) {
      kubeconfig = path.resolve(REPO, process.env.REBOUND_KUBECONFIG);
    } else {
      const dir = path.resolve(REPO, process.env.REBOUND_CLUSTER_STATE_DIR || '.state/cluster');
      kubeconfig = lastLine(run(path.join(REPO, 'dev/cluster-up.sh'), [dir]));
      stateDir = path.dirname(kubeconfig);
      binDir ||= lastLine(run(path.join(REPO, 'dev/build-control-plane.sh'), ['--print-bin-dir']));
    }
    let kubectl = process.env.REBOUND_KUBECTL;
    if (!kubectl) kubectl = binDir && fs.existsSync(path.join(binDir, 'kubectl')) ? path.join(binDir, 'kubectl') : 'kubectl';
    const c = { kubeconfig, stateDir, kubectl };
    const k = (args, opts) => run(kubectl, args, { ...opts, env: { KUBECONFIG: kubeconfig } });
    // Like the Rust harness: every CRD applied server-side (another test process may do the same at once).
    for (const file of fs.readdirSync(path.join(REPO, 'crds')).filter((f) => /\.ya?ml$/.test(f))) {
      for (let i = 0; ; i++) {
        try {
          k(['apply', '--server-side', '--field-manager', FIELD_MANAGER, '--force-conflicts', '-f', path.join(REPO, 'crds', file)]);
          break;
        } catch (e) {
          if (i >= 2) throw e;
          await sleep(500);
        }
      }
    }
    k(['wait', '--for=condition=Established', '--timeout=60s', 'crd/retrypolicies.rebound.dev']);
    return c;
  })();
  return clusterPromise;
}

/** rebound-operator and rebound-sidecar: REBOUND_BIN_DIR, else built with cargo (a no-op when fresh). */
let binariesPromise;
function binaries() {
  binariesPromise ||= (async () => {
    let dir = process.env.REBOUND_BIN_DIR;
    if (!dir) {
      run('cargo', ['build', '--quiet', '--locked', '-p', 'rebound-operator', '-p', 'rebound-sidecar']);
      const meta = JSON.parse(run('cargo', ['metadata', '--format-version', '1', '--no-deps']));
      dir = path.join(meta.target_directory, 'debug');
    }
    const bins = { operator: path.join(dir, 'rebound-operator'), sidecar: path.join(dir, 'rebound-sidecar') };
    for (const b of Object.values(bins)) if (!fs.existsSync(b)) throw new Error(`${b} is missing (cargo build -p rebound-operator -p rebound-sidecar)`);
    return bins;
  })();
  return binariesPromise;
}

/** The sidecar's Role from docs/sidecar.md: that one ConfigMap, read only. */
function sidecarRbac(ns) {
  return `apiVersion: v1
kind: ServiceAccount
metadata: {name: rebound-sidecar, namespace: ${ns}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: rebound-sidecar, namespace: ${ns}}
rules:
  - apiGroups: [""]
    resources: [configmaps]
    resourceNames: [rebound-policies]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: rebound-sidecar, namespace: ${ns}}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: rebound-sidecar}
subjects:
  - {kind: ServiceAccount, name: rebound-sidecar, namespace: ${ns}}
`;
}

/**
 * One namespace with its operator, sidecar and Redis. `Stack.start('name')`; `stop()` ends
 * everything it started. Fields: namespace, redisUrl, sidecar.{tcp,uds} (addresses as the
 * adapter takes them: "127.0.0.1:PORT", "unix:///path").
 */
class Stack {
  static async start(name, { sidecar = true } = {}) {
    const s = new Stack();
    s.name = name;
    const id = crypto.randomBytes(3).toString('hex');
    s.namespace = `node-${name}-${id}`.toLowerCase().replace(/[^a-z0-9-]/g, '-').slice(0, 63);
    s.dir = path.join(REPO, '.state', 'node-e2e', `${name}-${id}`);
    fs.mkdirSync(path.join(s.dir, 'logs'), { recursive: true });
    const [c, bins] = await Promise.all([cluster(), binaries()]);
    s.cluster = c;
    s.bins = bins;

    s.kubectl(['create', 'namespace', s.namespace]);
    s.kubectl(['label', 'namespace', s.namespace, 'rebound.dev/test=node-e2e']);
    s.kubectl(['-n', s.namespace, 'apply', '-f', '-'], { input: sidecarRbac(s.namespace) });

    redisDirs.add(path.join(s.dir, 'redis'));
    s.redisUrl = lastLine(run(path.join(REPO, 'dev/redis.sh'), ['up', path.join(s.dir, 'redis')]));

    s.operatorMetricsPort = await freePort();
    s.operator = new Proc('rebound-operator', bins.operator, [
      `--namespaces=${s.namespace}`, '--leader-elect=false', `--metrics-addr=127.0.0.1:${s.operatorMetricsPort}`, '--log-format=json',
    ], { env: { KUBECONFIG: c.kubeconfig }, logFile: path.join(s.dir, 'logs', 'operator.log') });

    // The sidecar's own credentials: the service account as RBAC sees it.
    if (c.stateDir) {
      s.sidecarKubeconfig = path.join(s.dir, 'sidecar.kubeconfig');
      run(path.join(REPO, 'dev/mint-user-kubeconfig.sh'), [
        c.stateDir, `system:serviceaccount:${s.namespace}:rebound-sidecar`,
        'system:serviceaccounts', `system:serviceaccounts:${s.namespace}`, s.sidecarKubeconfig,
      ]);
    } else {
      s.sidecarKubeconfig = c.kubeconfig; // REBOUND_KUBECONFIG: no CA key to mint with
    }
    s.sidecarPort = await freePort();
    s.sidecarAdminPort = await freePort();
    s.sidecar = { tcp: `127.0.0.1:${s.sidecarPort}`, uds: `unix://${path.join(s.dir, 'rebound.sock')}` };
    if (sidecar) await s.startSidecar();
    return s;
  }

  kubectl(args, opts = {}) {
    return run(this.cluster.kubectl, args, { ...opts, env: { KUBECONFIG: this.cluster.kubeconfig } });
  }

  /** Starts rebound-sidecar as a Pod runs it (same ports and socket every time). */
  async startSidecar({ waitServing = false } = {}) {
    if (this.sidecarProc?.alive()) throw new Error('the sidecar is already running');
    this.sidecarProc = new Proc('rebound-sidecar', this.bins.sidecar, [
      `--configmap=${this.namespace}/rebound-policies`,
      `--listen=127.0.0.1:${this.sidecarPort}`,
      `--uds=${this.sidecar.uds.slice('unix://'.length)}`,
      `--admin-listen=127.0.0.1:${this.sidecarAdminPort}`,
      '--log-format=json',
    ], { env: { KUBECONFIG: this.sidecarKubeconfig }, logFile: path.join(this.dir, 'logs', 'sidecar.log') });
    await waitFor('the sidecar admin port', async () => (await this.sidecarMetrics()).length > 0, { timeoutMs: 30_000 });
    if (waitServing) await waitFor('the sidecar to load a configuration', async () => (await this.sidecarConfigHash()) !== null);
  }

  /** SIGKILL (or `signal`) the sidecar, as a crashed or OOM-killed container. */
  async killSidecar(signal = 'SIGKILL') {
    return this.sidecarProc.stop(signal);
  }

  /** Sends a signal without waiting (SIGSTOP freezes the sidecar: calls then time out). */
  signalSidecar(signal) {
    process.kill(this.sidecarProc.pid, signal);
  }

  async sidecarMetrics() {
    return parseMetrics(await httpGet(this.sidecarAdminPort, '/metrics'));
  }

  /** The hash of the configuration the sidecar answers from, or null before one is loaded. */
  async sidecarConfigHash() {
    const metrics = await this.sidecarMetrics();
    const state = metrics.find((m) => m.name === 'rebound_sidecar_config_state' && m.value === 1)?.labels.state;
    if (state !== 'active' && state !== 'empty') return null;
    return metrics.find((m) => m.name === 'rebound_sidecar_config_info')?.labels.config_hash ?? null;
  }

  /** The compiled document of the namespace's ConfigMap, or null if there is none yet. */
  configMapDocument() {
    let text;
    try {
      text = this.kubectl(['-n', this.namespace, 'get', 'configmap', 'rebound-policies', '-o', 'jsonpath={.data.policies\\.json}']);
    } catch {
      return null;
    }
    return text ? JSON.parse(text) : null;
  }

  /**
   * `kubectl apply` of RetryPolicy YAML. With `wait` (default) returns once the operator has
   * compiled every applied generation into the ConfigMap and the sidecar (if running) answers
   * from that document. Returns {hash, generations: {name: generation}, startedAt, appliedAt}
   * (Date.now() when kubectl started and when it returned).
   */
  async applyPolicy(yaml, { wait = true } = {}) {
    const startedAt = Date.now();
    const out = JSON.parse(this.kubectl(['-n', this.namespace, 'apply', '-o', 'json', '-f', '-'], { input: yaml }));
    const appliedAt = Date.now();
    const items = out.kind === 'List' ? out.items : [out];
    const generations = Object.fromEntries(items.map((o) => [o.metadata.name, o.metadata.generation]));
    if (!wait) return { hash: null, generations, startedAt, appliedAt };
    const doc = await waitFor('the operator to compile the applied policies', () => {
      const d = this.configMapDocument();
      return d && Object.entries(generations).every(([n, g]) => d.policies.some((p) => p.name === n && p.generation === g)) && d;
    });
    if (this.sidecarProc?.alive()) {
      await waitFor(`the sidecar to load ${doc.hash}`, async () => (await this.sidecarConfigHash()) === doc.hash);
    }
    return { hash: doc.hash, generations, startedAt, appliedAt };
  }

  /** Stops the sidecar, the operator and Redis by PID; the namespace stays (no GC here). */
  async stop() {
    await Promise.all([this.sidecarProc?.stop(), this.operator?.stop()]);
    try {
      run(path.join(REPO, 'dev/redis.sh'), ['down', path.join(this.dir, 'redis')]);
      redisDirs.delete(path.join(this.dir, 'redis'));
    } catch (e) {
      console.error(e.message);
    }
  }
}

/** The events a worker emitted, in order, with look-ups the tests share. */
class Events {
  constructor() {
    this.list = [];
    this.push = (e) => this.list.push(e);
  }

  of(ev, jobId) {
    return this.list.filter((e) => e.ev === ev && (jobId === undefined || e.jobId === jobId));
  }

  /** Waits until `pred(events)` is truthy; returns its value. */
  until(what, pred, opts) {
    return waitFor(what, () => pred(this), opts);
  }
}

/** A RetryPolicy manifest from a spec object (JSON is YAML). */
/** Resolves true once something accepts TCP connections on 127.0.0.1:port. */
function accepts(port) {
  return new Promise((resolve) => {
    const s = net.connect({ host: '127.0.0.1', port }, () => {
      s.destroy();
      resolve(true);
    });
    s.on('error', () => resolve(false));
  });
}

/**
 * The rebound-sidecar of one test file: clients/conformance/policies.yaml (namespace
 * conformance) on an address fixed for the file, so a test may kill it and start it again
 * where the workers look for it. Logs in runDir/sidecar-<n>.log, one per start.
 */
class ConformanceSidecar {
  constructor(runDir) {
    this.runDir = runDir;
    this.port = 0;
    this.target = '';
    this.proc = null;
    this.starts = 0;
  }

  /** Starts it and waits until it listens; resolves to the time it did (ms). */
  async start() {
    if (!this.port) {
      this.bins = await binaries();
      this.port = await freePort();
      this.target = `127.0.0.1:${this.port}`;
    }
    this.starts++;
    this.proc = new Proc('rebound-sidecar', this.bins.sidecar, [
      '--policies-file', path.join(REPO, 'clients', 'conformance', 'policies.yaml'), '--namespace', 'conformance',
      '--listen', this.target, '--no-admin', '--log-format', 'json',
    ], { logFile: path.join(this.runDir, `sidecar-${this.starts}.log`) });
    await waitFor('the sidecar to listen', () => accepts(this.port), { timeoutMs: 30_000, intervalMs: 10 });
    return Date.now();
  }

  async stop() {
    await this.proc?.stop();
  }
}

function retryPolicy(name, spec) {
  return JSON.stringify({ apiVersion: 'rebound.dev/v1alpha1', kind: 'RetryPolicy', metadata: { name }, spec });
}

module.exports = { Stack, Proc, ConformanceSidecar, Events, REPO, retryPolicy, waitFor, sleep, freePort, parseMetrics, httpGet, run, binaries, lastLine, redisDirs };
