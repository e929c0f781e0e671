package gitops

// The Argo CD health check (argocd/health.lua) and kstatus on RetryPolicies in every
// state, each produced by the real rebound-operator on the real API server and read back
// from it.

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/yaml"
)

const healthKey = "resource.customizations.health.rebound.dev_RetryPolicy"

// argoHealth runs a health script as Argo CD runs the ones from argocd-cm: gopher-lua with
// only the package, base and table libraries, the object as the global `obj` (integers
// as numbers), a one-second budget, and a table {status, message} as the result.
func argoHealth(script string, obj *unstructured.Unstructured) (string, string, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
	} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return "", "", err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", toLua(l, obj.Object))
	if err := l.DoString(script); err != nil {
		return "", "", err
	}
	result, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return "", "", errNotTable
	}
	s, _ := result.RawGetString("status").(lua.LString)
	m, _ := result.RawGetString("message").(lua.LString)
	return string(s), string(m), nil
}

type luaError string

func (e luaError) Error() string { return string(e) }

const errNotTable = luaError("the health script did not return a table")

func toLua(l *lua.LState, v any) lua.LValue {
	switch x := v.(type) {
	case bool:
		return lua.LBool(x)
	case string:
		return lua.LString(x)
	case int64:
		return lua.LNumber(x)
	case float64:
		return lua.LNumber(x)
	case []any:
		t := l.CreateTable(len(x), 0)
		for _, item := range x {
			t.Append(toLua(l, item))
		}
		return t
	case map[string]any:
		t := l.CreateTable(0, len(x))
		for k, item := range x {
			t.RawSetString(k, toLua(l, item))
		}
		return t
	}
	return lua.LNil
}

func readScripts(t *testing.T) (string, string) {
	t.Helper()
	script, err := os.ReadFile("argocd/health.lua")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile("argocd/argocd-cm.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var cm struct {
		APIVersion string            `json:"apiVersion"`
		Kind       string            `json:"kind"`
		Metadata   map[string]any    `json:"metadata"`
		Data       map[string]string `json:"data"`
	}
	if err := yaml.UnmarshalStrict(raw, &cm); err != nil {
		t.Fatalf("argocd/argocd-cm.yaml: %v", err)
	}
	if cm.Kind != "ConfigMap" || cm.Metadata["name"] != "argocd-cm" {
		t.Fatalf("argocd/argocd-cm.yaml is not a patch of argocd-cm: %s %v", cm.Kind, cm.Metadata["name"])
	}
	return string(script), cm.Data[healthKey]
}

// The snippet users paste into argocd-cm is health.lua, byte for byte.
func TestArgoCDConfigMapSnippetIsTheScript(t *testing.T) {
	script, snippet := readScripts(t)
	if snippet != script {
		t.Fatalf("argocd/argocd-cm.yaml %s differs from argocd/health.lua", healthKey)
	}
}

// A state of a RetryPolicy and what each tool must make of it.
type state struct {
	name    string
	obj     *unstructured.Unstructured
	argo    string
	kstatus status.Status
}

