package gitops

// The real control plane and the real operator, driven the way the Rust tests drive them
// (dev/README.md): REBOUND_KUBECONFIG, else REBOUND_CLUSTER_STATE_DIR/kubeconfig; kubectl
// from REBOUND_KUBECTL or PATH; the operator binary from REBOUND_OPERATOR_BIN, else
// ../target/debug/rebound-operator.

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// repoRoot is the repository root (this package lives in gitops/).
func repoRoot(t *testing.T) string {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(wd)
}

type cluster struct {
	t          *testing.T
	root       string
	kubeconfig string
	kubectl    string
}

func connect(t *testing.T) *cluster {
	t.Helper()
	root := repoRoot(t)
	kubeconfig := os.Getenv("REBOUND_KUBECONFIG")
	if kubeconfig == "" {
		state := os.Getenv("REBOUND_CLUSTER_STATE_DIR")
		if state == "" {
			t.Fatal("no cluster: set REBOUND_CLUSTER_STATE_DIR (dev/cluster-up.sh DIR) or REBOUND_KUBECONFIG; dev/test.sh does")
		}
		if !filepath.IsAbs(state) {
			state = filepath.Join(root, state)
		}
		kubeconfig = filepath.Join(state, "kubeconfig")
	}
	kubectl := os.Getenv("REBOUND_KUBECTL")
	if kubectl == "" {
		kubectl = "kubectl"
	}
	c := &cluster{t: t, root: root, kubeconfig: kubeconfig, kubectl: kubectl}
	// The CRD as committed, with the field manager the Rust harness uses (no conflicts).
	c.must("apply", "--server-side", "--field-manager=rebound-tests", "-f", filepath.Join(root, "crds"))
	c.must("wait", "--for=condition=Established", "--timeout=60s", "crd/retrypolicies.rebound.dev")
	return c
}

// run runs kubectl and returns stdout, stderr and the error.
func (c *cluster) run(stdin string, args ...string) (string, string, error) {
	cmd := exec.Command(c.kubectl, append([]string{"--kubeconfig", c.kubeconfig}, args...)...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	return out.String(), errOut.String(), err
}

func (c *cluster) must(args ...string) string {
	c.t.Helper()
	out, stderr, err := c.run("", args...)
	if err != nil {
		c.t.Fatalf("kubectl %v: %v\n%s", args, err, stderr)
	}
	return out
}

func (c *cluster) apply(namespace, manifest string) {
	c.t.Helper()
	if _, stderr, err := c.run(manifest, "-n", namespace, "apply", "-f", "-"); err != nil {
		c.t.Fatalf("kubectl apply: %v\n%s", err, stderr)
	}
}

// namespace creates a fresh namespace (deleted ones stay Terminating: no controllers).
func (c *cluster) namespace(prefix string) string {
	c.t.Helper()
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		c.t.Fatal(err)
	}
	name := prefix + "-" + hex.EncodeToString(b)
	c.must("create", "namespace", name)
	return name
}

// policy reads a RetryPolicy back from the API server, as Argo CD and Flux see it.
func (c *cluster) policy(namespace, name string) *unstructured.Unstructured {
	c.t.Helper()
	out := c.must("-n", namespace, "get", "retrypolicy", name, "-o", "json")
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON([]byte(out)); err != nil {
		c.t.Fatalf("decoding RetryPolicy %s/%s: %v", namespace, name, err)
	}
	return u
}

// readyReason is the Ready condition's reason if it is for the current generation.
func readyReason(u *unstructured.Unstructured) string {
	conditions, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conditions {
		m, ok := c.(map[string]any)
		if !ok || m["type"] != "Ready" {
			continue
		}
		if observed, ok := m["observedGeneration"].(int64); !ok || observed != u.GetGeneration() {
			return ""
		}
		reason, _ := m["reason"].(string)
		return reason
	}
	return ""
}

// waitForReason polls until the policy's current Ready condition has reason.
func (c *cluster) waitForReason(namespace, name, reason string) *unstructured.Unstructured {
	c.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		u := c.policy(namespace, name)
		if readyReason(u) == reason {
			return u
		}
		if time.Now().After(deadline) {
			status, _ := json.Marshal(u.Object["status"])
			c.t.Fatalf("RetryPolicy %s/%s never reported %s; status %s", namespace, name, reason, status)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// operator is a running rebound-operator confined to some namespaces.
type operator struct {
	cmd *exec.Cmd
	log string
}

func (c *cluster) startOperator(namespaces ...string) *operator {
	c.t.Helper()
	bin := os.Getenv("REBOUND_OPERATOR_BIN")
	if bin == "" {
		bin = filepath.Join(c.root, "target", "debug", "rebound-operator")
	}
	if _, err := os.Stat(bin); err != nil {
		c.t.Fatalf("no operator binary (%v): cargo build -p rebound-operator, or set REBOUND_OPERATOR_BIN", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		c.t.Fatal(err)
	}
	metrics := l.Addr().String()
	l.Close()
	log := filepath.Join(c.t.TempDir(), "operator.log")
	f, err := os.Create(log)
	if err != nil {
		c.t.Fatal(err)
	}
	cmd := exec.Command(bin,
		"--namespaces="+strings.Join(namespaces, ","),
		"--leader-elect=false",
		"--metrics-addr="+metrics,
		"--log-format=json",
	)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.kubeconfig, "RUST_LOG=info")
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("starting %s: %v", bin, err)
	}
	op := &operator{cmd: cmd, log: log}
	c.t.Cleanup(op.stop)
	return op
}

// stop kills the operator (as a crash or a scale-down would) and waits for it.
func (o *operator) stop() {
	if o.cmd.ProcessState == nil {
		_ = o.cmd.Process.Kill()
		_ = o.cmd.Wait()
	}
}

func (o *operator) tail() string {
	b, _ := os.ReadFile(o.log)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return strings.Join(lines, "\n")
}

func manifest(name string, queues []string, maxAttempts int) string {
	quoted := make([]string, len(queues))
	for i, q := range queues {
		quoted[i] = fmt.Sprintf("%q", q)
	}
	return fmt.Sprintf(`apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata:
  name: %s
spec:
  queues: [%s]
  maxAttempts: %d
  backoff: {base: 1s, cap: 5m}
`, name, strings.Join(quoted, ", "), maxAttempts)
}
