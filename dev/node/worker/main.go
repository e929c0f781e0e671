// Command node-worker is the worker of the node tests: it asks its Pod's sidecar, through
// the Go client, what to do after a failure of attempt 1, 2, ... ATTEMPTS of a job, then
// of the next job (each its own job ID, as a retry budget sees them), over and over, and reports every answer as one JSON object: on stdout (`kubectl logs`) and, when
// REPORT_URL is set, by POST to that address (the tests listen on the node's address, so
// the answers of a Pod outlive the Pod). On SIGTERM it stops asking, reports
// {"event":"stopped"} with the number of calls and failures, and exits 0.
//
// Environment: REBOUND_TARGET (the sidecar; the client's default otherwise), QUEUE
// (default "webhooks"), ATTEMPTS (the attempt numbers cycle 1..ATTEMPTS, default 5),
// INTERVAL (between calls, default 100ms), REPORT_URL, POD_NAME, METRICS_LISTEN (an
// address such as ":9090": the Go adapter's rebound_adapter_* counters on /metrics for
// Prometheus; off when empty).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	rebound "github.com/rebound-dev/rebound/clients/go"
	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// Report is one line of what the worker saw.
type Report struct {
	Event        string `json:"event"`
	Pod          string `json:"pod"`
	Target       string `json:"target,omitempty"`
	Seq          int    `json:"seq"`
	Queue        string `json:"queue,omitempty"`
	Attempt      int    `json:"attempt,omitempty"`
	Decision     string `json:"decision,omitempty"`
	DelayMs      int64  `json:"delayMs"`
	Disposition  string `json:"disposition,omitempty"`
	Reason       string `json:"reason,omitempty"`
	Source       string `json:"source,omitempty"`
	Job          string `json:"job,omitempty"`
	Revision     string `json:"revision,omitempty"`
	PolicySource string `json:"policySource,omitempty"`
	Policy       string `json:"policy,omitempty"`
	Generation   int64  `json:"generation,omitempty"`
	ConfigHash   string `json:"configHash,omitempty"`
	Calls        int    `json:"calls"`
	Fallbacks    int    `json:"fallbacks"`
	UnixMs       int64  `json:"unixMs"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "node-worker:", err)
		os.Exit(1)
	}
}

func run() error {
	queue := envOr("QUEUE", "webhooks")
	attempts, err := strconv.Atoi(envOr("ATTEMPTS", "5"))
	if err != nil || attempts < 1 {
		return fmt.Errorf("ATTEMPTS=%q: want a positive integer", os.Getenv("ATTEMPTS"))
	}
	interval, err := time.ParseDuration(envOr("INTERVAL", "100ms"))
	if err != nil || interval <= 0 {
		return fmt.Errorf("INTERVAL=%q: want a positive duration", os.Getenv("INTERVAL"))
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	client, err := rebound.New(rebound.Options{Logger: logger})
	if err != nil {
		return err
	}
	defer client.Close()
	if addr := os.Getenv("METRICS_LISTEN"); addr != "" {
		if err := serveMetrics(addr, client, logger); err != nil {
			return err
		}
	}
	reporter := reporter{url: os.Getenv("REPORT_URL"), pod: os.Getenv("POD_NAME"), http: &http.Client{Timeout: 2 * time.Second}}
	// What the client was told to use ("" means its default, 127.0.0.1:7411).
	target := os.Getenv("REBOUND_TARGET")

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	calls, fallbacks := 0, 0
	var firstFailure time.Time
	for {
		if calls > 0 { // the first call at once, then one per interval
			select {
			case <-stop:
				reporter.send(Report{Event: "stopped", Seq: calls + 1, Calls: calls, Fallbacks: fallbacks})
				return nil
			case <-ticker.C:
			}
		}
		attempt := calls%attempts + 1
		if attempt == 1 {
			// Every attempt of a job carries its first failure: a policy in rollout
			// answers all of them from one revision.
			firstFailure = time.Now()
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		job := fmt.Sprintf("node-worker-job-%d", calls/attempts)
		answer := client.Decide(ctx, rebound.Failure{Queue: queue, Attempt: attempt, JobID: job, FirstFailure: firstFailure})
		cancel()
		calls++
		if answer.Source != rebound.SourceSidecar {
			fallbacks++
		}
		r := Report{
			Event: "answer", Seq: calls, Target: target, Queue: queue, Attempt: attempt,
			Decision: answer.Decision.String(), DelayMs: answer.Delay.Milliseconds(),
			Source: string(answer.Source), PolicySource: string(answer.PolicySource),
			Job: job, Revision: answer.Revision,
		}
		if !answer.Retry() {
			r.Disposition, r.Reason = answer.Disposition.String(), answer.Reason.String()
		}
		if p := answer.Policy; p != nil {
			r.Policy, r.Generation, r.ConfigHash = p.GetNamespace()+"/"+p.GetName(), p.GetGeneration(), p.GetConfigHash()
		}
		reporter.send(r)
	}
}

type reporter struct {
	url, pod string
	http     *http.Client
}

// send prints r and posts it; a report that cannot be posted is still on stdout.
func (rp reporter) send(r Report) {
	r.Pod, r.UnixMs = rp.pod, time.Now().UnixMilli()
	line, err := json.Marshal(r)
	if err != nil {
		return
	}
	fmt.Println(string(line))
	if rp.url == "" {
		return
	}
	resp, err := rp.http.Post(rp.url, "application/json", bytes.NewReader(line))
	if err != nil {
		fmt.Fprintln(os.Stderr, "node-worker: report:", err)
		return
	}
	resp.Body.Close()
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// serveMetrics exposes the counters of client the way a River worker does (the adapter's
// collector, one registry), so the monitoring tests scrape real adapter series.
func serveMetrics(addr string, client *rebound.Rebound, logger *slog.Logger) error {
	reg := prometheus.NewRegistry()
	if err := reboundriver.New(client, reboundriver.Options{}).RegisterMetrics(reg); err != nil {
		return fmt.Errorf("METRICS_LISTEN: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	server := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("METRICS_LISTEN=%q: %w", addr, err)
	}
	go func() {
		if err := server.Serve(listener); err != nil && err != http.ErrServerClosed {
			logger.Error("metrics server stopped", "err", err)
		}
	}()
	return nil
}
