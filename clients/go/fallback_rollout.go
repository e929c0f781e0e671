package rebound

import pb "github.com/rebound-dev/rebound/clients/go/reboundv1"

// cachedRollout is GetPolicy's rollout, prepared once: both revisions share the policy's
// identity (its jitter seed), as in the sidecar.
type cachedRollout struct {
	assign         *PreparedRollout
	canary         *PreparedPolicy
	revision       string
	stableRevision string
}

// prepareRollout prepares GetPolicy's rollout, nil when there is none.
func prepareRollout(r *pb.Rollout, identity string) *cachedRollout {
	if r == nil || r.GetCanary() == nil {
		return nil
	}
	steps := make([]RolloutStep, len(r.GetSteps()))
	for i, s := range r.GetSteps() {
		steps[i] = RolloutStep{Weight: s.GetWeight(), StartUnixMs: s.GetStartUnixMs()}
	}
	return &cachedRollout{
		assign:         PrepareRollout(r.GetRevision(), steps),
		canary:         PreparePolicy(r.GetCanary(), identity),
		revision:       r.GetRevision(),
		stableRevision: r.GetStableRevision(),
	}
}

// pick is the revision that answers a job, and its id ("" without a rollout). The first
// failure is clamped to now, as the sidecar clamps it before assigning.
func (p cachedPolicy) pick(jobID string, firstFailureUnixMs, nowUnixMs uint64) (*PreparedPolicy, string) {
	if p.rollout == nil {
		return p.prepared, ""
	}
	if arm, _, _ := p.rollout.assign.Arm(jobID, min(firstFailureUnixMs, nowUnixMs), nowUnixMs); arm == ArmCanary {
		return p.rollout.canary, p.rollout.revision
	}
	return p.prepared, p.rollout.stableRevision
}
