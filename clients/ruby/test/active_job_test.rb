# frozen_string_literal: true

# In-process checks of the ActiveJob and Sidekiq::Job entry points (their end-to-end runs
# on real sidekiq processes are in conformance_test.rb, `__active_job` and `__sidekiq_job`).
require_relative "test_helper"
require "logger"
require "active_job"
require "rebound/sidekiq"

class ActiveJobTest < Minitest::Test
  def test_retry_on_is_refused_on_a_rebound_active_job
    klass = Class.new(ActiveJob::Base) do
      def self.name = "RetryingJob"
      include Rebound::Sidekiq::ActiveJob
    end
    e = assert_raises(ArgumentError) { klass.retry_on(StandardError, wait: 5) }
    assert_includes e.message, "RetryingJob"
  end

  def test_the_wrapper_payload_is_seen_as_the_active_job
    klass = Class.new(ActiveJob::Base) do
      def self.name = "ViewedJob"
      include Rebound::Sidekiq::ActiveJob
      rebound_queue "policy-queue"
    end
    Object.const_set(:ViewedJob, klass) unless defined?(::ViewedJob)
    payload = {"class" => Rebound::Sidekiq::AJ_WRAPPER, "wrapped" => "ViewedJob", "jid" => "j1", "queue" => "q",
               "args" => [{"job_class" => "ViewedJob", "job_id" => "aj-1", "arguments" => [1, "x"]}]}
    assert_equal ViewedJob, Rebound::Sidekiq.active_job_class(payload)
    view = Rebound::Sidekiq.job_view(nil, payload)
    assert_equal ["ViewedJob", "aj-1", [1, "x"]], view.values_at(:job_class, :key, :args)
    assert_equal "policy-queue", view[:klass].rebound_queue
    # A plain ActiveJob class (without the module) is left to Sidekiq.
    assert_nil Rebound::Sidekiq.active_job_class(payload.merge("wrapped" => "ActiveJob::Base"))
  end

  def test_sidekiq_job_and_worker_are_one_module
    assert_same Rebound::Sidekiq::Worker, Rebound::Sidekiq::Job
    klass = Class.new do
      include Sidekiq::Job
      include Rebound::Sidekiq::Worker
    end
    assert klass.include?(Sidekiq::Job)
    assert_equal Rebound::Decide::MAX_ATTEMPTS, klass.get_sidekiq_options["retry"]
    assert_includes Rebound::Sidekiq.classes, klass
  end
end
