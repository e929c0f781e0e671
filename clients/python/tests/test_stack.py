"""The full stack: kube-apiserver + etcd, rebound-operator, a sidecar watching the
namespace's ConfigMap (with its own least-privilege credentials), Redis and a prefork
Celery worker; the policy applied and changed with kubectl. Needs REBOUND_CLUSTER_STATE_DIR
(dev/test.sh sets it; dev/cluster-up.sh DIR starts one)."""

import json
import os
import pathlib
import subprocess
import time
import uuid

import pytest

from conftest import REPO, TARGET_DIR, Worker, eventually, free_port
from rebound_celery import Rebound, enqueue

STATE = os.environ.get("REBOUND_CLUSTER_STATE_DIR")
pytestmark = pytest.mark.skipif(not STATE, reason="REBOUND_CLUSTER_STATE_DIR not set (no cluster)")

RBAC = """apiVersion: v1
kind: ServiceAccount
metadata: {{name: rebound-sidecar, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: rebound-sidecar, namespace: {ns}}}
rules:
  - apiGroups: [""]
    resources: [configmaps]
    resourceNames: [rebound-policies]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: rebound-sidecar, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: rebound-sidecar}}
subjects:
  - {{kind: ServiceAccount, name: rebound-sidecar, namespace: {ns}}}
"""

POLICY = """apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {{name: stack}}
spec:
  queues: ["stackq"]
  backoff: {{strategy: constant, base: 200ms, jitter: {{kind: none}}}}
  maxAttempts: {n}
  terminal: {{action: deadLetter, deadLetterQueue: work-dead}}
"""


def sh(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


@pytest.fixture(scope="module")
def stack(run_dir):
    state = str(pathlib.Path(STATE).resolve())
    kubeconfig = sh(str(REPO / "dev" / "cluster-up.sh"), state).strip().splitlines()[-1]
    bin_dir = sh(str(REPO / "dev" / "build-control-plane.sh"), "--print-bin-dir").strip().splitlines()[-1]
    env = dict(os.environ, KUBECONFIG=kubeconfig)

    def kubectl(*args, input=None):
        return sh(os.path.join(bin_dir, "kubectl"), *args, env=env, input=input)

    kubectl("apply", "--server-side", "--field-manager", "rebound-test", "--force-conflicts",
            "-f", str(REPO / "crds" / "retrypolicies.rebound.dev.yaml"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/retrypolicies.rebound.dev")
    ns = f"py-e2e-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", ns)
    kubectl("-n", ns, "apply", "-f", "-", input=RBAC.format(ns=ns))
    logs = run_dir / ns
    logs.mkdir()
    procs = []
    op_log = open(logs / "operator.log", "ab")
    procs.append(subprocess.Popen(
        [str(TARGET_DIR / "debug" / "rebound-operator"), f"--namespaces={ns}", "--leader-elect=false",
         f"--metrics-addr=127.0.0.1:{free_port()}", "--log-format=json"],
        env=env, stdout=op_log, stderr=op_log, stdin=subprocess.DEVNULL))
    sidecar_kc = str(logs / "sidecar.kubeconfig")
    sh(str(REPO / "dev" / "mint-user-kubeconfig.sh"), state, f"system:serviceaccount:{ns}:rebound-sidecar",
       "system:serviceaccounts", f"system:serviceaccounts:{ns}", sidecar_kc)
    kubectl("-n", ns, "apply", "-f", "-", input=POLICY.format(n=3))
    eventually(lambda: _configmap(kubectl, ns), 60, "the operator's ConfigMap")
    port = free_port()
    sc_log = open(logs / "sidecar.log", "ab")
    procs.append(subprocess.Popen(
        [str(TARGET_DIR / "debug" / "rebound-sidecar"), f"--configmap={ns}/rebound-policies",
         f"--listen=127.0.0.1:{port}", f"--admin-listen=127.0.0.1:{free_port()}", "--log-format=json"],
        env=dict(os.environ, KUBECONFIG=sidecar_kc), stdout=sc_log, stderr=sc_log, stdin=subprocess.DEVNULL))
    target = f"127.0.0.1:{port}"
    try:
        yield {"kubectl": kubectl, "ns": ns, "target": target, "logs": logs}
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        op_log.close()
        sc_log.close()
        subprocess.run([os.path.join(bin_dir, "kubectl"), "delete", "namespace", ns, "--wait=false"],
                       env=env, capture_output=True)


def _configmap(kubectl, ns):
    try:
        return kubectl("-n", ns, "get", "configmap", "rebound-policies", "-o", "jsonpath={.data.policies\\.json}")
    except subprocess.CalledProcessError:
        return None


def _max_attempts(target):
    rb = Rebound(target=target, deadline_ms=1000)
    ok = rb.refresh("stackq")
    rb.client.close()
    return ok and rb.cached_policy("stackq")[1]["maxAttempts"]


def test_policy_from_kubectl_governs_and_a_change_takes_over(stack, app, redis_url, r):
    eventually(lambda: _max_attempts(stack["target"]) == 3, 60, "the sidecar serving the policy")
    worker = Worker(redis_url, stack["target"], stack["logs"] / "worker.log")
    worker.start()
    try:
        key = f"stack-{uuid.uuid4()}"
        enqueue(app.flaky, args=(1000,), key=key, queue="stackq")
        (msg,) = eventually(lambda: [json.loads(x) for x in r.lrange(f"dead:{key}", 0, -1)], 60, "dead letter")
        assert msg["attempts"] == 3 and msg["reason"] == "GIVE_UP_REASON_MAX_ATTEMPTS"

        t0 = time.monotonic()
        stack["kubectl"]("-n", stack["ns"], "apply", "-f", "-", input=POLICY.format(n=5))
        eventually(lambda: _max_attempts(stack["target"]) == 5, 60, "the changed policy served")
        print(f"\npolicy change via kubectl served by the sidecar after {time.monotonic() - t0:.2f}s")
        key2 = f"stack-{uuid.uuid4()}"
        enqueue(app.flaky, args=(1000,), key=key2, queue="stackq")
        (msg2,) = eventually(lambda: [json.loads(x) for x in r.lrange(f"dead:{key2}", 0, -1)], 60, "dead letter")
        assert msg2["attempts"] == 5
        retries = [e for e in worker.events("rebound.retry") if e["key"] in (key, key2)]
        assert retries and all(e["source"] == "sidecar" for e in retries)
    finally:
        worker.stop()