func TestHealthOfEveryStateFromTheAPIServer(t *testing.T) {
	c := connect(t)
	main := c.namespace("gitops")
	notOwned := c.namespace("gitops-cm")
	quota := c.namespace("gitops-quota")
	var states []state

	// Not seen by an operator yet: no status at all.
	c.apply(main, manifest("first", []string{"emails"}, 4))
	states = append(states, state{"new, no status", c.policy(main, "first"), "Progressing",
		// kstatus has nothing to go on without observedGeneration or a condition.
		status.CurrentStatus})

	// A ConfigMap of the operator's name that someone else owns.
	c.must("-n", notOwned, "create", "configmap", "rebound-policies", "--from-literal=owner=someone-else")
	c.apply(notOwned, manifest("blocked", []string{"emails"}, 4))

	// A quota that forbids ConfigMaps: the write fails and the operator keeps retrying.
	// Without a controller manager the quota's usage is set by hand, as its controller would.
	c.must("-n", quota, "create", "quota", "no-configmaps", "--hard=configmaps=0")
	c.must("-n", quota, "patch", "resourcequota", "no-configmaps", "--subresource=status", "--type=merge",
		"-p", `{"status":{"hard":{"configmaps":"0"},"used":{"configmaps":"0"}}}`)
	c.apply(quota, manifest("retrying", []string{"emails"}, 4))

	op := c.startOperator(main, notOwned, quota)
	states = append(states,
		state{"Ready", c.waitForReason(main, "first", "Compiled"), "Healthy", status.CurrentStatus})

	// Newer policy claiming the same queue. (InvalidSpec cannot be reached through
	// admission, which refuses every spec the policy crate refuses; its status is a
	// partial-status case below.)
	c.apply(main, manifest("second", []string{"emails", "sms"}, 3))
	states = append(states,
		state{"Conflict", c.waitForReason(main, "second", "Conflict"), "Degraded", status.FailedStatus},
		state{"ConfigMapNotOwned", c.waitForReason(notOwned, "blocked", "ConfigMapNotOwned"), "Degraded", status.FailedStatus},
		state{"reconciling (ApplyFailed)", c.waitForReason(quota, "retrying", "ApplyFailed"), "Progressing", status.InProgressStatus},
	)

	// The operator is gone when the spec changes: the status is for an old generation.
	op.stop()
	c.apply(main, manifest("first", []string{"emails"}, 6))
	old := c.policy(main, "first")
	if old.GetGeneration() != 2 || readyReason(old) != "" {
		t.Fatalf("expected generation 2 with a status for generation 1, got %d: %v", old.GetGeneration(), old.Object["status"])
	}
	states = append(states, state{"old generation", old, "Progressing", status.InProgressStatus})

	script, snippet := readScripts(t)
	dump := os.Getenv("REBOUND_GITOPS_DUMP")
	for _, s := range states {
		for source, text := range map[string]string{"health.lua": script, "argocd-cm": snippet} {
			got, message, err := argoHealth(text, s.obj)
			if err != nil {
				t.Fatalf("%s (%s): %v", s.name, source, err)
			}
			if got != s.argo || message == "" {
				t.Errorf("%s (%s): Argo CD health %q (%q), want %q with a message", s.name, source, got, message, s.argo)
			}
		}
		res, err := status.Compute(s.obj)
		if err != nil {
			t.Fatalf("%s: kstatus: %v", s.name, err)
		}
		if res.Status != s.kstatus {
			t.Errorf("%s: kstatus %s (%s), want %s", s.name, res.Status, res.Message, s.kstatus)
		}
		if dump != "" {
			// For people: the objects as read back, e.g. to write Argo CD's own health_test.yaml.
			b, _ := s.obj.MarshalJSON()
			_ = os.WriteFile(filepath.Join(dump, s.name+".json"), b, 0o644)
		}
	}
	if t.Failed() {
		t.Logf("operator log:\n%s", op.tail())
	}
}

// The script never indexes a missing table, whatever part of the status is absent, and
// does not rely on Lua libraries Argo CD leaves out.
func TestHealthOfPartialStatuses(t *testing.T) {
	script, _ := readScripts(t)
	for _, tc := range []struct {
		name string
		obj  map[string]any
		want string
	}{
		{"no metadata.generation", map[string]any{"metadata": map[string]any{}, "status": map[string]any{"conditions": []any{
			map[string]any{"type": "Ready", "status": "True"}}}}, "Healthy"},
		{"empty conditions", map[string]any{"metadata": map[string]any{"generation": int64(1)}, "status": map[string]any{"conditions": []any{}}}, "Progressing"},
		{"Ready Unknown", map[string]any{"metadata": map[string]any{"generation": int64(1)}, "status": map[string]any{"observedGeneration": int64(1), "conditions": []any{
			map[string]any{"type": "Ready", "status": "Unknown", "observedGeneration": int64(1)}}}}, "Progressing"},
		{"Ready False alone", map[string]any{"metadata": map[string]any{"generation": int64(1)}, "status": map[string]any{"conditions": []any{
			map[string]any{"type": "Ready", "status": "False", "reason": "X"}}}}, "Degraded"},
		{"InvalidSpec", map[string]any{"metadata": map[string]any{"generation": int64(1)}, "status": map[string]any{"observedGeneration": int64(1), "conditions": []any{
			map[string]any{"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": "spec.backoff.cap: cap must be at least base", "observedGeneration": int64(1)}}}}, "Degraded"},
	} {
		got, _, err := argoHealth(script, &unstructured.Unstructured{Object: tc.obj})
		if err != nil || got != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
}
