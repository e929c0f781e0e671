"""A policy in rollout, sidecar killed: the fallback gives every job the revision, and the
answer, the sidecar gave it."""

import shutil

from conftest import CONFORMANCE, Sidecar, eventually
from rebound_celery import Rebound

# Before the first step, in the 20 % step, in the 50 % step, unknown (placed by now).
FIRSTS = [1_690_000_000_000, 1_720_000_000_000, 1_760_000_000_000, None]


def failures():
    out = []
    for i in range(200):
        f = {"job_id": f"job-{i}"}
        if FIRSTS[i % 4] is not None:
            f["first_failure_unix_ms"] = FIRSTS[i % 4]
        out.append((1 + i % 3, f))
    return out


def verdict(a):
    return (a["decision"], a["delayMs"], a["disposition"], a["deadLetterQueue"], a["reason"])


def test_sidecar_killed_fallback_follows_the_rollout(run_dir):
    # Stable: 25 attempts from 1 s, then a dead letter; canary: 2 attempts from 300 ms, then a
    # drop; steps of 20 % (from 2023-11-14) and 50 % (from 2025-06-15).
    docs = run_dir / "rollout-policies"
    docs.mkdir(exist_ok=True)
    shutil.copy(CONFORMANCE / "rollout-policies.json", docs / "policies.json")
    log = open(run_dir / "sidecar-rollout.log", "ab")
    sidecar = Sidecar(None, log, namespace="shop", policies_dir=docs)
    rb = None
    try:
        sidecar.start()
        rb = Rebound(target=sidecar.target, deadline_ms=2000)
        eventually(lambda: rb.refresh("payments"), 20, "the policy cached")
        want = []
        for attempt, f in failures():
            a = rb.decide("payments", attempt, **f)
            assert a["source"] == "sidecar", a
            want.append((verdict(a), a["revision"]))
        revisions = {r for _, r in want}
        assert len(revisions) == 2 and "" not in revisions, revisions
        sidecar.kill()
        answers = revs = 0
        for (attempt, f), (v, r) in zip(failures(), want):
            a = rb.decide("payments", attempt, **f)
            assert (a["source"], a["policySource"]) == ("fallback", "cached"), a
            answers += verdict(a) != v
            revs += a["revision"] != r
        assert (answers, revs) == (0, 0), f"of {len(want)} jobs, answers and revisions that differ"
    finally:
        if rb is not None:
            rb.client.close()
        sidecar.kill()
        log.close()
        shutil.rmtree(docs, ignore_errors=True)
