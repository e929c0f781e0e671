"""The client against a real sidecar: answers equal the port's, fork safety, never raising."""

import json
import os
import time

from conftest import free_port
from rebound_celery import DEFAULT_POLICY, Rebound, decide_local
from rebound_celery.core import DEFAULT_IDENTITY


def test_sidecar_answers_equal_the_local_port(sidecar):
    rb = Rebound(target=sidecar.target, deadline_ms=2000)
    compared = 0
    for queue in ("flaky", "doomed", "dropme", "crash"):
        assert rb.refresh(queue)
        _, resolved, prepared = rb.cached_policy(queue)
        for j in range(20):
            for attempt in (1, 2, 3, 4, 6, 9):
                ctx = {"job_id": f"job-{j}-ü", "error_class": "CardDeclined" if j % 7 == 0 else "http.503",
                       "retry_after_ms": 4000 if j % 5 == 0 else None}
                a = rb.decide(queue, attempt, **ctx)
                assert a["source"] == "sidecar"
                local = decide_local(resolved, prepared.identity, attempt,
                                     {"jobId": ctx["job_id"], "errorClass": ctx["error_class"],
                                      **({"retryAfterMs": 4000} if ctx["retry_after_ms"] else {})})
                for f in ("decision", "delayMs", "disposition", "deadLetterQueue", "reason", "reasonMessage"):
                    assert a[f] == local[f], (queue, j, attempt, f)
                compared += 1
    assert compared == 4 * 20 * 6
    assert rb.metrics()["fallback"] == {}


def test_channel_is_not_shared_across_fork(sidecar):
    rb = Rebound(target=sidecar.target, deadline_ms=2000)
    # Fetched first, so no background refresh is in flight at fork (gRPC does not survive
    # a fork during a call; Celery's prefork parent makes none).
    assert rb.refresh("flaky")
    assert rb.decide("flaky", 1, job_id="parent")["source"] == "sidecar"
    parent_channel = rb.client._channel
    # Several children: a child that reused the parent's connection state failed about one
    # time in four (UNAVAILABLE), so one fork alone would pass by luck.
    for child in range(8):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: a fresh channel, and a sidecar answer through it
            try:
                os.close(rfd)
                fresh = rb.client._channel is None
                a = rb.decide("flaky", 1, job_id=f"child-{child}")
                os.write(wfd, json.dumps({"fresh": fresh, "source": a["source"],
                                          "new": rb.client._channel is not parent_channel}).encode())
            finally:
                os._exit(0)
        os.close(wfd)
        out = json.loads(os.read(rfd, 4096))
        os.close(rfd)
        os.waitpid(pid, 0)
        assert out == {"fresh": True, "source": "sidecar", "new": True}, child
    assert rb.decide("flaky", 2, job_id="parent")["source"] == "sidecar"


def test_a_retry_budget_stretch_is_reported_and_added_to_the_delay(sidecar):
    rb = Rebound(target=sidecar.target, deadline_ms=2000)
    assert rb.refresh("budgeted")
    # One retry a second: three failures answered within a few ms share at most two slots.
    answers = []
    for j in range(3):
        asked_last = time.monotonic()
        answers.append(rb.decide("budgeted", 1, job_id=f"budget-{j}"))
    for a in answers:
        assert (a["source"], a["decision"]) == ("sidecar", "DECISION_RETRY")
        assert a["delayMs"] == 100 + a["budgetDelayMs"]
        assert a["budgetStretched"] == (a["budgetDelayMs"] > 0)
        assert a["budgetDelayMs"] <= 2000
    assert sum(a["budgetStretched"] for a in answers) >= 1
    # The same failure asked again: the same run time (its delay counted from now), no new slot.
    again = rb.decide("budgeted", 1, job_id="budget-2")
    between_ms = (time.monotonic() - asked_last) * 1000
    assert again["budgetStretched"] == answers[2]["budgetStretched"]
    assert 0 <= answers[2]["delayMs"] - again["delayMs"] <= between_ms + 1


def test_unreachable_sidecar_answers_from_the_documented_default():
    rb = Rebound(target=f"127.0.0.1:{free_port()}", deadline_ms=100)
    for attempt in (1, 5, 10):
        a = rb.decide("anything", attempt, job_id="k1", error_class="Boom")
        want = decide_local(DEFAULT_POLICY, DEFAULT_IDENTITY, attempt, {"jobId": "k1", "errorClass": "Boom"})
        assert (a["source"], a["policySource"], a["decision"], a["delayMs"], a["reason"], a["budgetStretched"]) == \
            ("fallback", "default", want["decision"], want["delayMs"], want["reason"], False)
    assert a["disposition"] == "DISPOSITION_DROP"  # attempt 10: the task ends FAILURE, kept
    m = rb.metrics()["fallback"]
    assert m["total"] == 3 and m["default_policy"] == 3 and m["unavailable"] == 3


def test_bad_input_never_raises():
    rb = Rebound(target=f"127.0.0.1:{free_port()}", deadline_ms=100)
    a = rb.decide("q", "not-a-number", job_id="x" * 5000, error_class="é" * 400,
                  first_failure_unix_ms="soon", retry_after_ms=float("nan"))
    assert (a["decision"], a["source"], a["policySource"]) == ("DECISION_RETRY", "fallback", "default")
