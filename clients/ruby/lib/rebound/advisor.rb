# frozen_string_literal: true

require "digest"
require "json"
require "time"
require "rebound/client"
require "rebound/decide"

module Rebound
  class << self
    # Where the adapter's JSON lines go (default: $stderr).
    attr_writer :log_io

    def log_io
      @log_io || $stderr
    end
  end

  # One JSON line on log_io (structured fields); never raises.
  def self.log(level, event, **fields)
    line = {"time" => Time.now.utc.iso8601(3), "level" => level, "event" => event, "pid" => Process.pid}.merge(fields.transform_keys(&:to_s))
    log_io.write(JSON.generate(line) + "\n")
  rescue StandardError
    nil
  end

  # Asks the sidecar; answers from the local fallback when it cannot. Never raises.
  #
  # Fallback = the last GetPolicy answer for the queue (fetched in a background thread
  # whenever a sidecar answer names a config hash this process has not fetched yet),
  # decided with Rebound::Decide; without one, DEFAULT_POLICY.
  class Advisor
    # What a RetryPolicy with an empty spec resolves to: 10 runs, exponential 1s..10m, full jitter, drop.
    DEFAULT_POLICY = {
      "strategy" => "STRATEGY_EXPONENTIAL", "baseMs" => 1000, "multiplier" => 2.0, "capMs" => 600_000,
      "jitter" => "JITTER_FULL", "jitterRatio" => 0.0, "scheduleMs" => [], "maxAttempts" => 10,
      "maxRetryDurationMs" => 0, "nonRetryableErrors" => [], "terminal" => "DISPOSITION_DROP",
      "deadLetterQueue" => "",
    }.freeze
    DEFAULT_IDENTITY = "rebound/default"
    MAX_JOB_ID_BYTES = 512
    MAX_ERROR_CLASS_BYTES = 253
    MAX_QUEUE_BYTES = 253
    # Answered when even the fallback fails (it should not).
    LAST_RESORT_DELAY_MS = 5000
    CAUSES = {GRPC::Core::StatusCodes::UNAVAILABLE => "unavailable",
              GRPC::Core::StatusCodes::DEADLINE_EXCEEDED => "deadline_exceeded",
              GRPC::Core::StatusCodes::NOT_FOUND => "not_found"}.freeze

    attr_reader :client, :target

    def initialize(target: nil, deadline_ms: 250, default_policy: nil)
      @target = target || ENV.fetch("REBOUND_TARGET", "127.0.0.1:7411")
      @client = Client.new(@target, deadline_ms / 1000.0)
      @default = Decide::Prepared.new(default_policy || DEFAULT_POLICY, DEFAULT_IDENTITY)
      @lock = Mutex.new
      @policies = {} # queue -> [config_hash, resolved, Prepared]
      @refreshing = {}
      @counters = {"decisions" => Hash.new(0), "fallback" => Hash.new(0), "dead_lettered" => 0, "dropped" => 0}
    end

    def metrics
      @lock.synchronize { JSON.parse(JSON.generate(@counters)) }
    end

    def count(group, key = nil)
      @lock.synchronize { key.nil? ? @counters[group] += 1 : @counters[group][key] += 1 }
    end

    def cached_policy(queue)
      @lock.synchronize { @policies[queue] }
    end

    # Fetches the queue's policy now (in the caller's thread); true on success.
    def refresh(queue)
      res = @client.get_policy(queue)
      ref = res.policy
      resolved = self.class.resolved_from_wire(res.resolved)
      prepared = Decide::Prepared.new(resolved, "#{ref.namespace}/#{ref.name}")
      @lock.synchronize { @policies[queue] = [ref.config_hash, resolved, prepared] }
      Rebound.log("info", "rebound.policy_fetched", queue: queue, policy: "#{ref.namespace}/#{ref.name}", config_hash: ref.config_hash)
      true
    rescue StandardError => e
      Rebound.log("warn", "rebound.get_policy_failed", queue: queue, cause: cause_of(e), error: e.message.to_s[0, 300])
      false
    end

    # The answer for this failure: a Hash in DecideResponse's proto3 JSON names plus
    # "source" = sidecar | fallback | default | last_resort.
    def decide(queue, attempt, job_id: nil, error_class: nil, first_failure_unix_ms: nil, retry_after_ms: nil)
      f = begin
        self.class.normalise(queue, attempt, job_id, error_class, first_failure_unix_ms, retry_after_ms)
      rescue StandardError
        {"queue" => queue.to_s, "attempt" => 1}
      end
      begin
        decide_normalised(f)
      rescue Exception => e # rubocop:disable Lint/RescueException -- never raise from the retry path
        Rebound.log("error", "rebound.fallback_failed", queue: f["queue"], error: e.inspect[0, 300])
        {"decision" => "DECISION_RETRY", "delayMs" => LAST_RESORT_DELAY_MS, "source" => "last_resort",
         "disposition" => "DISPOSITION_UNSPECIFIED", "deadLetterQueue" => "",
         "reason" => "GIVE_UP_REASON_UNSPECIFIED", "reasonMessage" => "",
         "budgetStretched" => false, "budgetDelayMs" => 0}
      end
    end

    # The same question for the sidecar and the fallback, within the proto's bounds.
    def self.normalise(queue, attempt, job_id, error_class, first_failure_unix_ms, retry_after_ms)
      q = truncate_utf8(queue.to_s, MAX_QUEUE_BYTES)
      f = {"queue" => q.empty? ? "default" : q, "attempt" => (Integer(attempt) rescue 1).clamp(1, 4_294_967_295)}
      unless job_id.nil? || job_id.to_s.empty?
        jid = job_id.to_s.dup.force_encoding("UTF-8").scrub
        jid = Digest::SHA256.hexdigest(jid) if jid.bytesize > MAX_JOB_ID_BYTES
        f["jobId"] = jid
      end
      if error_class.is_a?(String) && !error_class.empty?
        f["errorClass"] = truncate_utf8(error_class, MAX_ERROR_CLASS_BYTES)
      end
      first = (Integer(first_failure_unix_ms) rescue nil)
      f["firstFailureUnixMs"] = first if first && first >= 10**12 && first < 2**64
      ra = (Float(retry_after_ms) rescue nil)
      f["retryAfterMs"] = [ra.ceil, 2**63 - 1].min if ra&.finite? && ra > 0
      f
    end

    def self.truncate_utf8(text, limit)
      s = text.dup.force_encoding("UTF-8").scrub
      return s if s.bytesize <= limit
      s.byteslice(0, limit).scrub("")
    end

    def self.resolved_from_wire(r)
      {
        "strategy" => r.strategy.to_s, "baseMs" => r.base_ms, "multiplier" => r.multiplier,
        "capMs" => r.cap_ms, "jitter" => r.jitter.to_s, "jitterRatio" => r.jitter_ratio,
        "scheduleMs" => r.schedule_ms.to_a, "maxAttempts" => r.max_attempts,
        "maxRetryDurationMs" => r.max_retry_duration_ms, "nonRetryableErrors" => r.non_retryable_errors.to_a,
        "terminal" => r.terminal.to_s, "deadLetterQueue" => r.dead_letter_queue,
      }
    end

    def self.answer_from_wire(res)
      {
        "decision" => res.decision.to_s, "delayMs" => res.delay_ms, "disposition" => res.disposition.to_s,
        "deadLetterQueue" => res.dead_letter_queue, "reason" => res.reason.to_s, "reasonMessage" => res.reason_message,
        "budgetStretched" => res.budget_stretched, "budgetDelayMs" => res.budget_delay_ms,
        "policy" => {"name" => res.policy&.name.to_s, "namespace" => res.policy&.namespace.to_s,
                     "generation" => res.policy&.generation.to_i, "configHash" => res.policy&.config_hash.to_s},
      }
    end

    private

    def cause_of(err)
      err.is_a?(GRPC::BadStatus) ? CAUSES.fetch(err.code, "other") : "other"
    end

    def refresh_in_background(queue)
      @lock.synchronize do
        @refreshing, @pid = {}, Process.pid if @pid != Process.pid # threads do not survive fork
        return if @refreshing[queue]
        @refreshing[queue] = true
      end
      Thread.new do
        refresh(queue)
      ensure
        @lock.synchronize { @refreshing.delete(queue) }
      end
    end

    def decide_normalised(f)
      req = V1::DecideRequest.new(queue: f["queue"], attempt: f["attempt"], job_id: f.fetch("jobId", ""),
        error_class: f.fetch("errorClass", ""), first_failure_unix_ms: f.fetch("firstFailureUnixMs", 0),
        retry_after_ms: f.fetch("retryAfterMs", 0))
      answer = begin
        a = self.class.answer_from_wire(@client.decide(req))
        a["source"] = "sidecar"
        cached = cached_policy(f["queue"])
        refresh_in_background(f["queue"]) if cached.nil? || cached[0] != a["policy"]["configHash"]
        a
      rescue StandardError => e
        cause = cause_of(e)
        cached = cached_policy(f["queue"])
        ctx = f.slice("jobId", "errorClass", "firstFailureUnixMs", "retryAfterMs")
        ctx["nowUnixMs"] = (Time.now.to_r * 1000).to_i
        a = Decide.decide_prepared(cached ? cached[2] : @default, f["attempt"], ctx)
        a["source"] = cached ? "fallback" : "default"
        # A retry budget is one sidecar's schedule: a local answer is never stretched.
        a["budgetStretched"] = false
        a["budgetDelayMs"] = 0
        count("fallback", cause)
        count("fallback", "total")
        count("fallback", "default_policy") unless cached
        Rebound.log("warn", "rebound.fallback", queue: f["queue"], cause: cause, source: a["source"],
          attempt: f["attempt"], decision: a["decision"], delay_ms: a["delayMs"], error: e.message.to_s[0, 300])
        a
      end
      count("decisions", answer["decision"] == "DECISION_RETRY" ? answer["decision"] : answer["reason"])
      answer
    end
  end
end
