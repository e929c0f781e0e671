# frozen_string_literal: true

require "base64"
require "zlib"
require "sidekiq"
require "sidekiq/api"
require "sidekiq/job_retry"
require "rebound/advisor"

module Rebound
  # Rebound for Sidekiq worker classes:
  #
  #   class Deliver
  #     include Rebound::Sidekiq::Worker
  #     def perform(url) ... end
  #   end
  #
  # A failure asks the sidecar (attempt = Sidekiq's 0-based retry count + 1, job id = the
  # jid fixed at enqueue, first failure = the payload's failed_at) before Sidekiq's retrier
  # sees it, in ServerMiddleware. See clients/ruby/README.md.
  module Sidekiq
    # The Sidekiq versions whose sidekiq_retry_in may return :kill / :discard.
    HOOK_GIVES_UP = Gem::Version.new(::Sidekiq::VERSION) >= Gem::Version.new("6.5")
    DEAD_LETTER_CLASS = "Rebound::Sidekiq::DeadLetter"

    class << self
      attr_writer :advisor

      # The process's Advisor (REBOUND_TARGET, 250 ms deadline unless configured).
      def advisor
        @advisor ||= Advisor.new
      end

      # Rebound::Sidekiq.configure(target: "unix:///run/rebound.sock", deadline_ms: 250)
      def configure(**opts)
        @advisor = Advisor.new(**opts)
      end

      # Called with each dead-letter message (a Hash) by the DeadLetter worker; default: a JSON line.
      def on_dead_letter(&block)
        @dead_letter_handler = block
      end

      def dead_letter_handler
        @dead_letter_handler || ->(msg) { Rebound.log("info", "rebound.dead_letter_received", **msg.transform_keys(&:to_sym)) }
      end

      # Adds ServerMiddleware to the server chain once (first, so it sees every failure).
      def install_middleware
        ::Sidekiq.configure_server do |config|
          config.server_middleware do |chain|
            chain.prepend(ServerMiddleware) unless chain.exists?(ServerMiddleware)
          end
        end
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

      # The question for one failure of `job` (a Sidekiq job hash) on `queue`.
      def ask(worker, job, queue, exc, attempt)
        key = job["rebound_key"] || job["jid"]
        klass = worker&.class
        q = (klass.respond_to?(:rebound_queue) && klass.rebound_queue) || queue || job["queue"]
        error_class, retry_after = begin
          [worker.respond_to?(:rebound_error_class) ? worker.rebound_error_class(exc) : error_class_of(exc),
           worker.respond_to?(:rebound_retry_after_ms) ? worker.rebound_retry_after_ms(exc) : retry_after_ms_of(exc)]
        rescue StandardError => e # a mapper's bug must not change the job's fate
          Rebound.log("error", "rebound.hook_error", job_class: job["class"], error: e.inspect[0, 300])
          [exc.class.name.to_s, nil]
        end
        first = failed_at_ms(job) || now_ms
        answer = advisor.decide(q, attempt, job_id: key, error_class: error_class, first_failure_unix_ms: first,
          retry_after_ms: retry_after)
        fields = {job_class: job["class"], jid: job["jid"], key: key, queue: q, attempt: attempt,
                  error_class: error_class, decision: answer["decision"], delay_ms: answer["delayMs"],
                  source: answer["source"]}
        [answer, fields, first]
      end

      # The dead-letter message pushed to the policy's dead-letter queue.
      def dead_letter_message(job, exc, answer, fields, first)
        {"job_class" => job["class"], "jid" => job["jid"], "key" => fields[:key], "args" => job["args"],
         "queue" => fields[:queue], "attempts" => fields[:attempt], "reason" => answer["reason"],
         "reason_message" => answer["reasonMessage"], "error_class" => fields[:error_class],
         "error" => "#{exc.class.name}: #{exc.message}"[0, 2000], "first_failure_unix_ms" => first,
         "dead_lettered_unix_ms" => now_ms}
      end

      def push_dead_letter(queue, message)
        ::Sidekiq::Client.push("queue" => queue, "class" => DEAD_LETTER_CLASS, "args" => [message], "retry" => true)
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

    # Asks first: on a failure of a Rebound worker it asks Decide, then schedules the retry
    # itself in Sidekiq's retry set at exactly now + delay_ms (the same fields Sidekiq's
    # retrier writes, without Sidekiq's extra random seconds), or gives up (dead set plus
    # the dead-letter queue, or discard). Either way it raises JobRetry::Skip, which tells
    # the processor the failure is handled: the job is acknowledged, the error reported.
    # Anything Rebound cannot do (Redis down) falls through to Sidekiq's own retrier.
    class ServerMiddleware
      include ::Sidekiq::ServerMiddleware if defined?(::Sidekiq::ServerMiddleware)

      def call(worker, job, queue)
        pristine = worker.is_a?(Worker) ? ::Sidekiq.dump_json(job) : nil
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

      def shutdown?(e, seen = [])
        c = e.cause
        return false if c.nil? || seen.include?(c.object_id)
        seen << e.object_id
        c.instance_of?(::Sidekiq::Shutdown) || shutdown?(c, seen)
      end

      def handle(worker, msg, queue, exc)
        attempt = msg["retry_count"].nil? ? 1 : msg["retry_count"].to_i + 2
        answer, fields, first = Rebound::Sidekiq.ask(worker, msg, queue, exc, attempt)
        mark_failed(msg, queue, exc)
        msg["failed_at"] ||= first / 1000.0
        if answer["decision"] == "DECISION_RETRY"
          at = Time.now.to_f + answer["delayMs"] / 1000.0
          ::Sidekiq.redis { |c| c.zadd("retry", at.to_s, ::Sidekiq.dump_json(msg)) }
          Rebound.log("info", "rebound.retry", **fields)
        elsif answer["disposition"] == "DISPOSITION_DEAD_LETTER"
          dead_letter(worker, msg, exc, answer, fields, first)
        else
          Rebound::Sidekiq.advisor.count("dropped")
          Rebound.log("warn", "rebound.dropped", **fields, reason: answer["reason"])
        end
      rescue StandardError => e # Redis trouble: leave the failure to Sidekiq's retrier
        Rebound.log("error", "rebound.middleware_error", jid: msg["jid"], error: e.inspect[0, 300])
        return
      else
        raise ::Sidekiq::JobRetry::Skip
      end

      def dead_letter(worker, msg, exc, answer, fields, first)
        dlq = answer["deadLetterQueue"]
        Rebound::Sidekiq.push_dead_letter(dlq, Rebound::Sidekiq.dead_letter_message(msg, exc, answer, fields, first)) unless dlq.to_s.empty?
        begin
          worker.sidekiq_retries_exhausted_block&.call(msg, exc)
        rescue StandardError => e
          Rebound.log("error", "rebound.retries_exhausted_error", jid: msg["jid"], error: e.inspect[0, 300])
        end
        ::Sidekiq::DeadSet.new.kill(::Sidekiq.dump_json(msg), notify_failure: false) unless msg["dead"] == false
        death_handlers.each do |h|
          h.call(msg, exc)
        rescue StandardError => e
          Rebound.log("error", "rebound.death_handler_error", jid: msg["jid"], error: e.inspect[0, 300])
        end
        Rebound::Sidekiq.advisor.count("dead_lettered")
        Rebound.log("warn", "rebound.dead_lettered", **fields, reason: answer["reason"], dead_letter_queue: dlq)
      end

      # Sidekiq.death_handlers (6.x) or the default configuration's (7.x).
      def death_handlers
        return ::Sidekiq.death_handlers if ::Sidekiq.respond_to?(:death_handlers)
        ::Sidekiq.default_configuration.death_handlers
      rescue StandardError
        []
      end

      # What Sidekiq's JobRetry#attempt_retry records on the job before scheduling it.
      def mark_failed(msg, queue, exc)
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
        return unless msg["backtrace"] && exc.backtrace
        lines = msg["backtrace"] == true ? exc.backtrace : exc.backtrace[0...msg["backtrace"].to_i]
        msg["error_backtrace"] = Base64.encode64(Zlib::Deflate.deflate(::Sidekiq.dump_json(lines)))
      end
    end

    # include Rebound::Sidekiq::Worker: Sidekiq::Worker, sidekiq_options retry: 10000 (the
    # policy's maxAttempts decides, never Sidekiq's limit), sidekiq_retry_in wired to Decide
    # and the middleware installed. Override rebound_error_class(exc) /
    # rebound_retry_after_ms(exc) per class; `rebound_queue "name"` names the policy's queue.
    module Worker
      def self.included(base)
        base.include(::Sidekiq::Worker) unless base.include?(::Sidekiq::Worker)
        base.extend(ClassMethods)
        base.sidekiq_options(retry: Decide::MAX_ATTEMPTS)
        base.sidekiq_retry_in { |count, exc, job = nil| Rebound::Sidekiq::Worker.retry_in(base, count, exc, job) }
        base.prepend(InstanceHook)
        Rebound::Sidekiq.install_middleware
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
        def rebound_queue(name = nil)
          @rebound_queue = name unless name.nil?
          @rebound_queue
        end
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
      # middleware is what gives up.
      def self.retry_in(klass, count, exc, job)
        job ||= {}
        answer, fields, first = Rebound::Sidekiq.ask(nil, job, job["queue"] || (klass.respond_to?(:rebound_queue) && klass.rebound_queue) || klass.get_sidekiq_options["queue"], exc, count.to_i + 1)
        if answer["decision"] == "DECISION_RETRY"
          Rebound.log("info", "rebound.retry", **fields, via: "sidekiq_retry_in")
          return [(answer["delayMs"] + 999) / 1000, 1].max
        end
        if HOOK_GIVES_UP
          dead = answer["disposition"] == "DISPOSITION_DEAD_LETTER"
          if dead && !answer["deadLetterQueue"].to_s.empty?
            Rebound::Sidekiq.push_dead_letter(answer["deadLetterQueue"], Rebound::Sidekiq.dead_letter_message(job, exc, answer, fields, first))
          end
          Rebound.log("warn", dead ? "rebound.dead_lettered" : "rebound.dropped", **fields, reason: answer["reason"], via: "sidekiq_retry_in")
          return dead ? :kill : :discard
        end
        Rebound.log("error", "rebound.give_up_unsupported", **fields, reason: answer["reason"], via: "sidekiq_retry_in")
        nil
      rescue StandardError => e
        Rebound.log("error", "rebound.hook_error", error: e.inspect[0, 300])
        nil
      end
    end
  end
end
