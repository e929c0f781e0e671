# frozen_string_literal: true

require "json"

module Rebound
  # A port of the policy crate's decision function, for the local fallback.
  #
  # It must give the sidecar's answers bit for bit: the algorithm is specified in
  # policy/testdata/README.md and checked against decide-vectors.json. Delay arithmetic is
  # Ruby Float (IEEE-754 binary64) in the order written there; 64-bit values are Integers
  # masked to 64 bits.
  module Decide
    MASK64 = (1 << 64) - 1
    GOLDEN_GAMMA = 0x9E3779B97F4A7C15
    FNV_OFFSET = 0xCBF29CE484222325
    FNV_PRIME = 0x100000001B3
    TWO_POW_MINUS_53 = 2.0**-53
    # spec::limits::MAX_ATTEMPTS: retries are clamped to it.
    MAX_ATTEMPTS = 10_000
    # A pushback is honoured up to max(cap, 24h).
    MIN_PUSHBACK_LIMIT_MS = 86_400_000

    module_function

    def fnv1a64(text)
      h = FNV_OFFSET
      text.to_s.encode("UTF-8").each_byte { |b| h = ((h ^ b) * FNV_PRIME) & MASK64 }
      h
    end

    def mix64(z)
      z = (z + GOLDEN_GAMMA) & MASK64
      z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
      z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
      z ^ (z >> 31)
    end

    # Rust's f64::min / f64::max ignore a NaN operand.
    def fmin(a, b)
      return b if a.nan?
      return a if b.nan?
      a < b ? a : b
    end

    def fmax(a, b)
      return b if a.nan?
      return a if b.nan?
      a > b ? a : b
    end

    # Rust's `f64 as u64`: truncation; NaN and negatives to 0, +inf to u64::MAX.
    def to_u64(x)
      return 0 unless x > 0
      return MASK64 if x.infinite?
      [x.to_i, MASK64].min
    end

    # The random stream of one (job id, identity): unit(i) in [0, 1).
    class Draws
      def initialize(job_id, identity_seed)
        @seed = job_id.nil? ? nil : Decide.mix64(Decide.fnv1a64(job_id) ^ identity_seed)
      end

      def unit(i)
        return Random.rand if @seed.nil? # without a job id the sidecar draws at random; so does this
        bits = Decide.mix64((@seed + i * GOLDEN_GAMMA) & MASK64)
        (bits >> 11).to_f * TWO_POW_MINUS_53
      end
    end

    # A "*" glob matched like policy/src/pattern.rs (leftmost literal runs, whole name).
    def compile_glob(pattern)
      parts = pattern.split("*", -1)
      return ->(name) { name == pattern } if parts.length == 1
      prefix = parts.first
      suffix = parts.last
      runs = parts[1..-2].reject(&:empty?)
      lambda do |name|
        next false if name.bytesize < prefix.bytesize + suffix.bytesize
        next false unless name.start_with?(prefix) && name.end_with?(suffix)
        b = name.b
        pos = prefix.bytesize
        stop = b.bytesize - suffix.bytesize
        runs.all? do |run|
          at = b.index(run.b, pos)
          ok = !at.nil? && at + run.bytesize <= stop
          pos = at + run.bytesize if ok
          ok
        end
      end
    end

    def exponential(base, multiplier, k)
      power = 1.0
      square = multiplier
      e = k - 1
      while e > 0
        power *= square if e & 1 == 1
        e >>= 1
        square *= square if e > 0
      end
      base * power
    end

    def after(o, n)
      [o[0] + o[1] * n[0], o[1] * n[1], fmin(o[2], o[0] + o[1] * n[2])]
    end

    def apply(m, x)
      fmin(m[0] + m[1] * x, m[2])
    end

    def decorrelated(base, cap, k, draws)
      step = lambda do |i|
        u = draws.unit(i)
        [base * (1.0 - u), 3.0 * u, cap]
      end
      whole = k - (k % 4)
      v = base
      (0...whole).step(4) do |i|
        first = after(step.call(i + 2), step.call(i + 1))
        second = after(step.call(i + 4), step.call(i + 3))
        v = apply(after(second, first), v)
      end
      ((whole + 1)..k).each { |i| v = apply(step.call(i), v) }
      v
    end

    def delay(p, k, remaining, draws)
      k = k.clamp(1, MAX_ATTEMPTS)
      cap = p["capMs"].to_f
      base = p["baseMs"].to_f
      window = remaining.nil? ? cap : fmin(cap, remaining.to_f)
      capped =
        case p["strategy"]
        when "STRATEGY_EXPONENTIAL" then fmin(exponential(base, p["multiplier"].to_f, k), cap)
        when "STRATEGY_LINEAR" then fmin(base * k.to_f, cap)
        when "STRATEGY_CONSTANT" then fmin(base, cap)
        when "STRATEGY_SCHEDULE"
          sched = p["scheduleMs"]
          fmin(sched.empty? ? base : sched[[k, sched.length].min - 1].to_f, cap)
        when "STRATEGY_DECORRELATED"
          return to_u64(fmin(decorrelated(base, cap, k, draws), window))
        else
          raise ArgumentError, "policy.strategy: unknown strategy #{p["strategy"].inspect}"
        end
      jitter = p["jitter"]
      return to_u64(capped) if jitter == "JITTER_NONE"
      capped = fmin(capped, window)
      j =
        case jitter
        when "JITTER_FULL" then capped * draws.unit(k)
        when "JITTER_EQUAL" then capped / 2.0 + (capped / 2.0) * draws.unit(k)
        when "JITTER_PROPORTIONAL"
          r = p["jitterRatio"].to_f
          capped * ((1.0 - r) + (2.0 * r) * draws.unit(k))
        else
          raise ArgumentError, "policy.jitter: unknown jitter #{jitter.inspect}"
        end
      return 0 if j.nan?
      to_u64([[j, 0.0].max, window].min)
    end

    # format_millis: 1h2m3s4ms, exact.
    def format_millis(ms)
      rest = ms.to_i
      return "0s" if rest.zero?
      out = +""
      [["h", 3_600_000], ["m", 60_000], ["s", 1000], ["ms", 1]].each do |unit, size|
        n = rest / size
        next unless n > 0
        out << "#{n}#{unit}"
        rest -= n * size
      end
      out
    end

    # A ResolvedPolicy (proto3 JSON names) with its identity hash and globs computed once.
    class PreparedPolicy
      attr_reader :params, :identity, :identity_seed, :globs

      def initialize(policy, identity)
        @params = policy
        @identity = identity
        @identity_seed = Decide.fnv1a64(identity)
        @globs = policy["nonRetryableErrors"].map { |pat| [pat, Decide.compile_glob(pat)] }
      end
    end

    def opt_int(v)
      v.nil? ? nil : Integer(v)
    end

    # The answer for attempt `attempt` (1-based; 0 reads as 1), a Hash in DecideResponse's
    # proto3 JSON names. ctx keys (all optional): jobId, errorClass, firstFailureUnixMs,
    # nowUnixMs, retryAfterMs.
    def decide_prepared(prepared, attempt, ctx = {})
      p = prepared.params
      k = [Integer(attempt), 1].max
      give_up = lambda do |reason, message|
        terminal = p["terminal"]
        {"decision" => "DECISION_GIVE_UP", "delayMs" => 0, "disposition" => terminal,
         "deadLetterQueue" => terminal == "DISPOSITION_DEAD_LETTER" ? p["deadLetterQueue"] : "",
         "reason" => reason, "reasonMessage" => message}
      end

      error_class = ctx["errorClass"]
      unless error_class.nil?
        prepared.globs.each do |pattern, glob|
          next unless glob.call(error_class)
          return give_up.call("GIVE_UP_REASON_NON_RETRYABLE",
            "error class #{JSON.generate(error_class)} is non-retryable (matches #{JSON.generate(pattern)})")
        end
      end
      max_attempts = Integer(p["maxAttempts"])
      if k >= max_attempts
        msg = if k == max_attempts
          "attempt #{k} of #{max_attempts} failed (maxAttempts)"
        else
          "attempt #{k} failed, past maxAttempts #{max_attempts} (runs including the first)"
        end
        return give_up.call("GIVE_UP_REASON_MAX_ATTEMPTS", msg)
      end

      first = opt_int(ctx["firstFailureUnixMs"])
      now = opt_int(ctx["nowUnixMs"])
      elapsed = (!first.nil? && !now.nil? && now > first) ? now - first : 0
      limit = Integer(p["maxRetryDurationMs"])
      limit = nil unless limit > 0
      remaining = limit.nil? ? nil : [limit - elapsed, 0].max
      d = delay(p, k, remaining, Draws.new(ctx["jobId"], prepared.identity_seed))
      pushback = opt_int(ctx["retryAfterMs"])
      d = [d, [pushback, [Integer(p["capMs"]), MIN_PUSHBACK_LIMIT_MS].max].min].max unless pushback.nil?
      unless limit.nil?
        nxt = [elapsed + d, MASK64].min
        if nxt > limit
          return give_up.call("GIVE_UP_REASON_DEADLINE",
            "the next run would start #{format_millis(nxt)} after the first failure, " \
            "past maxRetryDuration #{format_millis(limit)}")
        end
      end
      {"decision" => "DECISION_RETRY", "delayMs" => d, "disposition" => "DISPOSITION_UNSPECIFIED",
       "deadLetterQueue" => "", "reason" => "GIVE_UP_REASON_UNSPECIFIED", "reasonMessage" => ""}
    end

    # One-shot form of decide_prepared.
    def decide_local(policy, identity, attempt, ctx = {})
      decide_prepared(PreparedPolicy.new(policy, identity), attempt, ctx)
    end
  end
end
