# frozen_string_literal: true

# The conformance jobs (clients/conformance/scenarios.json), loaded by the sidekiq processes
# (test/app.rb) and by the test process (to enqueue them). Every run is recorded in Redis
# (REDIS_URL) under the job's token, with the job id the run saw.
require "json"
require "logger"
require "redis"
require "active_job"
require "rebound/sidekiq"

ActiveJob::Base.queue_adapter = :sidekiq
ActiveJob::Base.logger = Logger.new(nil)

module Conformance
  module_function

  # Runs are recorded in REBOUND_RECORD_URL (the tests' own Redis, which stays up when a
  # test restarts the broker), else REDIS_URL.
  def redis
    url = ENV["REBOUND_RECORD_URL"] || ENV.fetch("REDIS_URL")
    (@redis ||= {})[url] ||= Redis.new(url: url)
  end

  # opts: "fail" => number of failing runs or "always"; "error" => error class name;
  # "sleep" => seconds before the outcome ("sleep_first": on the first run only). Returns normally once the failing runs are over.
  def run(token, opts, job_id, queue)
    n = redis.incr("conf:count:#{token}")
    redis.rpush("conf:runs:#{token}", JSON.generate({"ms" => (Time.now.to_r * 1000).to_i, "pid" => Process.pid,
                                                     "jobId" => job_id, "queue" => queue, "run" => n}))
    # "kill": the run SIGKILLs its own process (an OOM kill) on its first N runs, or "always".
    Process.kill("KILL", Process.pid) if opts["kill"] && (opts["kill"] == "always" || n <= opts["kill"].to_i)
    sleep opts["sleep"].to_f if opts["sleep"]
    sleep opts["sleep_first"].to_f if opts["sleep_first"] && n == 1
    fail_runs = opts["fail"] == "always" ? Float::INFINITY : opts["fail"].to_i
    raise Object.const_get(opts.fetch("error", "TransientError")), "run #{n} of #{token} failed" if n <= fail_runs
    redis.set("conf:done:#{token}", job_id)
  end
end

class TransientError < StandardError; end
class PermanentError < StandardError; end

# include Rebound::Sidekiq::Job next to Sidekiq's own Sidekiq::Job (Sidekiq >= 6.3).
class ConformJob
  include Sidekiq::Job
  include Rebound::Sidekiq::Job

  def perform(token, opts = {})
    Conformance.run(token, opts, jid, queue_name)
  end

  def queue_name = Thread.current[:rebound_test_queue]
end

# The same jobs through ActiveJob (queue_adapter :sidekiq).
class ConformActiveJob < ActiveJob::Base
  include Rebound::Sidekiq::ActiveJob

  def perform(token, opts = {})
    Conformance.run(token, opts, job_id, queue_name)
  end
end

# Records the queue each run came from (Sidekiq gives a job instance no queue of its own).
class QueueRecorder
  include Sidekiq::ServerMiddleware if defined?(Sidekiq::ServerMiddleware)

  def call(_worker, _job, queue)
    Thread.current[:rebound_test_queue] = queue
    yield
  ensure
    Thread.current[:rebound_test_queue] = nil
  end
end
Sidekiq.configure_server { |c| c.server_middleware { |ch| ch.add(QueueRecorder) } }
