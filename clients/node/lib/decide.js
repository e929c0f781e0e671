'use strict';
// A port of the policy crate's decision function (policy/src/decide.rs), used for the
// local fallback. It must give the sidecar's answers bit for bit: the algorithm is
// specified in policy/testdata/README.md and checked against decide-vectors.json.
// Delay arithmetic is IEEE-754 binary64 (a JS Number) in the order written there;
// 64-bit integers (hashes, epoch times, pushbacks) are BigInt.

const MASK64 = (1n << 64n) - 1n;
const U64_MAX = MASK64;
const GOLDEN_GAMMA = 0x9e3779b97f4a7c15n;
const FNV_OFFSET = 0xcbf29ce484222325n;
const FNV_PRIME = 0x100000001b3n;
const TWO_POW_MINUS_53 = 1 / 2 ** 53;
/** `spec::limits::MAX_ATTEMPTS`: retries are clamped to it. */
const MAX_ATTEMPTS = 10000;
/** `MIN_PUSHBACK_LIMIT_MS`: a pushback is honoured up to max(cap, 24h). */
const MIN_PUSHBACK_LIMIT_MS = 86400000;

const encoder = new TextEncoder();

/** 64-bit FNV-1a over the UTF-8 bytes of `text`. */
function fnv1a64(text) {
  let h = FNV_OFFSET;
  for (const b of encoder.encode(text)) {
    h = ((h ^ BigInt(b)) * FNV_PRIME) & MASK64;
  }
  return h;
}

/** The SplitMix64 finaliser. */
function mix64(z) {
  z = (z + GOLDEN_GAMMA) & MASK64;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK64;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & MASK64;
  return z ^ (z >> 31n);
}

/** The random stream of one (job id, identity): `unit(i)` in [0, 1). */
function draws(jobId, identitySeed) {
  if (jobId === undefined) {
    // Without a job id the sidecar draws at random; so does the fallback.
    return { unit: () => Math.random() };
  }
  const seed = mix64(fnv1a64(jobId) ^ identitySeed);
  return {
    unit(i) {
      const bits = mix64((seed + BigInt(i) * GOLDEN_GAMMA) & MASK64);
      return Number(bits >> 11n) * TWO_POW_MINUS_53;
    },
  };
}

// Rust's f64::min / f64::max ignore a NaN operand; Math.min / Math.max propagate it.
function fmin(a, b) {
  if (Number.isNaN(a)) return b;
  if (Number.isNaN(b)) return a;
  return a < b ? a : b;
}
function fmax(a, b) {
  if (Number.isNaN(a)) return b;
  if (Number.isNaN(b)) return a;
  return a > b ? a : b;
}
/** Rust's `f64 as u64`: truncation, NaN and negatives to 0. */
function toU64(x) {
  if (!(x > 0)) return 0;
  return Math.trunc(x);
}

/** A `*` glob, matched like policy/src/pattern.rs (leftmost literal runs, whole name). */
function compileGlob(pattern) {
  const parts = pattern.split('*');
  if (parts.length === 1) return (name) => name === pattern;
  const prefix = parts[0];
  const suffix = parts[parts.length - 1];
  const runs = parts.slice(1, -1).filter((p) => p.length > 0);
  return (name) => {
    if (name.length < prefix.length + suffix.length) return false;
    if (!name.endsWith(suffix) || !name.startsWith(prefix)) return false;
    let pos = prefix.length;
    const end = name.length - suffix.length;
    for (const run of runs) {
      const at = name.indexOf(run, pos);
      if (at < 0 || at + run.length > end) return false;
      pos = at + run.length;
    }
    return true;
  };
}

/** `base * multiplier^(k-1)` by binary exponentiation, lowest bit first. */
function exponential(base, multiplier, k) {
  let power = 1.0;
  let square = multiplier;
  let e = k - 1;
  while (e > 0) {
    if (e & 1) power = power * square;
    e = e >>> 1;
    if (e > 0) square = square * square;
  }
  return base * power;
}

function stepMap(base, cap, u) {
  return { add: base * (1.0 - u), mul: 3.0 * u, cap };
}
function after(o, n) {
  return { add: o.add + o.mul * n.add, mul: o.mul * n.mul, cap: fmin(o.cap, o.add + o.mul * n.cap) };
}
function apply(m, x) {
  return fmin(m.add + m.mul * x, m.cap);
}

/** Decorrelated jitter replayed from retry 1, folded four steps at a time. */
function decorrelated(base, cap, k, d) {
  const step = (i) => stepMap(base, cap, d.unit(i));
  const whole = k - (k % 4);
  let v = base;
  for (let i = 0; i < whole; i += 4) {
    const first = after(step(i + 2), step(i + 1));
    const second = after(step(i + 4), step(i + 3));
    v = apply(after(second, first), v);
  }
  for (let i = whole + 1; i <= k; i++) v = apply(step(i), v);
  return v;
}

