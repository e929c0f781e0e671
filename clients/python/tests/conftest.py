"""Real parts: Redis from dev/redis.sh, a real rebound-sidecar, real prefork Celery workers."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import base64
import contextlib
import types
import uuid

import pytest
import redis
from celery import Celery

REPO = pathlib.Path(__file__).resolve().parents[3]
HERE = pathlib.Path(__file__).resolve().parent
STATE = REPO / ".state" / "py-tests"
CONFORMANCE = REPO / "clients" / "conformance"
CONFORMANCE_POLICIES = CONFORMANCE / "policies.yaml"
WORK_QUEUES = "fixed-3,fixed-3-dlq,fixed-3-drop,no-policy"
DLQ = "fixed-3-dead"
TARGET_DIR = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
QUEUES = "flaky,doomed,dropme,payments,failover,crash,deadline,stackq,work-dead"

POLICIES = """
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: flaky}
spec:
  queues: ["flaky", "failover"]
  backoff: {strategy: exponential, base: 200ms, multiplier: 2, cap: 2s, jitter: {kind: full}}
  maxAttempts: 6
  terminal: {action: deadLetter, deadLetterQueue: work-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: doomed}
spec:
  queues: ["doomed"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 4
  nonRetryableErrors: ["CardDeclined"]
  terminal: {action: deadLetter, deadLetterQueue: work-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: dropme}
spec:
  queues: ["dropme", "payments"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 3
  nonRetryableErrors: ["CardDeclined"]
  terminal: {action: drop}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: deadline}
spec:
  queues: ["deadline"]
  backoff: {strategy: constant, base: 400ms, jitter: {kind: none}}
  maxAttempts: 100
  maxRetryDuration: 1500ms
  terminal: {action: deadLetter, deadLetterQueue: work-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: crash}
spec:
  queues: ["crash"]
  backoff: {strategy: constant, base: 3s, jitter: {kind: none}}
  maxAttempts: 5
  terminal: {action: deadLetter, deadLetterQueue: work-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: budgeted}
spec:
  queues: ["budgeted"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 5
  retryBudget: {ratePerSecond: 1, burst: 1}
"""


# Celery's worker log format: "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s";
# Rebound's messages are JSON objects.
LOG_LINE = re.compile(r"^\[(?P<time>[^\]]*?): (?P<level>[A-Z]+)/(?P<process>[^\]]+)\] (?P<message>\{.*\})\s*$")


def log_events(path, event=None):
    """The JSON messages of a worker log, each with its record's ``_level`` and ``_process``."""
    out = []
    try:
        data = open(path, "rb").read().decode(errors="replace")
    except FileNotFoundError:
        return out
    for line in data.splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        try:
            doc = json.loads(m["message"])
        except ValueError:
            continue
        if isinstance(doc, dict) and (event is None or doc.get("event") == event):
            doc["_level"], doc["_process"], doc["_time"] = m["level"], m["process"], m["time"]
            out.append(doc)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Sidecar:
    def __init__(self, policies_file, log, namespace="pytest", policies_dir=None):
        """RetryPolicy YAML compiled locally, or with ``policies_dir`` a compiled document
        (``policies.json`` in that directory) served as the operator wrote it."""
        binary = os.environ.get("REBOUND_SIDECAR") or str(TARGET_DIR / "debug" / "rebound-sidecar")
        if not os.path.exists(binary):
            pytest.fail(f"no sidecar at {binary}: cargo build -p rebound-sidecar")
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        source = ["--policies-dir", str(policies_dir)] if policies_dir else ["--policies-file", str(policies_file)]
        self.args = [binary, *source, "--namespace", namespace, "--listen", self.target, "--no-admin"]
        self.log = log
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)

        def up():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return True
            except OSError:
                return False

        try:
            eventually(up, 20, "sidecar listening")
        except BaseException:
            self.kill()  # never left running by a failed start
            raise
        time.sleep(0.3)  # the first configuration loads right after bind

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Worker:
    """`celery worker -P prefork` in its own process group (killed as a group, by our PID)."""

    def __init__(self, redis_url, target, log_path, visibility_timeout=8, concurrency=2, app="celery_app",
                 queues=QUEUES, extra=()):
        self.env = dict(os.environ, REDIS_URL=redis_url, REBOUND_TARGET=target, PYTHONPATH=str(HERE),
                        VISIBILITY_TIMEOUT=str(visibility_timeout))
        self.log_path = log_path
        self.concurrency = concurrency
        self.app, self.queues, self.extra = app, queues, list(extra)
        self.proc = None
        self.log = None

    def start(self):
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", self.app, "worker", "-P", "prefork", "-c", str(self.concurrency),
             "-Q", self.queues, "-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", f"w{uuid.uuid4().hex[:6]}@%h", *self.extra],
            env=self.env, cwd=str(HERE), stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def events(self, event=None):
        return log_events(self.log_path, event)

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def stop(self):
        self.kill(signal.SIGTERM)
        if self.proc:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # leftover pool children of our group
            except ProcessLookupError:
                pass
        if self.log:
            self.log.close()


