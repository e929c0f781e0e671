package rebound

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

type assignStep struct {
	Weight      uint32 `json:"weight"`
	StartUnixMs string `json:"startUnixMs"`
}

type assignCase struct {
	Name               string       `json:"name"`
	Revision           string       `json:"revision"`
	Steps              []assignStep `json:"steps"`
	JobID              *string      `json:"jobId"`
	FirstFailureUnixMs *string      `json:"firstFailureUnixMs"`
	NowUnixMs          string       `json:"nowUnixMs"`
	Expected           struct {
		Bucket *uint32 `json:"bucket"`
		Arm    string  `json:"arm"`
	} `json:"expected"`
}

func loadAssignVectors(t *testing.T) []assignCase {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "policy", "testdata", "assign-vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Format string       `json:"format"`
		Cases  []assignCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Format != "rebound.dev/assign-vectors/v1" || len(doc.Cases) < 100 {
		t.Fatalf("format %q with %d cases", doc.Format, len(doc.Cases))
	}
	return doc.Cases
}

func parseU64(t *testing.T, name, field, v string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatalf("%s: %s: %v", name, field, err)
	}
	return n
}

// args turns a case into Arm's arguments: absent fields are the zero values.
func (c assignCase) args(t *testing.T) (steps []RolloutStep, jobID string, first, now uint64) {
	t.Helper()
	for i, s := range c.Steps {
		steps = append(steps, RolloutStep{Weight: s.Weight, StartUnixMs: parseU64(t, c.Name, "steps["+strconv.Itoa(i)+"]", s.StartUnixMs)})
	}
	if c.JobID != nil {
		jobID = *c.JobID
	}
	if c.FirstFailureUnixMs != nil {
		first = parseU64(t, c.Name, "firstFailureUnixMs", *c.FirstFailureUnixMs)
	}
	return steps, jobID, first, parseU64(t, c.Name, "nowUnixMs", c.NowUnixMs)
}

// Every shared case, bit for bit: the arm, and the bucket exactly when the case has one.
func TestArmPassesEveryAssignVector(t *testing.T) {
	for _, c := range loadAssignVectors(t) {
		steps, jobID, first, now := c.args(t)
		arm, bucket, hasBucket := Arm(c.Revision, steps, jobID, first, now)
		if string(arm) != c.Expected.Arm {
			t.Errorf("%s: arm %s, want %s", c.Name, arm, c.Expected.Arm)
		}
		switch {
		case c.Expected.Bucket == nil && hasBucket:
			t.Errorf("%s: bucket %d, want none", c.Name, bucket)
		case c.Expected.Bucket != nil && (!hasBucket || bucket != *c.Expected.Bucket):
			t.Errorf("%s: bucket %d (%v), want %d", c.Name, bucket, hasBucket, *c.Expected.Bucket)
		}
	}
}

// A rollout prepared once answers every job of its cases as the one-shot form does (the
// fallback prepares it when GetPolicy's answer is loaded).
func TestPreparedRolloutAnswersLikeArm(t *testing.T) {
	prepared := map[string]*PreparedRollout{}
	for _, c := range loadAssignVectors(t) {
		steps, jobID, first, now := c.args(t)
		key := fmt.Sprint(c.Revision, steps)
		if prepared[key] == nil {
			prepared[key] = PrepareRollout(c.Revision, steps)
		}
		arm, bucket, hasBucket := prepared[key].Arm(jobID, first, now)
		wantArm, wantBucket, wantHas := Arm(c.Revision, steps, jobID, first, now)
		if arm != wantArm || bucket != wantBucket || hasBucket != wantHas {
			t.Errorf("%s: prepared %s %d %v, one-shot %s %d %v", c.Name, arm, bucket, hasBucket, wantArm, wantBucket, wantHas)
		}
	}
	if len(prepared) < 5 {
		t.Fatalf("only %d rollouts prepared", len(prepared))
	}
}

