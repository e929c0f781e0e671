# frozen_string_literal: true

require "digest"
require "json"
require "time"
require "rebound/client"
require "rebound/decide"
require "rebound/metrics"
require "rebound/rollout_cache"

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

  # A fault the adapter absorbed: an error line and rebound_adapter_hook_errors_total.
  def self.hook_error(event, **fields)
    Metrics.hook_error
    log("error", event, **fields)
  end

  # The core object: Rebound.new(target: "unix:///run/rebound/rebound.sock", deadline_ms: 250).
  # (Ruby's Rebound is the namespace, so the object is a Rebound::Advisor made by Rebound.new.)
  def self.new(**opts)
    Advisor.new(**opts)
  end

  # Asks the sidecar; answers from the local fallback when it cannot. Never raises.
  #
  # Every answer says who decided (source = sidecar | fallback) and where the policy came
  # from (policySource = sidecar | cached | default). The fallback decides with
  # Rebound::Decide from the queue's last GetPolicy answer (prefetched at start, refreshed
  # whenever a sidecar answer names a config hash this process has not fetched; with a
  # store, also the copy another process saved there), else DEFAULT_POLICY.
  class Advisor
    # clients/conformance/default-policy.json: what a RetryPolicy with an empty spec resolves
    # to: 10 runs, exponential 1s x2 capped at 10m, full jitter, terminal drop (which leaves
    # the job in the library's own dead/failed state; it never discards it).
    DEFAULT_POLICY = {
      "strategy" => "STRATEGY_EXPONENTIAL", "baseMs" => 1000, "multiplier" => 2.0, "capMs" => 600_000,
      "jitter" => "JITTER_FULL", "jitterRatio" => 0.0, "scheduleMs" => [].freeze, "maxAttempts" => 10,
      "maxRetryDurationMs" => 0, "nonRetryableErrors" => [].freeze, "terminal" => "DISPOSITION_DROP",
      "deadLetterQueue" => "",
    }.freeze
    DEFAULT_IDENTITY = "rebound/default"
    DEFAULT_TARGET = "127.0.0.1:7411"
    TARGET_VARIABLE = "REBOUND_TARGET"
    MAX_JOB_ID_BYTES = 512
    MAX_ERROR_CLASS_BYTES = 253
    MAX_QUEUE_BYTES = 253
    # Answered when even the fallback fails (it should not).
    LAST_RESORT_DELAY_MS = 5000
    # While a prefetch at start found no sidecar: how often it is tried again.
    PREFETCH_RETRY_S = 1.0
    CAUSES = {GRPC::Core::StatusCodes::UNAVAILABLE => "unavailable",
              GRPC::Core::StatusCodes::DEADLINE_EXCEEDED => "deadline_exceeded",
              GRPC::Core::StatusCodes::NOT_FOUND => "not_found"}.freeze

    attr_reader :client, :target, :target_error

    # The target comes from `target:`, else REBOUND_TARGET, else 127.0.0.1:7411. A malformed
    # one raises ConfigurationError (naming REBOUND_TARGET when it came from there), unless
    # strict: false, where every decision is a fallback and check_target! raises later.
    # store: optional shared copy of fetched policies (#read(queue), #write(queue, entry),
    # optionally #delete(queue) when the sidecar says the queue has no policy).
    def initialize(target: nil, deadline_ms: 250, default_policy: nil, strict: true, store: nil)
      @target_from = target.nil? ? TARGET_VARIABLE : "target"
      @target = target.nil? ? ENV.fetch(TARGET_VARIABLE, DEFAULT_TARGET) : target
      @target_error = Client.target_error(@target)
      @client = @target_error ? nil : Client.new(@target, deadline_ms / 1000.0)
      check_target! if strict
      @store = store
      @default = Decide::PreparedPolicy.new(default_policy || DEFAULT_POLICY, DEFAULT_IDENTITY)
      @lock = Mutex.new
      @policies = {} # queue -> [config_hash, resolved, PreparedPolicy, CachedRollout or nil]
      @refreshing = {}
      @pending = [] # queues a prefetch could not load from the sidecar
      @counters = {"decisions" => Hash.new(0), "fallback" => Hash.new(0), "dead_lettered" => 0, "dropped" => 0}
    end

    # Raises ConfigurationError if the target is malformed (names its variable).
    def check_target!
      return self unless @target_error
      name = @target_from == TARGET_VARIABLE ? "#{TARGET_VARIABLE}=#{@target.inspect}" : "target: #{@target.inspect}"
      raise ConfigurationError, "#{name} is not a sidecar address: #{@target_error}"
    end

    def target_variable
      @target_from
    end

    def metrics
      @lock.synchronize { JSON.parse(JSON.generate(@counters)) }
    end

    def count(group, key = nil)
      @lock.synchronize { key.nil? ? @counters[group] += 1 : @counters[group][key] += 1 }
    end

    # A job this adapter finished: dead-lettered or dropped.
    def count_terminal(dead_letter)
      count(dead_letter ? "dead_lettered" : "dropped")
      Metrics.terminal(dead_letter ? "dead_letter" : "drop")
    end

    def cached_policy(queue)
      @lock.synchronize { @policies[queue] }
    end

    # Fetches the queue's policy now (in the caller's thread): :ok, :not_found or :unavailable.
    def fetch_policy(queue, quiet: false)
      raise ConfigurationError, @target_error if @client.nil?
      res = @client.get_policy(queue)
      ref = res.policy
      resolved = self.class.resolved_from_wire(res.resolved)
      rollout = CachedRollout.hash_from_wire(res.rollout) { |canary| self.class.resolved_from_wire(canary) }
      remember(queue, ref.config_hash, resolved, "#{ref.namespace}/#{ref.name}", rollout)
      begin
        entry = {"configHash" => ref.config_hash, "name" => ref.name, "namespace" => ref.namespace,
                 "generation" => ref.generation.to_i, "resolved" => resolved}
        entry["rollout"] = rollout if rollout # other processes must assign jobs alike
        @store&.write(queue, entry)
      rescue StandardError => e
        Rebound.log("warn", "rebound.policy_store_failed", queue: queue, error: e.message.to_s[0, 300])
      end
      Rebound.log("info", "rebound.policy_fetched", queue: queue, policy: "#{ref.namespace}/#{ref.name}", config_hash: ref.config_hash)
      :ok
    rescue StandardError => e
      cause = cause_of(e)
      forget(queue) if cause == "not_found" # the sidecar has no policy for it (any more)
      unless quiet
        Rebound.log(cause == "not_found" ? "info" : "warn", "rebound.get_policy_failed", queue: queue, cause: cause,
          target: @target, error: e.message.to_s[0, 300])
      end
      cause == "not_found" ? :not_found : :unavailable
    end

    # Fetches the queue's policy now; true on success.
    def refresh(queue)
      fetch_policy(queue) == :ok
    end

    # GetPolicy for every queue the worker consumes, before any job runs. With the sidecar
    # unreachable: one warning naming the target, the store's copies (policySource=cached)
    # where there are any, and a background thread that tries again every second until the
    # sidecar answers. Returns {queue => :ok | :not_found | :unavailable}.
    def prefetch(queues)
      queues = queues.map(&:to_s).reject(&:empty?).uniq
      results = queues.to_h { |q| [q, fetch_policy(q, quiet: true)] }
      missing = results.select { |_, r| r == :unavailable }.keys
      results.each { |q, r| Rebound.log("info", "rebound.policy_missing", queue: q) if r == :not_found }
      unless missing.empty?
        loaded = missing.select { |q| load_stored(q) }
        Rebound.log("warn", "rebound.sidecar_unavailable", target: @target, queues: missing, cached_from_store: loaded,
          error: @target_error || "GetPolicy failed")
        @lock.synchronize { @pending = missing }
        retry_prefetch_in_background
      end
      results
    end

    # The answer for this failure: a Hash in DecideResponse's proto3 JSON names plus
    # "source" (sidecar | fallback) and "policySource" (sidecar | cached | default).
    def decide(queue, attempt, job_id: nil, error_class: nil, first_failure_unix_ms: nil, retry_after_ms: nil)
      f = normalised(queue, attempt, job_id, error_class, first_failure_unix_ms, retry_after_ms)
      begin
        decide_normalised(f)
      rescue Exception => e # rubocop:disable Lint/RescueException -- never raise from the retry path
        last_resort(f, e)
      end
    end

    # The fallback's answer without asking the sidecar (the adapter's own errors end here).
    def decide_locally(queue, attempt, job_id: nil, error_class: nil, first_failure_unix_ms: nil, retry_after_ms: nil, cause: "adapter_error")
      f = normalised(queue, attempt, job_id, error_class, first_failure_unix_ms, retry_after_ms)
      begin
        fallback(f, cause, nil)
      rescue Exception => e # rubocop:disable Lint/RescueException -- never raise from the retry path
        last_resort(f, e)
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
        "revision" => res.revision.to_s,
      }
    end

    private

    def normalised(queue, attempt, job_id, error_class, first_failure_unix_ms, retry_after_ms)
      self.class.normalise(queue, attempt, job_id, error_class, first_failure_unix_ms, retry_after_ms)
    rescue StandardError
      {"queue" => queue.to_s, "attempt" => 1}
    end

    def remember(queue, config_hash, resolved, identity, rollout = nil)
      prepared = Decide::PreparedPolicy.new(resolved, identity)
      cached = [config_hash, resolved, prepared, CachedRollout.from_hash(rollout, identity)]
      @lock.synchronize { @policies[queue] = cached }
    end

    def forget(queue)
      @lock.synchronize { @policies.delete(queue) }
      @store&.delete(queue) if @store.respond_to?(:delete)
    rescue StandardError
      nil
    end

    # The store's copy of the queue's policy (saved by any process of the worker), if any.
    def load_stored(queue)
      e = @store&.read(queue)
      return false unless e.is_a?(Hash) && e["resolved"].is_a?(Hash)
      remember(queue, e["configHash"].to_s, e["resolved"], "#{e["namespace"]}/#{e["name"]}", e["rollout"])
      Rebound.log("info", "rebound.policy_loaded", queue: queue, policy: "#{e["namespace"]}/#{e["name"]}",
        config_hash: e["configHash"], from: "store")
      true
    rescue StandardError => e
      Rebound.log("warn", "rebound.policy_store_failed", queue: queue, error: e.message.to_s[0, 300])
      false
    end

    def cause_of(err)
      return "bad_target" if err.is_a?(ConfigurationError)
      err.is_a?(GRPC::BadStatus) ? CAUSES.fetch(err.code, "other") : "other"
    end

    def fork_reset
      @refreshing, @pid = {}, Process.pid if @pid != Process.pid # threads do not survive fork
    end

    def refresh_in_background(queue)
      @lock.synchronize do
        fork_reset
        return if @refreshing[queue]
        @refreshing[queue] = true
      end
      Thread.new do
        refresh(queue)
      ensure
        @lock.synchronize { @refreshing.delete(queue) }
      end
    end

    def retry_prefetch_in_background
      return if @client.nil?
      @lock.synchronize do
        fork_reset
        return if @refreshing[:prefetch]
        @refreshing[:prefetch] = true
      end
      Thread.new do
        loop do
          sleep PREFETCH_RETRY_S
          queues = @lock.synchronize { @pending.dup }
          break if queues.empty?
          left = queues.select { |q| fetch_policy(q, quiet: true) == :unavailable }
          @lock.synchronize { @pending &= left }
          if left.length < queues.length
            Rebound.log("info", "rebound.sidecar_available", target: @target, fetched: queues - left)
          end
        end
      rescue StandardError => e
        Rebound.hook_error("rebound.prefetch_failed", error: e.inspect[0, 300])
      ensure
        @lock.synchronize { @refreshing.delete(:prefetch) }
      end
    end

    def decide_normalised(f)
      answer = begin
        raise ConfigurationError, @target_error if @client.nil?
        req = V1::DecideRequest.new(queue: f["queue"], attempt: f["attempt"], job_id: f.fetch("jobId", ""),
          error_class: f.fetch("errorClass", ""), first_failure_unix_ms: f.fetch("firstFailureUnixMs", 0),
          retry_after_ms: f.fetch("retryAfterMs", 0))
        a = self.class.answer_from_wire(@client.decide(req))
        a["source"] = "sidecar"
        a["policySource"] = "sidecar"
        cached = cached_policy(f["queue"])
        refresh_in_background(f["queue"]) if cached.nil? || cached[0] != a["policy"]["configHash"]
        a
      rescue StandardError => e
        fallback(f, cause_of(e), e)
      end
      count("decisions", answer["decision"] == "DECISION_RETRY" ? answer["decision"] : answer["reason"])
      Metrics.decision(answer["source"])
      answer
    end

    def fallback(f, cause, err)
      cached = cached_policy(f["queue"])
      cached = cached_policy(f["queue"]) if cached.nil? && load_stored(f["queue"])
      ctx = f.slice("jobId", "errorClass", "firstFailureUnixMs", "retryAfterMs")
      ctx["nowUnixMs"] = now = (Time.now.to_r * 1000).to_i
      # Clamped to now, as the sidecar clamps it before assigning and deciding.
      ctx["firstFailureUnixMs"] = [ctx["firstFailureUnixMs"], now].min if ctx.key?("firstFailureUnixMs")
      prepared, revision =
        if cached.nil? then [@default, ""]
        elsif cached[3] then cached[3].pick(cached[2], f["jobId"], ctx["firstFailureUnixMs"], now)
        else [cached[2], ""]
        end
      a = Decide.decide_prepared(prepared, f["attempt"], ctx)
      a["source"] = "fallback"
      a["revision"] = revision
      a["policySource"] = cached ? "cached" : "default"
      # A retry budget is one sidecar's schedule: a local answer is never stretched.
      a["budgetStretched"] = false
      a["budgetDelayMs"] = 0
      count("fallback", cause)
      count("fallback", "total")
      count("fallback", "default_policy") unless cached
      Metrics.fallback(cause, a["policySource"])
      Rebound.log("warn", "rebound.fallback", queue: f["queue"], cause: cause, source: a["source"],
        policy_source: a["policySource"], target: @target, attempt: f["attempt"], decision: a["decision"],
        delay_ms: a["delayMs"], error: (err ? err.message : cause).to_s[0, 300])
      a
    end

    def last_resort(f, err)
      Rebound.hook_error("rebound.fallback_failed", queue: f["queue"], error: err.inspect[0, 300])
      {"decision" => "DECISION_RETRY", "delayMs" => LAST_RESORT_DELAY_MS, "source" => "fallback",
       "policySource" => "default", "lastResort" => true,
       "disposition" => "DISPOSITION_UNSPECIFIED", "deadLetterQueue" => "",
       "reason" => "GIVE_UP_REASON_UNSPECIFIED", "reasonMessage" => "",
       "budgetStretched" => false, "budgetDelayMs" => 0, "revision" => ""}
    end
  end
end
