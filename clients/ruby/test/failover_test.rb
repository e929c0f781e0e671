# frozen_string_literal: true

# Sidecar killed → the fallback answers like the sidecar; worker killed → what Sidekiq 6.4's
# basic fetch keeps and what it loses.
require_relative "worker_test"

class FailoverTest < Minitest::Test
  include JobAsserts

  def test_sidecar_killed_fallback_gives_the_same_answers
    sidecar = Sidecar.new(Harness.policies_file, "sidecar-failover").start
    worker = SidekiqWorker.new(sidecar.target, "worker-failover", queues: %w[failover], concurrency: 1).start
    resolved, identity = policy_of(sidecar.target, "failover")
    # The worker fetched the policy at start; the first failure is answered by the sidecar.
    Harness.eventually("policy fetched by the worker", 30) { worker.events("rebound.policy_fetched").any? { |e| e["queue"] == "failover" } }
    jid = push("Flaky", "failover", 4)
    Harness.eventually("the first answer", 30) { worker.events("rebound.retry").any? { |e| e["jid"] == jid } }
    sidecar.kill
    Harness.eventually("completion with the sidecar down", 60) { r.get("done:#{jid}") }
    events = worker.events("rebound.retry").select { |e| e["jid"] == jid }
    assert_equal [1, 2, 3, 4], events.map { |e| e["attempt"] }
    assert_equal "sidecar", events.first["source"]
    events.each do |e|
      want = Rebound::Decide.decide_local(resolved, identity, e["attempt"], {"jobId" => jid, "errorClass" => "http.503"})
      assert_equal want["delayMs"], e["delay_ms"], e
    end
    later = events.drop(1).map { |e| e.values_at("source", "policy_source") }
    assert_includes later, %w[fallback cached]
    refute(later.any? { |_, ps| ps == "default" })
    fallbacks = worker.events("rebound.fallback").select { |e| [2, 3, 4].include?(e["attempt"]) }
    refute_empty fallbacks
    assert(fallbacks.all? { |e| e["cause"] == "unavailable" })

    # Back: answers come from the sidecar again.
    sidecar.start
    Harness.eventually("a sidecar answer after the restart", 60) do
      k = push("Flaky", "failover", 1)
      Harness.eventually("completion", 30) { r.get("done:#{k}") }
      worker.events("rebound.retry").any? { |e| e["jid"] == k && e["source"] == "sidecar" }
    end
  ensure
    worker&.stop
    sidecar&.kill
  end

  # Sidekiq 6.4's basic fetch takes a job off its queue with BRPOP: a job running when its
  # process is SIGKILLed is gone (Sidekiq Pro's super_fetch would recover it). What is in
  # Redis survives: retries waiting in the retry set run on the next process; a SIGTERM
  # (-t seconds to finish) pushes unfinished jobs back onto their queue.
  def test_worker_killed_retry_set_survives_sigterm_requeues_sigkill_loses_the_running_job
    target = Harness.sidecar.target
    worker = SidekiqWorker.new(target, "worker-crash", queues: %w[crash]).start
    between = push("Flaky", "crash", 1) # fails once, then waits 3 s in the retry set
    killed = push("Slow", "crash", 120)
    Harness.eventually("first failure", 30) { worker.events("rebound.retry").any? { |e| e["jid"] == between } }
    Harness.eventually("slow job running", 30) { r.get("started:#{killed}") }
    worker.kill # SIGKILL to the process group
    assert(Sidekiq::RetrySet.new.any? { |j| j.jid == between })
    nowhere = [Sidekiq::Queue.new("crash"), Sidekiq::RetrySet.new, Sidekiq::ScheduledSet.new, Sidekiq::DeadSet.new]
    assert(nowhere.none? { |set| set.any? { |j| j.jid == killed } }, "basic fetch: the killed job is in no queue or set")

    again = SidekiqWorker.new(target, "worker-crash-2", queues: %w[crash]).start
    Harness.eventually("the waiting retry completed", 60) { r.get("done:#{between}") }
    assert_equal 2, runs(between).length
    assert_nil r.get("done:#{killed}")
    assert_equal 1, runs(killed).length

    graceful = push("Slow", "crash", 120)
    Harness.eventually("slow job running", 30) { r.get("started:#{graceful}") }
    again.stop # SIGTERM: after -t 3 s the running job is pushed back onto its queue
    assert(Sidekiq::Queue.new("crash").any? { |j| j.jid == graceful }, "SIGTERM requeues the running job")
    third = SidekiqWorker.new(target, "worker-crash-3", queues: %w[crash]).start
    Harness.eventually("the requeued job completed", 60) { r.get("done:#{graceful}") }
    assert_equal 2, runs(graceful).length
    third.stop
  ensure
    [worker, again, third].compact.each(&:stop)
  end
end
