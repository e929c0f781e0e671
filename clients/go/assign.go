package rebound

import "unicode/utf8"

// A port of the policy crate's rollout assignment (policy/src/rollout/assign.rs): which
// revision of a policy in rollout answers a job. The fallback must pick the revision the
// sidecar picks, so it reproduces every case of policy/testdata/assign-vectors.json; the
// algorithm is specified in policy/testdata/README.md ("Rollout assignment vectors").

// RolloutArm is the revision that answers a job; the values are the vectors' names.
type RolloutArm string

const (
	// ArmStable is the revision that served before the rollout (GetPolicy's policy).
	ArmStable RolloutArm = "STABLE"
	// ArmCanary is the revision being rolled out (the rollout's canary).
	ArmCanary RolloutArm = "CANARY"
)

// maxRolloutSteps and maxRolloutWeight are spec::limits::MAX_ROLLOUT_STEPS and
// MAX_ROLLOUT_WEIGHT: a valid rollout never exceeds them.
const (
	maxRolloutSteps  = 10
	maxRolloutWeight = 99
)

// RolloutStep is one started step (rebound.v1.RolloutStep): from StartUnixMs on, Weight
// percent of newly failing jobs get the canary.
type RolloutStep struct {
	Weight      uint32
	StartUnixMs uint64
}

// wellFormed says whether steps are what a valid rollout holds: at most 10, weights in
// 1..99 strictly increasing, starts non-decreasing. The sidecar refuses anything else, so
// the fallback serves the stable revision rather than guess.
func wellFormed(steps []RolloutStep) bool {
	if len(steps) > maxRolloutSteps {
		return false
	}
	for i, s := range steps {
		if s.Weight < 1 || s.Weight > maxRolloutWeight {
			return false
		}
		if i > 0 && (s.Weight <= steps[i-1].Weight || s.StartUnixMs < steps[i-1].StartUnixMs) {
			return false
		}
	}
	return true
}

// rolloutBucket is a job id's bucket in 0..100 for a revision: the same job and revision
// always give the same bucket.
func rolloutBucket(revision, jobID string) uint32 {
	return uint32(mix64(fnv1a64(jobID)^fnv1a64(revision)) % 100)
}

// Arm is the revision that answers a job of a policy in rollout to revision (its id, which
// salts the hash) with the steps started so far: ArmCanary iff the job's bucket is below
// the weight of the last step started at or before its first failure. As in [Context],
// zero values mean "not given": no jobID ("") gives ArmStable and no bucket; an unknown
// first failure (0, as the protocol sends it) places the job by nowUnixMs. Malformed steps
// give ArmStable; a jobID or revision that is not valid UTF-8 counts as no job id.
// hasBucket is false exactly when there is no job id.
func Arm(revision string, steps []RolloutStep, jobID string, firstFailureUnixMs, nowUnixMs uint64) (arm RolloutArm, bucket uint32, hasBucket bool) {
	// Text that is not UTF-8 is no job id a sidecar accepts, and other ports cannot hash it.
	if jobID == "" || !utf8.ValidString(jobID) || !utf8.ValidString(revision) {
		return ArmStable, 0, false
	}
	bucket = rolloutBucket(revision, jobID)
	if !wellFormed(steps) {
		return ArmStable, bucket, true
	}
	t := firstFailureUnixMs
	if t == 0 {
		t = nowUnixMs
	}
	// Starts are non-decreasing, so the steps started by t are a prefix.
	started := 0
	for started < len(steps) && steps[started].StartUnixMs <= t {
		started++
	}
	if started > 0 && bucket < steps[started-1].Weight {
		return ArmCanary, bucket, true
	}
	return ArmStable, bucket, true
}
