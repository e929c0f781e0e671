"""The Celery side: a base Task class, an enqueue helper and the dead-letter message.

    @app.task(base=ReboundTask, bind=True)
    def deliver(self, url): ...

A failure of ``run`` asks Rebound (attempt = ``request.retries + 1``) and then retries
with the answer's countdown, dead-letters or drops. The idempotency key and the first
failure's time travel in the message headers, so every attempt sees the same ones.
"""

import time
import traceback
import uuid

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from .core import Rebound, _log

KEY_HEADER = "rebound_key"
FIRST_FAILURE_HEADER = "rebound_first_failure_ms"
DEAD_LETTER_TASK = "rebound.dead_letter"
"""The name of the task sent to the policy's dead-letter queue."""

_shared = {}


def shared_rebound(target=None):
    """One Rebound per target in this process (channels are per process anyway)."""
    key = target or ""
    if key not in _shared:
        _shared[key] = Rebound(target=target)
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


def enqueue(task, args=(), kwargs=None, key=None, **options):
    """``apply_async`` with a stable idempotency key (generated here, once, unless given).

    The key is the Celery task id too, so every retry of this job carries it.
    """
    key = str(key) if key else str(uuid.uuid4())
    headers = dict(options.pop("headers", None) or {})
    headers[KEY_HEADER] = key
    options.setdefault("task_id", key)
    return task.apply_async(args=args, kwargs=kwargs or {}, headers=headers, **options)


class ReboundTask(Task):
    """Base class: Rebound decides every retry of this task.

    Class attributes a task may override: ``rebound_queue`` (the policy's queue name;
    default the Celery queue the message came from, else the task name),
    ``rebound_target``, ``rebound_error_class(exc)``, ``rebound_retry_after_ms(exc)``.
    """

    abstract = True
    max_retries = None  # Celery's own limit never decides: Rebound owns the give-up
    acks_late = True  # see README: a crashed worker's message is redelivered
    reject_on_worker_lost = True
    rebound_queue = None
    rebound_target = None
    _rebound = None

    def rebound_error_class(self, exc):
        return default_error_class(exc)

    def rebound_retry_after_ms(self, exc):
        return default_retry_after_ms(exc)

    @property
    def rebound(self):
        if self._rebound is None:
            self._rebound = shared_rebound(self.rebound_target or self.app.conf.get("rebound_target"))
        return self._rebound

    def rebound_queue_name(self):
        if self.rebound_queue:
            return self.rebound_queue
        info = getattr(self.request, "delivery_info", None) or {}
        return info.get("routing_key") or self.name

    def rebound_key(self):
        return _header(self.request, KEY_HEADER) or self.request.id

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except (Retry, Ignore, Reject):
            raise
        except Exception as exc:
            self._rebound_on_failure(exc, args, kwargs)
            raise  # dead letter: the task ends FAILURE with its own exception

    def _rebound_on_failure(self, exc, args, kwargs):
        req = self.request
        now_ms = int(time.time() * 1000)
        try:
            first = int(_header(req, FIRST_FAILURE_HEADER) or now_ms)
            key = self.rebound_key()
            queue = self.rebound_queue_name()
            attempt = int(req.retries or 0) + 1
            error_class = self.rebound_error_class(exc)
            retry_after = self.rebound_retry_after_ms(exc)
        except Exception as err:  # a mapper's bug must not change the task's fate
            _log("error", "rebound.hook_error", task=self.name, error=repr(err)[:300])
            first, key, queue, attempt, error_class, retry_after = now_ms, req.id, self.name, 1, None, None
        answer = self.rebound.decide(queue, attempt, job_id=key, error_class=error_class,
                                     first_failure_unix_ms=first, retry_after_ms=retry_after)
        fields = dict(task=self.name, task_id=req.id, key=key, queue=queue, attempt=attempt,
                      error_class=error_class, decision=answer["decision"], delay_ms=answer["delayMs"],
                      source=answer["source"])
        if answer["decision"] == "DECISION_RETRY":
            _log("info", "rebound.retry", **fields)
            headers = {KEY_HEADER: key, FIRST_FAILURE_HEADER: first}
            raise self.retry(exc=exc, countdown=answer["delayMs"] / 1000.0, max_retries=None, headers=headers)
        fields.update(reason=answer["reason"], disposition=answer["disposition"],
                      dead_letter_queue=answer["deadLetterQueue"])
        if answer["disposition"] == "DISPOSITION_DEAD_LETTER" and answer["deadLetterQueue"]:
            self.app.send_task(DEAD_LETTER_TASK, queue=answer["deadLetterQueue"], kwargs={
                "task": self.name, "task_id": req.id, "key": key, "args": list(args), "kwargs": dict(kwargs),
                "queue": queue, "attempts": attempt, "reason": answer["reason"],
                "reason_message": answer["reasonMessage"], "error_class": error_class,
                "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000],
                "first_failure_unix_ms": first, "dead_lettered_unix_ms": now_ms,
            }, headers={KEY_HEADER: key})
            self.rebound.count_disposition("dead_lettered")
            _log("warn", "rebound.dead_lettered", **fields)
            return  # the caller re-raises: the task ends FAILURE
        self.rebound.count_disposition("dropped")
        _log("warn", "rebound.dropped", **fields)
        raise Ignore()
