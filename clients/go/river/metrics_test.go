package reboundriver_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// gathered is one registry's samples: "name{label=value,...}" (labels sorted) → value.
func gathered(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetType() != dto.MetricType_COUNTER {
			t.Fatalf("%s is a %s", f.GetName(), f.GetType())
		}
		for _, m := range f.GetMetric() {
			key := f.GetName() + "{"
			for i, l := range m.GetLabel() { // the client sorts labels by name
				if i > 0 {
					key += ","
				}
				key += l.GetName() + "=" + l.GetValue()
			}
			out[key+"}"] = m.GetCounter().GetValue()
		}
	}
	return out
}

// The rebound_adapter_* counters, gathered from the application's registry: answers of
// the sidecar, then with the sidecar killed fallbacks (unavailable, the cached policy),
// and the dead letters, all 13 series of the contract present.
func TestPrometheusCounters(t *testing.T) {
	s := startSidecar(t, "metrics-sidecar", "gotest", policies, "failover")
	rb := newRebound(t, s.Target, "failover")
	adapter := reboundriver.New(rb, reboundriver.Options{})
	reg := prometheus.NewRegistry()
	if err := adapter.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if err := adapter.RegisterMetrics(reg); err == nil {
		t.Fatal("a second registration of the same counters was accepted")
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, failWorker{})
	cfg := &river.Config{
		Queues: map[string]river.QueueConfig{"failover": {MaxWorkers: 4}}, Workers: workers, Logger: quiet(),
		FetchCooldown: 20 * time.Millisecond, FetchPollInterval: 50 * time.Millisecond, JobTimeout: 2 * time.Second,
	}
	c := startClient(t, t.Context(), pool, cfg, adapter)

	// The payments policy: 4 runs, then a dead letter.
	id := insert(t, c, "failover", FailArgs{FailTimes: -1})
	if job := waitFinal(t, c, id, 30*time.Second); job.State != rivertype.JobStateDiscarded {
		t.Fatalf("state %s", job.State)
	}
	want := map[string]float64{
		"rebound_adapter_decisions_total{adapter=river,source=sidecar}":         4,
		"rebound_adapter_decisions_total{adapter=river,source=fallback}":        0,
		"rebound_adapter_terminal_total{adapter=river,disposition=dead_letter}": 1,
		"rebound_adapter_terminal_total{adapter=river,disposition=drop}":        0,
		"rebound_adapter_hook_errors_total{adapter=river}":                      0,
	}
	for _, reason := range []string{"unavailable", "deadline_exceeded", "not_found", "other"} {
		for _, ps := range []string{"cached", "default"} {
			want["rebound_adapter_fallbacks_total{adapter=river,policy_source="+ps+",reason="+reason+"}"] = 0
		}
	}
	check := func(what string) {
		t.Helper()
		got := gathered(t, reg)
		if len(got) != len(want) {
			t.Fatalf("%s: %d series, want %d: %v", what, len(got), len(want), got)
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s: %s = %v, want %v", what, k, got[k], v)
			}
		}
	}
	check("sidecar up")

	s.Kill()
	id = insert(t, c, "failover", FailArgs{FailTimes: -1})
	if job := waitFinal(t, c, id, 30*time.Second); job.State != rivertype.JobStateDiscarded {
		t.Fatalf("state %s", job.State)
	}
	want["rebound_adapter_decisions_total{adapter=river,source=fallback}"] = 4
	want["rebound_adapter_fallbacks_total{adapter=river,policy_source=cached,reason=unavailable}"] = 4
	want["rebound_adapter_terminal_total{adapter=river,disposition=dead_letter}"] = 2
	check("sidecar killed")
}
