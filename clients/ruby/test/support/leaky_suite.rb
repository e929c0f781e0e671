# frozen_string_literal: true

# A suite that starts Redis, a sidecar and a sidekiq process through the harness, writes
# its run dir to LEAKY_READY, then, once LEAKY_READY.go exists, fails (or, with LEAKY_HANG=1, waits to be SIGKILLed).
# Run by test/cleanup_test.rb, which checks that nothing it started is left.
require_relative "../test_helper"

class LeakyTest < Minitest::Test
  def test_starts_processes_then_fails
    sidecar = Harness.sidecar
    SidekiqWorker.new(sidecar.target, "leaky-worker", queues: %w[leaky]).start
    File.write(ENV.fetch("LEAKY_READY"), Harness.run_dir)
    sleep 600 if ENV["LEAKY_HANG"] == "1"
    sleep 0.1 until File.exist?("#{ENV.fetch("LEAKY_READY")}.go") # the parent has seen them
    flunk "fails on purpose, with its processes running"
  end
end
