# frozen_string_literal: true

# End to end on a real `sidekiq` process, Redis and a real rebound-sidecar.
require_relative "test_helper"
require "rebound/sidekiq"

module JobAsserts
  def r = Harness.sidekiq_client

  def push(klass, queue, *args)
    Sidekiq::Client.push("class" => klass, "queue" => queue, "args" => args)
  end

  def runs(jid) = r.lrange("runs:#{jid}", 0, -1).map { |x| JSON.parse(x) }
  def dead_letters(jid) = r.lrange("dead:#{jid}", 0, -1).map { |x| JSON.parse(x) }
  def dead_set_entry(jid) = Sidekiq::DeadSet.new.find_job(jid)

  def policy_of(target, queue)
    rb = Rebound::Advisor.new(target: target, deadline_ms: 2000)
    assert rb.refresh(queue)
    _, resolved, prepared = rb.cached_policy(queue)
    rb.client.close
    [resolved, prepared.identity]
  end
end

class WorkerTest < Minitest::Test
  include JobAsserts

  def setup
    @worker = Shared.worker
  end

  def test_transient_failure_retried_within_bounds_then_completes
    jid = push("Flaky", "flaky", 3)
    Harness.eventually("completion", 60) { r.get("done:#{jid}") }
    seen = runs(jid)
    assert_equal 4, seen.length
    resolved, identity = policy_of(Harness.sidecar.target, "flaky")
    (1..3).each do |attempt|
      want = Rebound::Decide.decide_local(resolved, identity, attempt, {"jobId" => jid, "errorClass" => "http.503"})
      assert_equal "DECISION_RETRY", want["decision"]
      gap = seen[attempt]["ms"] - seen[attempt - 1]["ms"]
      # No Sidekiq jitter on top: the retry is due at exactly the answered delay; the
      # poller (every 0.1-0.3 s here; up to 5 s after start) and the run add the rest.
      assert_operator gap, :>=, want["delayMs"], "attempt #{attempt}"
      assert_operator gap, :<=, want["delayMs"] + 10_000, "attempt #{attempt}"
    end
    retries = @worker.events("rebound.retry").select { |e| e["jid"] == jid }
    assert_equal [[1, "sidecar", "sidecar"], [2, "sidecar", "sidecar"], [3, "sidecar", "sidecar"]], retries.map { |e| e.values_at("attempt", "source", "policy_source") }
    want = (1..3).map { |a| Rebound::Decide.decide_local(resolved, identity, a, {"jobId" => jid, "errorClass" => "http.503"})["delayMs"] }
    assert_equal want, retries.map { |e| e["delay_ms"] }
    assert_nil dead_set_entry(jid)
  end

  def test_always_failing_reaches_max_attempts_then_dead_set_and_dead_letter
    jid = push("Flaky", "doomed", 1000, "http.500")
    letters = Harness.eventually("dead letter", 60) { dead_letters(jid).then { |l| l.empty? ? nil : l } }
    assert_equal 4, runs(jid).length # maxAttempts runs, the first included
    assert_equal 1, letters.length
    msg = letters.first
    assert_equal [jid, jid, "Flaky", [1000, "http.500"]], msg.values_at("key", "jid", "job_class", "args")
    assert_equal ["GIVE_UP_REASON_MAX_ATTEMPTS", 4, "http.500", "doomed"], msg.values_at("reason", "attempts", "error_class", "queue")
    entry = Harness.eventually("the dead set entry", 10) { dead_set_entry(jid) }
    assert_equal [3, "CodedError", "doomed"], [entry["retry_count"], entry["error_class"], entry["queue"]]
    assert_equal 0, Sidekiq::RetrySet.new.count { |j| j.jid == jid }
    first = entry["failed_at"] * 1000
    assert_in_delta runs(jid).first["ms"], first, 1000
    assert_equal first.to_i, msg["first_failure_unix_ms"]
    # As when Sidekiq's own retries run out: the class's block, then the death handlers.
    assert_equal ["CodedError", "CodedError"], [r.get("exhausted:#{jid}"), r.get("death:#{jid}")]
  end

  def test_non_retryable_dead_letters_at_the_first_failure
    jid = push("Flaky", "doomed", 1000, "CardDeclined")
    msg = Harness.eventually("dead letter", 30) { dead_letters(jid).first }
    assert_equal ["GIVE_UP_REASON_NON_RETRYABLE", 1], msg.values_at("reason", "attempts")
    assert_equal 1, runs(jid).length
    assert Harness.eventually("the dead set entry", 10) { dead_set_entry(jid) }
  end

  # Drop leaves the job in Sidekiq's dead set, as when Sidekiq's own retries run out (the
  # class's block and the death handlers run), with no dead letter.
  def test_drop_keeps_the_job_in_the_dead_set_without_dead_letter
    jid = push("Flaky", "dropme", 1000)
    e = Harness.eventually("drop", 30) { @worker.events("rebound.dropped").find { |x| x["jid"] == jid } }
    assert_equal ["GIVE_UP_REASON_MAX_ATTEMPTS", 3, true], e.values_at("reason", "attempt", "dead_set")
    assert_equal 3, runs(jid).length
    entry = Harness.eventually("the dead set entry", 10) { dead_set_entry(jid) }
    assert_equal [2, "CodedError", "dropme"], [entry["retry_count"], entry["error_class"], entry["queue"]]
    assert_equal [], dead_letters(jid)
    assert_equal 0, Sidekiq::RetrySet.new.count { |j| j.jid == jid }
    assert_equal ["CodedError", "CodedError"], [r.get("exhausted:#{jid}"), r.get("death:#{jid}")]
    jid2 = push("Flaky", "payments", 1000, "CardDeclined")
    Harness.eventually("drop", 30) { @worker.events("rebound.dropped").find { |x| x["jid"] == jid2 } }
    assert_equal 1, runs(jid2).length
    assert Harness.eventually("the dead set entry", 10) { dead_set_entry(jid2) }
  end

  def test_first_failure_time_kept_across_retries_gives_up_at_the_deadline
    jid = push("Flaky", "deadline", 1000)
    msg = Harness.eventually("dead letter", 60) { dead_letters(jid).first }
    seen = runs(jid)
    assert_equal "GIVE_UP_REASON_DEADLINE", msg["reason"]
    assert_equal seen.length, msg["attempts"]
    assert_includes 2..9, msg["attempts"] # maxAttempts (100) never reached
    assert_operator seen[0]["ms"], :<=, msg["first_failure_unix_ms"]
    assert_operator msg["first_failure_unix_ms"], :<=, seen[1]["ms"]
  end
end
