"""The Celery app of the conformance scenarios (clients/conformance): queues are the
policies' names in policies.yaml; REDIS_URL and REBOUND_TARGET come from the environment."""

import json
import os
import signal
import time

import redis
from celery import Celery, signals

from rebound_celery import ReboundTask

REDIS_URL = os.environ["REDIS_URL"]
app = Celery("rebound_conformance", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    rebound_target=os.environ["REBOUND_TARGET"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={"visibility_timeout": int(os.environ.get("VISIBILITY_TIMEOUT", "8")),
                              "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
    worker_redirect_stdouts=False,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)
r = redis.Redis.from_url(REDIS_URL)


class TransientError(Exception):
    pass


class PermanentError(Exception):
    pass


ERRORS = {"TransientError": TransientError, "PermanentError": PermanentError}


def _run(task, fail_runs, error_class, sleep_s=0):
    key = task.rebound_key()
    r.rpush(f"runs:{key}", json.dumps({"retries": task.request.retries, "id": task.request.id,
                                       "ms": int(time.time() * 1000), "pid": os.getpid()}))
    n = r.incr(f"count:{key}")
    time.sleep(sleep_s)
    if fail_runs == "always" or n <= int(fail_runs):
        raise ERRORS[error_class](f"run {n} fails")
    r.set(f"done:{key}", json.dumps({"retries": task.request.retries}))
    return "ok"


@app.task(base=ReboundTask, bind=True, name="conformance.job")
def job(self, fail_runs, error_class="TransientError", sleep_s=0):
    return _run(self, fail_runs, error_class, sleep_s)


@app.task(base=ReboundTask, bind=True, name="conformance.autoretry", autoretry_for=(TransientError,),
          retry_backoff=True, retry_kwargs={"max_retries": 5})
def autoretry(self, fail_runs):
    """Celery's own autoretry settings on a ReboundTask: Rebound decides anyway."""
    return _run(self, fail_runs, "TransientError")


class BrokenMapper(ReboundTask):
    def rebound_error_class(self, exc):
        raise RuntimeError("a bug in the error-class mapper")

    def rebound_retry_after_ms(self, exc):
        raise RuntimeError("a bug in the retry-after mapper")


@app.task(base=BrokenMapper, bind=True, name="conformance.broken")
def broken(self, fail_runs):
    return _run(self, fail_runs, "TransientError")


@app.task(base=ReboundTask, bind=True, name="conformance.slow")
def slow(self, seconds):
    """Sleeps on its first run (to be SIGKILLed mid-run), succeeds afterwards."""
    key = self.rebound_key()
    r.rpush(f"runs:{key}", json.dumps({"retries": self.request.retries, "id": self.request.id,
                                       "ms": int(time.time() * 1000), "pid": os.getpid()}))
    if r.set(f"started:{key}", 1, nx=True):
        time.sleep(seconds)
    r.set(f"done:{key}", json.dumps({"retries": self.request.retries}))
    return "ok"


@app.task(name="conformance.errback")
def errback(request, exc, traceback):
    """link_error: runs when the task ends FAILURE."""
    r.rpush(f"errback:{request.id}", json.dumps({"exc": type(exc).__name__}))


class FaultTask(ReboundTask):
    def rebound_retry_after_ms(self, exc):
        """kill-while-deciding: the hook is deciding this run's failure: SIGKILL the child."""
        if isinstance(exc, TransientError) and self.request.args and self.request.args[0] == "kill-while-deciding":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().rebound_retry_after_ms(exc)


@app.task(base=FaultTask, bind=True, name="conformance.fault")
def fault(self, mode="fail", sleep_s=0):
    """The job of the fault scenarios (faults.json): records its run, then per ``mode``:
    fail | succeed | kill-child (SIGKILLs its pool child) | kill-worker (the worker and
    the child) | kill-while-flag (kill-child while ``kill:KEY`` exists, else succeed) |
    kill-while-deciding (fails; its child is SIGKILLed in the hook, see FaultTask)."""
    key = self.rebound_key()
    attempt = getattr(self, "rebound_attempt", lambda: self.request.retries + 1)()
    r.rpush(f"runs:{key}", json.dumps({"retries": self.request.retries, "attempt": attempt,
                                       "id": self.request.id, "ms": int(time.time() * 1000), "pid": os.getpid()}))
    if mode == "kill-child" or (mode == "kill-while-flag" and r.exists(f"kill:{key}")):
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill-worker":
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(sleep_s)
    if mode in ("succeed", "kill-while-flag"):
        r.set(f"done:{key}", json.dumps({"retries": self.request.retries, "pid": os.getpid()}))
        return "ok"
    raise TransientError(f"run {attempt} fails")


@signals.task_failure.connect
def _kill_after_give_up(sender=None, task_id=None, **_):
    """killed-between-dead-letter-and-ack: the job has given up (its dead letter written)
    and Celery has not acknowledged its message yet: SIGKILL the worker and the child."""
    if task_id and r.delete(f"kill-after-give-up:{task_id}"):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
