"""The adapter's Prometheus counters: the ``rebound_adapter_*`` contract every Rebound
adapter shares (clients/conformance/README.md "Metrics"), through ``prometheus_client``.

Off until the application calls :func:`enable` (``pip install rebound-celery[metrics]``).
Celery's prefork pool runs the retry hook in child processes: with
``PROMETHEUS_MULTIPROC_DIR`` set before the worker starts, ``prometheus_client`` keeps each
process's counts in that directory and ``MultiProcessCollector`` adds them up when scraped
(README "Metrics").
"""

import threading

ADAPTER = "celery"
SOURCES = ("sidecar", "fallback")
REASONS = ("unavailable", "deadline_exceeded", "not_found", "other")
POLICY_SOURCES = ("cached", "default")
DISPOSITIONS = ("dead_letter", "drop")

_lock = threading.Lock()
_counters = None  # (decisions, fallbacks, terminal, hook_errors) once enabled


class MetricsUnavailable(RuntimeError):
    """prometheus_client is not installed."""


def enable(registry=None):
    """Registers the four counters in ``registry`` (default: ``prometheus_client.REGISTRY``)
    and counts from now on, in this process and the pool children it forks. Call it where
    the Celery app is defined. A second call changes nothing."""
    global _counters
    try:
        from prometheus_client import REGISTRY, Counter
    except ImportError as err:
        raise MetricsUnavailable("prometheus_client is not installed: pip install 'rebound-celery[metrics]'") from err
    with _lock:
        if _counters is not None:
            return
        reg = REGISTRY if registry is None else registry
        decisions = Counter("rebound_adapter_decisions_total", "Retry decisions the hook used, by who answered.",
                            ["adapter", "source"], registry=reg)
        fallbacks = Counter("rebound_adapter_fallbacks_total",
                            "Decisions made without the sidecar, by cause and the policy used.",
                            ["adapter", "reason", "policy_source"], registry=reg)
        terminal = Counter("rebound_adapter_terminal_total", "Jobs the adapter dead-lettered or dropped.",
                           ["adapter", "disposition"], registry=reg)
        hook_errors = Counter("rebound_adapter_hook_errors_total",
                              "Faults inside the adapter that it absorbed (the hook never raises).",
                              ["adapter"], registry=reg)
        # Every series exists from the start (at 0), so rate() sees the first increment.
        for s in SOURCES:
            decisions.labels(ADAPTER, s)
        for r in REASONS:
            for p in POLICY_SOURCES:
                fallbacks.labels(ADAPTER, r, p)
        for d in DISPOSITIONS:
            terminal.labels(ADAPTER, d)
        hook_errors.labels(ADAPTER)
        _counters = (decisions, fallbacks, terminal, hook_errors)


def enabled():
    return _counters is not None


def _inc(index, *labels):
    """Never raises: counting must not break the retry path."""
    c = _counters
    if c is None:
        return
    try:
        c[index].labels(ADAPTER, *labels).inc()
    except Exception:  # pragma: no cover - a full disk under PROMETHEUS_MULTIPROC_DIR, say
        pass


def decision(source):
    _inc(0, source)


def fallback(reason, policy_source):
    _inc(1, reason if reason in REASONS else "other", policy_source)


def terminal(disposition):
    _inc(2, disposition)


def hook_error():
    _inc(3)
