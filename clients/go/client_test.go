package rebound

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

const testPolicies = `
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: expo}
spec:
  queues: ["expo", "expo:*"]
  backoff: {strategy: exponential, base: 200ms, multiplier: 2, cap: 30s, jitter: {kind: full}}
  maxAttempts: 8
  nonRetryableErrors: ["CardDeclined", "smtp.5*"]
  terminal: {action: deadLetter, deadLetterQueue: expo-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: email}
spec:
  queues: ["email"]
  backoff: {strategy: decorrelated, base: 5s, cap: 10m}
  maxAttempts: 12
  terminal: {action: drop}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: newsletter}
spec:
  queues: ["newsletter"]
  backoff: {strategy: schedule, schedule: ["1m", "5m", "30m", "2h"], cap: 3h, jitter: {kind: proportional, ratio: 0.2}}
  maxAttempts: 6
  terminal: {action: deadLetter, deadLetterQueue: newsletter-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: linear}
spec:
  queues: ["linear"]
  backoff: {strategy: linear, base: 1s, cap: 20s, jitter: {kind: equal}}
  maxAttempts: 5
  terminal: {action: drop}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: budgeted}
spec:
  queues: ["budgeted"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 5
  retryBudget: {ratePerSecond: 1, burst: 1}
`

var testQueues = []string{"expo", "expo:eu", "email", "newsletter", "linear"}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func startSidecar(t *testing.T) *devstack.Sidecar {
	t.Helper()
	dir := filepath.Join(devstack.StateDir("client"), strings.ReplaceAll(t.Name(), "/", "_"))
	s, err := devstack.NewFileSidecar(dir, "gotest", testPolicies, "expo")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return s
}

