"""The worker side: a bootstep that checks the sidecar's address and loads the policies.

Installed on the app when a ReboundTask binds to it. When the worker is created, in the
main process and before the pool forks, it:

- refuses a malformed REBOUND_TARGET / ``rebound_target`` (the worker does not start);
- asks ``GetPolicy`` for every queue the worker consumes (``-Q``) and every
  ``rebound_queue``, so each pool child — replaced ones included — inherits the namespace's
  real policies and decides from them during an outage (``policySource=cached``).

With the sidecar down at start the worker starts anyway (one warning naming the target);
the main process retries the prefetch every few seconds until it succeeds, and a child
loads what it lacks after its first sidecar answer.
"""

from celery import bootsteps, signals
from celery.exceptions import ImproperlyConfigured

from .client import TargetError, check_target
from .core import _log, shared_instances, shared_rebound

PREFETCH_RETRY_S = 2.0


class BadTarget(ImproperlyConfigured, TargetError):
    """REBOUND_TARGET is malformed: raised when the worker is created, before any job runs."""


def _rebound_tasks(app):
    """The app's Rebound tasks: those that say which target decides for them (duck-typed,
    so this module needs nothing from ``task``, which installs it)."""
    return [t for t in app.tasks.values() if callable(getattr(t, "rebound_target_setting", None))]


def worker_queues(app, tasks):
    names = set()
    try:
        consume = app.amqp.queues.consume_from or app.amqp.queues
        names.update(q.name if hasattr(q, "name") else str(q) for q in consume.values())
    except Exception:
        pass
    names.update(t.rebound_queue for t in tasks if t.rebound_queue)
    return sorted(n for n in names if n)


class ReboundStep(bootsteps.StartStopStep):
    """Checks the target and prefetches the policies (worker main process, before fork)."""

    label = "Rebound"

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        app = parent.app
        tasks = _rebound_tasks(app)
        self.instances = []
        targets = {}
        for t in tasks:
            targets.setdefault(t.rebound_target_setting(), []).append(t.name)
        for target, names in sorted(targets.items(), key=lambda kv: str(kv[0])):
            rb = shared_rebound(target)
            if rb.client is None:
                _log("error", "rebound.bad_target", setting="REBOUND_TARGET", target=rb.target, tasks=names)
                raise BadTarget(rb.target_error)
            try:
                check_target(rb.target)
            except TargetError as err:
                raise BadTarget(str(err)) from None
            self.instances.append(rb)
        queues = worker_queues(app, tasks)
        for rb in self.instances:
            rb.prefetch(queues)
            rb.client.close()  # the main process makes no call while the pool forks
        self.timer = None

    def start(self, parent):
        if any(rb.missing_queues() and rb._prefetch_pending for rb in self.instances):
            timer = getattr(parent, "timer", None)
            if timer is not None:
                self.timer = timer.call_repeatedly(PREFETCH_RETRY_S, self._again)

    def _again(self):
        """On the main thread (the event loop), never during a fork: prefetch what is missing."""
        try:
            pending = False
            for rb in self.instances:
                if rb._prefetch_pending and rb.missing_queues():
                    rb.prefetch(rb.missing_queues(), timeout_s=0.25, quiet=True)
                    rb.client.close()
                pending = pending or rb._prefetch_pending
            if not pending and self.timer is not None:
                self.timer.cancel()
                self.timer = None
        except Exception:
            pass

    def stop(self, parent):
        if self.timer is not None:
            try:
                self.timer.cancel()
            except Exception:
                pass
            self.timer = None


def _child_init(**_):
    """A pool child (replaced ones too) holds the main process's copy; it loads what the
    main process lacked in the background."""
    for rb in shared_instances():
        try:
            if rb.client is not None and rb.missing_queues():
                rb.prefetch_in_background(quiet=True)
        except Exception:
            pass


_connected = []


def install(app):
    steps = app.steps["worker"]
    if ReboundStep not in steps:
        steps.add(ReboundStep)
    if not _connected:
        signals.worker_process_init.connect(_child_init, weak=False)
        _connected.append(True)
