"""The Celery side: a base Task class, an enqueue helper and the dead-letter message.

    @app.task(base=ReboundTask, bind=True)
    def deliver(self, url): ...

A failure of ``run`` asks Rebound (attempt = ``request.retries + 1``) and then retries
with the answer's countdown, or gives up: the task ends FAILURE (result backend,
``link_error``, chain errbacks), after sending a dead letter when the policy says so. The
idempotency key and the first failure's time travel in the message headers, so every
attempt sees the same ones.
"""

import time
import traceback
import uuid

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from .core import Rebound, _log, logger

KEY_HEADER = "rebound_key"
FIRST_FAILURE_HEADER = "rebound_first_failure_ms"
DEAD_LETTER_TASK = "rebound.dead_letter"
"""The name of the task sent to the policy's dead-letter queue."""

_shared = {}


def shared_rebound(target=None):
    """One Rebound per target in this process (channels are per process anyway)."""
    key = target or ""
    if key not in _shared:
        _shared[key] = Rebound(target=target, strict=False)
    return _shared[key]


def default_error_class(exc):
    """A string ``code`` attribute (``http.503``), else the exception's class name."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code
    return type(exc).__name__


def default_retry_after_ms(exc):
    """``exc.retry_after_ms``, else ``exc.retry_after`` in seconds."""
    v = getattr(exc, "retry_after_ms", None)
    if isinstance(v, (int, float)) and v > 0:
        return v
    v = getattr(exc, "retry_after", None)
    if isinstance(v, (int, float)) and v > 0:
        return v * 1000
    return None


def _header(request, name):
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, name, None)  # protocol 2 puts custom headers on the request
    return value


class RetryRequested(Exception):
    """Stands for a bare ``self.retry()`` (no ``exc``) in a ReboundTask: Rebound decides it."""


def enqueue(task, args=(), kwargs=None, key=None, **options):
    """``apply_async`` with a stable idempotency key (generated here, once, unless given).

    The key is the Celery task id too, so every retry of this job carries it.
    """
    key = str(key) if key else str(uuid.uuid4())
    headers = dict(options.pop("headers", None) or {})
    headers[KEY_HEADER] = key
    options.setdefault("task_id", key)
    return task.apply_async(args=args, kwargs=kwargs or {}, headers=headers, **options)


def replay(app, message, **options):
    """Enqueues a dead letter's job again, as a new first run: the same task, args, kwargs,
    key and task id, on the queue it failed on. ``message`` = the dead letter's kwargs
    (what a ``rebound.dead_letter`` task receives). Returns the AsyncResult."""
    options.setdefault("queue", message.get("celery_queue") or message["queue"])
    headers = dict(options.pop("headers", None) or {})
    headers[KEY_HEADER] = message["key"]
    return app.send_task(message["task"], args=list(message.get("args") or ()),
                         kwargs=dict(message.get("kwargs") or {}), task_id=message.get("task_id") or message["key"],
                         headers=headers, **options)


def replay_dead_letters(app, queue, key=None, limit=None):
    """Takes the dead letters waiting on ``queue`` (a queue no worker consumes) and replays
    them — only the job ``key`` if given, the others are put back. Returns the replayed keys."""
    from queue import Empty

    replayed, keep = [], []
    with app.connection_for_write() as conn:
        sq = conn.SimpleQueue(queue)
        try:
            while limit is None or len(replayed) < limit:
                try:
                    msg = sq.get(block=False)
                except Empty:
                    break
                body = msg.payload
                letter = body[1] if isinstance(body, (list, tuple)) and len(body) > 1 else body
                if msg.headers.get("task") == DEAD_LETTER_TASK and (key is None or letter.get("key") == key):
                    replay(app, letter)
                    replayed.append(letter["key"])
                    msg.ack()
                else:
                    keep.append(msg)
        finally:
            for msg in keep:
                msg.requeue()
            sq.close()
    return replayed


class ReboundTask(Task):
    """Base class: Rebound decides every retry of this task.

    Class attributes a task may override: ``rebound_queue`` (the policy's queue name;
    default the Celery queue the message came from, else the task name),
    ``rebound_target``, ``rebound_error_class(exc)``, ``rebound_retry_after_ms(exc)``.

    Celery's own retry settings never decide: ``max_retries`` is None, and a
    ``self.retry(exc=…)`` — yours or ``autoretry_for``'s, whatever its countdown,
    ``retry_backoff`` or ``max_retries`` — hands ``exc`` to Rebound like any other failure.
    """

    abstract = True
    max_retries = None  # Celery's own limit never decides: Rebound owns the give-up
    acks_late = True  # see README: a crashed worker's message is redelivered
    reject_on_worker_lost = True
    rebound_queue = None
    rebound_target = None
    _rebound = None

    @classmethod
    def bind(cls, app):
        bound = super().bind(app)
        try:
            from .worker import install

            install(app)
        except Exception as err:  # pragma: no cover - never break task registration
            logger.warning("rebound: worker step not installed: %r", err)
        return bound

    def rebound_error_class(self, exc):
        return default_error_class(exc)

    def rebound_retry_after_ms(self, exc):
        return default_retry_after_ms(exc)

    def rebound_target_setting(self):
        """The target this task's decisions go to (REBOUND_TARGET if nothing else is set)."""
        return self.rebound_target or self.app.conf.get("rebound_target") or None

    @property
    def rebound(self):
        if self._rebound is None:
            self._rebound = shared_rebound(self.rebound_target_setting())
        return self._rebound

    def rebound_queue_name(self):
        if self.rebound_queue:
            return self.rebound_queue
        info = getattr(self.request, "delivery_info", None) or {}
        return info.get("routing_key") or self.name

    def rebound_key(self):
        return _header(self.request, KEY_HEADER) or self.request.id

    def retry(self, args=None, kwargs=None, exc=None, throw=True, eta=None, countdown=None, max_retries=None,
              **options):
        """Inside a run: hands ``exc`` to Rebound (Celery's countdown, backoff and
        max_retries are not used). Rebound's own retry goes to Celery's."""
        if self.request.called_directly or not throw:
            return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta, countdown=countdown,
                                 max_retries=max_retries, **options)
        if exc is None:
            exc = RetryRequested("self.retry() without exc")
        raise exc

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except (Retry, Ignore, Reject):
            raise
        except Exception as exc:
            self._rebound_on_failure(exc, args, kwargs)
            raise  # given up: the task ends FAILURE with its own exception

    def _rebound_fields(self, exc, now_ms):
        """The question's fields, each on its own: a mapper's bug loses only that field."""
        req = self.request
        out = {}
        for name, get, fallback in (
            ("first", lambda: int(_header(req, FIRST_FAILURE_HEADER) or now_ms), now_ms),
            ("key", self.rebound_key, req.id),
            ("queue", self.rebound_queue_name, self.name),
            ("attempt", lambda: int(req.retries or 0) + 1, None),
            ("error_class", lambda: self.rebound_error_class(exc), type(exc).__name__),
            ("retry_after", lambda: self.rebound_retry_after_ms(exc), None),
        ):
            try:
                out[name] = get()
            except Exception as err:
                _log("error", "rebound.hook_error", task=self.name, field=name, error=repr(err)[:300])
                out[name] = fallback
        if out["attempt"] is None:
            try:
                out["attempt"] = int(getattr(req, "retries", 0) or 0) + 1
            except Exception:
                out["attempt"] = 1
        return out

    def _rebound_on_failure(self, exc, args, kwargs):
        """Raises Retry (Rebound's countdown) or returns (given up: the caller re-raises)."""
        req = self.request
        now_ms = int(time.time() * 1000)
        q = self._rebound_fields(exc, now_ms)
        try:
            rb = self.rebound
            answer = rb.decide(q["queue"], q["attempt"], job_id=q["key"], error_class=q["error_class"],
                               first_failure_unix_ms=q["first"], retry_after_ms=q["retry_after"])
        except Exception as err:  # decide never raises; this guards the property
            _log("error", "rebound.hook_error", task=self.name, field="rebound", error=repr(err)[:300])
            rb, answer = None, Rebound(target="-", strict=False).decide(
                q["queue"], q["attempt"], job_id=q["key"])
        fields = dict(task=self.name, task_id=req.id, key=q["key"], queue=q["queue"], attempt=q["attempt"],
                      error_class=q["error_class"], decision=answer["decision"], delay_ms=answer["delayMs"],
                      source=answer["source"], policy_source=answer["policySource"])
        if answer["decision"] == "DECISION_RETRY":
            _log("info", "rebound.retry", **fields)
            headers = {KEY_HEADER: q["key"], FIRST_FAILURE_HEADER: q["first"]}
            # Task.retry itself (not self.retry, which hands the failure to Rebound).
            raise super().retry(exc=exc, countdown=answer["delayMs"] / 1000.0, max_retries=None, headers=headers)
        fields.update(reason=answer["reason"], disposition=answer["disposition"],
                      dead_letter_queue=answer["deadLetterQueue"])
        if answer["disposition"] == "DISPOSITION_DEAD_LETTER" and answer["deadLetterQueue"]:
            try:
                self.app.send_task(DEAD_LETTER_TASK, queue=answer["deadLetterQueue"], kwargs={
                    "task": self.name, "task_id": req.id, "key": q["key"], "args": list(args),
                    "kwargs": dict(kwargs), "queue": q["queue"], "attempts": q["attempt"],
                    "celery_queue": (getattr(req, "delivery_info", None) or {}).get("routing_key") or q["queue"],
                    "reason": answer["reason"], "reason_message": answer["reasonMessage"],
                    "error_class": q["error_class"],
                    "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000],
                    "first_failure_unix_ms": q["first"], "dead_lettered_unix_ms": now_ms,
                }, headers={KEY_HEADER: q["key"]})
            except Exception as err:  # the broker refused it: still FAILURE, never lost silently
                _log("error", "rebound.dead_letter_failed", error=repr(err)[:300], **fields)
                return
            if rb is not None:
                rb.count_disposition("dead_lettered")
            _log("warn", "rebound.dead_lettered", **fields)
            return
        # Drop: the library's own failed state — FAILURE in the result backend, link_error run.
        if rb is not None:
            rb.count_disposition("dropped")
        _log("warn", "rebound.dropped", **fields)
