package rebound

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
)

// rolloutDoc is a compiled document whose policy "payments" rolls out: stable 25 attempts
// from 1 s then a dead letter, canary 2 attempts from 300 ms then a drop; steps of 20 %
// (from 2023-11-14) and 50 % (from 2025-06-15).
var rolloutDoc = filepath.Join(devstack.RepoRoot(), "clients", "conformance", "rollout-policies.json")

// startRolloutSidecar serves rolloutDoc in file mode (--policies-dir).
func startRolloutSidecar(t *testing.T) *devstack.Sidecar {
	t.Helper()
	dir := filepath.Join(devstack.StateDir("client"), t.Name())
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(rolloutDoc)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "policies.json"), doc, 0o644); err != nil {
		t.Fatal(err)
	}
	port, err := devstack.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s := &devstack.Sidecar{
		Args:       []string{"--policies-dir", dir, "--namespace", "shop", "--no-admin"},
		Target:     fmt.Sprintf("127.0.0.1:%d", port),
		Log:        filepath.Join(dir, "sidecar.log"),
		ReadyQueue: "payments",
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return s
}

// rolloutFailures are 200 jobs of "payments", attempts 1..3, first failing before the
// rollout, during its 20 % step, during its 50 % step, or at an unknown time.
func rolloutFailures() []Failure {
	firsts := []time.Time{
		time.UnixMilli(1_690_000_000_000), // before the first step: stable
		time.UnixMilli(1_720_000_000_000), // 20 %
		time.UnixMilli(1_760_000_000_000), // 50 %
		{},                                // unknown: placed by now, 50 %
	}
	out := make([]Failure, 200)
	for i := range out {
		out[i] = Failure{Queue: "payments", Attempt: 1 + i%3, JobID: fmt.Sprintf("job-%d", i), FirstFailure: firsts[i%4]}
	}
	return out
}

type rolloutVerdict struct {
	verdict
	Revision string
}

// While the sidecar is down, a job of a policy in rollout gets the revision — and the
// answer — the sidecar gave it.
func TestSidecarKilledFallbackFollowsRollout(t *testing.T) {
	s := startRolloutSidecar(t)
	c := newClient(t, s.Target)
	ctx := context.Background()
	fs := rolloutFailures()
	want := make([]rolloutVerdict, len(fs))
	revisions := map[string]int{}
	for i, f := range fs {
		a := c.Decide(ctx, f)
		if a.Source != SourceSidecar || a.Revision == "" {
			t.Fatalf("%+v: %+v", f, a)
		}
		want[i] = rolloutVerdict{verdictOf(a), a.Revision}
		revisions[a.Revision]++
	}
	if len(revisions) != 2 {
		t.Fatalf("want both revisions among %d jobs, got %v", len(fs), revisions)
	}
	if ref, _ := c.Policy("payments"); ref == nil {
		t.Fatal("payments not cached")
	}
	s.Kill()
	answers, revs := 0, 0
	for i, f := range fs {
		a := c.Decide(ctx, f)
		if a.Source != SourceFallback || a.PolicySource != PolicyCached {
			t.Fatalf("%+v: source %s/%s", f, a.Source, a.PolicySource)
		}
		if verdictOf(a) != want[i].verdict {
			answers++
			t.Logf("%s: fallback %+v, sidecar said %+v", f.JobID, verdictOf(a), want[i].verdict)
		}
		if a.Revision != want[i].Revision {
			revs++
		}
	}
	if answers != 0 || revs != 0 {
		t.Fatalf("of %d jobs (revisions %v), %d fallback answers and %d revisions differ from the sidecar's",
			len(fs), revisions, answers, revs)
	}
}
