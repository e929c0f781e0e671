# frozen_string_literal: true

# The default policy (what an empty RetryPolicy spec resolves to) is the one of
# clients/conformance/default-policy.json, and it never discards work: its terminal drop
# leaves the job in Sidekiq's dead set (test/conformance_test.rb, default-policy-keeps-job).
# A malformed target is refused when the worker is configured, naming REBOUND_TARGET.
require_relative "test_helper"
require "rebound/advisor"

class DefaultPolicyTest < Minitest::Test
  FILE = File.join(REPO, "clients", "conformance", "default-policy.json")

  def test_embedded_default_is_the_briefs
    p = Rebound::Advisor::DEFAULT_POLICY
    assert_equal ["STRATEGY_EXPONENTIAL", 1000, 2.0, 600_000, "JITTER_FULL", 10, "DISPOSITION_DROP"],
      p.values_at("strategy", "baseMs", "multiplier", "capMs", "jitter", "maxAttempts", "terminal")
    assert_equal "rebound/default", Rebound::Advisor::DEFAULT_IDENTITY
  end

  # The GetPolicy JSON form: {"policy": {namespace, name, ...}, "resolved": {...}} (the
  # resolved fields at the top level are read too).
  def test_embedded_default_equals_the_conformance_file
    skip "#{FILE} not there yet" unless File.exist?(FILE)
    doc = JSON.parse(File.read(FILE))
    resolved = doc["resolved"] || doc
    Rebound::Advisor::DEFAULT_POLICY.each do |k, v|
      assert resolved.key?(k), "#{FILE} has no #{k}"
      want = resolved[k]
      v.is_a?(Numeric) ? assert_equal(want.to_f, v.to_f, k) : assert_equal(want, v, k)
    end
    identity = doc["identity"] || (doc["policy"] && "#{doc["policy"]["namespace"]}/#{doc["policy"]["name"]}")
    assert_equal Rebound::Advisor::DEFAULT_IDENTITY, identity if identity
  end

  def test_a_malformed_target_is_refused_naming_rebound_target
    ["http://127.0.0.1:1", "127.0.0.1", ":7411", "127.0.0.1:0", "127.0.0.1:70000", "unix:relative.sock", ""].each do |t|
      old = ENV["REBOUND_TARGET"]
      ENV["REBOUND_TARGET"] = t
      e = assert_raises(Rebound::ConfigurationError, t) { Rebound.new }
      assert e.message.start_with?("REBOUND_TARGET="), e.message
      # Made lazily (not strict), it answers from the fallback instead of raising.
      rb = Rebound::Advisor.new(strict: false)
      a = rb.decide("q", 1, job_id: "j")
      assert_equal %w[fallback default DECISION_RETRY], a.values_at("source", "policySource", "decision")
      assert_equal 1, rb.metrics["fallback"]["bad_target"]
    ensure
      ENV["REBOUND_TARGET"] = old
    end
    assert Rebound.new(target: "unix:///run/rebound/rebound.sock")
    assert Rebound.new(target: "[::1]:7411")
  end

  def test_attempt_ten_of_the_default_gives_up_with_drop
    a = Rebound::Advisor.new(target: "127.0.0.1:1", deadline_ms: 100).decide("nowhere", 10, job_id: "j")
    assert_equal %w[DECISION_GIVE_UP DISPOSITION_DROP fallback default],
      a.values_at("decision", "disposition", "source", "policySource")
  end
end
