package rebound

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

type vectorCase struct {
	Name     string            `json:"name"`
	Identity string            `json:"identity"`
	Policy   json.RawMessage   `json:"policy"`
	Attempt  uint64            `json:"attempt"`
	Context  map[string]string `json:"context"`
	Expected json.RawMessage   `json:"expected"`
}

func loadVectors(t *testing.T) []vectorCase {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "policy", "testdata", "decide-vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Format string       `json:"format"`
		Cases  []vectorCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Format != "rebound.dev/decide-vectors/v1" || len(doc.Cases) < 1000 {
		t.Fatalf("format %q with %d cases", doc.Format, len(doc.Cases))
	}
	return doc.Cases
}

func u64(t *testing.T, m map[string]string, key string) uint64 {
	t.Helper()
	v, ok := m[key]
	if !ok {
		return 0
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatalf("context.%s: %v", key, err)
	}
	return n
}

// Every shared case, bit for bit: decision, delay, disposition, dead-letter queue, reason
// and its message.
func TestDecideLocalPassesEverySharedVector(t *testing.T) {
	for _, c := range loadVectors(t) {
		var p pb.ResolvedPolicy
		if err := protojson.Unmarshal(c.Policy, &p); err != nil {
			t.Fatalf("%s: policy: %v", c.Name, err)
		}
		var want pb.DecideResponse
		if err := protojson.Unmarshal(c.Expected, &want); err != nil {
			t.Fatalf("%s: expected: %v", c.Name, err)
		}
		ctx := Context{
			JobID:              c.Context["jobId"],
			ErrorClass:         c.Context["errorClass"],
			FirstFailureUnixMs: u64(t, c.Context, "firstFailureUnixMs"),
			NowUnixMs:          u64(t, c.Context, "nowUnixMs"),
			RetryAfterMs:       u64(t, c.Context, "retryAfterMs"),
		}
		got, err := DecideLocal(&p, c.Identity, c.Attempt, ctx)
		if err != nil {
			t.Fatalf("%s: %v", c.Name, err)
		}
		got = &pb.DecideResponse{Decision: got.Decision, DelayMs: got.DelayMs, Disposition: got.Disposition,
			DeadLetterQueue: got.DeadLetterQueue, Reason: got.Reason, ReasonMessage: got.ReasonMessage}
		if !proto.Equal(got, &want) {
			t.Errorf("%s: got %v, want %v", c.Name, got, &want)
		}
	}
}

// The context numbers are decimal strings (uint64s beyond 2^53); a number would not parse.
func TestVectorContextNumbersAreStrings(t *testing.T) {
	var sawBig bool
	for _, c := range loadVectors(t) {
		if u64(t, c.Context, "retryAfterMs") > 1<<53 || u64(t, c.Context, "firstFailureUnixMs") > 1<<53 {
			sawBig = true
		}
	}
	if !sawBig {
		t.Fatal("no case beyond 2^53: the test would not notice a float64 parse")
	}
}
