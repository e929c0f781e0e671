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
