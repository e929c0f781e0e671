"""The fault scenarios (clients/conformance/faults.json) that list ``celery``, on real
prefork Celery workers, a Redis of each test's own (dev/redis.sh) and a real sidecar.

Faults are real: SIGKILL / SIGSTOP / SIGCONT of worker processes and of the sidecar, a
Redis ACL refusing the dead-letter key, Redis at ``maxmemory`` with ``noeviction``, and a
TCP proxy between worker and Redis that drops one reply. Each test tallies, for every
job, where it ended (completed, dead letter, or a message still in the queue or
unacknowledged) and asserts what the scenario's ``expect`` says, with ``WINDOW`` the
at-least-once window documented in the README."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import CONFORMANCE, DLQ, HERE, REPO, Env, eventually
from rebound_celery import enqueue

FAULTS = [s for s in json.loads((CONFORMANCE / "faults.json").read_text())["scenarios"]
          if "celery" in s["libraries"]]
QUEUE = "fixed-3-dlq"
MAX_ATTEMPTS = 3  # fixed-3-dlq in policies.yaml
WINDOW = 1
"""Duplicate runs one fault may add to a job: a run presumed lost (paused or running past
the visibility timeout) that goes on and finishes while its retry runs (README)."""
VT = 6  # the workers' visibility_timeout, s


def test_every_fault_scenario_has_a_test():
    names = {n for n in globals() if n.startswith("test_")}
    missing = [s["id"] for s in FAULTS
               if not any(n == "test_" + s["id"].replace("-", "_") or n.startswith("test_" + s["id"].replace("-", "_") + "_")
                          for n in names)]
    assert missing == [], f"fault scenarios without a Python test: {missing}"


# -- helpers -------------------------------------------------------------------------------

@pytest.fixture
def fx(run_dir, request):
    """A Redis of this test's own (ACLs, maxmemory and proxies touch nothing else), and an
    Env on it; everything started is stopped, Redis last."""
    state = run_dir / f"redis-{request.node.name}"
    url = subprocess.run([str(REPO / "dev" / "redis.sh"), "up", str(state)], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]
    e = None
    try:
        e = Env(url, 0, run_dir, request.node.name)
        e.base_url = url
        e.mod = e.app()
        yield e
    finally:
        if e is not None:
            e.close()
        subprocess.run([str(REPO / "dev" / "redis.sh"), "down", str(state)], check=False, capture_output=True)


def fault_of(sid):
    (s,) = [s for s in FAULTS if s["id"] == sid]
    return s["expect"]


def submit(e, mode="fail", sleep_s=0, key=None):
    key = key or f"{mode}-{uuid.uuid4()}"
    enqueue(e.mod.fault, args=(mode, sleep_s), key=key, queue=QUEUE, link_error=e.mod.errback)
    return key


def _task_ids(e, raws):
    out = []
    for raw in raws:
        doc = json.loads(raw)
        msg = doc[0] if isinstance(doc, list) else doc
        out.append(msg.get("headers", {}).get("id"))
    return out


def tally(e, keys):
    """Where every job is: completed, dead letter, pending (a message in its queue, or
    unacknowledged: held by a worker or waiting for its ETA), else lost."""
    pending = set(_task_ids(e, e.r.lrange(QUEUE, 0, -1))) | set(_task_ids(e, e.r.hvals("unacked")))
    out = {}
    for k in keys:
        letters = e.dead_letters(k)
        out[k] = {"completed": bool(e.r.get(f"done:{k}")), "dead_letters": len(letters), "letters": letters,
                  "pending": k in pending, "runs": e.runs(k)}
        out[k]["lost"] = not (out[k]["completed"] or letters or out[k]["pending"])
    return out


# A worker's main process that logged a CRITICAL record (Celery's "Unrecoverable error",
# after which it shuts down) and is still alive this long later is killed, as an
# orchestrator does once its termination grace period is over: Celery's warm shutdown can
# wait on a broker that refused it.
SHUTDOWN_GRACE = 10
RECORD = re.compile(r"^\[[^\]]*?: (?P<level>[A-Z]+)/(?P<process>[^\]]+)\] ")


def _main_process_failures(w):
    """How many CRITICAL records the worker's main process has logged (all its runs)."""
    try:
        data = open(w.log_path, "rb").read().decode(errors="replace")
    except FileNotFoundError:
        return 0
    return sum(1 for line in data.splitlines()
               if (m := RECORD.match(line)) and m["level"] == "CRITICAL" and m["process"] == "MainProcess")


