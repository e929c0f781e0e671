package rebound

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The committed stubs are what gen.sh makes from proto/rebound/v1/advisor.proto now.
func TestGeneratedStubsMatchTheProto(t *testing.T) {
	out := t.TempDir()
	cmd := exec.Command("./gen.sh", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("gen.sh: %v\n%s", err, b)
	}
	for _, name := range []string{"advisor.pb.go", "advisor_grpc.pb.go"} {
		fresh, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		committed, err := os.ReadFile(filepath.Join("reboundv1", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(fresh, committed) {
			t.Errorf("reboundv1/%s differs from a regeneration: run clients/go/gen.sh and commit", name)
		}
	}
}
