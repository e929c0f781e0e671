"""End to end on real prefork Celery workers, Redis and a real rebound-sidecar."""

import json
import uuid

from conftest import eventually
from rebound_celery import Rebound, decide_local, enqueue


def runs(r, key):
    return [json.loads(x) for x in r.lrange(f"runs:{key}", 0, -1)]


def dead(r, key):
    return [json.loads(x) for x in r.lrange(f"dead:{key}", 0, -1)]


def policy_of(target, queue):
    rb = Rebound(target=target, deadline_ms=2000)
    assert rb.refresh(queue)
    _, resolved, prepared = rb.cached_policy(queue)
    return resolved, prepared.identity


def test_transient_failure_retried_within_bounds_then_completes(app, worker, sidecar, r):
    key = f"flaky-{uuid.uuid4()}"
    enqueue(app.flaky, args=(3,), key=key, queue="flaky")
    done = json.loads(eventually(lambda: r.get(f"done:{key}"), 60, "completion"))
    assert done["retries"] == 3
    seen = runs(r, key)
    assert [x["retries"] for x in seen] == [0, 1, 2, 3]
    resolved, identity = policy_of(sidecar.target, "flaky")
    for attempt in (1, 2, 3):
        want = decide_local(resolved, identity, attempt, {"jobId": key, "errorClass": "http.503"})
        assert want["decision"] == "DECISION_RETRY"
        gap = seen[attempt]["ms"] - seen[attempt - 1]["ms"]
        assert want["delayMs"] <= gap <= want["delayMs"] + 10000, (attempt, gap, want["delayMs"])
    retries = [e for e in worker.events("rebound.retry") if e["key"] == key]
    assert [(e["attempt"], e["source"]) for e in retries] == [(1, "sidecar"), (2, "sidecar"), (3, "sidecar")]


def test_always_failing_reaches_max_attempts_then_dead_letter(app, worker, r):
    key = f"doomed-{uuid.uuid4()}"
    enqueue(app.flaky, args=(1000,), kwargs={"code": "http.500"}, key=key, queue="doomed")
    letters = eventually(lambda: dead(r, key), 60, "dead letter")
    assert len(runs(r, key)) == 4  # maxAttempts runs, the first included
    (msg,) = letters
    assert msg["key"] == key and msg["task_id"] == key
    assert msg["task"] == "tests.flaky"
    assert msg["args"] == [1000] and msg["kwargs"] == {"code": "http.500"}
    assert msg["reason"] == "GIVE_UP_REASON_MAX_ATTEMPTS" and msg["attempts"] == 4
    assert msg["error_class"] == "http.500" and msg["queue"] == "doomed"
    result = app.app.AsyncResult(key)
    eventually(lambda: result.state == "FAILURE", 10, "FAILURE state")


def test_non_retryable_dead_letters_at_the_first_failure(app, worker, r):
    key = f"declined-{uuid.uuid4()}"
    enqueue(app.flaky, args=(1000,), kwargs={"code": "CardDeclined"}, key=key, queue="doomed")
    (msg,) = eventually(lambda: dead(r, key), 30, "dead letter")
    assert msg["reason"] == "GIVE_UP_REASON_NON_RETRYABLE" and msg["attempts"] == 1
    assert len(runs(r, key)) == 1


def test_drop_ends_after_max_attempts_without_dead_letter(app, worker, r):
    key = f"drop-{uuid.uuid4()}"
    enqueue(app.flaky, args=(1000,), key=key, queue="dropme")
    eventually(lambda: [e for e in worker.events("rebound.dropped") if e["key"] == key], 30, "drop")
    (e,) = [e for e in worker.events("rebound.dropped") if e["key"] == key]
    assert e["reason"] == "GIVE_UP_REASON_MAX_ATTEMPTS" and e["attempt"] == 3
    assert len(runs(r, key)) == 3
    assert dead(r, key) == []
    key2 = f"drop-nr-{uuid.uuid4()}"
    enqueue(app.flaky, args=(1000,), kwargs={"code": "CardDeclined"}, key=key2, queue="payments")
    eventually(lambda: [e for e in worker.events("rebound.dropped") if e["key"] == key2], 30, "drop")
    assert len(runs(r, key2)) == 1


def test_first_failure_time_kept_across_retries_gives_up_at_the_deadline(app, worker, r):
    key = f"deadline-{uuid.uuid4()}"
    enqueue(app.flaky, args=(1000,), key=key, queue="deadline")
    (msg,) = eventually(lambda: dead(r, key), 60, "dead letter")
    seen = runs(r, key)
    assert msg["reason"] == "GIVE_UP_REASON_DEADLINE"
    assert 2 <= msg["attempts"] == len(seen) < 10  # maxAttempts (100) never reached
    # The first failure's time is the first run's, carried through every retry.
    assert seen[0]["ms"] <= msg["first_failure_unix_ms"] <= seen[1]["ms"]
    assert msg["dead_lettered_unix_ms"] - msg["first_failure_unix_ms"] <= 1500 + 5000