// The vectors exercise what could go wrong in a port: both arms, no job id and an empty
// one, ids beyond ASCII, an unknown first failure, several revisions.
func TestAssignVectorsCoverEveryKind(t *testing.T) {
	seen := map[string]bool{}
	revisions := map[string]bool{}
	for _, c := range loadAssignVectors(t) {
		seen[c.Expected.Arm] = true
		revisions[c.Revision] = true
		switch {
		case c.JobID == nil:
			seen["nojob"] = true
		case *c.JobID == "":
			seen["emptyjob"] = true
		case strconv.QuoteToASCII(*c.JobID) != strconv.Quote(*c.JobID):
			seen["nonascii"] = true
		}
		if c.FirstFailureUnixMs == nil && c.JobID != nil && *c.JobID != "" {
			seen["byNow"] = true
		}
	}
	for _, want := range []string{"STABLE", "CANARY", "nojob", "emptyjob", "nonascii", "byNow"} {
		if !seen[want] {
			t.Errorf("no vector with %s", want)
		}
	}
	if len(revisions) < 2 {
		t.Errorf("only %d revision(s): the salt is not exercised", len(revisions))
	}
}

// Malformed steps cannot come from a sidecar (it refuses them) and give STABLE, the same
// table in every adapter. The job is in bucket 0, so a port that read the steps anyway
// would answer CANARY.
func TestArmServesStableOnMalformedSteps(t *testing.T) {
	const revision = "sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c"
	const job, first, now = "job-186587197682", uint64(1800000600000), uint64(1800086400000)
	const s0, s1 = uint64(1800000000000), uint64(1800000600000)
	eleven := make([]RolloutStep, 11)
	for i := range eleven {
		eleven[i] = RolloutStep{Weight: uint32(i + 1), StartUnixMs: s0}
	}
	arm, bucket, _ := Arm(revision, []RolloutStep{{10, s0}, {50, s1}}, job, first, now)
	if arm != ArmCanary || bucket != 0 {
		t.Fatalf("well-formed control: %s bucket %d, want CANARY bucket 0", arm, bucket)
	}
	for name, steps := range map[string][]RolloutStep{
		"weight 0":           {{0, s0}},
		"weight 100":         {{100, s0}},
		"weights equal":      {{10, s0}, {10, s1}},
		"weights decreasing": {{50, s0}, {10, s1}},
		"starts decreasing":  {{10, s1}, {50, s0}},
		"11 steps":           eleven,
	} {
		arm, bucket, hasBucket := Arm(revision, steps, job, first, now)
		if arm != ArmStable || !hasBucket || bucket != 0 {
			t.Errorf("%s: %s bucket %d (%v), want STABLE bucket 0", name, arm, bucket, hasBucket)
		}
	}
}

// Text that is not UTF-8 counts as no job id, as in every adapter (JavaScript would hash a
// lone surrogate as U+FFFD, Python cannot encode it).
func TestArmTakesInvalidUTF8AsNoJobID(t *testing.T) {
	const revision = "sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c"
	steps := []RolloutStep{{10, 1800000000000}}
	for name, c := range map[string][2]string{
		"job id":   {revision, "job-\xff"},
		"revision": {"sha256:\xed\xa0\x80", "job-186587197682"},
	} {
		if arm, bucket, hasBucket := Arm(c[0], steps, c[1], 1800000600000, 1800086400000); arm != ArmStable || hasBucket {
			t.Errorf("%s not UTF-8: %s bucket %d (%v), want STABLE and no bucket", name, arm, bucket, hasBucket)
		}
	}
}

// 0 is how the protocol sends an unknown first failure: the job is placed by now, as the
// sidecar places it.
func TestArmPlacesAnUnknownFirstFailureByNow(t *testing.T) {
	const revision = "sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c"
	steps := []RolloutStep{{10, 1800000000000}}
	if arm, _, _ := Arm(revision, steps, "job-186587197682", 0, 1800000000000); arm != ArmCanary {
		t.Errorf("first failure 0, now in the step: %s, want CANARY", arm)
	}
	if arm, _, _ := Arm(revision, steps, "job-186587197682", 0, 1799999999999); arm != ArmStable {
		t.Errorf("first failure 0, now before the step: %s, want STABLE", arm)
	}
}