/** The jittered delay before retry `k`, in ms (a Number; `remaining` a Number or null). */
function delayForRetry(p, k, remaining, d) {
  k = Math.min(Math.max(k, 1), MAX_ATTEMPTS);
  const cap = p.capMs;
  const base = p.baseMs;
  const window = remaining === null ? cap : fmin(cap, remaining);
  let capped;
  switch (p.strategy) {
    case 'STRATEGY_EXPONENTIAL':
      capped = fmin(exponential(base, p.multiplier, k), cap);
      break;
    case 'STRATEGY_LINEAR':
      capped = fmin(base * k, cap);
      break;
    case 'STRATEGY_CONSTANT':
      capped = fmin(base, cap);
      break;
    case 'STRATEGY_SCHEDULE': {
      const s = p.scheduleMs;
      const index = Math.min(k - 1, Math.max(s.length - 1, 0));
      capped = fmin(s.length > 0 ? Number(s[index]) : base, cap);
      break;
    }
    case 'STRATEGY_DECORRELATED':
      return toU64(fmin(decorrelated(base, cap, k, d), window));
    default:
      throw new TypeError(`policy.strategy: unknown strategy ${p.strategy}`);
  }
  if (p.jitter === 'JITTER_NONE') return toU64(capped);
  capped = fmin(capped, window);
  let j;
  switch (p.jitter) {
    case 'JITTER_FULL':
      j = capped * d.unit(k);
      break;
    case 'JITTER_EQUAL':
      j = capped / 2.0 + (capped / 2.0) * d.unit(k);
      break;
    case 'JITTER_PROPORTIONAL': {
      const r = p.jitterRatio;
      j = capped * (1.0 - r + 2.0 * r * d.unit(k));
      break;
    }
    default:
      throw new TypeError(`policy.jitter: unknown jitter ${p.jitter}`);
  }
  // Rust's clamp(0, window) followed by `as u64`.
  if (Number.isNaN(j)) return 0;
  return toU64(Math.min(Math.max(j, 0.0), window));
}

/** `format_millis`: 1h2m3s4ms, exact. */
function formatMillis(ms) {
  let rest = BigInt(ms);
  if (rest === 0n) return '0s';
  let out = '';
  for (const [unit, size] of [['h', 3600000n], ['m', 60000n], ['s', 1000n], ['ms', 1n]]) {
    const n = rest / size;
    if (n > 0n) {
      out += `${n}${unit}`;
      rest -= n * size;
    }
  }
  return out;
}

function toBig(v) {
  if (v === undefined || v === null) return undefined;
  return typeof v === 'bigint' ? v : BigInt(v);
}

/**
 * A policy prepared for repeated decisions: the identity hash and the globs computed once.
 * `policy` is a ResolvedPolicy in proto3 JSON names; `identity` is "namespace/name".
 */
class PreparedPolicy {
  constructor(policy, identity) {
    this.params = policy;
    this.identity = identity;
    this.identitySeed = fnv1a64(identity);
    this.globs = policy.nonRetryableErrors.map((p) => [p, compileGlob(p)]);
  }
}

/**
 * decide(policy, attempt, context): the answer for attempt `attempt` (1-based; 0 reads as 1).
 * Context fields are optional; 64-bit ones may be BigInt or Number.
 */
function decidePrepared(prepared, attempt, ctx = {}) {
  const p = prepared.params;
  const k = Math.max(attempt, 1);
  const giveUp = (reason, reasonMessage) => ({
    decision: 'DECISION_GIVE_UP',
    delayMs: 0,
    disposition: p.terminal,
    deadLetterQueue: p.terminal === 'DISPOSITION_DEAD_LETTER' ? p.deadLetterQueue : '',
    reason,
    reasonMessage,
  });

  if (ctx.errorClass !== undefined) {
    for (const [pattern, glob] of prepared.globs) {
      if (glob(ctx.errorClass)) {
        return giveUp(
          'GIVE_UP_REASON_NON_RETRYABLE',
          `error class ${JSON.stringify(ctx.errorClass)} is non-retryable (matches ${JSON.stringify(pattern)})`,
        );
      }
    }
  }
  if (k >= p.maxAttempts) {
    return giveUp(
      'GIVE_UP_REASON_MAX_ATTEMPTS',
      k === p.maxAttempts
        ? `attempt ${k} of ${p.maxAttempts} failed (maxAttempts)`
        : `attempt ${k} failed, past maxAttempts ${p.maxAttempts} (runs including the first)`,
    );
  }

  const first = toBig(ctx.firstFailureUnixMs);
  const now = toBig(ctx.nowUnixMs);
  const elapsed = first !== undefined && now !== undefined && now > first ? now - first : 0n;
  const limit = p.maxRetryDurationMs > 0 ? BigInt(p.maxRetryDurationMs) : null;
  // remaining <= maxRetryDurationMs <= 8760h, so it converts to a Number exactly.
  const remaining = limit === null ? null : Number(limit > elapsed ? limit - elapsed : 0n);
  let delay = delayForRetry(p, k, remaining, draws(ctx.jobId, prepared.identitySeed));
  const pushback = toBig(ctx.retryAfterMs);
  if (pushback !== undefined) {
    const pushLimit = BigInt(Math.max(p.capMs, MIN_PUSHBACK_LIMIT_MS));
    delay = Math.max(delay, Number(pushback < pushLimit ? pushback : pushLimit));
  }
  if (limit !== null) {
    let next = elapsed + BigInt(delay);
    if (next > U64_MAX) next = U64_MAX;
    if (next > limit) {
      return giveUp(
        'GIVE_UP_REASON_DEADLINE',
        `the next run would start ${formatMillis(next)} after the first failure, past maxRetryDuration ${formatMillis(limit)}`,
      );
    }
  }
  return {
    decision: 'DECISION_RETRY',
    delayMs: delay,
    disposition: 'DISPOSITION_UNSPECIFIED',
    deadLetterQueue: '',
    reason: 'GIVE_UP_REASON_UNSPECIFIED',
    reasonMessage: '',
  };
}

/** One-shot form: `decideLocal(policy, identity, attempt, context)`. */
function decideLocal(policy, identity, attempt, ctx) {
  return decidePrepared(new PreparedPolicy(policy, identity), attempt, ctx);
}

module.exports = {
  decideLocal,
  decidePrepared,
  delayForRetry,
  draws,
  PreparedPolicy,
  fnv1a64,
  mix64,
  compileGlob,
  formatMillis,
  MAX_ATTEMPTS,
};
