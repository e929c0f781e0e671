# frozen_string_literal: true

# A policy in rollout, sidecar killed: the fallback gives every job the revision, and the
# answer, the sidecar gave it, also in a process that has only the store's copy.
require_relative "test_helper"
require "rebound/advisor"

class RolloutTest < Minitest::Test
  # Before the first step, in the 20 % step, in the 50 % step, unknown (placed by now).
  FIRSTS = [1_690_000_000_000, 1_720_000_000_000, 1_760_000_000_000, nil].freeze

  class HashStore < Hash
    def read(q) = self[q] && JSON.parse(self[q])
    def write(q, e) = self[q] = JSON.generate(e)
    def delete(q) = super(q)
  end

  def rollout_failures
    (0...200).map { |i| [1 + i % 3, {job_id: "job-#{i}", first_failure_unix_ms: FIRSTS[i % 4]}] }
  end

  def verdict(a) = a.values_at("decision", "delayMs", "disposition", "deadLetterQueue", "reason")

  def differences(rb, want)
    answers = revisions = 0
    rollout_failures.zip(want).each do |(attempt, f), (v, r)|
      a = rb.decide("payments", attempt, **f)
      assert_equal %w[fallback cached], a.values_at("source", "policySource")
      answers += 1 if verdict(a) != v
      revisions += 1 if a["revision"] != r
    end
    [answers, revisions]
  end

  def test_sidecar_killed_fallback_follows_the_rollout
    # Stable: 25 attempts from 1 s, then a dead letter; canary: 2 attempts from 300 ms, then
    # a drop; steps of 20 % (from 2023-11-14) and 50 % (from 2025-06-15).
    dir = File.join(Harness.run_dir, "rollout-policies")
    FileUtils.mkdir_p(dir)
    FileUtils.cp(File.join(REPO, "clients", "conformance", "rollout-policies.json"), File.join(dir, "policies.json"))
    sidecar = Sidecar.new(nil, "sidecar-rollout", probe_queue: "payments", namespace: "shop", policies_dir: dir).start
    store = HashStore.new
    rb = Rebound::Advisor.new(target: sidecar.target, deadline_ms: 2000, store: store)
    assert rb.refresh("payments")
    want = rollout_failures.map do |attempt, f|
      a = rb.decide("payments", attempt, **f)
      assert_equal "sidecar", a["source"]
      [verdict(a), a["revision"]]
    end
    revisions = want.map(&:last).uniq
    assert_equal 2, revisions.size, revisions.inspect
    refute_includes revisions, ""
    sidecar.kill
    assert_equal [0, 0], differences(rb, want), "of 200 jobs, [answers, revisions] that differ (this process)"
    # A process started during the outage: only the store's copy, which carries the rollout.
    later = Rebound::Advisor.new(target: sidecar.target, deadline_ms: 200, store: store)
    later.prefetch(%w[payments])
    assert_equal [0, 0], differences(later, want), "of 200 jobs, [answers, revisions] that differ (from the store)"
  ensure
    sidecar&.kill
    rb&.client&.close
    later&.client&.close
    FileUtils.rm_rf(dir) if dir
  end
end
