"""The contract's fixed points (docs/adapters.md): the default policy, the dependencies a
fresh venv needs, the target check and the reconnect bound."""

import importlib.metadata
import importlib.resources
import json

import pytest
from packaging.requirements import Requirement

import rebound_celery
from conftest import REPO, Sidecar, free_port
from rebound_celery import DEFAULT_IDENTITY, DEFAULT_POLICY, Rebound, TargetError
from rebound_celery.client import CHANNEL_OPTIONS, check_target

DEFAULT_FILE = REPO / "clients" / "conformance" / "default-policy.json"


def test_depends_on_celery_with_the_redis_extra():
    # The README's worker uses Redis: a fresh venv needs kombu's Redis transport and its deps.
    reqs = [Requirement(r) for r in importlib.metadata.requires("rebound-celery") if "extra ==" not in r]
    (celery,) = [r for r in reqs if r.name == "celery"]
    assert "redis" in celery.extras


def test_default_policy_copy_equals_the_conformance_file():
    doc = json.loads(DEFAULT_FILE.read_text())
    shipped = json.loads((importlib.resources.files(rebound_celery) / "default-policy.json").read_text())
    assert shipped == doc
    assert DEFAULT_POLICY == doc["resolved"] and DEFAULT_IDENTITY == doc["identity"] == "rebound/default"
    assert DEFAULT_POLICY["terminal"] == "DISPOSITION_DROP"  # = the task ends FAILURE, kept


def test_default_policy_is_what_an_empty_spec_resolves_to(run_dir):
    """The sidecar's own resolution of a RetryPolicy with nothing but queues."""
    path = run_dir / "empty-spec.yaml"
    path.write_text("apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: empty}\n"
                    "spec:\n  queues: [empty]\n")
    log = open(run_dir / "sidecar-empty-spec.log", "ab")
    s = Sidecar(path, log)
    try:
        s.start()
        rb = Rebound(target=s.target, deadline_ms=2000)
        assert rb.refresh("empty")
        _, resolved, _ = rb.cached_policy("empty")
        rb.client.close()
        assert resolved == json.loads(DEFAULT_FILE.read_text())["resolved"]
    finally:
        s.kill()
        log.close()


@pytest.mark.parametrize("bad", ["http://127.0.0.1:7411", "127.0.0.1", ":7411", "127.0.0.1:0", "127.0.0.1:70000",
                                 "", "unix:", "unix:///", "host:port", None])
def test_malformed_target_refused(bad):
    with pytest.raises(TargetError) as err:
        check_target(bad)
    assert "REBOUND_TARGET" in err.value.args[0]
    with pytest.raises(TargetError):
        Rebound(target=bad or "http://x")


@pytest.mark.parametrize("good", ["127.0.0.1:7411", "localhost:1", "[::1]:7411", "unix:///run/rebound/s.sock",
                                  "unix:relative.sock"])
def test_well_formed_targets_accepted(good):
    assert check_target(good) == good


def test_a_malformed_target_inside_the_retry_path_is_a_fallback_not_an_exception():
    rb = Rebound(target="http://127.0.0.1:1", strict=False)
    a = rb.decide("q", 3, job_id="k")
    assert (a["source"], a["policySource"], a["decision"]) == ("fallback", "default", "DECISION_RETRY")
    assert rb.metrics()["fallback"]["bad_target"] == 1


def test_reconnect_backoff_is_bounded_at_one_second():
    opts = dict(CHANNEL_OPTIONS)
    assert opts["grpc.max_reconnect_backoff_ms"] == 1000
    assert opts["grpc.initial_reconnect_backoff_ms"] == opts["grpc.min_reconnect_backoff_ms"] == 100


def test_prefetch_with_the_sidecar_down_answers_from_the_default():
    port = free_port()
    rb = Rebound(target=f"127.0.0.1:{port}", deadline_ms=500)
    out = rb.prefetch(["fixed-3"])
    assert out == {"fixed-3": "unavailable"}
    assert rb.decide("fixed-3", 1, job_id="k")["policySource"] == "default"
