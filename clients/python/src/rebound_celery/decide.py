"""A port of the policy crate's decision function, for the local fallback.

It must give the sidecar's answers bit for bit: the algorithm is specified in
policy/testdata/README.md and checked against decide-vectors.json. Delay arithmetic is
Python ``float`` (IEEE-754 binary64) in the order written there; 64-bit values are ints.
"""

import json
import math
import random

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
TWO_POW_MINUS_53 = 2.0**-53
MAX_ATTEMPTS = 10000
"""``spec::limits::MAX_ATTEMPTS``: retries are clamped to it."""
MIN_PUSHBACK_LIMIT_MS = 86400000
"""A pushback is honoured up to max(cap, 24h)."""


def fnv1a64(text):
    h = FNV_OFFSET
    for b in text.encode("utf-8"):
        h = ((h ^ b) * FNV_PRIME) & MASK64
    return h


def mix64(z):
    z = (z + GOLDEN_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class _Draws:
    """The random stream of one (job id, identity): ``unit(i)`` in [0, 1)."""

    def __init__(self, job_id, identity_seed):
        self.seed = None if job_id is None else mix64(fnv1a64(job_id) ^ identity_seed)

    def unit(self, i):
        if self.seed is None:  # without a job id the sidecar draws at random; so does this
            return random.random()
        bits = mix64((self.seed + i * GOLDEN_GAMMA) & MASK64)
        return float(bits >> 11) * TWO_POW_MINUS_53


# Rust's f64::min / f64::max ignore a NaN operand.
def _fmin(a, b):
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return a if a < b else b


def _fmax(a, b):
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return a if a > b else b


def _to_u64(x):
    """Rust's ``f64 as u64``: truncation; NaN and negatives to 0."""
    if not x > 0:
        return 0
    if math.isinf(x):
        return MASK64
    return int(x)


def compile_glob(pattern):
    """A ``*`` glob matched like policy/src/pattern.rs (leftmost literal runs, whole name)."""
    parts = pattern.split("*")
    if len(parts) == 1:
        return lambda name: name == pattern
    prefix, suffix = parts[0], parts[-1]
    runs = [p for p in parts[1:-1] if p]

    def match(name):
        if len(name) < len(prefix) + len(suffix):
            return False
        if not name.startswith(prefix) or not name.endswith(suffix):
            return False
        pos = len(prefix)
        end = len(name) - len(suffix)
        for run in runs:
            at = name.find(run, pos)
            if at < 0 or at + len(run) > end:
                return False
            pos = at + len(run)
        return True

    return match


def _exponential(base, multiplier, k):
    power, square, e = 1.0, multiplier, k - 1
    while e > 0:
        if e & 1:
            power = power * square
        e >>= 1
        if e > 0:
            square = square * square
    return base * power


def _after(o, n):
    return (o[0] + o[1] * n[0], o[1] * n[1], _fmin(o[2], o[0] + o[1] * n[2]))


def _apply(m, x):
    return _fmin(m[0] + m[1] * x, m[2])


def _decorrelated(base, cap, k, d):
    def step(i):
        u = d.unit(i)
        return (base * (1.0 - u), 3.0 * u, cap)

    whole = k - (k % 4)
    v = base
    for i in range(0, whole, 4):
        first = _after(step(i + 2), step(i + 1))
        second = _after(step(i + 4), step(i + 3))
        v = _apply(_after(second, first), v)
    for i in range(whole + 1, k + 1):
        v = _apply(step(i), v)
    return v


def _delay(p, k, remaining, d):
    k = min(max(k, 1), MAX_ATTEMPTS)
    cap = float(p["capMs"])
    base = float(p["baseMs"])
    window = cap if remaining is None else _fmin(cap, float(remaining))
    s = p["strategy"]
    if s == "STRATEGY_EXPONENTIAL":
        capped = _fmin(_exponential(base, float(p["multiplier"]), k), cap)
    elif s == "STRATEGY_LINEAR":
        capped = _fmin(base * float(k), cap)
    elif s == "STRATEGY_CONSTANT":
        capped = _fmin(base, cap)
    elif s == "STRATEGY_SCHEDULE":
        sched = p["scheduleMs"]
        capped = _fmin(float(sched[min(k, len(sched)) - 1]) if sched else base, cap)
    elif s == "STRATEGY_DECORRELATED":
        return _to_u64(_fmin(_decorrelated(base, cap, k, d), window))
    else:
        raise ValueError(f"policy.strategy: unknown strategy {s!r}")
    jitter = p["jitter"]
    if jitter == "JITTER_NONE":
        return _to_u64(capped)
    capped = _fmin(capped, window)
    if jitter == "JITTER_FULL":
        j = capped * d.unit(k)
    elif jitter == "JITTER_EQUAL":
        j = capped / 2.0 + (capped / 2.0) * d.unit(k)
    elif jitter == "JITTER_PROPORTIONAL":
        r = float(p["jitterRatio"])
        j = capped * ((1.0 - r) + (2.0 * r) * d.unit(k))
    else:
        raise ValueError(f"policy.jitter: unknown jitter {jitter!r}")
    if math.isnan(j):
        return 0
    return _to_u64(min(max(j, 0.0), window))


def format_millis(ms):
    """``format_millis``: 1h2m3s4ms, exact."""
    rest = int(ms)
    if rest == 0:
        return "0s"
    out = ""
    for unit, size in (("h", 3600000), ("m", 60000), ("s", 1000), ("ms", 1)):
        n = rest // size
        if n > 0:
            out += f"{n}{unit}"
            rest -= n * size
    return out


class PreparedPolicy:
    """A ResolvedPolicy (proto3 JSON names) with its identity hash and globs computed once."""

    __slots__ = ("params", "identity", "identity_seed", "globs")

    def __init__(self, policy, identity):
        self.params = policy
        self.identity = identity
        self.identity_seed = fnv1a64(identity)
        self.globs = [(pat, compile_glob(pat)) for pat in policy["nonRetryableErrors"]]


def _opt_int(v):
    return None if v is None else int(v)


def decide_prepared(prepared, attempt, ctx=None):
    """The answer for attempt ``attempt`` (1-based; 0 reads as 1).

    ``ctx`` keys (all optional): jobId, errorClass, firstFailureUnixMs, nowUnixMs,
    retryAfterMs. Returns a dict in DecideResponse's proto3 JSON names.
    """
    ctx = ctx or {}
    p = prepared.params
    k = max(int(attempt), 1)

    def give_up(reason, message):
        terminal = p["terminal"]
        return {
            "decision": "DECISION_GIVE_UP",
            "delayMs": 0,
            "disposition": terminal,
            "deadLetterQueue": p["deadLetterQueue"] if terminal == "DISPOSITION_DEAD_LETTER" else "",
            "reason": reason,
            "reasonMessage": message,
        }

    error_class = ctx.get("errorClass")
    if error_class is not None:
        for pattern, glob in prepared.globs:
            if glob(error_class):
                return give_up(
                    "GIVE_UP_REASON_NON_RETRYABLE",
                    f"error class {json.dumps(error_class, ensure_ascii=False)} is non-retryable "
                    f"(matches {json.dumps(pattern, ensure_ascii=False)})",
                )
    max_attempts = int(p["maxAttempts"])
    if k >= max_attempts:
        if k == max_attempts:
            msg = f"attempt {k} of {max_attempts} failed (maxAttempts)"
        else:
            msg = f"attempt {k} failed, past maxAttempts {max_attempts} (runs including the first)"
        return give_up("GIVE_UP_REASON_MAX_ATTEMPTS", msg)

    first = _opt_int(ctx.get("firstFailureUnixMs"))
    now = _opt_int(ctx.get("nowUnixMs"))
    elapsed = now - first if first is not None and now is not None and now > first else 0
    limit = int(p["maxRetryDurationMs"])
    limit = limit if limit > 0 else None
    remaining = None if limit is None else max(limit - elapsed, 0)
    delay = _delay(p, k, remaining, _Draws(ctx.get("jobId"), prepared.identity_seed))
    pushback = _opt_int(ctx.get("retryAfterMs"))
    if pushback is not None:
        delay = max(delay, min(pushback, max(int(p["capMs"]), MIN_PUSHBACK_LIMIT_MS)))
    if limit is not None:
        nxt = min(elapsed + delay, MASK64)
        if nxt > limit:
            return give_up(
                "GIVE_UP_REASON_DEADLINE",
                f"the next run would start {format_millis(nxt)} after the first failure, "
                f"past maxRetryDuration {format_millis(limit)}",
            )
    return {
        "decision": "DECISION_RETRY",
        "delayMs": delay,
        "disposition": "DISPOSITION_UNSPECIFIED",
        "deadLetterQueue": "",
        "reason": "GIVE_UP_REASON_UNSPECIFIED",
        "reasonMessage": "",
    }


def backoff_delay(prepared, attempt, job_id=None):
    """The policy's backoff delay for ``attempt`` (jitter keyed on ``job_id``), whatever its
    maxAttempts and deadline say: the wait before a give-up whose write was refused is
    tried again."""
    return _delay(prepared.params, max(int(attempt), 1), None, _Draws(job_id, prepared.identity_seed))


def decide_local(policy, identity, attempt, ctx=None):
    """One-shot form of :func:`decide_prepared`."""
    return decide_prepared(PreparedPolicy(policy, identity), attempt, ctx)
