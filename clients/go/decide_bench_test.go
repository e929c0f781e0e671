package rebound

import (
	"testing"

	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

// benchPolicy is the fallback policy with non-retryable patterns to match on every call.
func benchPolicy() *pb.ResolvedPolicy {
	p := DefaultPolicy()
	p.NonRetryableErrors = []string{"CardDeclined", "http.4*", "*.fatal", "smtp.5*.perm*"}
	return p
}

var benchContext = Context{JobID: "3f0c9a4e-0-4e3a-9c1e-2b7d5f8a0c31", ErrorClass: "http.503",
	FirstFailureUnixMs: 1_800_000_000_000 - 60_000, NowUnixMs: 1_800_000_000_000}

// The fallback path: a policy prepared once when it was fetched.
func BenchmarkPreparedPolicyDecide(b *testing.B) {
	prepared := PreparePolicy(benchPolicy(), "bench/webhooks")
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if _, err := prepared.Decide(uint64(1+i%24), benchContext); err != nil {
			b.Fatal(err)
		}
	}
}

// The one-shot form: the policy prepared again on every call.
func BenchmarkDecideLocal(b *testing.B) {
	policy := benchPolicy()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if _, err := DecideLocal(policy, "bench/webhooks", uint64(1+i%24), benchContext); err != nil {
			b.Fatal(err)
		}
	}
}

// The one-shot rollout assignment: three steps started, the revision hashed and the steps
// checked on every call.
func BenchmarkArm(b *testing.B) {
	const revision = "sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c"
	steps := []RolloutStep{{10, 1_800_000_000_000}, {50, 1_800_000_600_000}, {99, 1_800_002_400_000}}
	b.ReportAllocs()
	for b.Loop() {
		Arm(revision, steps, benchContext.JobID, benchContext.FirstFailureUnixMs, benchContext.NowUnixMs)
	}
}

// The prepared form: the revision hashed and the steps checked once.
func BenchmarkPreparedRolloutArm(b *testing.B) {
	r := PrepareRollout("sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c",
		[]RolloutStep{{10, 1_800_000_000_000}, {50, 1_800_000_600_000}, {99, 1_800_002_400_000}})
	b.ReportAllocs()
	for b.Loop() {
		r.Arm(benchContext.JobID, benchContext.FirstFailureUnixMs, benchContext.NowUnixMs)
	}
}