@pytest.fixture(scope="session")
def run_dir():
    d = STATE / f"run-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def redis_url(run_dir):
    state = run_dir / "redis"
    out = subprocess.run([str(REPO / "dev" / "redis.sh"), "up", str(state)], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    yield out
    subprocess.run([str(REPO / "dev" / "redis.sh"), "down", str(state)], check=False, capture_output=True)


@pytest.fixture(scope="session")
def policies_file(run_dir):
    p = run_dir / "policies.yaml"
    p.write_text(POLICIES)
    return p


@pytest.fixture(scope="session")
def sidecar(run_dir, policies_file):
    log = open(run_dir / "sidecar.log", "ab")
    s = Sidecar(policies_file, log)
    try:
        s.start()
        yield s
    finally:
        s.kill()
        log.close()


@pytest.fixture(scope="session")
def worker(run_dir, redis_url, sidecar):
    w = Worker(redis_url, sidecar.target, run_dir / "worker.log")
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="session")
def app(redis_url, sidecar):
    os.environ["REDIS_URL"] = redis_url
    os.environ["REBOUND_TARGET"] = sidecar.target
    sys.path.insert(0, str(HERE))
    import celery_app

    return celery_app


@pytest.fixture(scope="session")
def r(redis_url):
    return redis.Redis.from_url(redis_url)


class Env:
    """One Redis database, the conformance app against it, and what a test starts (stopped on exit)."""

    def __init__(self, redis_url, db, run_dir, name):
        self.url = f"{redis_url.rstrip('/')}/{db}"
        self.r = redis.Redis.from_url(self.url)
        self.r.flushdb()
        self.dir = run_dir / f"conformance-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stack = contextlib.ExitStack()

    def sidecar(self, start=True):
        log = self.stack.enter_context(open(self.dir / "sidecar.log", "ab"))
        s = Sidecar(CONFORMANCE_POLICIES, log, namespace="conformance")
        self.stack.callback(s.kill)
        if start:
            s.start()
        return s

    def worker(self, target, start=True, url=None, log="worker.log", **kw):
        kw.setdefault("queues", WORK_QUEUES)
        w = Worker(url or self.url, target, self.dir / log, app="conformance_app", **kw)
        self.stack.callback(w.stop)
        if start:
            w.start()
        return w

    def app(self, target=None):
        """A producer on this database: the conformance tasks by name, and their results."""
        app = Celery("conformance-producer", broker=self.url, backend=self.url)
        self.stack.callback(app.close)
        return types.SimpleNamespace(app=app, **{n: app.signature(f"conformance.{n}")
                                                 for n in ("job", "autoretry", "broken", "slow", "errback", "fault")})

    def runs(self, key):
        return [json.loads(x) for x in self.r.lrange(f"runs:{key}", 0, -1)]

    def dead_letters(self, key=None):
        """The rebound.dead_letter messages waiting on the dead-letter queue (kombu's Redis list)."""
        out = []
        for raw in self.r.lrange(DLQ, 0, -1):
            msg = json.loads(raw)
            body = msg["body"]
            if msg["properties"].get("body_encoding") == "base64":
                body = base64.b64decode(body)
            args, kwargs, _ = json.loads(body)
            if msg["headers"].get("task") == "rebound.dead_letter" and (key is None or kwargs["key"] == key):
                out.append(kwargs)
        return out

    def errbacks(self, key):
        return [json.loads(x) for x in self.r.lrange(f"errback:{key}", 0, -1)]

    def close(self):
        self.stack.close()
