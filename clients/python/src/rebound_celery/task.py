"""The Celery side: a base Task class, an enqueue helper and the dead-letter message.

    @app.task(base=ReboundTask, bind=True)
    def deliver(self, url): ...

A failure of ``run`` asks Rebound (attempt = the run's number, counted in Redis before the
body runs, see :mod:`rebound_celery.runs`) and then retries with the answer's countdown,
or gives up: the task ends FAILURE (result backend, ``link_error``, chain errbacks), after
a dead letter when the policy says so. A run that ended without an answer is decided as
a failed run (``WorkerLost``) at its message's next delivery. The idempotency key and the
first failure's time travel in the message headers, so every attempt sees the same ones.
"""

import time
import traceback
import uuid

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from .core import Rebound, _hook_error, _log, logger, shared_rebound
from .runs import (ATTEMPT_HEADER, DECIDE_HEADER, EPISODE_HEADER, MESSAGE_HEADER, RunRecords, dead_letter_payload,
                   log_uncounted_once, new_token)
from .worker import install

KEY_HEADER = "rebound_key"
FIRST_FAILURE_HEADER = "rebound_first_failure_ms"
DEAD_LETTER_TASK = "rebound.dead_letter"
"""The name of the task sent to the policy's dead-letter queue."""


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
        ticket = self._rebound_acquire()
        if ticket is not None and ticket.verdict == "decide":
            # The run ended without an answer (or its give-up could not be written): it is
            # decided now, and the body does not run again for it.
            exc = ticket.pending_exception()
            self._rebound_on_failure(exc, args, kwargs, ticket, error_class=ticket.error_class)
            raise exc
        try:
            result = super().__call__(*args, **kwargs)
        except (Retry, Ignore, Reject):
            raise
        except Exception as exc:
            self._rebound_on_failure(exc, args, kwargs, ticket)
            raise  # given up: the task ends FAILURE with its own exception
        if ticket is not None:
            ticket.end("completed", fenced=False)
        return result

    def rebound_attempt(self):
        """The attempt this run is (1 = the first run), lost runs included."""
        ticket = getattr(self.request, "rebound_ticket", None)
        return ticket.attempt if ticket is not None else int(self.request.retries or 0) + 1

    def _rebound_records(self):
        app = self.app
        records = _records.get(id(app), False)
        if records is False:
            records = _records[id(app)] = RunRecords.for_app(app)
            if records is None:
                log_uncounted_once(app)
        return records

    def _rebound_acquire(self):
        """Records this run's start (or finds it was one already): a Ticket, or None when
        runs cannot be counted here (called directly, eager, a broker other than Redis).
        Raises Ignore for a duplicate of a message whose job went on or ended."""
        req = self.request
        if req.called_directly or getattr(req, "is_eager", False):
            return None
        records = self._rebound_records()
        tag = (getattr(req, "properties", None) or {}).get("delivery_tag")
        if records is None or not tag:
            return None
        pending = _header(req, DECIDE_HEADER)
        ticket = Ticket(records, self.rebound_key(), _header(req, EPISODE_HEADER) or tag,
                        _header(req, MESSAGE_HEADER) or tag, pending if isinstance(pending, dict) else None)
        before = _header(req, ATTEMPT_HEADER)
        try:
            before = int(before) if before is not None else int(req.retries or 0)
            ticket.verdict, value = records.acquire(ticket.key, ticket.episode, ticket.message, ticket.token,
                                                    before, decide=ticket.pending is not None)
        except Exception as err:  # Redis refused or is gone: the message waits for redelivery
            _hook_error("rebound.run_not_recorded", task=self.name, task_id=req.id, key=ticket.key,
                        error=repr(err)[:300])
            raise Reject(err, requeue=True)
        if ticket.verdict in ("ended", "obsolete"):
            _log("info", "rebound.duplicate_skipped", task=self.name, task_id=req.id, key=ticket.key,
                 episode=ticket.episode, verdict=ticket.verdict, state=value)
            raise Ignore()
        ticket.attempt = value
        req.rebound_ticket = ticket
        if ticket.verdict == "decide" and ticket.pending is None:
            _log("warn", "rebound.run_lost", task=self.name, task_id=req.id, key=ticket.key, attempt=value,
                 episode=ticket.episode)
        return ticket

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
                _hook_error("rebound.hook_error", task=self.name, field=name, error=repr(err)[:300])
                out[name] = fallback
        if out["attempt"] is None:
            try:
                out["attempt"] = int(getattr(req, "retries", 0) or 0) + 1
            except Exception:
                out["attempt"] = 1
        return out

    def _rebound_on_failure(self, exc, args, kwargs, ticket=None, error_class=None):
        """Raises Retry (Rebound's countdown) or returns (given up: the caller re-raises).
        Raises Ignore when another delivery already carried the job on, and Retry or
        Reject(requeue=True) when the give-up could not be written: never acknowledged as
        done then."""
        req = self.request
        now_ms = int(time.time() * 1000)
        q = self._rebound_fields(exc, now_ms)
        if ticket is not None:
            q["attempt"] = ticket.attempt
        if error_class:
            q["error_class"] = error_class
        try:
            rb = self.rebound
            answer = rb.decide(q["queue"], q["attempt"], job_id=q["key"], error_class=q["error_class"],
                               first_failure_unix_ms=q["first"], retry_after_ms=q["retry_after"])
        except Exception as err:  # decide never raises; this guards the property
            _hook_error("rebound.hook_error", task=self.name, field="rebound", error=repr(err)[:300])
            rb, answer = None, Rebound(target="-", strict=False).decide(
                q["queue"], q["attempt"], job_id=q["key"])
        fields = dict(task=self.name, task_id=req.id, key=q["key"], queue=q["queue"], attempt=q["attempt"],
                      error_class=q["error_class"], decision=answer["decision"], delay_ms=answer["delayMs"],
                      source=answer["source"], policy_source=answer["policySource"])
        headers = {KEY_HEADER: q["key"], FIRST_FAILURE_HEADER: q["first"]}
        if answer["decision"] == "DECISION_RETRY":
            self._rebound_next(ticket, headers, q, fields)
            _log("info", "rebound.retry", **fields)
            self._rebound_retry(exc, answer["delayMs"], headers, fields)
        fields.update(reason=answer["reason"], disposition=answer["disposition"],
                      dead_letter_queue=answer["deadLetterQueue"])
        error_text = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
        dead_letter = answer["disposition"] == "DISPOSITION_DEAD_LETTER" and answer["deadLetterQueue"]
        try:
            if dead_letter:
                letter = {
                    "task": self.name, "task_id": req.id, "key": q["key"], "args": list(args),
                    "kwargs": dict(kwargs), "queue": q["queue"], "attempts": q["attempt"],
                    "celery_queue": (getattr(req, "delivery_info", None) or {}).get("routing_key") or q["queue"],
                    "reason": answer["reason"], "reason_message": answer["reasonMessage"],
                    "error_class": q["error_class"], "error": error_text,
                    "first_failure_unix_ms": q["first"], "dead_lettered_unix_ms": now_ms,
                }
                if ticket is None:
                    self.app.send_task(DEAD_LETTER_TASK, queue=answer["deadLetterQueue"], kwargs=letter,
                                       headers={KEY_HEADER: q["key"]})
                    state = "ok"
                else:
                    push = dead_letter_payload(self.app, DEAD_LETTER_TASK, answer["deadLetterQueue"], letter,
                                               {KEY_HEADER: q["key"]})
                    state = ticket.end("dead_lettered", push=push)
            else:  # drop: the library's own failed state (FAILURE, link_error run)
                state = "ok" if ticket is None else ticket.end("dropped")
        except Exception as err:  # refused (ACL, maxmemory) or no reply: decided again later
            _hook_error("rebound.dead_letter_failed" if dead_letter else "rebound.drop_failed",
                        error=repr(err)[:300], **fields)
            self._rebound_defer(exc, ticket, headers, q, fields, error_text)
        if state != "ok":
            _log("info", "rebound.superseded", state=state, **fields)
            raise Ignore()
        if rb is not None:
            rb.count_disposition("dead_lettered" if dead_letter else "dropped")
        _log("warn", "rebound.dead_lettered" if dead_letter else "rebound.dropped", **fields)

    def _rebound_next(self, ticket, headers, q, fields):
        """Names the message about to carry the job on (its headers); Ignore when another
        delivery has taken the job over."""
        if ticket is None:
            return
        nxt = new_token()
        try:
            state = ticket.intent(nxt)
        except Exception as err:
            _hook_error("rebound.run_not_recorded", error=repr(err)[:300], **fields)
            raise Reject(err, requeue=True)
        if state != "ok":
            _log("info", "rebound.superseded", state=state, **fields)
            raise Ignore()
        headers.update({EPISODE_HEADER: ticket.episode, MESSAGE_HEADER: nxt, ATTEMPT_HEADER: ticket.attempt})

    def _rebound_retry(self, exc, delay_ms, headers, fields):
        """Task.retry itself (not self.retry, which hands the failure to Rebound). When the
        retry cannot be published, the message goes back for redelivery instead of being
        dropped as Celery would."""
        try:
            raise super().retry(exc=exc, countdown=delay_ms / 1000.0, max_retries=None, headers=headers)
        except Reject as rej:
            if rej.requeue:
                raise
            _hook_error("rebound.retry_failed", error=repr(rej.reason)[:300], **fields)
            raise Reject(rej.reason, requeue=True) from None

    def _rebound_defer(self, exc, ticket, headers, q, fields, error_text):
        """The give-up could not be written: a message decides it again after the policy's
        backoff delay for the attempt (one step further each time), without running the body."""
        if ticket is None:
            raise Reject(exc, requeue=True)
        tries = int((ticket.pending or {}).get("tries") or 0) + 1
        delay_ms = self.rebound.backoff_ms(q["queue"], q["attempt"] + tries - 1, q["key"])
        self._rebound_next(ticket, headers, q, fields)
        headers[DECIDE_HEADER] = {"error_class": q["error_class"], "error": error_text, "tries": tries}
        _log("warn", "rebound.give_up_deferred", tries=tries, retry_in_ms=delay_ms, **fields)
        self._rebound_retry(exc, delay_ms, headers, fields)


