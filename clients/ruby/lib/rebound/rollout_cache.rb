# frozen_string_literal: true

require "rebound/assign"
require "rebound/decide"

module Rebound
  # GetPolicy's rollout as the fallback keeps it: prepared once when the policy is cached
  # (or read from the store), so the fallback picks, per job, the revision the sidecar picks.
  class CachedRollout
    attr_reader :revision, :stable_revision

    # The rollout in its stored form ("revision", "stableRevision", "canary" as a resolved
    # policy, "steps" as [{"weight", "startUnixMs"}]) with the canary prepared under the
    # policy's identity: both revisions share the jitter seed, as in the sidecar.
    def self.from_hash(h, identity)
      return nil unless h.is_a?(Hash) && h["canary"].is_a?(Hash)

      new(h, identity)
    end

    # The stored form of GetPolicyResponse.rollout, its canary turned into a resolved policy
    # by the block (the caller's wire reader, so that this file needs nothing above it); nil
    # when the policy is not in rollout.
    def self.hash_from_wire(r)
      return nil if r.nil? || r.canary.nil?

      {"revision" => r.revision, "stableRevision" => r.stable_revision,
       "canary" => yield(r.canary),
       "steps" => r.steps.map { |s| {"weight" => s.weight, "startUnixMs" => s.start_unix_ms} }}
    end

    def initialize(h, identity)
      @revision = h["revision"].to_s
      @stable_revision = h["stableRevision"].to_s
      @assign = Assign::PreparedRollout.new(h["revision"], h["steps"])
      @canary = Decide::PreparedPolicy.new(h["canary"], identity)
    end

    # [prepared, revision]: the revision answering the job.
    def pick(stable, job_id, first_failure_unix_ms, now_unix_ms)
      if Assign.arm_prepared(@assign, job_id, first_failure_unix_ms, now_unix_ms)["arm"] == Assign::CANARY
        [@canary, @revision]
      else
        [stable, @stable_revision]
      end
    end
  end
end
