package gitops

// Argo CD health and kstatus of RetryPolicies in each rollout phase. The status is the one
// rebound-operator writes (docs/operator.md: status.rollout and the Progressing, Degraded
// and Healthy conditions beside Ready, Reconciling and Stalled), written here through the
// status subresource of the real API server, which checks it against the CRD's schema,
// and read back as Argo CD and Flux read it.

import (
	"encoding/json"
	"fmt"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

const (
	newRevision    = "sha256:1a2b3c4d5e6f1a2b3c4d5e6f1a2b3c4d5e6f1a2b3c4d5e6f1a2b3c4d5e6f1a2b"
	stableRevision = "sha256:9f8e7d6c5b4a9f8e7d6c5b4a9f8e7d6c5b4a9f8e7d6c5b4a9f8e7d6c5b4a9f8e"
)

func rolloutManifest(name string) string {
	return manifest(name, []string{name}, 5) + `  rollout:
    steps: [{weight: 10, pause: 10m}, {weight: 50}]
    analysis: {minFailedJobs: 200}
`
}

func condition(kind, status, reason, message string, generation int64) map[string]any {
	return map[string]any{
		"type": kind, "status": status, "reason": reason, "message": message,
		"observedGeneration": generation, "lastTransitionTime": "2026-01-02T03:04:05Z",
	}
}

// rolloutStatus is status as the operator writes it for a policy in phase, for generation.
func rolloutStatus(phase string, generation int64) map[string]any {
	analysis := map[string]any{
		"verdict": "Continue", "eValue": 0.4, "threshold": 20.0,
		"failedNew": 40, "failedStable": 360, "badNew": 2, "badStable": 17,
		"stepFailedJobs": 400, "minFailedJobs": 200,
	}
	rollout := map[string]any{
		"phase": phase, "revision": newRevision, "stableRevision": stableRevision,
		"steps":    []any{map[string]any{"weight": 10, "startUnixMs": 1767323045000}},
		"analysis": analysis,
	}
	var conditions []any
	switch phase {
	case "Progressing":
		rollout["step"] = 0
		rollout["message"] = "step 1/2 at weight 10%: 400 of 200 failed jobs; bad-job ratio 5.0% new vs 4.7% stable"
		conditions = []any{
			condition("Ready", "False", "RollingOut", "rolling out "+newRevision, generation),
			condition("Reconciling", "True", "RolloutStep", "step 1/2 at weight 10%", generation),
			condition("Stalled", "False", "RollingOut", "", generation),
			condition("Progressing", "True", "RolloutStep", "step 1/2 at weight 10%", generation),
		}
	case "Paused":
		rollout["step"] = 1
		rollout["steps"] = append(rollout["steps"].([]any), map[string]any{"weight": 50, "startUnixMs": 1767323645000})
		rollout["message"] = "step 2/2 at weight 50% waits for promote: kubectl rebound rollout promote"
		conditions = []any{
			condition("Ready", "False", "RollingOut", "rolling out "+newRevision, generation),
			condition("Reconciling", "True", "RolloutPaused", "step 2/2 waits for promote", generation),
			condition("Stalled", "False", "RollingOut", "", generation),
			condition("Progressing", "True", "RolloutPaused", "step 2/2 waits for promote", generation),
		}
	case "Degraded":
		analysis["verdict"] = "Harm"
		analysis["eValue"] = 31.5
		analysis["badNew"] = 30
		rollout["message"] = "rolled back at step 1/2: bad-job ratio 75.0% new vs 4.7% stable, e-value 31.5 >= 20"
		degraded := "rolled back at step 1/2: bad-job ratio 75.0% new vs 4.7% stable (e-value 31.5 >= 20); " +
			"revert the change in Git or `kubectl rebound rollout retry`"
		conditions = []any{
			condition("Ready", "False", "RolledBack", degraded, generation),
			condition("Reconciling", "False", "RolledBack", "", generation),
			condition("Stalled", "True", "RolledBack", degraded, generation),
			condition("Progressing", "False", "RolloutAborted", degraded, generation),
			condition("Degraded", "True", "RolledBack", degraded, generation),
		}
	case "Healthy":
		rollout["stableRevision"] = newRevision
		delete(rollout, "steps")
		rollout["message"] = "promoted " + newRevision
		conditions = []any{
			condition("Ready", "True", "Compiled", "compiled into rebound-policies", generation),
			condition("Reconciling", "False", "Compiled", "", generation),
			condition("Stalled", "False", "Compiled", "", generation),
			condition("Progressing", "False", "RolloutComplete", "promoted "+newRevision, generation),
			condition("Healthy", "True", "RolloutComplete", "promoted "+newRevision, generation),
		}
	}
	return map[string]any{"observedGeneration": generation, "conditions": conditions, "rollout": rollout}
}

// writeStatus replaces the policy's status through the status subresource.
func (c *cluster) writeStatus(namespace, name string, st map[string]any) *unstructured.Unstructured {
	c.t.Helper()
	patch, err := json.Marshal(map[string]any{"status": st})
	if err != nil {
		c.t.Fatal(err)
	}
	c.must("-n", namespace, "patch", "retrypolicy", name, "--subresource=status", "--type=merge",
		"--field-manager=rebound-operator", "-p", string(patch))
	return c.policy(namespace, name)
}

func TestHealthOfRolloutPhasesFromTheAPIServer(t *testing.T) {
	c := connect(t)
	// No operator in this namespace: the statuses below are the only ones written.
	ns := c.namespace("gitops-rollout")
	var states []state
	for _, tc := range []struct {
		phase   string
		argo    string
		kstatus status.Status
	}{
		{"Progressing", "Progressing", status.InProgressStatus},
		{"Paused", "Suspended", status.InProgressStatus},
		{"Degraded", "Degraded", status.FailedStatus},
		{"Healthy", "Healthy", status.CurrentStatus},
	} {
		name := "rollout-" + map[string]string{
			"Progressing": "progressing", "Paused": "paused", "Degraded": "degraded", "Healthy": "healthy",
		}[tc.phase]
		c.apply(ns, rolloutManifest(name))
		u := c.writeStatus(ns, name, rolloutStatus(tc.phase, 1))
		if got, _, _ := unstructured.NestedString(u.Object, "status", "rollout", "phase"); got != tc.phase {
			t.Fatalf("%s: the API server kept phase %q", name, got)
		}
		states = append(states, state{tc.phase, u, tc.argo, tc.kstatus})
	}

	// A new commit lands (generation 2) while the status still says Healthy for 1.
	c.apply(ns, rolloutManifest("rollout-healthy")+"  nonRetryableErrors: [Fatal]\n")
	stale := c.policy(ns, "rollout-healthy")
	if stale.GetGeneration() != 2 {
		t.Fatalf("expected generation 2, got %d", stale.GetGeneration())
	}
	states = append(states, state{"Healthy, generation not observed", stale, "Progressing", status.InProgressStatus})

	script, snippet := readScripts(t)
	for _, s := range states {
		wantMessage := ""
		if s.argo != "Healthy" {
			wantMessage, _, _ = unstructured.NestedString(s.obj.Object, "status", "rollout", "message")
		}
		for source, text := range map[string]string{"health.lua": script, "argocd-cm": snippet} {
			got, message, err := argoHealth(text, s.obj)
			if err != nil {
				t.Fatalf("%s (%s): %v", s.name, source, err)
			}
			if got != s.argo || message == "" {
				t.Errorf("%s (%s): Argo CD health %q (%q), want %q with a message", s.name, source, got, message, s.argo)
			}
			// Progressing and Suspended show the operator's message (step, weight, samples,
			// ratios); Degraded the Degraded condition's, with the evidence.
			switch {
			case s.name == "Progressing" || s.name == "Paused":
				if message != wantMessage {
					t.Errorf("%s (%s): message %q, want status.rollout.message %q", s.name, source, message, wantMessage)
				}
			case s.name == "Degraded":
				if want := "RolledBack: " + conditionMessage(s.obj, "Degraded"); message != want {
					t.Errorf("%s (%s): message %q, want %q", s.name, source, message, want)
				}
			}
		}
		res, err := status.Compute(s.obj)
		if err != nil {
			t.Fatalf("%s: kstatus: %v", s.name, err)
		}
		if res.Status != s.kstatus {
			t.Errorf("%s: kstatus %s (%s), want %s", s.name, res.Status, res.Message, s.kstatus)
		}
	}
}

func conditionMessage(u *unstructured.Unstructured, kind string) string {
	conditions, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conditions {
		if m, ok := c.(map[string]any); ok && m["type"] == kind {
			return fmt.Sprint(m["message"])
		}
	}
	return ""
}

// Rollout statuses with parts missing: the script never indexes a missing table.
func TestHealthOfPartialRolloutStatuses(t *testing.T) {
	script, _ := readScripts(t)
	meta := map[string]any{"generation": int64(1)}
	for _, tc := range []struct {
		name    string
		rollout map[string]any
		conds   []any
		want    string
	}{
		{"Paused without message or step", map[string]any{"phase": "Paused"}, []any{}, "Suspended"},
		{"Progressing without message", map[string]any{"phase": "Progressing", "step": int64(1)}, []any{}, "Progressing"},
		{"Degraded phase without the condition", map[string]any{"phase": "Degraded"}, []any{}, "Degraded"},
		{"Degraded condition, phase still Progressing", map[string]any{"phase": "Progressing"},
			[]any{condition("Degraded", "True", "Aborted", "aborted", 1)}, "Degraded"},
		{"Healthy, Ready True", map[string]any{"phase": "Healthy"},
			[]any{condition("Ready", "True", "Compiled", "ok", 1)}, "Healthy"},
		{"Progressing, Stalled True (Conflict)", map[string]any{"phase": "Progressing"},
			[]any{condition("Stalled", "True", "Conflict", "queue taken", 1)}, "Degraded"},
		{"empty rollout, no conditions", map[string]any{}, []any{}, "Progressing"},
	} {
		obj := map[string]any{"metadata": meta, "status": map[string]any{
			"observedGeneration": int64(1), "conditions": tc.conds, "rollout": tc.rollout}}
		got, message, err := argoHealth(script, &unstructured.Unstructured{Object: obj})
		if err != nil || got != tc.want || message == "" {
			t.Errorf("%s: %q (%q), %v; want %q with a message", tc.name, got, message, err, tc.want)
		}
	}
}
