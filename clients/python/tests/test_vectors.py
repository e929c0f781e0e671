"""The fallback's port of decide gives every answer of policy/testdata/decide-vectors.json."""

import json
import pathlib

from rebound_celery.decide import decide_local

REPO = pathlib.Path(__file__).resolve().parents[3]
VECTORS = REPO / "policy" / "testdata" / "decide-vectors.json"
FIELDS = ("decision", "delayMs", "disposition", "deadLetterQueue", "reason", "reasonMessage")


def test_every_vector_bit_for_bit():
    doc = json.loads(VECTORS.read_text())
    assert doc["format"] == "rebound.dev/decide-vectors/v1"
    cases = doc["cases"]
    assert len(cases) > 100
    mismatches = []
    for case in cases:
        got = decide_local(case["policy"], case["identity"], case["attempt"], case["context"])
        want = case["expected"]
        if any(got[f] != want[f] for f in FIELDS):
            mismatches.append((case["name"], {f: got[f] for f in FIELDS}, want))
    assert mismatches == [], f"{len(mismatches)} of {len(cases)} differ, first: {mismatches[:3]}"


def test_shipped_proto_matches_the_repository():
    shipped = REPO / "clients" / "python" / "src" / "rebound_celery" / "proto" / "rebound" / "v1" / "advisor.proto"
    assert shipped.read_bytes() == (REPO / "proto" / "rebound" / "v1" / "advisor.proto").read_bytes()