def settle(e, keys, timeout, supervise=(), want=lambda t: t["completed"] or t["dead_letters"]):
    """Waits until every job reached its end, failing early once a job has run more than
    maxAttempts + WINDOW times. ``supervise``: workers restarted when they exit, or killed
    and restarted when they are still shutting down SHUTDOWN_GRACE after a failure."""
    end = time.monotonic() + timeout
    while True:
        for w in supervise:
            failures = _main_process_failures(w)
            if failures > getattr(w, "failures_seen", 0):
                w.failures_seen, w.failing_since = failures, time.monotonic()
            failing_since = getattr(w, "failing_since", None)
            if (w.proc.poll() is None and failing_since is not None
                    and time.monotonic() - failing_since > SHUTDOWN_GRACE):
                w.kill()
            if w.proc.poll() is not None:
                w.failing_since = None
                w.restarts = getattr(w, "restarts", 0) + 1
                w.start()
        t = tally(e, keys)
        over = {k: len(v["runs"]) for k, v in t.items() if len(v["runs"]) > MAX_ATTEMPTS + WINDOW}
        assert not over, f"runs past maxAttempts + window: {over}"
        if all(want(v) for v in t.values()):
            return t
        if time.monotonic() > end:
            raise AssertionError(f"not settled after {timeout} s: "
                                 f"{ {k: {x: v[x] for x in ('completed', 'dead_letters', 'pending')} | {'runs': len(v['runs'])} for k, v in t.items()} }")
        time.sleep(0.5)


def assert_expect(t, expect, gave_up=None):
    """The scenario's expect, on the tally: nothing lost, runs within maxAttempts + WINDOW,
    one dead letter per give-up."""
    gave_up = set(t) if gave_up is None else set(gave_up)
    assert expect["jobsLost"] == 0
    assert [k for k, v in t.items() if v["lost"]] == []
    assert expect["runsAtMost"] == "maxAttempts+window"
    assert {k: len(v["runs"]) for k, v in t.items() if len(v["runs"]) > MAX_ATTEMPTS + WINDOW} == {}
    assert expect["deadLettersPerGiveUp"] == 1
    assert {k: t[k]["dead_letters"] for k in gave_up} == {k: 1 for k in gave_up}


def events_of(w, event, key):
    return [x for x in w.events(event) if x.get("key") == key]


def start(e, **kw):
    sidecar = e.sidecar()
    kw.setdefault("visibility_timeout", VT)
    kw.setdefault("queues", QUEUE)
    w = e.worker(sidecar.target, **kw)
    eventually(lambda: w.events("rebound.prefetched"), 60, "the worker's prefetch")
    return sidecar, w


def state_of(e, key):
    return e.mod.app.AsyncResult(key).state


# -- the scenarios ---------------------------------------------------------------------------

