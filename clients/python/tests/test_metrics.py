"""rebound_adapter_* from a real prefork worker of 2 processes (prometheus_client's
multiprocess mode): the counts of both pool children add up, answers from the sidecar
count as source="sidecar", with the sidecar stopped as fallbacks (unavailable, from the
cached policy), and a dead letter in terminal_total. Read back through prometheus_client's
own MultiProcessCollector, as a scrape would."""

import json
import shutil
import sys
import uuid

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from conftest import Sidecar, Worker, eventually
from rebound_celery import enqueue

A = "celery"


def read(path):
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(path))
    return lambda name, **labels: reg.get_sample_value(name, {"adapter": A, **labels})


def test_counts_add_up_across_prefork_children(app, r, redis_url, run_dir, policies_file):
    mp = run_dir / f"prom-{uuid.uuid4().hex[:6]}"
    mp.mkdir()
    log = open(run_dir / "sidecar-metrics.log", "ab")
    sidecar = Sidecar(policies_file, log)
    sidecar.start()
    worker = Worker(redis_url, sidecar.target, run_dir / "worker-metrics.log", concurrency=2, app="metrics_app")
    worker.env["PROMETHEUS_MULTIPROC_DIR"] = str(mp)
    worker.start()
    try:
        # Sidecar up: 12 tasks that fail once each (12 answers), spread over both children.
        keys = [f"m-{uuid.uuid4()}" for _ in range(12)]
        for k in keys:
            enqueue(app.flaky, args=(1,), key=k, queue="flaky")
        # One that gives up at once (non-retryable): the doomed policy dead-letters it.
        doomed = f"doomed-{uuid.uuid4()}"
        enqueue(app.flaky, args=(1, "CardDeclined"), key=doomed, queue="doomed")
        eventually(lambda: all(r.get(f"done:{k}") for k in keys), 60, "the tasks done")
        eventually(lambda: r.lrange(f"dead:{doomed}", 0, -1), 60, "the dead letter")
        pids = {json.loads(run)["pid"] for k in keys for run in r.lrange(f"runs:{k}", 0, -1)}
        assert len(pids) == 2, f"both pool children ran tasks: {pids}"
        value = read(mp)
        assert value("rebound_adapter_decisions_total", source="sidecar") == 13
        assert value("rebound_adapter_decisions_total", source="fallback") == 0
        assert value("rebound_adapter_terminal_total", disposition="dead_letter") == 1
        assert value("rebound_adapter_terminal_total", disposition="drop") == 0

        # Sidecar stopped: 6 more tasks failing once, decided from the cached policy.
        sidecar.kill()
        more = [f"f-{uuid.uuid4()}" for _ in range(6)]
        for k in more:
            enqueue(app.flaky, args=(1,), key=k, queue="failover")
        eventually(lambda: all(r.get(f"done:{k}") for k in more), 60, "the tasks done without the sidecar")
        value = read(mp)
        assert value("rebound_adapter_decisions_total", source="sidecar") == 13
        assert value("rebound_adapter_decisions_total", source="fallback") == 6
        assert value("rebound_adapter_fallbacks_total", reason="unavailable", policy_source="cached") == 6
        assert value("rebound_adapter_fallbacks_total", reason="unavailable", policy_source="default") == 0
        assert value("rebound_adapter_hook_errors_total") == 0
    finally:
        worker.stop()
        sidecar.kill()
        log.close()
        shutil.rmtree(mp, ignore_errors=True)


def test_enable_without_prometheus_client_names_the_extra(monkeypatch):
    import rebound_celery.metrics as m

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(m.MetricsUnavailable, match=r"rebound-celery\[metrics\]"):
        m.enable()
