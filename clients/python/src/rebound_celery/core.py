"""Asks the sidecar; answers from the local fallback when it cannot. Never raises.

Fallback = the last ``GetPolicy`` answer for the queue — loaded at worker start by
:meth:`Rebound.prefetch` (the main process, before the pool forks) and again in a
background thread whenever a sidecar answer names a config hash this process has not
fetched — decided with the port of ``decide`` (``policySource=cached``); without one,
:data:`DEFAULT_POLICY` (``policySource=default``).
"""

import hashlib
import json
import os
import logging
import threading
import time
import weakref

import grpc

from ._pb import advisor_pb2 as pb
from .client import AdvisorClient, TargetError, answer_from_wire, resolved_from_wire
from .decide import PreparedPolicy, backoff_delay, decide_prepared
from . import metrics
from .rollout_cache import pick, prepare_rollout

def _load_default():
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default-policy.json"), "rb") as f:
        doc = json.load(f)
    return doc["resolved"], doc["identity"]


DEFAULT_POLICY, DEFAULT_IDENTITY = _load_default()
"""What a RetryPolicy with an empty spec resolves to (clients/conformance/default-policy.json):
10 runs, exponential 1s..10m, full jitter, then drop (the task ends FAILURE, nothing discarded)."""
MAX_JOB_ID_BYTES = 512
MAX_ERROR_CLASS_BYTES = 253
LAST_RESORT_DELAY_MS = 5000
"""Answered when even the fallback fails (it should not)."""

_instances = weakref.WeakSet()


try:  # Celery's logger hierarchy: the worker's handlers, format and level (-l) apply
    from celery.utils.log import get_logger as _get_logger
except ImportError:  # pragma: no cover - Celery is a dependency
    _get_logger = logging.getLogger
logger = _get_logger("rebound_celery")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def _log(level, event, **fields):
    """One log record through Celery's logger whose message is a JSON object; never raises."""
    try:
        lvl = _LEVELS[level]
        if logger.isEnabledFor(lvl):
            logger.log(lvl, "%s", json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str))
    except Exception:  # a logger must never break the retry path
        pass


def _hook_error(event, **fields):
    """A fault the adapter absorbed: an error line and ``rebound_adapter_hook_errors_total``."""
    metrics.hook_error()
    _log("error", event, **fields)


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


_UNREACHABLE = ("unavailable", "deadline_exceeded")


