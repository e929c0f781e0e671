"""Sidecar killed → the fallback answers like the sidecar; worker SIGKILLed → nothing lost."""

import json
import time
import uuid

from conftest import Sidecar, Worker, eventually
from rebound_celery import Rebound, decide_local, enqueue


def runs(r, key):
    return [json.loads(x) for x in r.lrange(f"runs:{key}", 0, -1)]


def test_sidecar_killed_fallback_gives_the_same_answers(app, r, redis_url, run_dir, policies_file):
    log = open(run_dir / "sidecar-failover.log", "ab")
    sidecar = Sidecar(policies_file, log)
    sidecar.start()
    worker = Worker(redis_url, sidecar.target, run_dir / "worker-failover.log", concurrency=1)
    worker.start()
    try:
        rb = Rebound(target=sidecar.target, deadline_ms=2000)
        assert rb.refresh("failover")
        _, resolved, prepared = rb.cached_policy("failover")
        rb.client.close()
        key = f"failover-{uuid.uuid4()}"
        # The first failure is answered by the sidecar, which makes the worker fetch the policy.
        r.set(f"count:{key}", 0)
        enqueue(app.flaky, args=(4,), key=key, queue="failover")
        eventually(lambda: [e for e in worker.events("rebound.retry") if e["key"] == key], 30, "the first failure")
        sidecar.kill()
        eventually(lambda: r.get(f"done:{key}"), 60, "completion with the sidecar down")
        events = [e for e in worker.events("rebound.retry") if e["key"] == key]
        assert [e["attempt"] for e in events] == [1, 2, 3, 4]
        assert events[0]["source"] == "sidecar"
        for e in events:
            want = decide_local(resolved, prepared.identity, e["attempt"], {"jobId": key, "errorClass": "http.503"})
            assert e["delay_ms"] == want["delayMs"], e
        later = [(e["source"], e["policy_source"]) for e in events[1:]]
        assert ("fallback", "cached") in later and all(ps != "default" for _, ps in later)
        fallbacks = [e for e in worker.events("rebound.fallback") if e["attempt"] in (2, 3, 4)]
        assert fallbacks and all(e["cause"] == "unavailable" for e in fallbacks)

        # Back: answers come from the sidecar again.
        sidecar.start()

        def sidecar_answers():
            k = f"back-{uuid.uuid4()}"
            enqueue(app.flaky, args=(1,), key=k, queue="failover")
            eventually(lambda: r.get(f"done:{k}"), 30, "completion")
            return [e for e in worker.events("rebound.retry") if e["key"] == k and e["source"] == "sidecar"]

        eventually(sidecar_answers, 30, "a sidecar answer after the restart")
    finally:
        worker.stop()
        sidecar.kill()
        log.close()


def test_worker_sigkilled_mid_task_and_between_failure_and_retry(app, r, redis_url, run_dir, sidecar):
    path = run_dir / "worker-crash.log"
    worker = Worker(redis_url, sidecar.target, path, visibility_timeout=6)
    worker.start()
    mid = f"mid-{uuid.uuid4()}"
    between = f"between-{uuid.uuid4()}"
    enqueue(app.slow, args=(120,), key=mid, queue="crash")
    enqueue(app.flaky, args=(1,), key=between, queue="crash")
    eventually(lambda: r.get(f"started:{mid}"), 30, "slow task running")
    eventually(lambda: [e for e in worker.events("rebound.retry") if e["key"] == between], 30, "first failure")
    time.sleep(0.5)  # the decision is logged just before the retry message is sent
    worker.kill()  # SIGKILL to the main process and its pool children
    time.sleep(0.5)
    again = Worker(redis_url, sidecar.target, path, visibility_timeout=6)
    again.start()
    try:
        eventually(lambda: r.get(f"done:{mid}"), 90, "the killed task completed")
        eventually(lambda: r.get(f"done:{between}"), 90, "the pending retry completed")
        assert len(runs(r, mid)) == 2
        # The retry sent before the kill still runs (the failed run's own message may run
        # again too, if the kill came before its ack: at least once, same key).
        eventually(lambda: 1 in [x["retries"] for x in runs(r, between)], 90, "the retry ran")
    finally:
        again.stop()
