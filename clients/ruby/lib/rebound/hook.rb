# frozen_string_literal: true

require "base64"
require "json"
require "securerandom"
require "zlib"
require "sidekiq"
require "sidekiq/api"
require "sidekiq/job_retry"
require "rebound/advisor"

module Rebound
  # The retry hook (loaded by rebound/sidekiq, which users require; the optional fetch in
  # rebound/reliable_fetch builds on this file, so nothing here names it).
  #
  # Rebound for Sidekiq job classes and ActiveJob jobs run by Sidekiq:
  #
  #   class Deliver
  #     include Rebound::Sidekiq::Job       # (or ::Worker; includes Sidekiq::Job)
  #     def perform(url) ... end
  #   end
  #
  #   class DeliverJob < ApplicationJob    # ActiveJob, queue_adapter :sidekiq
  #     include Rebound::Sidekiq::ActiveJob
  #     def perform(url) ... end
  #   end
  #
  # A failure asks the sidecar (attempt = Sidekiq's 0-based retry count + 1, job id = the
  # jid fixed at enqueue, or ActiveJob's job_id; first failure = the payload's failed_at)
  # before Sidekiq's retrier sees it, in ServerMiddleware. At server start the target is
  # checked and the policies of the process's queues are fetched. See clients/ruby/README.md.
  module Sidekiq
    # The Sidekiq versions whose sidekiq_retry_in may return :kill / :discard.
    HOOK_GIVES_UP = Gem::Version.new(::Sidekiq::VERSION) >= Gem::Version.new("6.5")
    DEAD_LETTER_CLASS = "Rebound::Sidekiq::DeadLetter"
    AJ_WRAPPER = "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper"
    # How long the middleware waits for Redis to carry out a decision (a Redis restart).
    REDIS_WAIT_S = 30

    class << self
      attr_writer :rebound

      # The process's Rebound (REBOUND_TARGET, 250 ms deadline unless configured). A
      # malformed target is refused at server start (start!); made lazily here it only
      # makes every decision a fallback.
      def rebound
        @rebound ||= Advisor.new(strict: false, store: RedisPolicyStore.new)
      end

      # Deprecated name of rebound.
      def advisor = rebound

      def advisor=(value)
        self.rebound = value
      end

      # Rebound::Sidekiq.configure(target: "unix:///run/rebound.sock", deadline_ms: 250);
      # raises Rebound::ConfigurationError on a malformed target.
      def configure(**opts)
        @rebound = Advisor.new(store: RedisPolicyStore.new, **opts)
      end

      # Called with each dead-letter message (a Hash) by the DeadLetter job; default: a JSON line.
      def on_dead_letter(&block)
        @dead_letter_handler = block
      end

      def dead_letter_handler
        @dead_letter_handler || ->(msg) { Rebound.log("info", "rebound.dead_letter_received", **msg.transform_keys(&:to_sym)) }
      end

      # Job classes using Rebound (their rebound_queue names are prefetched too).
      def classes
        @classes ||= []
      end

      # Adds ServerMiddleware to the front of the server chain and start! to the startup
      # event, once. Called by including Worker/Job/ActiveJob; call it from an initializer
      # when the job classes are loaded lazily.
      def install
        return if @installed
        @installed = true
        ::Sidekiq.configure_server do |config|
          config.server_middleware do |chain|
            chain.prepend(ServerMiddleware) unless chain.exists?(ServerMiddleware)
          end
          config.on(:startup) { Rebound::Sidekiq.start! }
        end
      end
      alias_method :install_middleware, :install

      # At server start, before any job runs: refuse a malformed target (raises
      # Rebound::ConfigurationError naming REBOUND_TARGET: sidekiq exits), then GetPolicy
      # for every queue this process works (see Advisor#prefetch).
      def start!
        rb = rebound
        begin
          rb.check_target!
        rescue ConfigurationError => e
          Rebound.log("error", "rebound.bad_target", variable: rb.target_variable, target: rb.target.to_s, error: e.message)
          raise
        end
        begin
          rb.prefetch(worker_queues)
        rescue StandardError => e # only a bad address stops the worker
          Rebound.hook_error("rebound.prefetch_failed", target: rb.target.to_s, error: e.inspect[0, 300])
          {}
        end
      end

      # The queues this process works plus the rebound_queue of every Rebound class.
      def worker_queues
        qs = if ::Sidekiq.respond_to?(:options) && ::Sidekiq.options.is_a?(Hash) && ::Sidekiq.options[:queues]
          ::Sidekiq.options[:queues]
        elsif ::Sidekiq.respond_to?(:default_configuration)
          ::Sidekiq.default_configuration.capsules.values.flat_map(&:queues)
        else
          []
        end
        (qs.map(&:to_s) + classes.filter_map { |k| k.respond_to?(:rebound_queue) && k.rebound_queue }).uniq
      rescue StandardError
        []
      end

      # Runs a dead job again: its dead-set entry (found by jid, or the dead-letter
      # message's jid) goes back onto its queue with the same jid, as the Web UI's "Retry
      # Now" does: it gets one more run. Raises ArgumentError when it is not in the dead set.
      def replay(jid_or_message)
        jid = jid_or_message.is_a?(Hash) ? jid_or_message["jid"] : jid_or_message.to_s
        entry = ::Sidekiq::DeadSet.new.find_job(jid)
        raise ArgumentError, "job #{jid} is not in Sidekiq's dead set" unless entry
        entry.retry
        jid
      end

      def error_class_of(exc)
        code = exc.respond_to?(:code) ? exc.code : nil
        code.is_a?(String) && !code.empty? ? code : exc.class.name.to_s
      end

      def retry_after_ms_of(exc)
        if exc.respond_to?(:retry_after_ms) && exc.retry_after_ms.is_a?(Numeric) && exc.retry_after_ms > 0
          exc.retry_after_ms
        elsif exc.respond_to?(:retry_after) && exc.retry_after.is_a?(Numeric) && exc.retry_after > 0
          exc.retry_after * 1000
        end
      end

      def now_ms
        (Time.now.to_r * 1000).to_i
      end

      # Sidekiq's failed_at (seconds as a Float in 6.x/7.x; ms as an Integer in 8.x) in ms.
      def failed_at_ms(job)
        v = job["failed_at"]
        return nil unless v.is_a?(Numeric)
        v >= 1e12 ? v.to_i : (v.to_r * 1000).to_i
      end

      # The ActiveJob class of a JobWrapper payload when it uses Rebound, else nil.
      def active_job_class(job)
        return nil unless job["class"].to_s == AJ_WRAPPER && defined?(Rebound::Sidekiq::ActiveJob)
        klass = Object.const_get(job["wrapped"].to_s)
        klass.include?(Rebound::Sidekiq::ActiveJob) ? klass : nil
      rescue StandardError
        nil
      end

      # The failure's job as Rebound sees it: the ActiveJob job for a JobWrapper.
      def job_view(worker, job)
        aj = active_job_class(job)
        if aj
          data = job["args"].is_a?(Array) && job["args"].first.is_a?(Hash) ? job["args"].first : {}
          {klass: aj, job_class: aj.name, key: job["rebound_key"] || data["job_id"] || job["jid"],
           args: data["arguments"], mapper: aj}
        else
          {klass: worker&.class, job_class: job["class"], key: job["rebound_key"] || job["jid"], args: job["args"], mapper: worker}
        end
      end

      # The question for one failure of `job` (a Sidekiq job hash) on `queue`.
      def ask(worker, job, queue, exc, attempt)
        view = job_view(worker, job)
        klass = view[:klass]
        q = (klass.respond_to?(:rebound_queue) && klass.rebound_queue) || queue || job["queue"]
        mapper = view[:mapper]
        error_class, retry_after = begin
          [mapper.respond_to?(:rebound_error_class) ? mapper.rebound_error_class(exc) : error_class_of(exc),
           mapper.respond_to?(:rebound_retry_after_ms) ? mapper.rebound_retry_after_ms(exc) : retry_after_ms_of(exc)]
        rescue StandardError => e # a mapper's bug must not change the job's fate
          Rebound.hook_error("rebound.hook_error", job_class: view[:job_class], error: e.inspect[0, 300])
          [exc.class.name.to_s, nil]
        end
        first = failed_at_ms(job) || now_ms
        answer = rebound.decide(q, attempt, job_id: view[:key], error_class: error_class, first_failure_unix_ms: first,
          retry_after_ms: retry_after)
        [answer, fields_of(view, job, q, attempt, error_class, answer), first, view]
      end

      # ask, but never raises: an error inside the adapter ends in a fallback decision.
      def ask_safely(worker, job, queue, exc, attempt)
        ask(worker, job, queue, exc, attempt)
      rescue Exception => e # rubocop:disable Lint/RescueException -- never hand the failure to Sidekiq's retries
        raise if e.is_a?(::Sidekiq::Shutdown)
        Rebound.hook_error("rebound.adapter_error", stage: "ask", jid: (job["jid"] rescue nil), error: e.inspect[0, 300])
        view = (job_view(worker, job) rescue {klass: nil, job_class: job["class"], key: job["jid"], args: job["args"]})
        q = queue || job["queue"]
        first = (failed_at_ms(job) rescue nil) || now_ms
        answer = rebound.decide_locally(q, attempt, job_id: view[:key], error_class: (exc.class.name rescue nil),
          first_failure_unix_ms: first)
        [answer, fields_of(view, job, q, attempt, (exc.class.name rescue nil), answer), first, view]
      end

      def fields_of(view, job, queue, attempt, error_class, answer)
        {job_class: view[:job_class], jid: job["jid"], key: view[:key], queue: queue, attempt: attempt,
         error_class: error_class, decision: answer["decision"], delay_ms: answer["delayMs"],
         source: answer["source"], policy_source: answer["policySource"]}
      end

      # The dead-letter message pushed to the policy's dead-letter queue. attempts = the
      # runs the job made (a replayed job's earlier runs included).
      def dead_letter_message(job, exc, answer, fields, first, runs, args = job["args"])
        {"job_class" => fields[:job_class], "jid" => job["jid"], "key" => fields[:key], "args" => args,
         "queue" => fields[:queue], "attempts" => runs, "reason" => answer["reason"],
         "reason_message" => answer["reasonMessage"], "error_class" => fields[:error_class],
         "error" => "#{exc.class.name}: #{exc.message}"[0, 2000], "first_failure_unix_ms" => first,
         "dead_lettered_unix_ms" => now_ms}
      end

      def push_dead_letter(queue, message)
        ::Sidekiq::Client.push("queue" => queue, "class" => DEAD_LETTER_CLASS, "args" => [message], "retry" => true)
      end

      # The job Sidekiq::Client.push would enqueue for a dead letter, for a write of its own.
      def dead_letter_item(queue, message)
        now = Time.now.to_f
        {"class" => DEAD_LETTER_CLASS, "queue" => queue, "args" => [message], "retry" => true,
         "jid" => SecureRandom.hex(12), "created_at" => now, "enqueued_at" => now}
      end

      # Runs the block, again while Redis is unreachable (a restart), for up to REDIS_WAIT_S.
      def with_redis(what, jid)
        deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + REDIS_WAIT_S
        logged = false
        begin
          yield
        rescue StandardError => e
          raise unless redis_connection_error?(e) && Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
          Rebound.log("warn", "rebound.redis_unavailable", jid: jid, writing: what, error: e.message.to_s[0, 300]) unless logged
          logged = true
          sleep 0.5
          retry
        end
      end

      def redis_connection_error?(e)
        names = e.class.ancestors.map(&:name)
        names.include?("Redis::BaseConnectionError") || names.include?("RedisClient::ConnectionError") ||
          e.is_a?(Errno::ECONNREFUSED) || e.is_a?(Errno::ECONNRESET) || e.is_a?(IOError)
      end
    end

    # Each process's GetPolicy answers, kept in Redis (hash rebound:policies, one field per
    # queue) so that a process started while the sidecar is down decides from the real
    # policy (policySource=cached), not the default.
    class RedisPolicyStore
      KEY = "rebound:policies"

      def read(queue)
        raw = ::Sidekiq.redis { |c| c.hget(KEY, queue) }
        raw && JSON.parse(raw)
      end

      def write(queue, entry)
        ::Sidekiq.redis { |c| c.hset(KEY, queue, JSON.generate(entry)) }
      end

      def delete(queue)
        ::Sidekiq.redis { |c| c.hdel(KEY, queue) }
      end
    end

    # Consumes a dead-letter queue (`sidekiq -q webhooks-dead`): hands each message to the
    # handler set with Rebound::Sidekiq.on_dead_letter.
    class DeadLetter
      include ::Sidekiq::Worker

      def perform(message)
        Rebound::Sidekiq.dead_letter_handler.call(message)
      end
    end

    # Asks first: on a failure of a Rebound job it asks Decide, then schedules the retry
    # itself in Sidekiq's retry set at exactly now + delay_ms (the same fields Sidekiq's
    # retrier writes, without Sidekiq's extra random seconds), or gives up: the job goes to
    # Sidekiq's dead set either way (drop or dead letter; dead letter also pushes a message
    # to the policy's dead-letter queue), after the class's sidekiq_retries_exhausted block
    # and before the death handlers. Then it raises JobRetry::Skip, which tells the
    # processor the failure is handled: the job is acknowledged, the error reported.
    class ServerMiddleware
      include ::Sidekiq::ServerMiddleware if defined?(::Sidekiq::ServerMiddleware)

      def call(worker, job, queue)
        pristine = rebound_job?(worker, job) ? ::Sidekiq.dump_json(job) : nil
        yield
      rescue ::Sidekiq::Shutdown, ::Sidekiq::JobRetry::Handled
        raise
      rescue Exception => e # rubocop:disable Lint/RescueException -- what Sidekiq's retrier catches
        raise if pristine.nil? || shutdown?(e)
        msg = ::Sidekiq.load_json(pristine)
        raise unless msg["retry"] # retry: false pushed by a caller: Sidekiq's own handling
        handle(worker, msg, queue, e) # raises Skip when done
        raise
      end

      private

      def rebound_job?(worker, job)
        worker.is_a?(Worker) || !Rebound::Sidekiq.active_job_class(job).nil?
      rescue StandardError
        false
      end

      def shutdown?(e, seen = [])
        c = e.cause
        return false if c.nil? || seen.include?(c.object_id)
        seen << e.object_id
        c.instance_of?(::Sidekiq::Shutdown) || shutdown?(c, seen)
      end

      # The failure is written with the job's acknowledgment when ReliableFetch fetched it.
      def handle(worker, msg, queue, exc)
        unit = Thread.current[:rebound_unit]
        unit = nil unless unit.respond_to?(:settled) && unit.jid == msg["jid"]
        Failure.carry_out(worker, Failure.count(msg, queue, exc), queue, exc, unit)
      rescue ::Sidekiq::Shutdown
        raise
      rescue StandardError => e # Redis gone for longer than REDIS_WAIT_S: the job is not acknowledged
        Rebound.hook_error("rebound.middleware_error", jid: msg["jid"], error: e.inspect[0, 300])
        return
      else
        raise ::Sidekiq::JobRetry::Skip
      end
    end

    # One failed run: counted on the job (count), then decided and carried out (carry_out).
    # Shared by the middleware and ReliableFetch's recovery of lost runs.
    module Failure
      module_function

      # A copy of msg with the fields Sidekiq's retrier records for a failure
      # (JobRetry#attempt_retry) and rebound_runs, the runs made (this one included;
      # Sidekiq's count restarts lower on a replay, this one does not).
      def count(msg, queue, exc)
        msg = ::Sidekiq.load_json(::Sidekiq.dump_json(msg))
        msg.delete("rebound_claimed_by")
        runs = (msg["rebound_runs"] || (msg["retry_count"].nil? ? 0 : msg["retry_count"].to_i + 1)).to_i + 1
        msg["queue"] = msg["retry_queue"] || queue
        m = (exc.message.to_s[0, 10_000] rescue +"!!! ERROR MESSAGE THREW AN ERROR !!!").dup
        msg["error_message"] = m.force_encoding("utf-8").scrub
        msg["error_class"] = exc.class.name
        if msg["retry_count"]
          msg["retried_at"] = Time.now.to_f
          msg["retry_count"] += 1
        else
          msg["failed_at"] = Time.now.to_f
          msg["retry_count"] = 0
        end
        msg["rebound_runs"] = runs
        if msg["backtrace"] && exc.backtrace
          lines = msg["backtrace"] == true ? exc.backtrace : exc.backtrace[0...msg["backtrace"].to_i]
          msg["error_backtrace"] = Base64.encode64(Zlib::Deflate.deflate(::Sidekiq.dump_json(lines)))
        end
        msg
      end

      # Decides a counted failure (attempt = the run that failed) and writes the outcome:
      # with unit (a fetched job that settles itself, as ReliableFetch's do), together with
      # the job's removal from its working list; a unit no longer there means a recovery
      # already counted and decided the run.
      def carry_out(worker, msg, queue, exc, unit = nil, recovered: false)
        attempt = msg["retry_count"].to_i + 1
        runs = msg["rebound_runs"]
        answer, fields, first, view = Rebound::Sidekiq.ask_safely(worker, msg, queue, exc, attempt)
        msg["failed_at"] ||= first / 1000.0
        if answer["decision"] == "DECISION_RETRY"
          at = Time.now.to_f + answer["delayMs"] / 1000.0
          payload = ::Sidekiq.dump_json(msg)
          if unit
            return skipped(msg, fields) unless unit.settle("retry", payload, at: at,
              recovered: recovered ? {"kind" => "retry", "payload" => payload} : nil)
          else
            Rebound::Sidekiq.with_redis("retry", msg["jid"]) { ::Sidekiq.redis { |c| c.zadd("retry", at.to_s, payload) } }
          end
          Rebound.log("info", "rebound.retry", **fields, runs: runs)
        else
          give_up(worker, msg, exc, answer, fields, first, runs, view, unit, recovered)
        end
        true
      end

      def skipped(msg, fields)
        Rebound.log("warn", "rebound.settle_skipped", **fields, reason: "recovered while it ran")
        false
      end

      # Drop and dead letter both leave the job in Sidekiq's dead set, as when Sidekiq's
      # own retries run out; a dead letter also pushes its message to the queue.
      def give_up(worker, msg, exc, answer, fields, first, runs, view, unit, recovered)
        dead_letter = answer["disposition"] == "DISPOSITION_DEAD_LETTER"
        dlq = dead_letter ? answer["deadLetterQueue"].to_s : ""
        message = unless dlq.empty?
          Rebound::Sidekiq.dead_letter_message(msg, exc, answer, fields, first, runs, view ? view[:args] : msg["args"])
        end
        payload = msg["dead"] == false ? "" : ::Sidekiq.dump_json(msg)
        if unit
          letter = message && ::Sidekiq.dump_json(Rebound::Sidekiq.dead_letter_item(dlq, message))
          rec = recovered ? {"kind" => "dead", "payload" => payload, "letter" => letter, "dlq" => (dlq unless dlq.empty?)} : nil
          return skipped(msg, fields) unless unit.settle("dead", payload, dead_letter_queue: (dlq unless dlq.empty?),
            letter: letter, recovered: rec)
        else
          Rebound::Sidekiq.with_redis("dead_letter", msg["jid"]) { Rebound::Sidekiq.push_dead_letter(dlq, message) } if message
          unless payload.empty?
            Rebound::Sidekiq.with_redis("dead_set", msg["jid"]) { ::Sidekiq::DeadSet.new.kill(payload, notify_failure: false) }
          end
        end
        begin
          worker.sidekiq_retries_exhausted_block&.call(msg, exc) if worker.respond_to?(:sidekiq_retries_exhausted_block)
        rescue StandardError => e
          Rebound.hook_error("rebound.retries_exhausted_error", jid: msg["jid"], error: e.inspect[0, 300])
        end
        death_handlers.each do |h|
          h.call(msg, exc)
        rescue StandardError => e
          Rebound.hook_error("rebound.death_handler_error", jid: msg["jid"], error: e.inspect[0, 300])
        end
        Rebound::Sidekiq.rebound.count_terminal(dead_letter)
        Rebound.log("warn", dead_letter ? "rebound.dead_lettered" : "rebound.dropped", **fields, runs: runs,
          reason: answer["reason"], disposition: answer["disposition"], dead_set: msg["dead"] != false,
          dead_letter_queue: dlq)
      end

      # Sidekiq.death_handlers (6.x) or the default configuration's (7.x).
      def death_handlers
        return ::Sidekiq.death_handlers if ::Sidekiq.respond_to?(:death_handlers)
        ::Sidekiq.default_configuration.death_handlers
      rescue StandardError
        []
      end
    end

    # `rebound_queue "name"` on a job class: the queue its policy is looked up by (else the
    # class's Sidekiq queue). Shared by Sidekiq jobs and ActiveJob classes.
    module QueueName
      def rebound_queue(name = nil)
        @rebound_queue = name unless name.nil?
        @rebound_queue
      end
    end

    # include Rebound::Sidekiq::Job (or ::Worker): Sidekiq::Job, sidekiq_options retry:
    # 10000 (the policy's maxAttempts decides, never Sidekiq's limit), sidekiq_retry_in
    # wired to Decide and the middleware installed. Override rebound_error_class(exc) /
    # rebound_retry_after_ms(exc) per class; `rebound_queue "name"` names the policy's queue.
    module Worker
      def self.included(base)
        sidekiq_job = defined?(::Sidekiq::Job) ? ::Sidekiq::Job : ::Sidekiq::Worker
        base.include(sidekiq_job) unless base.include?(sidekiq_job)
        base.extend(ClassMethods)
        # "rebound" travels in every payload pushed through the class, so a process that
        # lacks the class still knows the policy decides the job's lost runs.
        base.sidekiq_options(retry: Decide::MAX_ATTEMPTS, "rebound" => true)
        base.sidekiq_retry_in { |count, exc, job = nil| Rebound::Sidekiq::Worker.retry_in(base, count, exc, job) }
        base.prepend(InstanceHook)
        Rebound::Sidekiq.classes << base
        Rebound::Sidekiq.install
      end

      # Sidekiq 6.4 calls the hook with (count, exception) only: the instance's block knows
      # the jid, so the jitter is keyed on it there too (7.x passes the job as well).
      module InstanceHook
        def sidekiq_retry_in_block
          inst = self
          lambda do |count, exc, job = nil|
            Rebound::Sidekiq::Worker.retry_in(inst.class, count, exc, job || {"jid" => inst.jid, "class" => inst.class.name})
          end
        end
      end

      module ClassMethods
        include QueueName
      end

      def rebound_error_class(exc)
        Rebound::Sidekiq.error_class_of(exc)
      end

      def rebound_retry_after_ms(exc)
        Rebound::Sidekiq.retry_after_ms_of(exc)
      end

      # Sidekiq's own hook, reached only for failures the middleware did not handle. It
      # answers integer seconds, rounded up and at least 1 (0 means "Sidekiq's default"),
      # to which Sidekiq adds rand(10) * (count + 1) seconds. Sidekiq >= 6.5 also takes
      # :kill / :discard. 6.4 cannot give up here: a give-up is logged
      # (rebound.give_up_unsupported) and Sidekiq's default delay applies; on 6.4 the
      # middleware is what gives up. Never raises: an error here is a fallback decision.
      def self.retry_in(klass, count, exc, job)
        job ||= {}
        queue = job["queue"] || (klass.respond_to?(:rebound_queue) && klass.rebound_queue) || klass.get_sidekiq_options["queue"]
        answer, fields, first = Rebound::Sidekiq.ask_safely(nil, job, queue, exc, count.to_i + 1)
        if answer["decision"] == "DECISION_RETRY"
          Rebound.log("info", "rebound.retry", **fields, via: "sidekiq_retry_in")
          return [(answer["delayMs"] + 999) / 1000, 1].max
        end
        if HOOK_GIVES_UP
          dead = answer["disposition"] == "DISPOSITION_DEAD_LETTER"
          if dead && !answer["deadLetterQueue"].to_s.empty?
            Rebound::Sidekiq.push_dead_letter(answer["deadLetterQueue"],
              Rebound::Sidekiq.dead_letter_message(job, exc, answer, fields, first, count.to_i + 1))
          end
          Rebound.log("warn", dead ? "rebound.dead_lettered" : "rebound.dropped", **fields, reason: answer["reason"], via: "sidekiq_retry_in")
          return :kill # drop too: the dead set, never discarded
        end
        Rebound.log("error", "rebound.give_up_unsupported", **fields, reason: answer["reason"], via: "sidekiq_retry_in")
        nil
      rescue StandardError => e
        Rebound.hook_error("rebound.hook_error", error: e.inspect[0, 300])
        (Advisor::LAST_RESORT_DELAY_MS / 1000.0).ceil
      end
    end

    # Sidekiq >= 6.3 names it Sidekiq::Job; so does Rebound.
    Job = Worker

    # include Rebound::Sidekiq::ActiveJob in an ActiveJob class (queue_adapter :sidekiq):
    # its failures are decided by the policy of the queue it runs on (or `rebound_queue
    # "name"`), exactly as for a Sidekiq job; key = ActiveJob's job_id. Class methods
    # rebound_error_class(exc) / rebound_retry_after_ms(exc) map errors. ActiveJob's
    # retry_on would retry behind the policy's back: it raises here.
    module ActiveJob
      def self.included(base)
        base.extend(ClassMethods)
        Rebound::Sidekiq.classes << base
        Rebound::Sidekiq.install
      end

      module ClassMethods
        include QueueName

        def retry_on(*exceptions, **_opts)
          raise ArgumentError, "#{name}: retry_on #{exceptions.map(&:to_s).join(", ")} conflicts with " \
            "Rebound::Sidekiq::ActiveJob (the RetryPolicy decides every retry); remove it"
        end
      end
    end
  end
end
