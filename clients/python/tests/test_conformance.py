"""The conformance scenarios (clients/conformance/scenarios.json) on real prefork Celery
workers, Redis from dev/redis.sh and real rebound-sidecars serving policies.yaml.

Each scenario id has a test named ``test_<id with - as _>`` (more may follow the name)."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import DLQ, HERE, REPO, Env, eventually, free_port
from rebound_celery import DEFAULT_IDENTITY, DEFAULT_POLICY, Rebound, decide_local, enqueue

CONFORMANCE = REPO / "clients" / "conformance"
SCENARIOS = json.loads((CONFORMANCE / "scenarios.json").read_text())["scenarios"]


def scenario(sid):
    (s,) = [s for s in SCENARIOS if s["id"] == sid]
    return s


def test_every_scenario_has_a_test():
    names = {n for n in globals() if n.startswith("test_")}
    missing = [s["id"] for s in SCENARIOS
               if not any(n == "test_" + s["id"].replace("-", "_") or n.startswith("test_" + s["id"].replace("-", "_") + "_")
                          for n in names)]
    assert missing == [], f"conformance scenarios without a Python test: {missing}"


# -- helpers -------------------------------------------------------------------------------

_db = iter(range(1, 16))


@pytest.fixture
def env(redis_url, run_dir, request):
    db = next(_db)
    if db == 5:  # test_readme's
        db = next(_db)
    e = Env(redis_url, db, run_dir, request.node.name)
    yield e
    e.close()


@pytest.fixture(scope="module")
def shared(redis_url, run_dir):
    """One sidecar and one prefork worker for the scenarios that break nothing."""
    e = Env(redis_url, 15, run_dir, "shared")
    try:  # what it started is stopped even when the setup fails
        sidecar = e.sidecar()
        worker = e.worker(sidecar.target)
        e.mod = e.app(sidecar.target)
        e.sidecar_, e.worker_ = sidecar, worker
        eventually(lambda: worker.events("rebound.prefetched"), 60, "the worker's prefetch")
        yield e
    finally:
        e.close()


def resolved_of(target, queue):
    rb = Rebound(target=target, deadline_ms=2000)
    assert rb.refresh(queue)
    _, resolved, prepared = rb.cached_policy(queue)
    rb.client.close()
    return resolved, prepared.identity


def state_of(mod, key):
    return mod.app.AsyncResult(key).state


def library_terminal(e, key, timeout=60):
    """FAILURE in the result backend, and link_error has run."""
    eventually(lambda: state_of(e.mod, key) == "FAILURE", timeout, "FAILURE in the result backend")
    eventually(lambda: e.errbacks(key), 30, "link_error run")


def submit(e, task, args, key=None, queue="fixed-3", **options):
    key = key or f"{queue}-{uuid.uuid4()}"
    enqueue(task, args=args, key=key, queue=queue, link_error=e.mod.errback, **options)
    return key


def events_of(worker, event, key):
    return [x for x in worker.events(event) if x.get("key") == key]


# -- the scenarios ---------------------------------------------------------------------------

def test_retry_then_succeed(shared):
    e, w = shared, shared.worker_
    key = submit(e, e.mod.job, (2,), queue="fixed-3")
    eventually(lambda: e.r.get(f"done:{key}"), 60, "completion")
    runs = e.runs(key)
    assert len(runs) == scenario("retry-then-succeed")["expect"]["runs"] == 3
    assert {x["id"] for x in runs} == {key}
    resolved, identity = resolved_of(e.sidecar_.target, "fixed-3")
    retries = events_of(w, "rebound.retry", key)
    assert [(x["attempt"], x["source"], x["policy_source"]) for x in retries] == [(1, "sidecar", "sidecar"),
                                                                                   (2, "sidecar", "sidecar")]
    for x in retries:
        want = decide_local(resolved, identity, x["attempt"], {"jobId": key, "errorClass": "TransientError"})
        assert x["delay_ms"] == want["delayMs"]
        gap = runs[x["attempt"]]["ms"] - runs[x["attempt"] - 1]["ms"]
        assert want["delayMs"] <= gap + 5 <= want["delayMs"] + 10000, (x, gap)
        assert x["_level"] == "INFO"  # Celery's logger, at the event's level
    assert state_of(e.mod, key) == "SUCCESS"


def test_exhausted_dead_letter(shared):
    e, w = shared, shared.worker_
    key = submit(e, e.mod.job, ("always",), queue="fixed-3-dlq")
    library_terminal(e, key)
    (letter,) = eventually(lambda: e.dead_letters(key), 30, "the dead letter")
    assert len(e.runs(key)) == 3
    assert letter["args"] == ["always"] and letter["key"] == letter["task_id"] == key
    assert letter["queue"] == "fixed-3-dlq" and letter["attempts"] == 3
    assert letter["reason"] == "GIVE_UP_REASON_MAX_ATTEMPTS" and letter["error_class"] == "TransientError"
    (ev,) = events_of(w, "rebound.dead_lettered", key)
    assert ev["_level"] == "WARNING" and ev["dead_letter_queue"] == DLQ


def test_exhausted_drop_keeps_job(shared):
    e, w = shared, shared.worker_
    key = submit(e, e.mod.job, ("always",), queue="fixed-3-drop")
    library_terminal(e, key)
    assert len(e.runs(key)) == 3
    assert e.dead_letters(key) == []
    (ev,) = events_of(w, "rebound.dropped", key)
    assert (ev["reason"], ev["disposition"], ev["attempt"]) == ("GIVE_UP_REASON_MAX_ATTEMPTS", "DISPOSITION_DROP", 3)
    assert e.errbacks(key) == [{"exc": "TransientError"}]


def test_non_retryable_error(shared):
    e = shared
    key = submit(e, e.mod.job, ("always", "PermanentError"), queue="fixed-3-dlq")
    library_terminal(e, key)
    (letter,) = eventually(lambda: e.dead_letters(key), 30, "the dead letter")
    assert letter["reason"] == scenario("non-retryable-error")["expect"]["reason"]
    assert letter["attempts"] == 1 and len(e.runs(key)) == 1


def test_replayed_dead_letter(shared):
    e = shared
    key = submit(e, e.mod.job, (3,), queue="fixed-3-dlq")
    eventually(lambda: e.dead_letters(key), 60, "the dead letter")
    assert len(e.runs(key)) == 3
    # The documented command (README): replay the job's dead letter from the queue.
    out = subprocess.run([sys.executable, "-m", "rebound_celery", "replay", "conformance_app", DLQ, "--key", key],
                         cwd=str(HERE), env=dict(os.environ, REDIS_URL=e.url, REBOUND_TARGET=e.sidecar_.target),
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"replayed": [key]}
    eventually(lambda: e.r.get(f"done:{key}"), 60, "the replayed job completed")
    runs = e.runs(key)
    assert len(runs) == 4 and runs[3]["retries"] == 0  # one run, a new first run
    assert {x["id"] for x in runs} == {key}
    assert e.dead_letters(key) == []
    eventually(lambda: state_of(e.mod, key) == "SUCCESS", 30, "SUCCESS")


def test_default_policy_keeps_job(env):
    target = f"127.0.0.1:{free_port()}"  # nothing ever listens there
    w = env.worker(target)
    env.mod = env.app(target)
    ev = eventually(lambda: w.events("rebound.sidecar_unreachable"), 60, "the start warning")[0]
    assert ev["target"] == target and ev["_level"] == "WARNING"
    key = submit(env, env.mod.job, ("always",), queue="fixed-3", retries=9)  # its 10th run
    library_terminal(env, key)
    assert len(env.runs(key)) == 1
    (d,) = events_of(w, "rebound.dropped", key)
    want = scenario("default-policy-keeps-job")["expect"]
    assert (d["decision"], d["disposition"], d["policy_source"], d["source"]) == \
        (want["decision"], want["disposition"], want["policySource"], want["source"])
    (fb,) = [x for x in w.events("rebound.fallback") if x["queue"] == "fixed-3" and x["attempt"] == 10]
    assert fb["_level"] == "WARNING" and fb["target"] == target and fb["policy"] == DEFAULT_IDENTITY
    assert decide_local(DEFAULT_POLICY, DEFAULT_IDENTITY, 10)["disposition"] == "DISPOSITION_DROP"


def test_outage_every_process_uses_real_policy(env):
    sidecar = env.sidecar()
    # Every run in a new pool child: each one forked by the main process, most after the kill.
    w = env.worker(sidecar.target, extra=["--max-tasks-per-child", "1"])
    env.mod = env.app(sidecar.target)
    pre = eventually(lambda: w.events("rebound.prefetched"), 60, "the prefetch")[0]
    assert "fixed-3-dlq" in pre["queues"] and pre["_process"] == "MainProcess"
    resolved, identity = resolved_of(sidecar.target, "fixed-3-dlq")
    time.sleep(1.0)  # the pool's children are up
    sidecar.kill()
    key = submit(env, env.mod.job, ("always",), queue="fixed-3-dlq")
    (letter,) = eventually(lambda: env.dead_letters(key), 60, "the dead letter")
    runs = env.runs(key)
    assert len(runs) == 3 and letter["attempts"] == 3
    assert len({x["pid"] for x in runs}) == 3  # three processes, replaced children
    retries = events_of(w, "rebound.retry", key)
    assert [x["attempt"] for x in retries] == [1, 2]
    for x in retries:
        assert (x["source"], x["policy_source"]) == ("fallback", "cached")
        want = decide_local(resolved, identity, x["attempt"], {"jobId": key, "errorClass": "TransientError"})
        assert x["delay_ms"] == want["delayMs"]
    (d,) = events_of(w, "rebound.dead_lettered", key)
    assert (d["source"], d["policy_source"]) == ("fallback", "cached")
    library_terminal(env, key)


def test_sidecar_down_at_start(env):
    sidecar = env.sidecar(start=False)  # its address chosen, nothing listening yet
    w = env.worker(sidecar.target)
    env.mod = env.app(sidecar.target)
    ev = eventually(lambda: w.events("rebound.sidecar_unreachable"), 60, "the start warning")
    assert ev[0]["target"] == sidecar.target and ev[0]["_level"] == "WARNING" and len(ev) == 1
    key = submit(env, env.mod.job, (1,), queue="fixed-3")
    eventually(lambda: env.r.get(f"done:{key}"), 60, "a job done on the default policy")
    (x,) = events_of(w, "rebound.retry", key)
    assert (x["source"], x["policy_source"]) == ("fallback", "default")
    assert w.proc.poll() is None
    up_ms = _start_and_measure(env, w, sidecar)
    bound = scenario("sidecar-down-at-start")["expect"]["assertBackToSidecarWithinMs"]
    assert up_ms <= bound, up_ms
    # and the main process loads the worker's queues' policies: children it forks during a
    # later outage decide from them
    eventually(lambda: [p for p in w.events("rebound.policy_fetched")
                        if p["queue"] == "fixed-3-dlq" and p["_process"] == "MainProcess"], 30,
               "the main process loaded the policies after the sidecar came back")


def _start_and_measure(env, w, sidecar):
    """Starts the sidecar, then fails probe jobs until one is answered by it: ms from the
    sidecar listening to the first run answered by the sidecar (printed)."""
    sidecar.start()
    up = int(time.time() * 1000) - 300  # start() waits 0.3 s after the port answers

    def back():
        k = submit(env, env.mod.job, (1,), queue="fixed-3")
        eventually(lambda: env.r.get(f"done:{k}"), 30, "a probe done")
        hits = [x for x in events_of(w, "rebound.retry", k) if x["source"] == "sidecar"]
        return env.runs(k)[0]["ms"] if hits else None

    first = eventually(back, 30, "an answer from the restarted sidecar")
    # The probe before it, if any, may have started before the sidecar was up: the bound
    # is on the first sidecar-answered run after the sidecar listened.
    ms = max(first - up, 0)
    print(f"back on the sidecar {ms} ms after it listened")
    return ms


def test_malformed_target_refused(env):
    target = scenario("malformed-target-refused")["target"]
    env.mod = env.app("127.0.0.1:1")
    key = submit(env, env.mod.job, (0,), queue="fixed-3")  # waiting before the worker starts
    w = env.worker(target)
    rc = w.proc.wait(timeout=60)
    assert rc != 0
    (ev,) = w.events("rebound.bad_target")
    assert (ev["setting"], ev["target"], ev["_level"]) == ("REBOUND_TARGET", target, "ERROR")
    assert env.runs(key) == []  # no job ran


def test_adapter_error_never_hands_to_library_mapper_raises(shared):
    e, w = shared, shared.worker_
    key = submit(e, e.mod.broken, ("always",), queue="fixed-3")
    library_terminal(e, key)
    assert len(e.runs(key)) == 3  # the policy's maxAttempts, attempts counted despite the bug
    assert [x["attempt"] for x in events_of(w, "rebound.retry", key)] == [1, 2]
    assert type(e.mod.app.AsyncResult(key).result).__name__ == "TransientError"  # the task's own error
    assert {x["field"] for x in w.events("rebound.hook_error")} >= {"error_class", "retry_after"}


def test_adapter_error_never_hands_to_library_sidecar_error_answer(shared):
    e, w = shared, shared.worker_
    key = submit(e, e.mod.job, ("always",), queue="no-policy")  # the sidecar answers NOT_FOUND
    try:
        eventually(lambda: len(e.runs(key)) >= 2, 60, "the second run")
        runs = e.runs(key)
        first = events_of(w, "rebound.retry", key)[0]
        assert (first["source"], first["policy_source"]) == ("fallback", "default")
        fb = [x for x in w.events("rebound.fallback") if x["queue"] == "no-policy" and x["attempt"] == 1]
        assert fb and fb[0]["cause"] == "not_found"
        want = decide_local(DEFAULT_POLICY, DEFAULT_IDENTITY, 1, {"jobId": key, "errorClass": "TransientError"})
        assert first["delay_ms"] == want["delayMs"]
        # Rebound's countdown, not Celery's default_retry_delay (180 s)
        assert runs[1]["ms"] - runs[0]["ms"] < want["delayMs"] + 10000
        assert runs[1]["retries"] == 1
    finally:
        e.mod.app.control.revoke(key)


def test_adapter_error_never_hands_to_library_autoretry_backoff(shared):
    e = shared
    key = submit(e, e.mod.autoretry, ("always",), queue="fixed-3-dlq")
    (letter,) = eventually(lambda: e.dead_letters(key), 60, "the dead letter")
    assert letter["attempts"] == 3 and len(e.runs(key)) == 3  # the policy's, not retry_kwargs' 5
    library_terminal(e, key)


def test_sidecar_restart_reconnects(env):
    sidecar = env.sidecar()
    w = env.worker(sidecar.target)
    env.mod = env.app(sidecar.target)
    eventually(lambda: w.events("rebound.prefetched"), 60, "the prefetch")
    keys = [submit(env, env.mod.job, (2,), queue="fixed-3") for _ in range(3)]
    eventually(lambda: w.events("rebound.retry"), 30, "a first failure")
    sidecar.kill()  # SIGKILL
    keys += [submit(env, env.mod.job, (2,), queue="fixed-3") for _ in range(3)]
    eventually(lambda: [x for x in w.events("rebound.retry") if x["source"] == "fallback"], 30, "fallback answers")
    ms = _start_and_measure(env, w, sidecar)
    assert ms <= scenario("sidecar-restart-reconnects")["expect"]["assertBackToSidecarWithinMs"], ms
    for k in keys:
        eventually(lambda: env.r.get(f"done:{k}"), 60, "every job done")
        assert len(env.runs(k)) == 3


def test_worker_sigkill(env):
    sidecar = env.sidecar()
    w = env.worker(sidecar.target, visibility_timeout=6)
    env.mod = env.app(sidecar.target)
    key = submit(env, env.mod.slow, (120,), queue="fixed-3-dlq")
    eventually(lambda: env.r.get(f"started:{key}"), 60, "the run started")
    w.kill()  # SIGKILL to the main process and its children
    again = env.worker(sidecar.target, visibility_timeout=6)
    eventually(lambda: env.r.get(f"done:{key}"), 90, "the killed job ran again")
    runs = env.runs(key)
    assert 2 <= len(runs) <= 3 and {x["id"] for x in runs} == {key}
    assert again.proc.poll() is None


def test_broker_restart(run_dir):
    state = run_dir / "redis-broker"
    url = subprocess.run([str(REPO / "dev" / "redis.sh"), "up", str(state), "--persist"], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    e = Env(url, 0, run_dir, "broker-restart")
    try:
        sidecar = e.sidecar()
        w = e.worker(sidecar.target)
        e.mod = e.app(sidecar.target)
        eventually(lambda: w.events("rebound.prefetched"), 60, "the prefetch")
        # Two runs in progress (the pool full, so no message is being moved from a queue to
        # kombu's unacked hash: that move is two Redis commands, and a Redis stop between
        # them loses the message — a kombu limitation, see docs/adapters.md), two waiting.
        keys = [submit(e, e.mod.job, (2, "TransientError", 3), queue="fixed-3-dlq") for _ in range(2)]
        eventually(lambda: all(e.runs(k) for k in keys), 30, "both runs started")
        keys += [submit(e, e.mod.job, (2,), queue="fixed-3-dlq") for _ in range(2)]
        pid = int((state / "redis.pid").read_text())
        os.kill(pid, signal.SIGTERM)  # Redis stops (writing its AOF) and starts again on its port
        eventually(lambda: not os.path.exists(f"/proc/{pid}"), 30, "redis stopped")
        time.sleep(1.0)
        subprocess.run([str(REPO / "dev" / "redis.sh"), "up", str(state), "--persist"], check=True,
                       capture_output=True)
        keys.append(submit(e, e.mod.job, (2,), queue="fixed-3-dlq"))
        restarts = []

        def settled(k):
            # Celery 5.7 / kombu 5.7: the worker exits ("Unrecoverable error") when Redis goes
            # away mid-run; run it under a supervisor (systemd Restart=, Kubernetes). This is one.
            if w.proc.poll() is not None:
                restarts.append(w.proc.returncode)
                w.start()
            return e.r.get(f"done:{k}") or e.dead_letters(k)

        for k in keys:
            eventually(lambda: settled(k), 120, "every job done")
        print(f"worker restarted by the supervisor {len(restarts)} time(s)")
        for k in keys:
            runs = e.runs(k)
            # a run cut off by the restart counts as one of the policy's attempts (the
            # job may then end as a dead letter), never one past maxAttempts
            assert (e.r.get(f"done:{k}") or e.dead_letters(k)) and 1 <= len(runs) <= 3 + 1, (k, runs)
            assert max(x["retries"] for x in runs) <= 2
    finally:
        e.close()
        subprocess.run([str(REPO / "dev" / "redis.sh"), "down", str(state)], check=False, capture_output=True)