def test_paused_past_every_timeout(fx):
    expect = fault_of("paused-past-every-timeout")
    sidecar, w1 = start(fx, concurrency=3, log="worker-1.log")
    ok = submit(fx, "succeed", 2)
    failing = [submit(fx, "fail", 2) for _ in range(4)]
    eventually(lambda: len([k for k in [ok, *failing] if fx.runs(k)]) >= 3, 60, "three runs in the first worker")
    w2 = fx.worker(sidecar.target, concurrency=3, log="worker-2.log", visibility_timeout=VT, queues=QUEUE)
    os.killpg(w1.proc.pid, signal.SIGSTOP)  # main process and pool children, mid-run
    try:
        time.sleep(VT + 8)  # past the visibility timeout and kombu's restore sweep
    finally:
        os.killpg(w1.proc.pid, signal.SIGCONT)
    t = settle(fx, [ok, *failing], 120)
    assert_expect(t, expect, gave_up=failing)
    assert expect["completedNotDeadLettered"] and t[ok]["completed"] and t[ok]["dead_letters"] == 0
    lost = [x for w in (w1, w2) for x in w.events("rebound.run_lost")]
    print(f"paused: runs per job {[len(t[k]['runs']) for k in [ok, *failing]]}, lost runs decided {len(lost)}")
    assert lost, "the paused runs were decided as runs without an answer"
    for k in failing:
        (letter,) = t[k]["letters"]
        assert letter["attempts"] == MAX_ATTEMPTS


def _killed_on_every_run(fx, mode, supervise):
    expect = fault_of("killed-on-every-run")
    sidecar, w = start(fx, concurrency=2)
    key = submit(fx, mode)
    t = settle(fx, [key], 150, supervise=[w] if supervise else ())
    assert_expect(t, expect)
    runs = t[key]["runs"]
    (letter,) = t[key]["letters"]
    assert expect["finalState"] == "deadLetter" and expect["deadLetterAttemptsEqualsRuns"]
    assert letter["attempts"] == len(runs) == MAX_ATTEMPTS  # endsWithin maxAttempts
    assert letter["error_class"] == "WorkerLost"
    # everyUnansweredRunCounted: each run after a killed one is numbered one higher
    assert [x["attempt"] for x in runs] == [1, 2, 3]
    assert [x["attempt"] for x in w.events("rebound.run_lost") if x["key"] == key] == [1, 2, 3]
    eventually(lambda: state_of(fx, key) == "FAILURE", 30, "FAILURE in the result backend")
    return t, w


def test_killed_on_every_run_pool_child(fx):
    _killed_on_every_run(fx, "kill-child", supervise=False)


def test_killed_on_every_run_worker(fx):
    _, w = _killed_on_every_run(fx, "kill-worker", supervise=True)
    assert w.restarts >= MAX_ATTEMPTS


def test_killed_while_deciding(fx):
    expect = fault_of("killed-while-deciding")
    sidecar, w = start(fx, concurrency=2)
    os.kill(sidecar.proc.pid, signal.SIGSTOP)  # hung: every Decide waits for its 250 ms deadline
    try:
        key = submit(fx, "kill-while-deciding")
        t = settle(fx, [key], 120)
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    assert_expect(t, expect)
    assert expect["everyUnansweredRunCounted"]
    assert [x["attempt"] for x in t[key]["runs"]] == [1, 2, 3]
    # each run was cut off in its hook: none of the body's failures got an answer; each
    # was decided (by the fallback) at the next delivery, as a run without an answer
    answered = [x for x in events_of(w, "rebound.retry", key) + events_of(w, "rebound.dead_lettered", key)]
    assert [x["error_class"] for x in answered] == ["WorkerLost"] * 3
    assert [x["attempt"] for x in events_of(w, "rebound.run_lost", key)] == [1, 2, 3]
    (d,) = events_of(w, "rebound.dead_lettered", key)
    assert (d["source"], d["error_class"], d["attempt"]) == ("fallback", "WorkerLost", 3)


