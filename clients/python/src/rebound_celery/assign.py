"""A port of the policy crate's rollout assignment (policy/src/rollout/assign.rs).

Which revision of a policy in rollout answers a job. The fallback must pick the revision
the sidecar picks, so it reproduces every case of policy/testdata/assign-vectors.json; the
algorithm is specified in policy/testdata/README.md ("Rollout assignment vectors").
64-bit values are ints, hashed with decide's ``fnv1a64`` and ``mix64``.
"""

import re

from .decide import MASK64, fnv1a64, mix64

STABLE = "STABLE"
"""The revision that served before the rollout (GetPolicy's policy)."""
CANARY = "CANARY"
"""The revision being rolled out (the rollout's canary)."""
MAX_ROLLOUT_STEPS = 10
"""``spec::limits::MAX_ROLLOUT_STEPS``: a valid rollout has no more."""
MAX_ROLLOUT_WEIGHT = 99
"""``spec::limits::MAX_ROLLOUT_WEIGHT``: weights are percent in 1..99."""

_DECIMAL = re.compile(r"[0-9]{1,20}")


def _u64(v):
    """A uint64 from an int or a decimal string (proto3 JSON); None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        n = v
    elif isinstance(v, str) and _DECIMAL.fullmatch(v):
        n = int(v)
    else:
        return None
    return n if 0 <= n <= MASK64 else None


def _well_formed(steps):
    """The steps as (weight, start) pairs, or None unless they are what a valid rollout
    holds: a list of at most 10, weights ints in 1..99 strictly increasing, starts uint64s
    non-decreasing. The sidecar refuses anything else, so the fallback serves the stable
    revision rather than guess."""
    if not isinstance(steps, (list, tuple)) or len(steps) > MAX_ROLLOUT_STEPS:
        return None
    out = []
    for step in steps:
        if not isinstance(step, dict):
            return None
        weight, start = step.get("weight"), _u64(step.get("startUnixMs"))
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_ROLLOUT_WEIGHT:
            return None
        if start is None or (out and (weight <= out[-1][0] or start < out[-1][1])):
            return None
        out.append((weight, start))
    return out


def _salt(revision):
    """``fnv1a64(revision)``, or None for a revision that is not a valid str."""
    if not isinstance(revision, str):
        return None
    try:
        return fnv1a64(revision)
    except UnicodeEncodeError:  # a lone surrogate: not text a sidecar accepts
        return None


class PreparedRollout:
    """A rollout ready for repeated assignments: the revision's hash and the check of its
    steps done once, when GetPolicy's answer is loaded, not on every job. ``revision`` is the
    new revision's id (it salts the hash); ``steps`` the steps started so far (dicts
    ``weight``, ``startUnixMs``, as GetPolicy's rollout gives them)."""

    __slots__ = ("salt", "steps")

    def __init__(self, revision, steps):
        # None when the revision is not a valid str: every job then STABLE, no bucket.
        self.salt = _salt(revision)
        # (weight, start) pairs, or None when malformed: every job then STABLE.
        self.steps = _well_formed(steps)


def arm_prepared(prepared, job_id, first_failure_unix_ms, now_unix_ms):
    """The revision that answers a job: ``{"arm": "STABLE" | "CANARY", "bucket": 0..99}``,
    the shape of the vectors' ``expected``.

    ``bucket`` is present exactly when there is a job id (a non-empty str). CANARY iff the
    bucket is below the weight of the last step started at or before the job's first
    failure; an unknown first failure (None or 0, as the protocol sends it) places the job
    by ``now_unix_ms``. Times are ints or decimal strings. Malformed input (steps, times, a
    non-str revision) gives STABLE, and an id that is not valid Unicode (a lone surrogate)
    counts as no job id; it never raises.
    """
    if not isinstance(job_id, str) or job_id == "" or prepared.salt is None:
        return {"arm": STABLE}
    try:
        bucket = mix64(fnv1a64(job_id) ^ prepared.salt) % 100
    except UnicodeEncodeError:  # a lone surrogate: not text a sidecar accepts, so no job id
        return {"arm": STABLE}
    first = 0 if first_failure_unix_ms is None else _u64(first_failure_unix_ms)
    t = _u64(now_unix_ms) if first == 0 else first
    if prepared.steps is None or t is None:
        return {"arm": STABLE, "bucket": bucket}
    weight = 0
    # Starts are non-decreasing, so the steps started by t are a prefix.
    for w, start in prepared.steps:
        if start > t:
            break
        weight = w
    return {"arm": CANARY if bucket < weight else STABLE, "bucket": bucket}


def arm(revision, steps, job_id, first_failure_unix_ms, now_unix_ms):
    """One-shot form of :func:`arm_prepared`."""
    return arm_prepared(PreparedRollout(revision, steps), job_id, first_failure_unix_ms, now_unix_ms)
