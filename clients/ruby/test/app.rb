# frozen_string_literal: true

# The Sidekiq app the tests run in real `sidekiq` processes (REDIS_URL, REBOUND_TARGET from
# the environment). Every run is recorded in Redis under the job's jid.
require "json"
require "redis"
require "rebound/sidekiq"
# A process that lacks the conformance job classes (recovered-without-job-class).
require_relative "jobs" unless ENV["REBOUND_TEST_NO_JOBS"] == "1"

# Scheduled and retry sets are polled every 0.1-0.3 s (Sidekiq's default: 5 s per process).
Sidekiq.options[:poll_interval_average] = 0.2
Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
R = Redis.new(url: ENV.fetch("REDIS_URL"))
Sidekiq.death_handlers << ->(job, ex) { R.set("death:#{job["jid"]}", ex.class.name) }
Rebound::Sidekiq.on_dead_letter { |m| R.rpush("dead:#{m["key"]}", JSON.generate(m)) }
# The adapter's Prometheus counters (metrics_test.rb): prometheus-client-mmap keeps them in
# files under prometheus_multiproc_dir, which the test reads back.
Rebound::Metrics.enable if ENV["prometheus_multiproc_dir"]

class CodedError < StandardError
  attr_reader :code

  def initialize(code)
    super("failed with #{code}")
    @code = code
  end
end

module Recording
  def record
    R.rpush("runs:#{jid}", JSON.generate({"ms" => (Time.now.to_r * 1000).to_i, "pid" => Process.pid}))
  end
end

# Fails its first `fail_times` runs with error class `code`, then succeeds.
class Flaky
  include Rebound::Sidekiq::Worker
  include Recording
  sidekiq_retries_exhausted { |msg, ex| R.set("exhausted:#{msg["jid"]}", ex.class.name) }

  def perform(fail_times, code = "http.503")
    record
    raise CodedError, code if R.incr("count:#{jid}") <= fail_times
    R.set("done:#{jid}", "1")
  end
end

# Sleeps on its first run (to be killed mid-job), succeeds afterwards.
class Slow
  include Rebound::Sidekiq::Worker
  include Recording

  def perform(seconds)
    record
    sleep seconds if R.set("started:#{jid}", "1", nx: true)
    R.set("done:#{jid}", "1")
  end
end

# After the worker classes (including Rebound::Sidekiq::Worker installs the middleware).
if ENV["REBOUND_NO_MIDDLEWARE"] == "1" # the sidekiq_retry_in path alone
  Sidekiq.configure_server { |c| c.server_middleware { |ch| ch.remove(Rebound::Sidekiq::ServerMiddleware) } }
end

# For the sidekiq_retry_in path on 6.4, which knows a job's queue only from its class.
class HookFlaky < Flaky
  sidekiq_options queue: "hookq"
end

# Faults inside the adapter (adapter-error-never-hands-to-library): the question itself raises.
if ENV["REBOUND_TEST_FAULT"] == "ask"
  Rebound::Sidekiq.singleton_class.prepend(Module.new do
    def ask(*)
      raise NoMethodError, "injected fault in Rebound::Sidekiq.ask"
    end
  end)
end

# Reliable fetch (worker-sigkill): a job running in a SIGKILLed process runs again.
Rebound::Sidekiq.reliable_fetch! if ENV["REBOUND_TEST_RELIABLE_FETCH"] == "1"

# Fault injection (test/fault_test.rb): a longer sidecar deadline, so that a kill lands
# while the hook waits for a hung sidecar; a kill right after the give-up was written.
Rebound::Sidekiq.configure(deadline_ms: Integer(ENV["REBOUND_TEST_DEADLINE_MS"])) if ENV["REBOUND_TEST_DEADLINE_MS"]
Sidekiq.death_handlers << ->(_job, _ex) { Process.kill("KILL", Process.pid) } if ENV["REBOUND_TEST_KILL_AFTER_GIVE_UP"] == "1"