def test_killed_between_dead_letter_and_ack(fx):
    expect = fault_of("killed-between-dead-letter-and-ack")
    sidecar, w = start(fx, concurrency=2)
    key = f"fail-{uuid.uuid4()}"
    fx.r.set(f"kill-after-give-up:{key}", 1)
    submit(fx, "fail", key=key)
    settle(fx, [key], 90, supervise=[w])
    # the kill came after the dead letter; the message comes back after the visibility
    # timeout, to the restarted worker
    end = time.monotonic() + 60
    while not events_of(w, "rebound.duplicate_skipped", key) and time.monotonic() < end:
        if w.proc.poll() is not None:
            w.start()
        time.sleep(0.5)
    t = tally(fx, [key])
    assert expect["deadLetters"] == 1 and t[key]["dead_letters"] == 1
    assert_expect(t, expect)
    assert len(t[key]["runs"]) == MAX_ATTEMPTS
    (skip,) = events_of(w, "rebound.duplicate_skipped", key)
    assert (skip["verdict"], skip["state"]) == ("ended", "dead_lettered")
    assert fx.r.hlen("unacked") == 0


def _acl_refusing(key):
    """ACL key patterns for every key but ``key`` (Redis globs have no 'not')."""
    pats = [f"~{key}?*"]
    for i, c in enumerate(key):
        if i:
            pats.append(f"~{key[:i]}")
        pats.append(f"~{key[:i]}[^{c}]*")
    return pats


def test_dead_letter_write_refused(fx):
    expect = fault_of("dead-letter-write-refused")
    fx.r.execute_command("ACL", "SETUSER", "worker", "on", ">pw", "~*", "&*", "+@all")
    url = fx.base_url.replace("redis://", "redis://worker:pw@") + "/0"
    sidecar, w = start(fx, concurrency=2, url=url)
    key = submit(fx, "fail", 1.5)
    eventually(lambda: len(fx.runs(key)) == MAX_ATTEMPTS, 60, "the last run")
    fx.r.execute_command("ACL", "SETUSER", "worker", "resetkeys", *_acl_refusing(DLQ))
    assert fx.r.execute_command("ACL", "DRYRUN", "worker", "LPUSH", DLQ, "x") != b"OK"
    assert fx.r.execute_command("ACL", "DRYRUN", "worker", "LPUSH", QUEUE, "x") == b"OK"
    try:
        eventually(lambda: events_of(w, "rebound.dead_letter_failed", key), 30, "the refused dead letter")
        time.sleep(3)
        # neverCountedAsDeadLetteredWhileRefused
        t = tally(fx, [key])
        assert t[key]["dead_letters"] == 0 and t[key]["pending"] and not t[key]["lost"]
        assert events_of(w, "rebound.dead_lettered", key) == []
        refused = events_of(w, "rebound.dead_letter_failed", key)
    finally:
        fx.r.execute_command("ACL", "SETUSER", "worker", "allkeys")
    t = settle(fx, [key], 60)
    assert expect["neverCountedAsDeadLetteredWhileRefused"] and expect["deadLettersAfterAllowed"] == 1
    assert_expect(t, expect)
    assert len(t[key]["runs"]) == MAX_ATTEMPTS  # decided again, never run again
    (letter,) = t[key]["letters"]
    assert (letter["attempts"], letter["error_class"]) == (MAX_ATTEMPTS, "TransientError")
    deferred = events_of(w, "rebound.give_up_deferred", key)
    print(f"dead letter refused {len(refused)} time(s) in 3 s, written once allowed")
    assert deferred and all(x["attempt"] == MAX_ATTEMPTS for x in deferred)
    eventually(lambda: state_of(fx, key) == "FAILURE", 30, "FAILURE in the result backend")


def test_broker_out_of_memory(fx):
    expect = fault_of("broker-out-of-memory")
    sidecar, w = start(fx, concurrency=2)
    keys = [submit(fx, "fail", 2) for _ in range(2)]
    eventually(lambda: all(len(fx.runs(k)) == MAX_ATTEMPTS for k in keys), 60, "both jobs in their last run")
    fx.r.config_set("maxmemory-policy", "noeviction")
    fx.r.config_set("maxmemory", "1")
    try:
        eventually(lambda: [x for x in w.events() if x.get("key") in keys and x["event"] in (
            "rebound.dead_letter_failed", "rebound.run_not_recorded")] or None, 30, "a refused give-up")
        time.sleep(3)
        t = tally(fx, keys)
        assert [k for k, v in t.items() if v["dead_letters"]] == []
    finally:
        fx.r.config_set("maxmemory", "0")
    t = settle(fx, keys, 90, supervise=[w])
    assert_expect(t, expect)
    print(f"out of memory: runs per job {[len(t[k]['runs']) for k in keys]}, "
          f"worker restarts {getattr(w, 'restarts', 0)}")


