# frozen_string_literal: true

# The README's quick start, as pasted: its worker.rb (with the "Metrics" section's lines
# added), its sidekiq command and its producer, against Redis and a real sidecar serving a
# fast policy for the queue `webhooks`; the served rebound_adapter_* counters scraped.
require_relative "test_helper"
require "net/http"

class ReadmeTest < Minitest::Test
  FAST = <<~YAML
    apiVersion: rebound.dev/v1alpha1
    kind: RetryPolicy
    metadata: {name: webhooks}
    spec:
      queues: ["webhooks"]
      backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
      maxAttempts: 40
      terminal: {action: deadLetter, deadLetterQueue: webhooks-dead}
  YAML

  def test_quick_start_as_pasted
    text = File.read(File.join(HERE, "..", "README.md"))
    blocks = text.scan(/```ruby\n(.*?)```/m).map(&:first)
    code = blocks[0]
    metrics = blocks.select { |b| b.start_with?("# worker.rb, continued") }
    assert_equal 1, metrics.length
    commands = text[/```sh\n(sidekiq -r.*?)```/m, 1].strip.split("\n")
    assert_equal "sidekiq -r ./worker.rb -q webhooks -q webhooks-dead &", commands[0]
    assert_equal "ruby worker.rb", commands[1]
    assert_includes text, "export RUBYLIB=/path/to/rebound/clients/ruby/lib"
    qs = File.join(Harness.run_dir, "quickstart").tap { |d| FileUtils.mkdir_p(d) }
    File.write(File.join(qs, "worker.rb"), "#{code}\n#{metrics[0]}")
    FileUtils.mkdir_p(File.join(qs, "prom"))
    File.write(File.join(qs, "policy.yaml"), FAST)
    sidecar = Sidecar.new(File.join(qs, "policy.yaml"), "quickstart/sidecar", probe_queue: "webhooks").start
    db = "#{Harness.redis_url.chomp("/")}/5" # a database of its own
    env = {"REDIS_URL" => db, "REBOUND_TARGET" => sidecar.target, "RUBYLIB" => LIB}
    port = Harness.free_port
    log = File.join(qs, "worker.log")
    pid = Harness.spawn_logged(env.merge("METRICS_PORT" => port.to_s, "prometheus_multiproc_dir" => File.join(qs, "prom")),
      commands[0].delete_suffix(" &").split, log, chdir: qs)
    out, st = Open3.capture2e(env, *commands[1].split, chdir: qs)
    assert st.success?, out
    require "redis"
    r = Redis.new(url: db)
    # Every job ran to its end: 5 deliveries, nothing queued or waiting to retry.
    Harness.eventually("the quick start's jobs done", 90) do
      r.llen("queue:webhooks").zero? && r.zcard("retry").zero? &&
        r.get("stat:processed").to_i - r.get("stat:failed").to_i == 5
    end
    events = Harness.events(log)
    retries = events.select { |e| e["event"] == "rebound.retry" }
    # (each run fails with probability 0.6: no retry at all happens 1% of the time)
    assert(retries.all? { |e| e["source"] == "sidecar" && e["queue"] == "webhooks" })
    assert_equal [], events.select { |e| %w[rebound.fallback rebound.dead_lettered].include?(e["event"]) }

    # Metrics: every answer the worker used, scraped from its /metrics.
    scrape = lambda do
      Net::HTTP.get(URI("http://127.0.0.1:#{port}/metrics")).lines.each_with_object({}) do |line, acc|
        m = /\A(\w+)\{(.*)\} (\S+)\s*\z/.match(line) or next
        acc[[m[1], m[2].scan(/(\w+)="([^"]*)"/).to_h]] = Float(m[3])
      end
    end
    answers = ["rebound_adapter_decisions_total", {"adapter" => "sidekiq", "source" => "sidecar"}]
    Harness.eventually("#{retries.length} sidecar answers scraped", 30) { (scrape.call[answers] rescue nil) == retries.length }
    s = scrape.call
    assert_equal 0, s[["rebound_adapter_decisions_total", {"adapter" => "sidekiq", "source" => "fallback"}]]
    assert_equal 0, s[["rebound_adapter_hook_errors_total", {"adapter" => "sidekiq"}]]
  ensure
    if pid
      Process.kill("TERM", -pid) rescue nil
      Harness.reap(pid, 30)
    end
    sidecar&.kill
  end
end