_records = {}


class WorkerLost(Exception):
    """A run that ended without an answer: its pool child or worker was killed, or it was
    paused past the visibility timeout. Decided by the policy as a failed run."""


class GiveUpRetried(Exception):
    """A failure whose give-up could not be written at first, decided again: carries the
    original error class (``code``) and message."""

    def __init__(self, error_class, error):
        super().__init__(error)
        self.code = error_class


class Ticket:
    """One delivery's hold on its job's run record (see :mod:`rebound_celery.runs`)."""

    def __init__(self, records, key, episode, message, pending):
        self.records, self.key, self.episode, self.message = records, str(key), str(episode), str(message)
        self.pending = pending
        self.token = new_token()
        self.verdict, self.attempt = None, None

    @property
    def error_class(self):
        return (self.pending or {}).get("error_class") or "WorkerLost"

    def pending_exception(self):
        if self.pending is not None:
            return GiveUpRetried(self.error_class, str(self.pending.get("error") or ""))
        return WorkerLost(f"attempt {self.attempt} ended without an answer (worker lost)")

    def intent(self, next_message):
        return self.records.intent(self.key, self.episode, self.message, self.token, next_message)

    def end(self, how, fenced=True, push=None):
        if how == "completed":
            try:
                return self.records.end(self.key, self.episode, self.message, self.token, how, fenced=False)
            except Exception as err:  # a success stays a success; a duplicate may run it again
                _hook_error("rebound.end_not_recorded", key=self.key, how=how, error=repr(err)[:300])
                return "ok"
        return self.records.end(self.key, self.episode, self.message, self.token, how, fenced=fenced, push=push)
