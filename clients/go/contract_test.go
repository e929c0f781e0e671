package rebound

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

// logBuffer is a JSON slog handler's output, read back as structured lines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) lines(t *testing.T, event string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	raw := append([]byte(nil), l.buf.Bytes()...)
	l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if m["event"] == event {
			out = append(out, m)
		}
	}
	return out
}

func jsonLogger(l *logBuffer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// A malformed REBOUND_TARGET is refused by New with a *TargetError naming the setting.
func TestMalformedTargetRefused(t *testing.T) {
	for _, target := range []string{"http://127.0.0.1:1", "127.0.0.1", ":7411", "127.0.0.1:0", "127.0.0.1:65536",
		"127.0.0.1:99999", "unix:", "unix:relative.sock", "unix://", "host name:80", "[::1]"} {
		t.Run(target, func(t *testing.T) {
			t.Setenv("REBOUND_TARGET", target)
			c, err := New(Options{Logger: quiet()})
			var te *TargetError
			if !errors.As(err, &te) || te.Setting != "REBOUND_TARGET" || te.Target != target {
				if c != nil {
					c.Close()
				}
				t.Fatalf("New with REBOUND_TARGET=%q: %v", target, err)
			}
		})
	}
	// Options.Target is named as such.
	_, err := New(Options{Target: "http://x:1", Logger: quiet()})
	var te *TargetError
	if !errors.As(err, &te) || te.Setting != "Options.Target" {
		t.Fatalf("Options.Target: %v", err)
	}
	for _, target := range []string{"127.0.0.1:7411", "localhost:1", "[::1]:65535", "unix:///run/rebound.sock", "unix:/run/r.sock"} {
		c, err := New(Options{Target: target, Logger: quiet()})
		if err != nil {
			t.Fatalf("%q refused: %v", target, err)
		}
		c.Close()
	}
}

// Prefetch loads every queue's policy at start: a fallback right after (sidecar killed
// before any job failed) answers from the namespace's real policy (policySource cached).
func TestPrefetchAtStartServesTheOutage(t *testing.T) {
	s := startSidecar(t)
	c := newClient(t, s.Target)
	c.Prefetch(context.Background(), "expo", "email", "nobody-governs-this")
	s.Kill()
	for _, q := range []string{"expo", "email"} {
		a := c.Decide(context.Background(), Failure{Queue: q, Attempt: 1, JobID: "p"})
		if a.Source != SourceFallback || a.PolicySource != PolicyCached || a.Policy.GetName() == "" {
			t.Fatalf("%s: %+v", q, a)
		}
	}
	if a := c.Decide(context.Background(), Failure{Queue: "nobody-governs-this", Attempt: 1}); a.PolicySource != PolicyDefault {
		t.Fatalf("ungoverned queue: %+v", a)
	}
}

// The sidecar down at start: the client starts anyway, logs one warning naming the target,
// answers with the default policy, and prefetches again once the sidecar is there.
func TestSidecarDownAtStartPrefetchesOnReconnect(t *testing.T) {
	dir := filepath.Join(devstack.StateDir("client"), "down-at-start")
	s, err := devstack.NewFileSidecar(dir, "gotest", testPolicies, "expo")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	var logs logBuffer
	c, err := New(Options{Target: s.Target, Logger: jsonLogger(&logs)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.Prefetch(context.Background(), "expo", "email")
	warnings := logs.lines(t, "rebound.prefetch")
	if len(warnings) != 1 || warnings[0]["level"] != "WARN" || warnings[0]["target"] != s.Target {
		t.Fatalf("prefetch warnings %v", warnings)
	}
	if a := c.Decide(context.Background(), Failure{Queue: "expo", Attempt: 1, JobID: "d"}); a.Source != SourceFallback || a.PolicySource != PolicyDefault {
		t.Fatalf("before the sidecar: %+v", a)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	up := time.Now()
	for {
		if ref, _ := c.Cached("email"); ref != nil {
			break
		}
		if time.Since(up) > 5*time.Second {
			t.Fatalf("email's policy not prefetched %s after the sidecar came up", time.Since(up))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("policies prefetched %s after the sidecar was ready", time.Since(up).Round(time.Millisecond))
	if n := len(logs.lines(t, "rebound.prefetch")); n != 1 {
		t.Fatalf("%d prefetch warnings", n)
	}
}

// The reconnect backoff is bounded: after the sidecar is SIGKILLed and restarted on the same
// address (having been down long enough for an unbounded backoff to grow), the client is back
// on it within a few seconds.
func TestReconnectAfterSidecarRestartIsBounded(t *testing.T) {
	s := startSidecar(t)
	c := newClient(t, s.Target)
	f := Failure{Queue: "expo", Attempt: 1, JobID: "r"}
	if a := c.Decide(context.Background(), f); a.Source != SourceSidecar {
		t.Fatalf("%+v", a)
	}
	s.Kill()
	// Failing calls for a while: grpc's default backoff would reach tens of seconds.
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); {
		if a := c.Decide(context.Background(), f); a.Source != SourceFallback {
			t.Fatalf("sidecar killed, yet %+v", a)
		}
		time.Sleep(100 * time.Millisecond)
	}
	spawned := time.Now()
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	up := time.Now()
	for c.Decide(context.Background(), f).Source != SourceSidecar {
		if time.Since(up) > 5*time.Second {
			t.Fatalf("still on the fallback %s after the sidecar was back", time.Since(up))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("back on the sidecar %s after it was ready (%s after it was spawned)",
		time.Since(up).Round(time.Millisecond), time.Since(spawned).Round(time.Millisecond))
}

// The Go default policy is the one of clients/conformance/default-policy.json.
func TestDefaultPolicyEqualsConformanceFile(t *testing.T) {
	file := filepath.Join(devstack.RepoRoot(), "clients", "conformance", "default-policy.json")
	raw, err := os.ReadFile(file)
	if os.IsNotExist(err) {
		t.Skipf("%s not there yet", file)
	}
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	resolved := raw
	if r, ok := doc["resolved"]; ok {
		resolved = r
	}
	var identity string
	for _, k := range []string{"identity", "jitterIdentity"} {
		if v, ok := doc[k]; ok {
			if err := json.Unmarshal(v, &identity); err != nil {
				t.Fatal(err)
			}
		}
	}
	got := &pb.ResolvedPolicy{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(resolved, got); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if !proto.Equal(got, DefaultPolicy()) {
		t.Fatalf("%s: %v\nGo's DefaultPolicy(): %v", file, got, DefaultPolicy())
	}
	if identity != "" && identity != DefaultIdentity {
		t.Fatalf("identity %q, Go's %q", identity, DefaultIdentity)
	}
}

// The core object is Rebound; Client stays as its deprecated alias.
func TestCoreObjectIsRebound(t *testing.T) {
	var r *Rebound
	var c *Client = r
	_ = c
	if fmt.Sprintf("%T", r) != "*rebound.Rebound" {
		t.Fatalf("%T", r)
	}
}
