# frozen_string_literal: true

require "rebound/decide"

module Rebound
  # A port of the policy crate's rollout assignment (policy/src/rollout/assign.rs): which
  # revision of a policy in rollout answers a job.
  #
  # The fallback must pick the revision the sidecar picks, so it reproduces every case of
  # policy/testdata/assign-vectors.json; the algorithm is specified in
  # policy/testdata/README.md ("Rollout assignment vectors"). 64-bit values are Integers,
  # hashed with Decide's fnv1a64 and mix64.
  module Assign
    # The revision that served before the rollout (GetPolicy's policy).
    STABLE = "STABLE"
    # The revision being rolled out (the rollout's canary).
    CANARY = "CANARY"
    # spec::limits::MAX_ROLLOUT_STEPS and MAX_ROLLOUT_WEIGHT: a valid rollout stays within them.
    MAX_ROLLOUT_STEPS = 10
    MAX_ROLLOUT_WEIGHT = 99
    DECIMAL = /\A[0-9]{1,20}\z/.freeze

    module_function

    # A rollout ready for repeated assignments: the revision's hash and the check of its
    # steps done once, when GetPolicy's answer is loaded, not on every job. `revision` is the
    # new revision's id (it salts the hash); `steps` the steps started so far (Hashes
    # "weight", "startUnixMs", as GetPolicy's rollout gives them).
    class PreparedRollout
      # salt: fnv1a64(revision), nil when the revision is not a valid String (every job then
      # STABLE, no bucket). steps: [weight, start] pairs, nil when malformed (every job STABLE).
      attr_reader :salt, :steps

      def initialize(revision, steps)
        revision = Assign.utf8(revision)
        @salt = revision && Decide.fnv1a64(revision)
        @steps = Assign.well_formed(steps)
      end
    end

    # The revision that answers a job: {"arm" => "STABLE" | "CANARY", "bucket" => 0..99},
    # the shape of the vectors' "expected".
    #
    # "bucket" is present exactly when there is a job id (a non-empty String). CANARY iff the
    # bucket is below the weight of the last step started at or before the job's first
    # failure; an unknown first failure (nil or 0, as the protocol sends it) places the job
    # by `now_unix_ms`. Times are Integers or decimal Strings. Malformed input (steps, times,
    # a non-String revision) gives STABLE, and an id that is not valid UTF-8 counts as no job
    # id; it never raises.
    def arm_prepared(prepared, job_id, first_failure_unix_ms, now_unix_ms)
      job_id = utf8(job_id)
      return { "arm" => STABLE } if job_id.nil? || job_id.empty? || prepared.salt.nil?

      bucket = Decide.mix64(Decide.fnv1a64(job_id) ^ prepared.salt) % 100
      first = first_failure_unix_ms.nil? ? 0 : u64(first_failure_unix_ms)
      t = first == 0 ? u64(now_unix_ms) : first
      return { "arm" => STABLE, "bucket" => bucket } if prepared.steps.nil? || t.nil?

      weight = 0
      # Starts are non-decreasing, so the steps started by t are a prefix.
      prepared.steps.each do |w, start|
        break if start > t

        weight = w
      end
      { "arm" => bucket < weight ? CANARY : STABLE, "bucket" => bucket }
    end

    # One-shot form of arm_prepared.
    def arm(revision, steps, job_id, first_failure_unix_ms, now_unix_ms)
      arm_prepared(PreparedRollout.new(revision, steps), job_id, first_failure_unix_ms, now_unix_ms)
    end

    # The String as valid UTF-8, or nil: bytes that are not UTF-8 are no id a sidecar
    # accepts, and the other ports could not hash them alike.
    def utf8(v)
      return nil unless v.is_a?(String)

      s = v.encoding == Encoding::UTF_8 ? v : v.encode(Encoding::UTF_8)
      s.valid_encoding? ? s : nil
    rescue EncodingError
      nil
    end

    # A uint64 from an Integer or a decimal String (proto3 JSON); nil for anything else.
    def u64(v)
      n = case v
          when Integer then v
          when String then DECIMAL.match?(v) ? v.to_i : nil
          end
      n if n && n >= 0 && n <= Decide::MASK64
    end

    # The steps as [weight, start] pairs, or nil unless they are what a valid rollout holds:
    # an Array of at most 10, weights Integers in 1..99 strictly increasing, starts uint64s
    # non-decreasing. The sidecar refuses anything else, so the fallback serves the stable
    # revision rather than guess.
    def well_formed(steps)
      return nil unless steps.is_a?(Array) && steps.length <= MAX_ROLLOUT_STEPS

      steps.each_with_object([]) do |step, out|
        return nil unless step.is_a?(Hash)

        weight = step["weight"]
        start = u64(step["startUnixMs"])
        return nil unless weight.is_a?(Integer) && weight.between?(1, MAX_ROLLOUT_WEIGHT) && start
        return nil if !out.empty? && (weight <= out.last[0] || start < out.last[1])

        out << [weight, start]
      end
    end
  end
end
