package gitops

// Argo CD health and kstatus of the RetryPolicy objects the real rebound-operator writes in
// each phase of a rollout, driven as a person would: kubectl apply of a change, then the
// requests `kubectl rebound rollout promote|abort|retry` writes (status.rollout.request).

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

// rolledManifest is `name` at maxAttempts with a rollout: a paused 10 % step, then a
// manual 50 % step.
func rolledManifest(name string, maxAttempts int) string {
	return manifest(name, []string{name}, maxAttempts) + `  rollout:
    steps: [{weight: 10, pause: 10m}, {weight: 50}]
`
}

// waitForPhase polls until the operator has observed the current generation and
// status.rollout.phase is phase (and, for Progressing or Paused, the step is step).
func (c *cluster) waitForPhase(op *operator, namespace, name, phase string, step int64) *unstructured.Unstructured {
	c.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		u := c.policy(namespace, name)
		observed, _, _ := unstructured.NestedInt64(u.Object, "status", "observedGeneration")
		got, _, _ := unstructured.NestedString(u.Object, "status", "rollout", "phase")
		at, found, _ := unstructured.NestedInt64(u.Object, "status", "rollout", "step")
		stepOK := phase == "Healthy" || phase == "Degraded" || (found && at == step)
		if observed == u.GetGeneration() && got == phase && stepOK {
			return u
		}
		if time.Now().After(deadline) {
			st, _ := json.Marshal(u.Object["status"])
			c.t.Fatalf("%s/%s never reached %s (step %d): status %s\noperator log:\n%s", namespace, name, phase, step, st, op.tail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// request writes what `kubectl rebound rollout ACTION` writes: the action for the revision
// the status shows, with a fresh id, under the plugin's field manager.
func (c *cluster) request(namespace, name, action string, n int) {
	c.t.Helper()
	revision, _, _ := unstructured.NestedString(c.policy(namespace, name).Object, "status", "rollout", "revision")
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"rollout": map[string]any{
		"request": map[string]any{"action": action, "revision": revision, "id": fmt.Sprintf("%016x", n)},
	}}})
	if err != nil {
		c.t.Fatal(err)
	}
	c.must("-n", namespace, "patch", "retrypolicy", name, "--subresource=status", "--type=merge",
		"--field-manager=kubectl-rebound", "-p", string(patch))
}

func TestHealthOfTheObjectsTheOperatorWritesInEachPhase(t *testing.T) {
	c := connect(t)
	ns := c.namespace("gitops-rollout-operator")
	op := c.startOperator(ns)
	script, snippet := readScripts(t)
	check := func(u *unstructured.Unstructured, what, argo string, kstatus status.Status) {
		t.Helper()
		for source, text := range map[string]string{"health.lua": script, "argocd-cm": snippet} {
			got, message, err := argoHealth(text, u)
			if err != nil {
				t.Fatalf("%s (%s): %v", what, source, err)
			}
			if got != argo {
				t.Errorf("%s (%s): Argo CD health %q (%q), want %q", what, source, got, message, argo)
			}
			if argo != "Healthy" && message == "" {
				t.Errorf("%s (%s): %s without a message", what, source, got)
			}
		}
		res, err := status.Compute(u)
		if err != nil {
			t.Fatalf("%s: kstatus: %v", what, err)
		}
		if res.Status != kstatus {
			t.Errorf("%s: kstatus %s (%s), want %s", what, res.Status, res.Message, kstatus)
		}
	}

	c.apply(ns, rolledManifest("orders", 5))
	check(c.waitForPhase(op, ns, "orders", "Healthy", 0), "first revision", "Healthy", status.CurrentStatus)

	c.apply(ns, rolledManifest("orders", 6))
	check(c.waitForPhase(op, ns, "orders", "Progressing", 0), "step 1 in its pause", "Progressing", status.InProgressStatus)

	c.request(ns, "orders", "Promote", 1)
	check(c.waitForPhase(op, ns, "orders", "Paused", 1), "step 2 waiting for promote", "Suspended", status.InProgressStatus)

	c.request(ns, "orders", "Abort", 2)
	check(c.waitForPhase(op, ns, "orders", "Degraded", 0), "aborted", "Degraded", status.FailedStatus)

	c.request(ns, "orders", "Retry", 3)
	check(c.waitForPhase(op, ns, "orders", "Progressing", 0), "retried", "Progressing", status.InProgressStatus)

	c.request(ns, "orders", "PromoteFull", 4)
	check(c.waitForPhase(op, ns, "orders", "Healthy", 0), "promoted", "Healthy", status.CurrentStatus)

	// A new commit the operator has not observed yet: Progressing for Argo CD, InProgress
	// for kstatus, whatever the old status says.
	op.stop()
	c.apply(ns, rolledManifest("orders", 7))
	check(c.policy(ns, "orders"), "generation not observed", "Progressing", status.InProgressStatus)
}
