# frozen_string_literal: true

# rebound_adapter_* from a real sidekiq process (prometheus-client-mmap, Debian's
# ruby-prometheus-client-mmap): answers of the sidecar, then with the sidecar killed
# fallbacks (unavailable, the cached policy), and a dead letter; read back through the
# library's own exposition of the process's files.
require_relative "worker_test"
require "prometheus/client"
require "prometheus/client/formats/text"

class MetricsTest < Minitest::Test
  include JobAsserts

  # Queues of this test alone (other tests' workers run at once on the same Redis).
  POLICY = <<~YAML
    apiVersion: rebound.dev/v1alpha1
    kind: RetryPolicy
    metadata: {name: metrics}
    spec:
      queues: ["metricsq"]
      backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
      maxAttempts: 4
      nonRetryableErrors: ["CardDeclined"]
      terminal: {action: deadLetter, deadLetterQueue: metrics-dead}
  YAML

  # The text exposition parsed: {[name, {label => value}] => value}.
  def scrape(dir)
    Prometheus::Client::Formats::Text.marshal_multiprocess(dir).lines.each_with_object({}) do |line, out|
      next if line.start_with?("#") || line.strip.empty?
      m = /\A([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)\s*\z/.match(line) or flunk("exposition line #{line.inspect}")
      labels = (m[2] || "").scan(/(\w+)="((?:[^"\\]|\\.)*)"/).to_h
      out[[m[1], labels]] = Float(m[3])
    end
  end

  def value(samples, name, **labels)
    samples.fetch([name, {"adapter" => "sidekiq"}.merge(labels.transform_keys(&:to_s))]) { flunk("no #{name} #{labels}: #{samples.keys}") }
  end

  def test_counts_sidecar_answers_fallbacks_and_dead_letters
    dir = File.join(Harness.run_dir, "prom-#{SecureRandom.hex(3)}")
    FileUtils.mkdir_p(dir)
    File.write(File.join(dir, "..", "metrics-policy.yaml"), POLICY)
    sidecar = Sidecar.new(File.join(dir, "..", "metrics-policy.yaml"), "sidecar-metrics", probe_queue: "metricsq").start
    worker = SidekiqWorker.new(sidecar.target, "worker-metrics", queues: %w[metricsq], dead_letters: %w[metrics-dead],
      env: {"prometheus_multiproc_dir" => dir}).start
    Harness.eventually("policy fetched by the worker", 30) { worker.events("rebound.policy_fetched").any? { |e| e["queue"] == "metricsq" } }
    jids = Array.new(3) { push("Flaky", "metricsq", 1) }
    doomed = push("Flaky", "metricsq", 1, "CardDeclined") # non-retryable: dead-lettered at once
    Harness.eventually("the jobs done", 60) { jids.all? { |j| r.get("done:#{j}") } }
    Harness.eventually("the dead letter", 60) { !dead_letters(doomed).empty? }
    Harness.eventually("the dead letter counted", 10) { value(scrape(dir), "rebound_adapter_terminal_total", disposition: "dead_letter") == 1 }
    s = scrape(dir)
    assert_equal 4, value(s, "rebound_adapter_decisions_total", source: "sidecar")
    assert_equal 0, value(s, "rebound_adapter_decisions_total", source: "fallback")
    assert_equal 0, value(s, "rebound_adapter_terminal_total", disposition: "drop")
    assert_equal 13, s.keys.count { |name, labels| name.start_with?("rebound_adapter_") && labels["adapter"] == "sidekiq" }

    sidecar.kill
    more = Array.new(3) { push("Flaky", "metricsq", 1) }
    Harness.eventually("the jobs done without the sidecar", 60) { more.all? { |j| r.get("done:#{j}") } }
    s = scrape(dir)
    assert_equal 4, value(s, "rebound_adapter_decisions_total", source: "sidecar")
    assert_equal 3, value(s, "rebound_adapter_decisions_total", source: "fallback")
    assert_equal 3, value(s, "rebound_adapter_fallbacks_total", reason: "unavailable", policy_source: "cached")
    assert_equal 0, value(s, "rebound_adapter_fallbacks_total", reason: "unavailable", policy_source: "default")
    assert_equal 0, value(s, "rebound_adapter_hook_errors_total")
  ensure
    worker&.stop
    sidecar&.kill
    FileUtils.rm_rf(dir) if dir
  end

  def test_a_registry_that_is_not_one_is_refused_naming_it
    err = assert_raises(ArgumentError) { Rebound::Metrics::Sink.new(Object.new) }
    assert_match(/\Aregistry: /, err.message)
  end
end
