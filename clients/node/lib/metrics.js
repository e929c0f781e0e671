'use strict';
// The adapter's Prometheus counters (the `rebound_adapter_*` contract shared by every
// Rebound adapter), registered into the application's prom-client Registry. Nothing is
// registered or served unless the application passes one.

/** Name → help and label names: the same in every language's adapter. */
const METRICS = Object.freeze({
  decisions: {
    name: 'rebound_adapter_decisions_total',
    help: 'Retry decisions the hook used, by who answered (sidecar or local fallback).',
    labelNames: ['adapter', 'source'],
  },
  fallbacks: {
    name: 'rebound_adapter_fallbacks_total',
    help: 'Decisions made without the sidecar, by cause and the policy used (cached copy or built-in default).',
    labelNames: ['adapter', 'reason', 'policy_source'],
  },
  terminal: {
    name: 'rebound_adapter_terminal_total',
    help: 'Jobs the adapter dead-lettered or dropped.',
    labelNames: ['adapter', 'disposition'],
  },
  hookErrors: {
    name: 'rebound_adapter_hook_errors_total',
    help: 'Faults inside the adapter that it absorbed (the hook never throws).',
    labelNames: ['adapter'],
  },
});

/** Every label value each counter can take: all series exist from the adapter's first use. */
const SOURCES = ['sidecar', 'fallback'];
const REASONS = ['unavailable', 'deadline_exceeded', 'not_found', 'other'];
const POLICY_SOURCES = ['cached', 'default'];
const DISPOSITIONS = ['dead_letter', 'drop'];

/**
 * The counter `spec` in `registry`: the one registered there already (another Rebound
 * instance of the same process, so their counts add up), else a new one.
 */
function counterIn(promClient, registry, spec) {
  const existing = registry.getSingleMetric(spec.name);
  if (existing) {
    const labels = existing.labelNames || [];
    // By class name: the application may hold another copy of prom-client than this package.
    const isCounter = existing instanceof promClient.Counter || (existing.constructor && existing.constructor.name === 'Counter');
    if (!isCounter || labels.join(',') !== spec.labelNames.join(',')) {
      throw new TypeError(`registry: ${spec.name} is registered already, not as a counter with labels ${spec.labelNames.join(', ')}`);
    }
    return existing;
  }
  return new promClient.Counter({ ...spec, registers: [registry] });
}

/** The counters of one Rebound instance. `registry`: a prom-client Registry. */
class AdapterMetrics {
  constructor(registry, promClient = loadPromClient()) {
    if (!registry || typeof registry.getSingleMetric !== 'function' || typeof registry.registerMetric !== 'function') {
      throw new TypeError('registry: must be a prom-client Registry (e.g. require("prom-client").register)');
    }
    this.decisions = counterIn(promClient, registry, METRICS.decisions);
    this.fallbacks = counterIn(promClient, registry, METRICS.fallbacks);
    this.terminal = counterIn(promClient, registry, METRICS.terminal);
    this.hookErrors = counterIn(promClient, registry, METRICS.hookErrors);
    this.seen = new Set();
  }

  /** Creates every series of `adapter` at 0 the first time it is seen (rate() needs a start). */
  init(adapter) {
    if (this.seen.has(adapter)) return;
    this.seen.add(adapter);
    for (const source of SOURCES) this.decisions.inc({ adapter, source }, 0);
    for (const reason of REASONS) {
      for (const policy_source of POLICY_SOURCES) this.fallbacks.inc({ adapter, reason, policy_source }, 0);
    }
    for (const disposition of DISPOSITIONS) this.terminal.inc({ adapter, disposition }, 0);
    this.hookErrors.inc({ adapter }, 0);
  }

  decision(adapter, source) {
    this.init(adapter);
    this.decisions.inc({ adapter, source });
  }

  fallback(adapter, reason, policySource) {
    this.init(adapter);
    this.fallbacks.inc({ adapter, reason, policy_source: policySource });
  }

  terminalJob(adapter, disposition) {
    this.init(adapter);
    this.terminal.inc({ adapter, disposition });
  }

  hookError(adapter) {
    this.init(adapter);
    this.hookErrors.inc({ adapter });
  }
}

/** prom-client as the application installed it (an optional peer dependency). */
function loadPromClient() {
  try {
    return require('prom-client');
  } catch (e) {
    throw new TypeError(`registry: prom-client is not installed (npm install prom-client): ${e.message}`);
  }
}

/** No registry: counting costs nothing. */
const NO_METRICS = Object.freeze({ decision() {}, fallback() {}, terminalJob() {}, hookError() {} });

module.exports = { AdapterMetrics, NO_METRICS, METRICS };
