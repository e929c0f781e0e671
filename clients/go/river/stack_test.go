package reboundriver_test

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river/rivertype"

	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
)

// The full stack: kube-apiserver + etcd (dev/cluster-up.sh), rebound-operator, a sidecar
// watching the namespace's ConfigMap with least-privilege credentials, PostgreSQL and a
// River worker; the policy applied and changed with kubectl. Needs
// REBOUND_CLUSTER_STATE_DIR (dev/test.sh sets it).

const stackRBAC = `apiVersion: v1
kind: ServiceAccount
metadata: {name: rebound-sidecar, namespace: %[1]s}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: rebound-sidecar, namespace: %[1]s}
rules:
  - apiGroups: [""]
    resources: [configmaps]
    resourceNames: [rebound-policies]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: rebound-sidecar, namespace: %[1]s}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: rebound-sidecar}
subjects:
  - {kind: ServiceAccount, name: rebound-sidecar, namespace: %[1]s}
`

const stackPolicy = `apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: stack}
spec:
  queues: ["stackq"]
  backoff: {strategy: constant, base: 200ms, jitter: {kind: none}}
  maxAttempts: %d
  terminal: {action: deadLetter, deadLetterQueue: stack-dead}
`

// script runs dev/NAME and returns its last stdout line. Its output goes to files, not
// pipes: a daemon it starts keeps what it inherited open, and a pipe would never close.
func script(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := os.CreateTemp(t.TempDir(), "stdout")
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	errf, err := os.Create(filepath.Join(runDir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	defer errf.Close()
	cmd := exec.Command(filepath.Join(devstack.RepoRoot(), "dev", name), args...)
	cmd.Stdout, cmd.Stderr = out, errf
	if err := cmd.Run(); err != nil {
		t.Fatalf("dev/%s: %v (log %s)", name, err, errf.Name())
	}
	raw, err := os.ReadFile(out.Name())
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(raw)), "\n")
	return lines[len(lines)-1]
}

func cargoBin(t *testing.T, name string) string {
	t.Helper()
	dir := os.Getenv("CARGO_TARGET_DIR")
	if dir == "" {
		dir = filepath.Join(devstack.RepoRoot(), "target")
	}
	bin := filepath.Join(dir, "debug", name)
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("no %s (cargo build -p %s): %v", bin, name, err)
	}
	return bin
}

// background runs a process until the test ends (SIGTERM, then SIGKILL).
func background(t *testing.T, log string, env []string, bin string, args ...string) {
	t.Helper()
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env, cmd.Stdout, cmd.Stderr = env, f, f
	cmd.SysProcAttr = devstack.DieWithParent()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		f.Close()
	})
}

func TestStackPolicyFromKubectlGovernsAndAChangeTakesOver(t *testing.T) {
	state := os.Getenv("REBOUND_CLUSTER_STATE_DIR")
	if state == "" {
		t.Skip("REBOUND_CLUSTER_STATE_DIR not set (no cluster; dev/test.sh sets it)")
	}
	state, _ = filepath.Abs(state)
	kubeconfig := script(t, "cluster-up.sh", state)
	kubectlBin := filepath.Join(script(t, "build-control-plane.sh", "--print-bin-dir"), "kubectl")
	env := append(os.Environ(), "KUBECONFIG="+kubeconfig)
	kubectl := func(stdin string, args ...string) (string, error) {
		cmd := exec.Command(kubectlBin, args...)
		cmd.Env, cmd.Stdin = env, strings.NewReader(stdin)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, errb.String())
		}
		return out.String(), nil
	}
	must := func(stdin string, args ...string) {
		t.Helper()
		if _, err := kubectl(stdin, args...); err != nil {
			t.Fatal(err)
		}
	}
	must("", "apply", "--server-side", "--field-manager", "rebound-test", "--force-conflicts",
		"-f", filepath.Join(devstack.RepoRoot(), "crds", "retrypolicies.rebound.dev.yaml"))
	must("", "wait", "--for=condition=Established", "--timeout=60s", "crd/retrypolicies.rebound.dev")
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	ns := "go-e2e-" + hex.EncodeToString(suffix)
	must("", "create", "namespace", ns)
	t.Cleanup(func() { _, _ = kubectl("", "delete", "namespace", ns, "--wait=false") })
	must(fmt.Sprintf(stackRBAC, ns), "-n", ns, "apply", "-f", "-")
	logs := filepath.Join(runDir, ns)
	if err := os.MkdirAll(logs, 0o755); err != nil {
		t.Fatal(err)
	}

	metricsPort, _ := devstack.FreePort()
	background(t, filepath.Join(logs, "operator.log"), env, cargoBin(t, "rebound-operator"),
		"--namespaces="+ns, "--leader-elect=false", fmt.Sprintf("--metrics-addr=127.0.0.1:%d", metricsPort), "--log-format=json")
	sidecarKC := filepath.Join(logs, "sidecar.kubeconfig")
	script(t, "mint-user-kubeconfig.sh", state, "system:serviceaccount:"+ns+":rebound-sidecar",
		"system:serviceaccounts", "system:serviceaccounts:"+ns, sidecarKC)
	must(fmt.Sprintf(stackPolicy, 3), "-n", ns, "apply", "-f", "-")
	eventually(t, 60*time.Second, "the operator's ConfigMap", func() bool {
		out, err := kubectl("", "-n", ns, "get", "configmap", "rebound-policies", "-o", "name")
		return err == nil && strings.TrimSpace(out) != ""
	})
	port, _ := devstack.FreePort()
	adminPort, _ := devstack.FreePort()
	target := fmt.Sprintf("127.0.0.1:%d", port)
	background(t, filepath.Join(logs, "sidecar.log"), append(os.Environ(), "KUBECONFIG="+sidecarKC),
		cargoBin(t, "rebound-sidecar"), "--configmap="+ns+"/rebound-policies", "--listen="+target,
		fmt.Sprintf("--admin-listen=127.0.0.1:%d", adminPort), "--log-format=json")

	served := func(n uint32) func() bool {
		return func() bool {
			rb := newRebound(t, target)
			_, resolved := rb.Policy("stackq")
			rb.Close()
			return resolved.GetMaxAttempts() == n
		}
	}
	eventually(t, 60*time.Second, "the sidecar serving the policy", served(3))
	rb := newRebound(t, target, "stackq")
	c := startRiver(t, rb, "stackq")
	id := insert(t, c, "stackq", FailArgs{FailTimes: -1})
	job := waitFinal(t, c, id, 60*time.Second)
	if g := giveUpOf(t, job); job.State != rivertype.JobStateDiscarded || job.Attempt != 3 || g == nil ||
		g.Policy != ns+"/stack" || g.Source != "sidecar" || g.DeadLetterQueue != "stack-dead" {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}

	must(fmt.Sprintf(stackPolicy, 5), "-n", ns, "apply", "-f", "-")
	eventually(t, 60*time.Second, "the changed policy served", served(5))
	id = insert(t, c, "stackq", FailArgs{FailTimes: -1})
	job = waitFinal(t, c, id, 60*time.Second)
	if g := giveUpOf(t, job); job.State != rivertype.JobStateDiscarded || job.Attempt != 5 || g == nil || g.Source != "sidecar" {
		t.Fatalf("after the change: state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
	if fb := rb.Metrics().Fallback; fb.Total != 0 {
		t.Fatalf("fallbacks %+v", fb)
	}
}

func eventually(t *testing.T, within time.Duration, what string, check func() bool) {
	t.Helper()
	end := time.Now().Add(within)
	for !check() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