class DropOneReply:
    """A TCP proxy to Redis that forwards everything, except that it drops the reply to the
    first command naming ``key`` as an argument (after Redis applied it) and closes that
    connection, as a network cut would."""

    def __init__(self, port, key):
        self.upstream, self.key = port, key.encode()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped, self.marked, self.socks, self.threads = [], False, [], []
        self._lock = threading.Lock()
        self.threads.append(threading.Thread(target=self._accept, daemon=True))
        self.threads[0].start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.socks += [client, server]
            marks = _Marks()
            for fn in (self._requests, self._replies):
                th = threading.Thread(target=fn, args=(client, server, marks), daemon=True)
                th.start()
                self.threads.append(th)

    def _requests(self, client, server, marks):
        buf = b""
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                return self._close(client, server)
            if marks.plain:
                server.sendall(data)
                continue
            buf += data
            while buf and not marks.plain:
                item = _resp(buf, 0)
                if item is None:
                    break
                end, cmd = item
                raw, buf = buf[:end], buf[end:]
                name = (cmd[0] if isinstance(cmd, list) and cmd else b"").upper()
                with self._lock:
                    target = not self.dropped and not self.marked and name in (
                        b"EVALSHA", b"EVAL", b"LPUSH", b"RPUSH", b"FCALL") and self.key in cmd[1:]
                    self.marked = self.marked or target
                if name in (b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE"):
                    marks.plain = True  # pushes from now on, not one reply per command
                else:
                    marks.append(target)
                server.sendall(raw)
            if marks.plain and buf:
                server.sendall(buf)
                buf = b""

    def _replies(self, client, server, marks):
        buf = b""
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data:
                return self._close(client, server)
            buf += data
            while buf and marks:
                item = _resp(buf, 0)
                if item is None:
                    break
                end, _ = item
                if marks.pop(0):
                    with self._lock:
                        self.dropped.append(True)
                    return self._close(client, server)
                client.sendall(buf[:end])
                buf = buf[end:]
            if buf and marks.plain and not marks:
                client.sendall(buf)
                buf = b""

    @staticmethod
    def _close(*socks):
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.listener.close()
        self._close(*self.socks)
        for th in self.threads:
            th.join(timeout=5)


class _Marks(list):
    """Per connection: for each command sent, whether its reply is the one to drop."""

    plain = False


def _resp(buf, i):
    """(end, value) of the RESP2/RESP3 item at ``buf[i:]``, or None when it is incomplete."""
    j = buf.find(b"\r\n", i)
    if j < 0:
        return None
    kind, line = buf[i:i + 1], buf[i + 1:j]
    if kind in (b"+", b"-", b":", b"_", b",", b"#", b"("):
        return j + 2, line
    if kind in (b"$", b"=", b"!"):
        n = int(line)
        if n < 0:
            return j + 2, None
        if len(buf) < j + 4 + n:
            return None
        return j + 4 + n, buf[j + 2:j + 2 + n]
    if kind in (b"*", b"~", b">", b"%", b"|"):
        n = int(line)
        if n < 0:
            return j + 2, None
        items, k = [], j + 2
        for _ in range(n * 2 if kind in (b"%", b"|") else n):
            item = _resp(buf, k)
            if item is None:
                return None
            k, v = item
            items.append(v)
        if kind == b"|":  # an attribute precedes the reply itself
            return _resp(buf, k)
        return k, items
    raise ValueError(f"not RESP: {buf[i:i + 20]!r}")


def test_commit_reply_lost(fx):
    expect = fault_of("commit-reply-lost")
    port = int(fx.base_url.rsplit(":", 1)[1])
    proxy = DropOneReply(port, DLQ)
    fx.stack.callback(proxy.close)
    sidecar, w = start(fx, concurrency=2, url=f"redis://127.0.0.1:{proxy.port}/0")
    key = submit(fx, "fail")
    t = settle(fx, [key], 60)
    time.sleep(2)  # a second write, if any, would land now
    t = tally(fx, [key])
    assert proxy.dropped, "the give-up write's reply was dropped"
    assert expect["deadLetters"] == 1 and t[key]["dead_letters"] == 1
    assert_expect(t, expect)
    eventually(lambda: state_of(fx, key) == "FAILURE", 30, "FAILURE in the result backend")
    print(f"reply dropped for {proxy.dropped}")


def test_sidecar_hung(fx):
    expect = fault_of("sidecar-hung")
    sidecar, w = start(fx, concurrency=4)
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    stopped = time.time() * 1000
    try:
        keys = [submit(fx, "fail") for _ in range(80)]
        time.sleep(20)
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
        resumed = time.time() * 1000
    t = settle(fx, keys, 180)
    assert_expect(t, expect)
    during = [x for x in w.events("rebound.retry") + w.events("rebound.dead_lettered")
              if x.get("key") in t and stopped < _ms(x) < resumed - 500]
    assert during and {x["source"] for x in during} == {expect["source"]}
    print(f"sidecar hung 20 s: {len(during)} decisions by the fallback meanwhile, "
          f"runs per job max {max(len(v['runs']) for v in t.values())}")


def _ms(event):
    """When the worker logged an event (Celery's log time, local), in ms."""
    import datetime

    ts = datetime.datetime.strptime(event["_time"], "%Y-%m-%d %H:%M:%S,%f")
    return time.mktime(ts.timetuple()) * 1000 + ts.microsecond / 1000


def test_replay_after_crashes(fx):
    expect = fault_of("replay-after-crashes")
    sidecar, w = start(fx, concurrency=2)
    key = f"crashes-{uuid.uuid4()}"
    fx.r.set(f"kill:{key}", 1)
    submit(fx, "kill-while-flag", key=key)
    t = settle(fx, [key], 120)
    assert_expect(t, expect)
    assert len(t[key]["runs"]) == MAX_ATTEMPTS and t[key]["letters"][0]["attempts"] == MAX_ATTEMPTS
    fx.r.delete(f"kill:{key}")
    out = subprocess.run([sys.executable, "-m", "rebound_celery", "replay", "conformance_app", DLQ, "--key", key],
                         cwd=str(HERE), env=dict(os.environ, REDIS_URL=fx.url, REBOUND_TARGET=sidecar.target),
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"replayed": [key]}
    eventually(lambda: fx.r.get(f"done:{key}"), 60, "the replayed job completed")
    runs = fx.runs(key)
    assert len(runs) - MAX_ATTEMPTS == expect["replayRuns"] == 1
    assert expect["sameJobId"] and {x["id"] for x in runs} == {key}
    assert runs[-1]["attempt"] == 1  # a new first run
    eventually(lambda: state_of(fx, key) == "SUCCESS", 30, "SUCCESS")


def test_gives_up_twice(fx):
    expect = fault_of("gives-up-twice")
    sidecar, w = start(fx, concurrency=2)
    key = submit(fx, "fail")
    settle(fx, [key], 60)
    eventually(lambda: state_of(fx, key) == "FAILURE", 30, "FAILURE")
    submit(fx, "fail", key=key)  # the same key enqueued again
    eventually(lambda: len(fx.dead_letters(key)) == 2, 60, "the second give-up")
    time.sleep(1)
    runs = fx.runs(key)
    assert expect["deadLetters"] == 2 and len(fx.dead_letters(key)) == 2
    assert [x["attempt"] for x in runs] == [1, 2, 3, 1, 2, 3]
    assert [x["attempts"] for x in fx.dead_letters(key)] == [3, 3]
