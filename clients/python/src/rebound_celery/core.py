"""Asks the sidecar; answers from the local fallback when it cannot. Never raises.

Fallback = the last ``GetPolicy`` answer for the queue (fetched in a background thread
whenever a sidecar answer names a config hash this process has not fetched yet), decided
with the port of ``decide``; without one, :data:`DEFAULT_POLICY`.
"""

import hashlib
import json
import os
import sys
import threading
import time
import weakref

import grpc

from ._pb import advisor_pb2 as pb
from .client import AdvisorClient, answer_from_wire, resolved_from_wire
from .decide import PreparedPolicy, decide_prepared

DEFAULT_POLICY = {
    "strategy": "STRATEGY_EXPONENTIAL",
    "baseMs": 1000,
    "multiplier": 2.0,
    "capMs": 600000,
    "jitter": "JITTER_FULL",
    "jitterRatio": 0.0,
    "scheduleMs": [],
    "maxAttempts": 10,
    "maxRetryDurationMs": 0,
    "nonRetryableErrors": [],
    "terminal": "DISPOSITION_DROP",
    "deadLetterQueue": "",
}
"""What a RetryPolicy with an empty spec resolves to: 10 runs, exponential 1s..10m, full jitter, drop."""
DEFAULT_IDENTITY = "rebound/default"
MAX_JOB_ID_BYTES = 512
MAX_ERROR_CLASS_BYTES = 253
LAST_RESORT_DELAY_MS = 5000
"""Answered when even the fallback fails (it should not)."""

_instances = weakref.WeakSet()


def _log(level, event, **fields):
    """One JSON line on stderr (structured fields); never raises."""
    try:
        fields = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": level,
                  "event": event, "pid": os.getpid(), **fields}
        sys.stderr.write(json.dumps(fields, default=str) + "\n")
    except Exception:  # a logger must never break the retry path
        pass


def _truncate_utf8(text, limit):
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", errors="ignore")