class Rebound:
    """One per process (or per target); safe under threads and across fork.

    ``strict=False`` keeps a malformed target from raising here: every answer is then a
    fallback (the worker refuses such a target at start, see :mod:`rebound_celery.worker`).
    """

    def __init__(self, target=None, deadline_ms=250, default_policy=None, strict=True):
        self.target = target or os.environ.get("REBOUND_TARGET") or "127.0.0.1:7411"
        self.target_error = None
        try:
            self.client = AdvisorClient(self.target, deadline_ms / 1000.0)
        except TargetError as err:
            if strict:
                raise
            self.client, self.target_error = None, str(err)
        self.default = PreparedPolicy(default_policy or DEFAULT_POLICY, DEFAULT_IDENTITY)
        self._lock = threading.Lock()
        self._policies = {}  # queue -> (configHash, resolved, PreparedPolicy)
        self._rollouts = {}  # queue -> CachedRollout, while its cached policy rolls out
        self._refreshing = set()
        self._absent = set()  # queues the sidecar has no policy for (NOT_FOUND)
        self.queues = set()  # the queues of this worker (prefetched at start)
        self._prefetch_pending = False  # the start's prefetch did not reach the sidecar
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
        """``dead_lettered`` or ``dropped``: a job this adapter finished."""
        with self._lock:
            self.counters[which] += 1
        metrics.terminal("dead_letter" if which == "dead_lettered" else "drop")

    def metrics(self):
        with self._lock:
            return json.loads(json.dumps(self.counters))

    def cached_policy(self, queue):
        with self._lock:
            return self._policies.get(queue)

    def _cached_with_rollout(self, queue):
        """The cached policy and its rollout (None when not in rollout), read together."""
        with self._lock:
            return self._policies.get(queue), self._rollouts.get(queue)

    def _fetch(self, queue, timeout=None, quiet=False):
        """GetPolicy for the queue now (the caller's thread): None on success, else the cause."""
        if self.client is None:
            return "bad_target"
        try:
            res = self.client.get_policy(queue, timeout=timeout)
        except Exception as err:
            cause = _cause(err)
            if cause == "not_found":
                with self._lock:
                    self._absent.add(queue)
            if not quiet and cause != "not_found":
                _log("warn", "rebound.get_policy_failed", queue=queue, target=self.target, cause=cause,
                     error=str(err)[:300])
            return cause
        ref = res.policy
        resolved = resolved_from_wire(res.resolved)
        identity = f"{ref.namespace}/{ref.name}"
        prepared = PreparedPolicy(resolved, identity)
        rollout = prepare_rollout(res, identity)
        with self._lock:
            self._policies[queue] = (ref.config_hash, resolved, prepared)
            if rollout is None:
                self._rollouts.pop(queue, None)
            else:
                self._rollouts[queue] = rollout
            self._absent.discard(queue)
        _log("info", "rebound.policy_fetched", queue=queue, policy=f"{ref.namespace}/{ref.name}",
             config_hash=ref.config_hash, target=self.target)
        return None

    def refresh(self, queue):
        """Fetches the queue's policy now (the caller's thread); True on success."""
        return self._fetch(queue) is None

    def prefetch(self, queues, timeout_s=1.0, quiet=False):
        """Loads the policy of every queue now, in the caller's thread (the worker's main
        process, before the pool forks: children inherit the answers). Never raises.

        Returns ``{queue: None | cause}``. With the sidecar unreachable, one warning naming
        the target (``quiet``: at debug level); the queues are prefetched again after the
        next sidecar answer.
        """
        queues = sorted({str(q) for q in queues if q})
        with self._lock:
            self.queues.update(queues)
        out = {}
        for q in queues:
            cause = out.get(q) or self._fetch(q, timeout=timeout_s, quiet=True)
            out[q] = cause
            if cause in _UNREACHABLE or cause == "bad_target":
                for rest in queues:
                    out.setdefault(rest, cause)
                break
        down = [c for c in out.values() if c in _UNREACHABLE]
        with self._lock:
            self._prefetch_pending = bool(down)
        if down:
            _log("debug" if quiet else "warn", "rebound.sidecar_unreachable", target=self.target, cause=down[0], queues=queues,
                 policy_source="default")
        else:
            _log("info", "rebound.prefetched", target=self.target, queues=[q for q in queues if out[q] is None],
                 without_policy=[q for q in queues if out[q] == "not_found"],
                 failed=[q for q in queues if out[q] not in (None, "not_found")])
        return out

    def missing_queues(self):
        with self._lock:
            return sorted(q for q in self.queues if q not in self._policies and q not in self._absent)

    def _in_background(self, key, fn):
        with self._lock:
            if key in self._refreshing:
                return
            self._refreshing.add(key)

        def run():
            try:
                fn()
            except Exception:
                pass
            finally:
                with self._lock:
                    self._refreshing.discard(key)

        threading.Thread(target=run, name="rebound-refresh", daemon=True).start()

    def _refresh_in_background(self, queue):
        self._in_background(("queue", queue), lambda: self._fetch(queue))

    def prefetch_in_background(self, quiet=False):
        """The worker's queues without a policy yet, fetched in a thread (children, reconnect)."""
        def run():
            missing = self.missing_queues()
            if missing:
                self.prefetch(missing, quiet=quiet)
        self._in_background("prefetch", run)

    def backoff_ms(self, queue, attempt, job_id=None):
        """The queue's policy's backoff delay for ``attempt`` (cached policy, else the
        default), for a decision that has to wait. Never raises."""
        try:
            cached = self.cached_policy(str(queue))
            return backoff_delay(cached[2] if cached else self.default, attempt, job_id)
        except Exception:
            return LAST_RESORT_DELAY_MS

    def decide(self, queue, attempt, **context):
        """The answer for this failure: a dict in DecideResponse's JSON names plus ``source``
        (sidecar | fallback) and ``policySource`` (sidecar | cached | default). Never raises."""
        try:
            f = normalise_failure(queue, attempt, **context)
        except Exception:
            f = {"queue": str(queue), "attempt": 1}
        try:
            return self._decide(f)
        except Exception as err:  # never raise from the retry path
            _hook_error("rebound.fallback_failed", queue=f["queue"], target=self.target, error=repr(err)[:300])
            return {"decision": "DECISION_RETRY", "delayMs": LAST_RESORT_DELAY_MS, "source": "fallback",
                    "policySource": "default", "lastResort": True,
                    "disposition": "DISPOSITION_UNSPECIFIED", "deadLetterQueue": "",
                    "reason": "GIVE_UP_REASON_UNSPECIFIED", "reasonMessage": "",
                    "budgetStretched": False, "budgetDelayMs": 0, "revision": ""}

    def _decide(self, f):
        try:
            if self.client is None:
                raise TargetError(self.target_error)
            req = pb.DecideRequest(queue=f["queue"], attempt=f["attempt"], job_id=f.get("jobId", ""),
                                   error_class=f.get("errorClass", ""),
                                   first_failure_unix_ms=f.get("firstFailureUnixMs", 0),
                                   retry_after_ms=f.get("retryAfterMs", 0))
            answer = answer_from_wire(self.client.decide(req))
            answer["source"] = answer["policySource"] = "sidecar"
            cached = self.cached_policy(f["queue"])
            if cached is None or cached[0] != answer["policy"]["configHash"]:
                self._refresh_in_background(f["queue"])
            with self._lock:
                pending = self._prefetch_pending
            if pending:  # back after a start without the sidecar: load the worker's queues now
                with self._lock:
                    self._prefetch_pending = False
                self.prefetch_in_background()
        except Exception as err:
            cause = "bad_target" if isinstance(err, TargetError) else _cause(err)
            cached, rollout = self._cached_with_rollout(f["queue"])
            ctx = {k: f[k] for k in ("jobId", "errorClass", "firstFailureUnixMs", "retryAfterMs") if k in f}
            ctx["nowUnixMs"] = now = int(time.time() * 1000)
            if "firstFailureUnixMs" in ctx:  # clamped to now, as the sidecar clamps it
                ctx["firstFailureUnixMs"] = min(ctx["firstFailureUnixMs"], now)
            prepared, revision = (pick(cached[2], rollout, f.get("jobId"), ctx.get("firstFailureUnixMs"), now)
                                  if cached else (self.default, ""))
            answer = decide_prepared(prepared, f["attempt"], ctx)
            answer["revision"] = revision
            # A retry budget is one sidecar's schedule: a local answer is never stretched.
            answer["budgetStretched"], answer["budgetDelayMs"] = False, 0
            answer["source"] = "fallback"
            answer["policySource"] = "cached" if cached else "default"
            if cause in _UNREACHABLE:
                with self._lock:
                    self._prefetch_pending = self._prefetch_pending or bool(self.queues)
            self._count("fallback", cause)
            self._count("fallback", "total")
            self._count("fallback", "cached" if cached else "default_policy")
            metrics.fallback(cause, answer["policySource"])
            _log("warn", "rebound.fallback", queue=f["queue"], target=self.target, cause=cause,
                 source="fallback", policy_source=answer["policySource"], policy=prepared.identity,
                 attempt=f["attempt"], decision=answer["decision"], delay_ms=answer["delayMs"])
        self._count("decisions", answer["decision"] if answer["decision"] == "DECISION_RETRY" else answer["reason"])
        metrics.decision(answer["source"])
        return answer


_shared = {}


def shared_rebound(target=None):
    """One Rebound per target in this process (channels are per process anyway)."""
    key = target or ""
    if key not in _shared:
        _shared[key] = Rebound(target=target, strict=False)
    return _shared[key]


def shared_instances():
    """The Rebound of every target this process has used (see ``shared_rebound``)."""
    return list(_shared.values())


def _after_fork_in_child():
    for rb in list(_instances):
        rb._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
