package reboundriver

import (
	"github.com/prometheus/client_golang/prometheus"

	rebound "github.com/rebound-dev/rebound/clients/go"
)

// AdapterLabel is the value of the adapter label on the rebound_adapter_* counters.
const AdapterLabel = "river"

var (
	decisionsDesc = prometheus.NewDesc("rebound_adapter_decisions_total",
		"Retry decisions the hook used, by who answered (sidecar or local fallback).",
		[]string{"adapter", "source"}, nil)
	fallbacksDesc = prometheus.NewDesc("rebound_adapter_fallbacks_total",
		"Decisions made without the sidecar, by cause and the policy used (cached copy or built-in default).",
		[]string{"adapter", "reason", "policy_source"}, nil)
	terminalDesc = prometheus.NewDesc("rebound_adapter_terminal_total",
		"Jobs the adapter dead-lettered or dropped.",
		[]string{"adapter", "disposition"}, nil)
	hookErrorsDesc = prometheus.NewDesc("rebound_adapter_hook_errors_total",
		"Faults inside the adapter that it absorbed (the hook never fails).",
		[]string{"adapter"}, nil)
)

// collector reads the client's counters (rebound.Rebound.Metrics) when scraped: one
// count, two views, no double accounting.
type collector struct{ client *rebound.Rebound }

// Collector is the rebound_adapter_* counters of the adapter's client (every answer of
// the client, the middleware's and any Decide of your own) as a prometheus.Collector.
func (a *Adapter) Collector() prometheus.Collector { return collector{a.client} }

// RegisterMetrics registers Collector in reg (e.g. prometheus.DefaultRegisterer). Nothing
// is registered unless the application calls it; a second adapter of the same client in
// the same registry is refused (prometheus.AlreadyRegisteredError).
func (a *Adapter) RegisterMetrics(reg prometheus.Registerer) error {
	return reg.Register(a.Collector())
}

func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{decisionsDesc, fallbacksDesc, terminalDesc, hookErrorsDesc} {
		ch <- d
	}
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	m := c.client.Metrics()
	counter := func(d *prometheus.Desc, v int, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{AdapterLabel}, labels...)...)
	}
	counter(decisionsDesc, m.Sources.Sidecar, "sidecar")
	counter(decisionsDesc, m.Sources.Fallback, "fallback")
	all := rebound.FallbackCauses{
		Unavailable: m.Fallback.Unavailable, DeadlineExceeded: m.Fallback.DeadlineExceeded,
		NotFound: m.Fallback.NotFound, Other: m.Fallback.Other,
	}
	def := m.Fallback.FromDefault
	for _, r := range []struct {
		reason       string
		all, fromDef int
	}{
		{"unavailable", all.Unavailable, def.Unavailable},
		{"deadline_exceeded", all.DeadlineExceeded, def.DeadlineExceeded},
		{"not_found", all.NotFound, def.NotFound},
		{"other", all.Other, def.Other},
	} {
		counter(fallbacksDesc, r.all-r.fromDef, r.reason, "cached")
		counter(fallbacksDesc, r.fromDef, r.reason, "default")
	}
	counter(terminalDesc, m.DeadLettered, "dead_letter")
	counter(terminalDesc, m.Dropped, "drop")
	counter(hookErrorsDesc, m.HookErrors)
}
