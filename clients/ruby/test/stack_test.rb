# frozen_string_literal: true

# The full stack: kube-apiserver + etcd (dev/cluster-up.sh), rebound-operator, a sidecar
# watching the namespace's ConfigMap with its own least-privilege credentials, Redis and a
# `sidekiq` process; the policy applied and changed with kubectl. Needs
# REBOUND_CLUSTER_STATE_DIR (dev/test.sh sets it; dev/cluster-up.sh DIR starts one).
require_relative "worker_test"

class StackTest < Minitest::Test
  include JobAsserts

  RBAC = <<~YAML
    apiVersion: v1
    kind: ServiceAccount
    metadata: {name: rebound-sidecar, namespace: NS}
    ---
    apiVersion: rbac.authorization.k8s.io/v1
    kind: Role
    metadata: {name: rebound-sidecar, namespace: NS}
    rules:
      - apiGroups: [""]
        resources: [configmaps]
        resourceNames: [rebound-policies]
        verbs: [get, list, watch]
    ---
    apiVersion: rbac.authorization.k8s.io/v1
    kind: RoleBinding
    metadata: {name: rebound-sidecar, namespace: NS}
    roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: rebound-sidecar}
    subjects:
      - {kind: ServiceAccount, name: rebound-sidecar, namespace: NS}
  YAML

  def policy(max_attempts) = <<~YAML
    apiVersion: rebound.dev/v1alpha1
    kind: RetryPolicy
    metadata: {name: stack}
    spec:
      queues: ["stackq"]
      backoff: {strategy: constant, base: 200ms, jitter: {kind: none}}
      maxAttempts: #{max_attempts}
      terminal: {action: deadLetter, deadLetterQueue: work-dead}
  YAML

  def setup
    skip "REBOUND_CLUSTER_STATE_DIR not set (no cluster)" unless ENV["REBOUND_CLUSTER_STATE_DIR"]
  end

  def kubectl(*args, input: nil)
    Harness.run!(@kubectl, *args, env: {"KUBECONFIG" => @kubeconfig}, input: input)
  end

  def max_attempts(target)
    rb = Rebound::Advisor.new(target: target, deadline_ms: 1000)
    ok = rb.refresh("stackq")
    rb.client.close
    ok && rb.cached_policy("stackq")[1]["maxAttempts"]
  end

  def test_policy_from_kubectl_governs_and_a_change_takes_over
    state = File.expand_path(ENV.fetch("REBOUND_CLUSTER_STATE_DIR"), REPO)
    @kubeconfig = Harness.last_line(Harness.run!(File.join(REPO, "dev", "cluster-up.sh"), state))
    @kubectl = File.join(Harness.last_line(Harness.run!(File.join(REPO, "dev", "build-control-plane.sh"), "--print-bin-dir")), "kubectl")
    kubectl("apply", "--server-side", "--field-manager", "rebound-tests", "--force-conflicts", "-f", File.join(REPO, "crds", "retrypolicies.rebound.dev.yaml"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/retrypolicies.rebound.dev")
    ns = "rb-e2e-#{SecureRandom.hex(4)}"
    kubectl("create", "namespace", ns)
    kubectl("-n", ns, "apply", "-f", "-", input: RBAC.gsub("NS", ns))
    logs = File.join(Harness.run_dir, ns).tap { |d| FileUtils.mkdir_p(d) }
    pids = []
    pids << Harness.spawn_logged({"KUBECONFIG" => @kubeconfig},
      [File.join(Harness.bin_dir, "rebound-operator"), "--namespaces=#{ns}", "--leader-elect=false",
       "--metrics-addr=127.0.0.1:#{Harness.free_port}", "--log-format=json"], File.join(logs, "operator.log"))
    sidecar_kc = File.join(logs, "sidecar.kubeconfig")
    Harness.run!(File.join(REPO, "dev", "mint-user-kubeconfig.sh"), state, "system:serviceaccount:#{ns}:rebound-sidecar",
      "system:serviceaccounts", "system:serviceaccounts:#{ns}", sidecar_kc)
    kubectl("-n", ns, "apply", "-f", "-", input: policy(3))
    target = "127.0.0.1:#{Harness.free_port}"
    pids << Harness.spawn_logged({"KUBECONFIG" => sidecar_kc},
      [File.join(Harness.bin_dir, "rebound-sidecar"), "--configmap=#{ns}/rebound-policies", "--listen=#{target}",
       "--admin-listen=127.0.0.1:#{Harness.free_port}", "--log-format=json"], File.join(logs, "sidecar.log"))
    Harness.eventually("the sidecar serving the policy", 60) { max_attempts(target) == 3 }
    worker = SidekiqWorker.new(target, "#{ns}/worker", queues: %w[stackq]).start

    jid = push("Flaky", "stackq", 1000)
    msg = Harness.eventually("dead letter", 60) { dead_letters(jid).first }
    assert_equal [3, "GIVE_UP_REASON_MAX_ATTEMPTS"], msg.values_at("attempts", "reason")

    t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    kubectl("-n", ns, "apply", "-f", "-", input: policy(5))
    Harness.eventually("the changed policy served", 60) { max_attempts(target) == 5 }
    puts format("\npolicy change via kubectl served by the sidecar after %.2fs", Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0)
    jid2 = push("Flaky", "stackq", 1000)
    msg2 = Harness.eventually("dead letter", 60) { dead_letters(jid2).first }
    assert_equal 5, msg2["attempts"]
    assert_equal 5, runs(jid2).length
    retries = worker.events("rebound.retry").select { |e| [jid, jid2].include?(e["jid"]) }
    assert_equal 2 + 4, retries.length
    assert(retries.all? { |e| e["source"] == "sidecar" })
  ensure
    worker&.stop
    pids&.each do |pid|
      Process.kill("TERM", pid) rescue nil
      Harness.reap(pid)
    end
    system(@kubectl, "delete", "namespace", ns, "--wait=false", out: File::NULL, err: File::NULL, exception: false) if ns
  end
end
