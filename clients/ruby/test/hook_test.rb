# frozen_string_literal: true

# Without the middleware, Sidekiq's own retrier calls sidekiq_retry_in: the answer in whole
# seconds, rounded up, plus Sidekiq 6.4's rand(10) * (count + 1) seconds on top.
require_relative "worker_test"

class HookTest < Minitest::Test
  include JobAsserts

  def test_sidekiq_retry_in_alone_answers_whole_seconds_and_sidekiq_adds_its_jitter
    worker = SidekiqWorker.new(Harness.sidecar.target, "worker-hook", queues: %w[hookq], env: {"REBOUND_NO_MIDDLEWARE" => "1"}).start
    jid = push("HookFlaky", "hookq", 1)
    Harness.eventually("completion", 60) { r.get("done:#{jid}") }
    (e,) = worker.events("rebound.retry").select { |x| x["jid"] == jid }
    assert_equal ["sidekiq_retry_in", 1, "sidecar"], e.values_at("via", "attempt", "source")
    resolved, identity = policy_of(Harness.sidecar.target, "hookq")
    want = Rebound::Decide.decide_local(resolved, identity, 1, {"jobId" => jid, "errorClass" => "http.503"})
    assert_equal want["delayMs"], e["delay_ms"]
    seconds = [(want["delayMs"] + 999) / 1000, 1].max
    first, second = runs(jid)
    gap = second["ms"] - first["ms"]
    assert_operator gap, :>=, seconds * 1000
    assert_operator gap, :<=, (seconds + 9 * 1) * 1000 + 10_000 # + rand(10) * (count + 1), count = 0; + poll
  ensure
    worker&.stop
  end
end
