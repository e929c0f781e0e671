"""The fallback's port of the rollout assignment picks the revision the sidecar picks: every
case of policy/testdata/assign-vectors.json, and the table of malformed input that every
adapter answers alike."""

import json
import pathlib
import random

import pytest

import rebound_celery
from rebound_celery.assign import PreparedRollout, arm, arm_prepared

REPO = pathlib.Path(__file__).resolve().parents[3]
VECTORS = REPO / "policy" / "testdata" / "assign-vectors.json"

REVISION = "sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c"
JOB = "job-186587197682"  # in bucket 0 for REVISION: reading malformed steps anyway gives CANARY
FIRST, NOW = 1800000600000, 1800086400000
S0, S1 = "1800000000000", "1800000600000"


def steps(*pairs):
    return [{"weight": w, "startUnixMs": s} for w, s in pairs]


def cases():
    doc = json.loads(VECTORS.read_text())
    assert doc["format"] == "rebound.dev/assign-vectors/v1"
    assert len(doc["cases"]) > 100
    return doc["cases"]


def test_every_vector_bit_for_bit():
    mismatches = []
    for c in cases():
        first = c.get("firstFailureUnixMs")
        got = arm(c["revision"], c["steps"], c.get("jobId"), None if first is None else int(first),
                  int(c["nowUnixMs"]))
        if got != c["expected"]:
            mismatches.append((c["name"], got, c["expected"]))
    assert mismatches == [], f"{len(mismatches)} differ, first: {mismatches[:3]}"


def test_a_rollout_prepared_once_answers_like_the_one_shot_form():
    prepared = {}
    for c in cases():
        key = json.dumps([c["revision"], c["steps"]])
        rollout = prepared.setdefault(key, PreparedRollout(c["revision"], c["steps"]))
        first = c.get("firstFailureUnixMs")
        got = arm_prepared(rollout, c.get("jobId"), None if first is None else int(first), int(c["nowUnixMs"]))
        assert got == c["expected"], c["name"]
    assert len(prepared) >= 5


def test_times_as_decimal_strings_give_the_same_answers():
    for c in cases():
        got = arm(c["revision"], c["steps"], c.get("jobId"), c.get("firstFailureUnixMs"), c["nowUnixMs"])
        assert got == c["expected"], c["name"]


def test_the_vectors_cover_every_kind():
    seen, revisions = set(), set()
    for c in cases():
        seen.add(c["expected"]["arm"])
        revisions.add(c["revision"])
        job = c.get("jobId")
        seen.add("nojob" if job is None else "emptyjob" if job == "" else "nonascii" if not job.isascii() else "job")
        if job and "firstFailureUnixMs" not in c:
            seen.add("bynow")
    assert {"STABLE", "CANARY", "nojob", "emptyjob", "nonascii", "bynow"} <= seen
    assert len(revisions) >= 2, "a single revision: the salt is not exercised"


MALFORMED_IN_BUCKET_0 = {
    "weight 0": steps((0, S0)),
    "weight 100": steps((100, S0)),
    "weights equal": steps((10, S0), (10, S1)),
    "weights decreasing": steps((50, S0), (10, S1)),
    "starts decreasing": steps((10, S1), (50, S0)),
    "11 steps": steps(*[(i + 1, S0) for i in range(11)]),
    "weight 10.5": steps((10.5, S0)),
    'weight "10"': steps(("10", S0)),
    "weight true": steps((True, S0)),
    "weight missing": [{"startUnixMs": S0}],
    "start -1": steps((10, -1)),
    'start "abc"': steps((10, "abc")),
    "start 2^64": steps((10, "18446744073709551616")),
    "start missing": [{"weight": 10}],
    "steps null": None,
    "steps an object": {"weight": 10, "startUnixMs": S0},
    "a step not an object": [10],
}


def test_well_formed_control_is_canary():
    assert arm(REVISION, steps((10, S0), (50, S1)), JOB, FIRST, NOW) == {"arm": "CANARY", "bucket": 0}


@pytest.mark.parametrize("name", sorted(MALFORMED_IN_BUCKET_0))
def test_malformed_steps_give_stable(name):
    assert arm(REVISION, MALFORMED_IN_BUCKET_0[name], JOB, FIRST, NOW) == {"arm": "STABLE", "bucket": 0}


def test_malformed_arguments_give_stable():
    good = steps((10, S0))
    assert arm(REVISION, good, JOB, "abc", NOW) == {"arm": "STABLE", "bucket": 0}
    assert arm(REVISION, good, JOB, None, "abc") == {"arm": "STABLE", "bucket": 0}
    assert arm(REVISION, good, JOB, -5, NOW) == {"arm": "STABLE", "bucket": 0}
    assert arm(None, good, JOB, FIRST, NOW) == {"arm": "STABLE"}
    assert arm(42, good, JOB, FIRST, NOW) == {"arm": "STABLE"}
    assert arm(REVISION, good, 42, FIRST, NOW) == {"arm": "STABLE"}
    assert arm(REVISION, good, "job-\ud800", FIRST, NOW) == {"arm": "STABLE"}
    assert arm("sha256:\udc00", good, JOB, FIRST, NOW) == {"arm": "STABLE"}


def test_any_mix_of_odd_arguments_gives_a_well_formed_answer():
    pool = [None, "", "x", "abc", "\ud800", -1, 0, 1.5, float("nan"), float("inf"), 2**64,
            "18446744073709551616", REVISION, JOB, S0, FIRST, NOW, [], {}, [None], [{}],
            steps((10, S0)), steps((10, S0), (50, S1)), True, b"job"]
    rng = random.Random(12345)
    for _ in range(5000):
        got = arm(*(rng.choice(pool) for _ in range(5)))
        assert got["arm"] in ("STABLE", "CANARY")
        assert set(got) <= {"arm", "bucket"} and 0 <= got.get("bucket", 0) < 100


@pytest.mark.parametrize("unknown", [None, 0, "0"])
def test_an_unknown_first_failure_is_placed_by_now(unknown):
    s = steps((10, S0))
    assert arm(REVISION, s, JOB, unknown, int(S0))["arm"] == "CANARY"
    assert arm(REVISION, s, JOB, unknown, int(S0) - 1)["arm"] == "STABLE"


def test_arm_is_exported_from_the_package():
    assert rebound_celery.arm is arm