func newClient(t *testing.T, target string) *Client {
	t.Helper()
	c, err := New(Options{Target: target, Deadline: 2 * time.Second, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// questions: every queue × attempts 1..13 × 4 job ids × 3 error classes, some with pushback.
func questions() []Failure {
	var out []Failure
	for _, q := range testQueues {
		for attempt := 0; attempt <= 13; attempt++ {
			for j := 0; j < 4; j++ {
				for _, class := range []string{"", "CardDeclined", "smtp.550"} {
					f := Failure{Queue: q, Attempt: attempt, JobID: fmt.Sprintf("job-%d", j), ErrorClass: class}
					if j == 3 {
						f.RetryAfter = 90 * time.Second
					}
					out = append(out, f)
				}
			}
		}
	}
	return out
}

type verdict struct {
	Decision    pb.Decision
	Delay       time.Duration
	Disposition pb.Disposition
	DLQ         string
	Reason      pb.GiveUpReason
}

func verdictOf(a Answer) verdict {
	return verdict{a.Decision, a.Delay, a.Disposition, a.DeadLetterQueue, a.Reason}
}

func localVerdict(t *testing.T, c *Client, f Failure) verdict {
	t.Helper()
	ref, resolved := c.Policy(f.Queue)
	if ref == nil {
		t.Fatalf("no policy for %s", f.Queue)
	}
	r := Normalise(f)
	res, err := DecideLocal(resolved, ref.GetNamespace()+"/"+ref.GetName(), uint64(r.Attempt),
		Context{JobID: r.JobId, ErrorClass: r.ErrorClass, RetryAfterMs: r.RetryAfterMs})
	if err != nil {
		t.Fatal(err)
	}
	v := verdict{res.Decision, 0, res.Disposition, res.DeadLetterQueue, res.Reason}
	if res.Decision == pb.Decision_DECISION_RETRY {
		v.Delay = time.Duration(res.DelayMs) * time.Millisecond
	}
	return v
}

// The sidecar's answers equal the local port's, with the policy GetPolicy returned.
func TestSidecarAnswersEqualLocalPort(t *testing.T) {
	s := startSidecar(t)
	c := newClient(t, s.Target)
	ctx := context.Background()
	qs := questions()
	for _, f := range qs {
		a := c.Decide(ctx, f)
		if a.Source != SourceSidecar {
			t.Fatalf("%+v answered by %s", f, a.Source)
		}
		if got, want := verdictOf(a), localVerdict(t, c, f); got != want {
			t.Fatalf("%+v: sidecar %+v, local %+v", f, got, want)
		}
	}
	m := c.Metrics()
	if m.Fallback.Total != 0 {
		t.Fatalf("fallbacks: %+v", m.Fallback)
	}
	d := m.Decisions
	if d.Retry == 0 || d.GiveUpMaxAttempts == 0 || d.GiveUpNonRetryable == 0 ||
		d.Retry+d.GiveUpMaxAttempts+d.GiveUpNonRetryable != len(qs) {
		t.Fatalf("decisions %+v for %d questions", d, len(qs))
	}
}

// A budget's stretch is reported and included in the delay; a repeat runs at the same time.
func TestRetryBudgetStretchIsReported(t *testing.T) {
	s := startSidecar(t)
	c := newClient(t, s.Target)
	ctx := context.Background()
	// One retry a second: three failures answered within a few ms share at most two slots.
	var answers []Answer
	var askedLast time.Time
	stretched := 0
	for j := 0; j < 3; j++ {
		askedLast = time.Now()
		a := c.Decide(ctx, Failure{Queue: "budgeted", Attempt: 1, JobID: fmt.Sprintf("budget-%d", j)})
		if a.Source != SourceSidecar || !a.Retry() {
			t.Fatalf("answer %d: %+v", j, a)
		}
		if a.Delay != 100*time.Millisecond+a.BudgetDelay || a.BudgetStretched != (a.BudgetDelay > 0) ||
			a.BudgetDelay > 2*time.Second {
			t.Fatalf("answer %d: delay %v, stretched %v by %v", j, a.Delay, a.BudgetStretched, a.BudgetDelay)
		}
		if a.BudgetStretched {
			stretched++
		}
		answers = append(answers, a)
	}
	if stretched == 0 {
		t.Fatalf("three retries in two one-retry slots, none stretched: %+v", answers)
	}
	// The same failure asked again: the same run time (its delay counted from now), no new slot.
	again := c.Decide(ctx, Failure{Queue: "budgeted", Attempt: 1, JobID: "budget-2"})
	between := time.Since(askedLast)
	if earlier := answers[2].Delay - again.Delay; earlier < 0 || earlier > between+time.Millisecond ||
		again.BudgetStretched != answers[2].BudgetStretched {
		t.Fatalf("repeat %+v, first %+v, %v apart", again, answers[2], between)
	}
}

// With the sidecar killed the answers come from the cached policies and are identical;
// once it is back, from the sidecar again.
func TestSidecarKilledFallbackAnswersIdentical(t *testing.T) {
	s := startSidecar(t)
	c := newClient(t, s.Target)
	ctx := context.Background()
	qs := questions()
	want := make([]verdict, len(qs))
	for i, f := range qs {
		want[i] = verdictOf(c.Decide(ctx, f))
	}
	for _, q := range testQueues {
		if ref, _ := c.Policy(q); ref == nil {
			t.Fatalf("%s not cached", q)
		}
	}
	s.Kill()
	for i, f := range qs {
		a := c.Decide(ctx, f)
		if a.Source != SourceFallback || a.PolicySource != PolicyCached {
			t.Fatalf("%+v: source %s/%s", f, a.Source, a.PolicySource)
		}
		if got := verdictOf(a); got != want[i] {
			t.Fatalf("%+v: fallback %+v, sidecar said %+v", f, got, want[i])
		}
		if a.Policy.GetName() == "" {
			t.Fatalf("%+v: fallback without the cached policy's name", f)
		}
	}
	fb := c.Metrics().Fallback
	if fb.Total != len(qs) || fb.Unavailable != len(qs) || fb.DefaultPolicy != 0 {
		t.Fatalf("fallback counters %+v, want %d unavailable", fb, len(qs))
	}

	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	var a Answer
	for i := 0; i < 100; i++ {
		if a = c.Decide(ctx, qs[0]); a.Source == SourceSidecar {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if a.Source != SourceSidecar || verdictOf(a) != want[0] {
		t.Fatalf("after restart: %+v", a)
	}
}

// Nothing listening and nothing cached: the documented default policy, never an error.
func TestNoSidecarAnswersWithDefaultPolicy(t *testing.T) {
	port, err := devstack.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t, fmt.Sprintf("127.0.0.1:%d", port))
	for attempt := 1; attempt <= 11; attempt++ {
		f := Failure{Queue: "anything", Attempt: attempt, JobID: "j1"}
		a := c.Decide(context.Background(), f)
		res, err := DecideLocal(DefaultPolicy(), DefaultIdentity, uint64(attempt), Context{JobID: "j1"})
		if err != nil {
			t.Fatal(err)
		}
		if a.Source != SourceFallback || a.PolicySource != PolicyDefault || a.Decision != res.Decision ||
			a.Delay != time.Duration(res.DelayMs)*time.Millisecond || a.Disposition != res.Disposition {
			t.Fatalf("attempt %d: %+v, default policy says %+v", attempt, a, res)
		}
	}
	m := c.Metrics()
	if m.Fallback.DefaultPolicy != 11 || m.Fallback.Unavailable != 11 || m.Decisions.Retry != 9 || m.Decisions.GiveUpMaxAttempts != 2 {
		t.Fatalf("metrics %+v", m)
	}
}

// A queue no policy governs: NOT_FOUND from the sidecar, answered by the default policy.
func TestUnknownQueueFallsBackToDefault(t *testing.T) {
	s := startSidecar(t)
	c := newClient(t, s.Target)
	a := c.Decide(context.Background(), Failure{Queue: "nobody-governs-this", Attempt: 10, JobID: "x"})
	if a.Source != SourceFallback || a.PolicySource != PolicyDefault ||
		a.Reason != pb.GiveUpReason_GIVE_UP_REASON_MAX_ATTEMPTS || a.Disposition != pb.Disposition_DISPOSITION_DROP {
		t.Fatalf("%+v", a)
	}
	if fb := c.Metrics().Fallback; fb.NotFound != 1 {
		t.Fatalf("%+v", fb)
	}
}

// The sidecar on a unix socket only.
func TestUnixSocketTarget(t *testing.T) {
	dir := filepath.Join(devstack.StateDir("client"), "uds")
	s, err := devstack.NewFileSidecar(dir, "gotest", testPolicies, "expo")
	if err != nil {
		t.Fatal(err)
	}
	s.UDS = filepath.Join(dir, "rebound.sock")
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	c := newClient(t, s.Target)
	a := c.Decide(context.Background(), Failure{Queue: "expo", Attempt: 8, JobID: "u"})
	if a.Source != SourceSidecar || a.DeadLetterQueue != "expo-dead" || a.Policy.GetName() != "expo" {
		t.Fatalf("%+v", a)
	}
}

func TestNormalise(t *testing.T) {
	long := strings.Repeat("j", 600)
	r := Normalise(Failure{Queue: "q", Attempt: -3, JobID: long, ErrorClass: strings.Repeat("é", 200),
		FirstFailure: time.Unix(1700000000, 0), RetryAfter: 1500 * time.Microsecond})
	if r.Attempt != 1 || len(r.JobId) != 64 || len(r.ErrorClass) != 252 || r.FirstFailureUnixMs != 1700000000000 || r.RetryAfterMs != 2 {
		t.Fatalf("%+v", r)
	}
	if r := Normalise(Failure{Queue: "q", Attempt: 7, FirstFailure: time.UnixMilli(1700000000)}); r.Attempt != 7 || r.FirstFailureUnixMs != 0 {
		t.Fatalf("%+v", r)
	}
	if _, err := New(Options{Target: "http://x"}); err == nil {
		t.Fatal("a URL target was accepted")
	}
}
