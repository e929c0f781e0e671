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

// PreparedRollout is a rollout ready for repeated assignments: the revision's hash and the
// check of its steps are done once, when GetPolicy's answer is loaded, not on every job.
type PreparedRollout struct {
	// salt is fnv1a64(revision); valid is false when revision is not UTF-8.
	salt  uint64
	valid bool
	// steps is nil when they are malformed: every job then gets ArmStable.
	steps []RolloutStep
}

// PrepareRollout prepares a rollout to revision (its id, which salts the hash) with the
// steps started so far. steps is kept, not copied: do not change it afterwards.
func PrepareRollout(revision string, steps []RolloutStep) *PreparedRollout {
	r := &PreparedRollout{salt: fnv1a64(revision), valid: utf8.ValidString(revision)}
	if wellFormed(steps) {
		r.steps = steps
	}
	return r
}

// Arm is the revision that answers a job of a policy in rollout to revision (its id, which
// salts the hash) with the steps started so far: the one-shot form of
// [PreparedRollout.Arm].
func Arm(revision string, steps []RolloutStep, jobID string, firstFailureUnixMs, nowUnixMs uint64) (arm RolloutArm, bucket uint32, hasBucket bool) {
	return PrepareRollout(revision, steps).Arm(jobID, firstFailureUnixMs, nowUnixMs)
}

// Arm is the revision that answers a job: ArmCanary iff the job's bucket (0..99) is below
// the weight of the last step started at or before its first failure. As in [Context],
// zero values mean "not given": no jobID ("") gives ArmStable and no bucket; an unknown
// first failure (0, as the protocol sends it) places the job by nowUnixMs. Malformed steps
// give ArmStable; a jobID or revision that is not valid UTF-8 counts as no job id.
// hasBucket is false exactly when there is no job id.
func (r *PreparedRollout) Arm(jobID string, firstFailureUnixMs, nowUnixMs uint64) (arm RolloutArm, bucket uint32, hasBucket bool) {
	// Text that is not UTF-8 is no job id a sidecar accepts, and other ports cannot hash it.
	if jobID == "" || !r.valid || !utf8.ValidString(jobID) {
		return ArmStable, 0, false
	}
	bucket = uint32(mix64(fnv1a64(jobID)^r.salt) % 100)
	t := firstFailureUnixMs
	if t == 0 {
		t = nowUnixMs
	}
	// Starts are non-decreasing, so the steps started by t are a prefix.
	started := 0
	for started < len(r.steps) && r.steps[started].StartUnixMs <= t {
		started++
	}
	if started > 0 && bucket < r.steps[started-1].Weight {
		return ArmCanary, bucket, true
	}
	return ArmStable, bucket, true
}
