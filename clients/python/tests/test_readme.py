"""The README's quick start, as pasted: its tasks.py, its worker command and its producer,
against Redis and a real sidecar serving a fast policy for the queue `webhooks`."""

import contextlib
import json
import os
import re
import subprocess
import sys
import urllib.request

import redis

from conftest import HERE, Sidecar, eventually, free_port, log_events as json_events

README = HERE.parent / "README.md"
FAST = """apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: webhooks}
spec:
  queues: ["webhooks"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 40
  terminal: {action: deadLetter, deadLetterQueue: webhooks-dead}
"""


@contextlib.contextmanager
def quick_start_stack(qs, db, **extra_env):
    """A sidecar serving FAST from `qs`, and the environment the quick start's commands run
    in; yields (env, stack). On exit, on failure too, what `start_worker` started and the
    sidecar are stopped and their logs closed."""
    (qs / "policy.yaml").write_text(FAST)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(qs / "sidecar.log", "ab"))
        sidecar = Sidecar(qs / "policy.yaml", log)
        stack.callback(sidecar.kill)
        sidecar.start()
        env = dict(os.environ, REDIS_URL=db, REBOUND_TARGET=sidecar.target,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **extra_env)
        yield env, stack


def start_worker(stack, qs, argv, env):
    """The quick start's worker in a session of its own, logging to worker.log; `stack`
    stops the whole session (pool children included) when it closes."""
    wlog = stack.enter_context(open(qs / "worker.log", "ab"))
    worker = subprocess.Popen(argv, cwd=qs, env=env, stdout=wlog, stderr=wlog,
                              stdin=subprocess.DEVNULL, start_new_session=True)

    def stop():
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)

    stack.callback(stop)
    return worker


def test_quick_start_as_pasted(run_dir, redis_url):
    text = README.read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    commands = re.findall(r"```sh\n(celery -A tasks.*?)```", text, re.S)[0].strip().splitlines()
    assert commands[0].startswith("celery -A tasks worker") and commands[1] == "python tasks.py"
    qs = run_dir / "quickstart"
    qs.mkdir()
    (qs / "tasks.py").write_text(code)
    db = redis_url.rstrip("/") + "/5"  # a database of its own
    with quick_start_stack(qs, db) as (env, stack):
        start_worker(stack, qs, commands[0].rstrip(" &").split(), env)
        subprocess.run(commands[1].split(), cwd=qs, env=env, check=True, timeout=60)
        r = redis.Redis.from_url(db)
        # Every job ran to its end: nothing queued, nothing waiting unacknowledged.
        eventually(lambda: r.llen("webhooks") == 0 and r.hlen("unacked") == 0, 90, "the quick start's jobs done")
        events = json_events(qs / "worker.log")
        retries = [e for e in events if e.get("event") == "rebound.retry"]
        # (each run fails with probability 0.6: no retry at all happens 1% of the time)
        assert all(e["source"] == "sidecar" and e["queue"] == "webhooks" for e in retries)
        assert [e for e in events if e.get("event") in ("rebound.fallback", "rebound.dead_lettered")] == []


def test_metrics_as_pasted(run_dir, redis_url):
    """The "Metrics" section added to the quick start: a worker of 2 pool children in
    multiprocess mode serves the sum of their rebound_adapter_* counters."""
    from prometheus_client.parser import text_string_to_metric_families

    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    extra = [b for b in blocks if b.startswith("# tasks.py, continued")]
    assert len(extra) == 1
    script = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "PROMETHEUS_MULTIPROC_DIR=" in b][0]
    lines = script.strip().splitlines()
    assert len(lines) == 3 and lines[2] == "python tasks.py"
    qs = run_dir / "metrics-readme"
    qs.mkdir()
    (qs / "tasks.py").write_text(blocks[0] + "\n\n" + extra[0])
    mp = str(qs / "prom")
    db = redis_url.rstrip("/") + "/6"
    port = free_port()

    def sh(line):
        return ["bash", "-euc", line.replace("/tmp/rebound-metrics", mp)]

    with quick_start_stack(qs, db, METRICS_PORT=str(port)) as (env, stack):
        subprocess.run(sh(lines[0]), cwd=qs, env=env, check=True, timeout=30)
        start_worker(stack, qs, sh(lines[1].rstrip(" &")), env)
        subprocess.run(sh(lines[2]), cwd=qs, env=env, check=True, timeout=60)
        r = redis.Redis.from_url(db)
        eventually(lambda: r.llen("webhooks") == 0 and r.hlen("unacked") == 0, 90, "the jobs done")
        retries = [e for e in json_events(qs / "worker.log") if e.get("event") == "rebound.retry"]

        def scraped():
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(body) for s in fam.samples}

        want = (("adapter", "celery"), ("source", "sidecar"))
        eventually(lambda: scraped().get(("rebound_adapter_decisions_total", want)) == len(retries), 30,
                   f"{len(retries)} sidecar decisions scraped")
        got = scraped()
        assert got[("rebound_adapter_decisions_total", (("adapter", "celery"), ("source", "fallback")))] == 0
        assert got[("rebound_adapter_hook_errors_total", (("adapter", "celery"),))] == 0
