"""The Celery app the tests run in real workers (REDIS_URL, REBOUND_TARGET from the env)."""

import json
import os
import time

import redis
from celery import Celery

from rebound_celery import DEAD_LETTER_TASK, ReboundTask

REDIS_URL = os.environ["REDIS_URL"]
app = Celery("rebound_tests", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    rebound_target=os.environ["REBOUND_TARGET"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # A message a killed worker held comes back after visibility_timeout (longer than any
    # task run plus any countdown here), found by a sweep every interval*throttle seconds.
    broker_transport_options={"visibility_timeout": int(os.environ.get("VISIBILITY_TIMEOUT", "8")),
                              "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
    worker_redirect_stdouts=False,
    broker_connection_retry_on_startup=True,
)
r = redis.Redis.from_url(REDIS_URL)


class CodedError(Exception):
    def __init__(self, code):
        super().__init__(f"failed with {code}")
        self.code = code


def _record(task, key):
    r.rpush(f"runs:{key}", json.dumps({"retries": task.request.retries, "ms": int(time.time() * 1000),
                                       "pid": os.getpid()}))


@app.task(base=ReboundTask, bind=True, name="tests.flaky")
def flaky(self, fail_times, code="http.503"):
    key = self.rebound_key()
    _record(self, key)
    if r.incr(f"count:{key}") <= fail_times:
        raise CodedError(code)
    r.set(f"done:{key}", json.dumps({"retries": self.request.retries}))
    return "ok"


@app.task(base=ReboundTask, bind=True, name="tests.slow")
def slow(self, seconds):
    """Sleeps on its first run (to be killed mid-task), succeeds afterwards."""
    key = self.rebound_key()
    _record(self, key)
    if r.set(f"started:{key}", 1, nx=True):
        time.sleep(seconds)
    r.set(f"done:{key}", json.dumps({"retries": self.request.retries}))
    return "ok"


@app.task(name=DEAD_LETTER_TASK)
def dead_letter(**message):
    """A consumer of the dead-letter queues: records what it received."""
    r.rpush(f"dead:{message['key']}", json.dumps(message))
