# frozen_string_literal: true

# Rebound::Advisor against a real sidecar: answers equal the port's, the deadline holds,
# bad input never raises, a forked child makes its own channel.
require_relative "test_helper"
require "rebound/advisor"

class ClientTest < Minitest::Test
  def advisor(**kw) = Rebound::Advisor.new(target: Harness.sidecar.target, **kw)

  def test_sidecar_answers_equal_the_port_for_the_fetched_policy
    rb = advisor(deadline_ms: 2000)
    assert rb.refresh("flaky")
    _, resolved, prepared = rb.cached_policy("flaky")
    (1..6).each do |attempt|
      jid = SecureRandom.hex(12)
      got = rb.decide("flaky", attempt, job_id: jid, error_class: "http.503")
      want = Rebound::Decide.decide_local(resolved, prepared.identity, attempt, {"jobId" => jid, "errorClass" => "http.503"})
      assert_equal "sidecar", got["source"]
      assert_equal want.slice("decision", "delayMs", "disposition", "deadLetterQueue", "reason"),
        got.slice("decision", "delayMs", "disposition", "deadLetterQueue", "reason")
    end
  end

  def test_a_retry_budget_stretch_is_reported_and_added_to_the_delay
    rb = advisor(deadline_ms: 2000)
    assert rb.refresh("budgeted")
    # One retry a second: three failures answered within a few ms share at most two slots.
    asked_last = nil
    answers = (0..2).map do |j|
      asked_last = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      rb.decide("budgeted", 1, job_id: "budget-#{j}")
    end
    answers.each do |a|
      assert_equal %w[sidecar DECISION_RETRY], a.values_at("source", "decision")
      assert_equal 100 + a["budgetDelayMs"], a["delayMs"]
      assert_equal a["budgetDelayMs"].positive?, a["budgetStretched"]
      assert_operator a["budgetDelayMs"], :<=, 2000
    end
    assert_operator answers.count { |a| a["budgetStretched"] }, :>=, 1
    # The same failure asked again: the same run time (its delay counted from now), no new slot.
    again = rb.decide("budgeted", 1, job_id: "budget-2")
    between_ms = (Process.clock_gettime(Process::CLOCK_MONOTONIC) - asked_last) * 1000
    assert_equal answers[2]["budgetStretched"], again["budgetStretched"]
    assert_operator answers[2]["delayMs"] - again["delayMs"], :>=, 0
    assert_operator answers[2]["delayMs"] - again["delayMs"], :<=, between_ms + 1
  end

  def test_frozen_sidecar_answered_by_the_fallback_within_the_deadline
    sidecar = Sidecar.new(Harness.policies_file, "sidecar-frozen").start
    rb = Rebound::Advisor.new(target: sidecar.target, deadline_ms: 200)
    assert rb.refresh("flaky")
    Process.kill("STOP", sidecar.instance_variable_get(:@pid))
    got = rb.decide("flaky", 2, job_id: "frozen-1")
    assert_equal %w[fallback cached], got.values_at("source", "policySource")
    assert_equal 1, rb.metrics["fallback"]["deadline_exceeded"]
  ensure
    Process.kill("CONT", sidecar.instance_variable_get(:@pid)) rescue nil
    sidecar&.kill
  end

  def test_unknown_queue_and_bad_input_never_raise
    rb = advisor
    got = rb.decide("no-such-queue", 1, job_id: "x")
    assert_equal ["fallback", "default", "DECISION_RETRY"], got.values_at("source", "policySource", "decision")
    assert_equal 1, rb.metrics["fallback"]["not_found"]
    weird = [[0, "a" * 600, "\xff\xfe".b, 5, -3], [nil, nil, 42, "soon", Float::NAN], ["7", "", "", 10**30, 10**30]]
    weird.each do |attempt, jid, err, first, ra|
      a = rb.decide("flaky", attempt, job_id: jid, error_class: err, first_failure_unix_ms: first, retry_after_ms: ra)
      assert_includes %w[DECISION_RETRY DECISION_GIVE_UP], a["decision"]
      assert_equal "sidecar", a["source"], a # normalised into what the proto accepts
    end
    assert_raises(Rebound::ConfigurationError) { Rebound.new(target: "not a target") }
  end

  # What one process fetched, another (started while the sidecar is down) decides from;
  # a queue the sidecar has no policy for is forgotten from the store.
  class HashStore < Hash
    def read(q) = self[q] && JSON.parse(self[q])
    def write(q, e) = self[q] = JSON.generate(e)
    def delete(q) = super(q)
  end

  def test_a_shared_store_gives_a_later_process_the_real_policy
    store = HashStore.new
    rb = advisor(deadline_ms: 2000, store: store)
    assert rb.prefetch(%w[flaky no-such-queue]) == {"flaky" => :ok, "no-such-queue" => :not_found}
    assert store.key?("flaky")
    later = Rebound.new(target: "127.0.0.1:#{Harness.free_port}", deadline_ms: 200, store: store)
    later.prefetch(%w[flaky])
    a = later.decide("flaky", 2, job_id: "shared-1", error_class: "http.503")
    assert_equal %w[fallback cached], a.values_at("source", "policySource")
    _, resolved, prepared = rb.cached_policy("flaky")
    assert_equal Rebound::Decide.decide_local(resolved, prepared.identity, 2, {"jobId" => "shared-1", "errorClass" => "http.503"})["delayMs"], a["delayMs"]
    store["no-such-queue"] = store["flaky"] # a policy deleted since
    assert_equal :not_found, rb.fetch_policy("no-such-queue")
    refute store.key?("no-such-queue")
  end

  # Ruby gRPC 1.51 (Debian 12) refuses every call in a process forked after the parent made
  # a channel ("grpc cannot be used before and after forking"): the child answers from the
  # fallback (the policy cached before the fork). A child forked before the parent's first
  # call makes its own channel.
  FORKING = <<~RUBY
    require "rebound/advisor"
    rb = Rebound::Advisor.new(target: ARGV[0], deadline_ms: 2000)
    first = fork { print rb.decide("flaky", 1, job_id: "child")["source"], " "; $stdout.flush; exit!(0) }
    Process.wait(first)
    print rb.decide("flaky", 1, job_id: "parent")["source"], " "
    $stdout.flush
    rb.refresh("flaky") # the policy the child's fallback answers from
    second = fork { print rb.decide("flaky", 1, job_id: "child2")["source"]; $stdout.flush; exit!(0) }
    Process.wait(second)
  RUBY

  def test_fork_a_child_before_the_first_call_uses_the_sidecar_after_it_the_fallback
    out, err, st = Open3.capture3({"RUBYLIB" => LIB}, "ruby", "-e", FORKING, Harness.sidecar.target)
    assert st.success?, err
    assert_equal %w[sidecar sidecar fallback], out.split
    fallback = Harness.events_in(err, "rebound.fallback")
    assert_equal [["other", "fallback"]], fallback.map { |e| e.values_at("cause", "source") }
  end
end
