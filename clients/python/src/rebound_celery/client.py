"""The gRPC client of rebound.v1.RetryAdvisor: a channel per process, created lazily.

gRPC channels must not cross fork (Celery's prefork pool forks after import), so the
channel is made on first use and dropped in the child by an ``os.register_at_fork`` hook;
a PID check covers forks the hook does not see. Calls are thread-safe.
"""

import os
import re
import threading
import weakref

import grpc

from ._pb import advisor_pb2 as pb

_TARGET_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d{1,5}$")
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),  # back on a restarted sidecar within ~1 s
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30000),
    # gRPC pools connections process-wide by target; a child's new channel would otherwise
    # pick up the parent's inherited, dead connection and fail with UNAVAILABLE.
    ("grpc.use_local_subchannel_pool", 1),
]
_clients = weakref.WeakSet()


class TargetError(ValueError):
    """A malformed REBOUND_TARGET (or ``rebound_target``)."""


def check_target(target):
    """Accepts ``unix:///abs/path.sock``, ``unix:path``, ``host:port`` (port 1-65535).

    Raises :class:`TargetError` naming REBOUND_TARGET otherwise.
    """
    if isinstance(target, str) and target.startswith("unix:") and len(target) > len("unix:") \
            and target.strip("/") != "unix:":
        return target
    m = _TARGET_RE.match(target) if isinstance(target, str) else None
    if m and 0 < int(target.rsplit(":", 1)[1]) <= 65535:
        return target
    raise TargetError(f"REBOUND_TARGET (or rebound_target) is {target!r}: the sidecar's address must be "
                      f"'host:port' (e.g. 127.0.0.1:7411) or 'unix:///path/to.sock'")


class AdvisorClient:
    def __init__(self, target, deadline_s):
        self.target = check_target(target)
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._pid = None
        self._channel = None
        self._decide = None
        self._get_policy = None
        _clients.add(self)

    def _stubs(self):
        with self._lock:
            if self._channel is None or self._pid != os.getpid():
                # A channel inherited over fork is abandoned, never used or closed here.
                ch = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
                self._decide = ch.unary_unary(
                    "/rebound.v1.RetryAdvisor/Decide",
                    request_serializer=pb.DecideRequest.SerializeToString,
                    response_deserializer=pb.DecideResponse.FromString,
                )
                self._get_policy = ch.unary_unary(
                    "/rebound.v1.RetryAdvisor/GetPolicy",
                    request_serializer=pb.GetPolicyRequest.SerializeToString,
                    response_deserializer=pb.GetPolicyResponse.FromString,
                )
                self._channel, self._pid = ch, os.getpid()
            return self._decide, self._get_policy

    def decide(self, request):
        return self._stubs()[0](request, timeout=self.deadline_s)

    def get_policy(self, queue, timeout=None):
        return self._stubs()[1](pb.GetPolicyRequest(queue=queue), timeout=timeout or self.deadline_s)

    def _forget(self):
        """In a forked child: drop the parent's channel without touching it."""
        self._lock = threading.Lock()
        self._channel = self._decide = self._get_policy = None
        self._pid = None

    def close(self):
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel = None


def _after_fork_in_child():
    for c in list(_clients):
        c._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def resolved_from_wire(r):
    """``rebound.v1.ResolvedPolicy`` → the proto3 JSON shape decide reads."""
    return {
        "strategy": pb.Strategy.Name(r.strategy),
        "baseMs": int(r.base_ms),
        "multiplier": r.multiplier,
        "capMs": int(r.cap_ms),
        "jitter": pb.Jitter.Name(r.jitter),
        "jitterRatio": r.jitter_ratio,
        "scheduleMs": [int(x) for x in r.schedule_ms],
        "maxAttempts": int(r.max_attempts),
        "maxRetryDurationMs": int(r.max_retry_duration_ms),
        "nonRetryableErrors": list(r.non_retryable_errors),
        "terminal": pb.Disposition.Name(r.terminal),
        "deadLetterQueue": r.dead_letter_queue,
    }


def answer_from_wire(res):
    return {
        "decision": pb.Decision.Name(res.decision),
        "delayMs": int(res.delay_ms),
        "disposition": pb.Disposition.Name(res.disposition),
        "deadLetterQueue": res.dead_letter_queue,
        "reason": pb.GiveUpReason.Name(res.reason),
        "reasonMessage": res.reason_message,
        "budgetStretched": bool(res.budget_stretched),
        "budgetDelayMs": int(res.budget_delay_ms),
        "policy": {
            "name": res.policy.name,
            "namespace": res.policy.namespace,
            "generation": int(res.policy.generation),
            "configHash": res.policy.config_hash,
        },
        "revision": res.revision,
    }
