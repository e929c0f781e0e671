"""The Celery app of the conformance scenarios (clients/conformance): queues are the
policies' names in policies.yaml; REDIS_URL and REBOUND_TARGET come from the environment."""

import json
import os
import time

import redis
from celery import Celery

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