def normalise_failure(queue, attempt, job_id=None, error_class=None, first_failure_unix_ms=None,
                      retry_after_ms=None):
    """The same question for the sidecar and the fallback (proto bounds applied)."""
    f = {"queue": str(queue)}
    try:
        a = int(attempt)
    except (TypeError, ValueError):
        a = 1
    f["attempt"] = min(max(a, 1), 4294967295)
    if job_id not in (None, ""):
        jid = str(job_id)
        if len(jid.encode("utf-8")) > MAX_JOB_ID_BYTES:
            jid = hashlib.sha256(jid.encode("utf-8")).hexdigest()
        f["jobId"] = jid
    if isinstance(error_class, str) and error_class:
        f["errorClass"] = _truncate_utf8(error_class, MAX_ERROR_CLASS_BYTES)
    try:
        if first_failure_unix_ms is not None and int(first_failure_unix_ms) >= 10**12:
            f["firstFailureUnixMs"] = int(first_failure_unix_ms)
    except (TypeError, ValueError):
        pass
    try:
        if retry_after_ms is not None and float(retry_after_ms) > 0:
            f["retryAfterMs"] = min(int(-(-float(retry_after_ms) // 1)), 2**63 - 1)
    except (TypeError, ValueError, OverflowError):
        pass
    return f


def _cause(err):
    code = err.code() if isinstance(err, grpc.RpcError) and hasattr(err, "code") else None
    return {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
            grpc.StatusCode.NOT_FOUND: "not_found"}.get(code, "other")


class Rebound:
    """One per process (or per app); safe under threads and across fork."""

    def __init__(self, target=None, deadline_ms=250, default_policy=None):
        self.target = target or os.environ.get("REBOUND_TARGET", "127.0.0.1:7411")
        self.client = AdvisorClient(self.target, deadline_ms / 1000.0)
        self.default = PreparedPolicy(default_policy or DEFAULT_POLICY, DEFAULT_IDENTITY)
        self._lock = threading.Lock()
        self._policies = {}  # queue -> (configHash, resolved, PreparedPolicy)
        self._refreshing = set()
        self.counters = {"decisions": {}, "fallback": {}, "dead_lettered": 0, "dropped": 0}
        _instances.add(self)

    def _after_fork(self):
        """In a forked child: a lock another thread held, and refresh threads, did not come along."""
        self._lock = threading.Lock()
        self._refreshing = set()

    def _count(self, group, key):
        with self._lock:
            self.counters[group][key] = self.counters[group].get(key, 0) + 1

    def count_disposition(self, which):
        with self._lock:
            self.counters[which] += 1

    def metrics(self):
        with self._lock:
            return json.loads(json.dumps(self.counters))

    def cached_policy(self, queue):
        with self._lock:
            return self._policies.get(queue)

    def refresh(self, queue):
        """Fetches the queue's policy now (the caller's thread); True on success."""
        try:
            res = self.client.get_policy(queue)
        except Exception as err:
            _log("warn", "rebound.get_policy_failed", queue=queue, cause=_cause(err), error=str(err)[:300])
            return False
        ref = res.policy
        resolved = resolved_from_wire(res.resolved)
        prepared = PreparedPolicy(resolved, f"{ref.namespace}/{ref.name}")
        with self._lock:
            self._policies[queue] = (ref.config_hash, resolved, prepared)
        _log("info", "rebound.policy_fetched", queue=queue, policy=f"{ref.namespace}/{ref.name}",
             config_hash=ref.config_hash)
        return True

    def _refresh_in_background(self, queue):
        with self._lock:
            if queue in self._refreshing:
                return
            self._refreshing.add(queue)

        def run():
            try:
                self.refresh(queue)
            finally:
                with self._lock:
                    self._refreshing.discard(queue)

        threading.Thread(target=run, name="rebound-refresh", daemon=True).start()

    def decide(self, queue, attempt, **context):
        """The answer for this failure (a dict, ``source`` = sidecar | fallback | default)."""
        try:
            f = normalise_failure(queue, attempt, **context)
        except Exception:
            f = {"queue": str(queue), "attempt": 1}
        try:
            return self._decide(f)
        except Exception as err:  # never raise from the retry path
            _log("error", "rebound.fallback_failed", queue=f["queue"], error=repr(err)[:300])
            return {"decision": "DECISION_RETRY", "delayMs": LAST_RESORT_DELAY_MS, "source": "last_resort",
                    "disposition": "DISPOSITION_UNSPECIFIED", "deadLetterQueue": "",
                    "reason": "GIVE_UP_REASON_UNSPECIFIED", "reasonMessage": "",
                    "budgetStretched": False, "budgetDelayMs": 0}

    def _decide(self, f):
        req = pb.DecideRequest(queue=f["queue"], attempt=f["attempt"], job_id=f.get("jobId", ""),
                               error_class=f.get("errorClass", ""),
                               first_failure_unix_ms=f.get("firstFailureUnixMs", 0),
                               retry_after_ms=f.get("retryAfterMs", 0))
        try:
            answer = answer_from_wire(self.client.decide(req))
            answer["source"] = "sidecar"
            cached = self.cached_policy(f["queue"])
            if cached is None or cached[0] != answer["policy"]["configHash"]:
                self._refresh_in_background(f["queue"])
        except Exception as err:
            cause = _cause(err)
            cached = self.cached_policy(f["queue"])
            prepared = cached[2] if cached else self.default
            ctx = {k: f[k] for k in ("jobId", "errorClass", "firstFailureUnixMs", "retryAfterMs") if k in f}
            ctx["nowUnixMs"] = int(time.time() * 1000)
            answer = decide_prepared(prepared, f["attempt"], ctx)
            # A retry budget is one sidecar's schedule: a local answer is never stretched.
            answer["budgetStretched"], answer["budgetDelayMs"] = False, 0
            answer["source"] = "fallback" if cached else "default"
            self._count("fallback", cause)
            self._count("fallback", "total")
            if not cached:
                self._count("fallback", "default_policy")
            _log("warn", "rebound.fallback", queue=f["queue"], cause=cause, source=answer["source"],
                 attempt=f["attempt"], decision=answer["decision"], delay_ms=answer["delayMs"])
        self._count("decisions", answer["decision"] if answer["decision"] == "DECISION_RETRY" else answer["reason"])
        return answer


def _after_fork_in_child():
    for rb in list(_instances):
        rb._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
