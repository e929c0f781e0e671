package reboundriver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
)

// A fast policy for the quick start's queue; maxAttempts 2 so some jobs become dead letters.
const quickPolicy = `apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: webhooks}
spec:
  queues: ["webhooks"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 2
  terminal: {action: deadLetter, deadLetterQueue: webhooks-dead}
`

func blocks(text, lang string) []string {
	var out []string
	for _, m := range regexp.MustCompile("(?s)```"+lang+"\n(.*?)```").FindAllStringSubmatch(text, -1) {
		out = append(out, m[1])
	}
	return out
}

// The README's quick start, as pasted (with /path/to/rebound the checkout), on a database
// of its own and a sidecar serving a fast policy; then the README's dead-letter query.
func TestReadmeQuickStartAsPasted(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(devstack.RepoRoot(), "clients", "go", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(raw)
	sh, code, sqls := blocks(text, "sh"), blocks(text, "go"), blocks(text, "sql")
	metricsCode := ""
	replay := false
	for _, c := range code {
		if strings.HasPrefix(c, "// metrics/main.go") {
			metricsCode = c
		}
		replay = replay || strings.Contains(c, "reboundriver.Replay(ctx, client, deadLetterID)")
	}
	if len(sh) < 2 || !strings.HasPrefix(sh[0], "mkdir rebound-quickstart") || sh[1] != "go mod tidy\ngo run .\n" ||
		!strings.Contains(code[0], "package main") || len(sqls) != 1 || !replay || metricsCode == "" {
		t.Fatalf("README blocks changed: sh %q", sh)
	}

	ctx := context.Background()
	if _, err := pool.Exec(ctx, "DROP DATABASE IF EXISTS quickstart"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE DATABASE quickstart"); err != nil {
		t.Fatal(err)
	}
	dbURL := strings.Replace(pool.Config().ConnString(), "/postgres?", "/quickstart?", 1)
	s := startSidecar(t, "quickstart-sidecar", "demo", quickPolicy, "webhooks")

	dir := t.TempDir()
	env := append(os.Environ(), "DATABASE_URL="+dbURL, "REBOUND_TARGET="+s.Target, "GOWORK=off", "GOFLAGS=-buildvcs=false")
	run := func(where, script string) []byte {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 8*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(cctx, "bash", "-euo", "pipefail", "-c", script)
		cmd.Dir, cmd.Env = where, env
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s: %v\n%s", script, err, errb.String())
		}
		return out.Bytes()
	}
	run(dir, strings.ReplaceAll(sh[0], "/path/to/rebound", devstack.RepoRoot()))
	app := filepath.Join(dir, "rebound-quickstart")
	if err := os.WriteFile(filepath.Join(app, "main.go"), []byte(code[0]), 0o644); err != nil {
		t.Fatal(err)
	}
	out := run(app, sh[1])

	type line struct {
		Job      int64  `json:"job"`
		State    string `json:"state"`
		Attempts int    `json:"attempts"`
	}
	var jobs []line
	var metrics struct {
		Decisions struct{ Retry, GiveUpMaxAttempts int }
		Fallback  struct{ Total int }
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err == nil && l.Job != 0 {
			jobs = append(jobs, l)
		} else if err := json.Unmarshal(sc.Bytes(), &metrics); err != nil {
			t.Fatalf("unexpected output line %q", sc.Text())
		}
	}
	var cancelled []int64 // given up: discarded
	for _, j := range jobs {
		switch {
		case j.State == "completed" && j.Attempts >= 1 && j.Attempts <= 2:
		case j.State == "discarded" && j.Attempts == 2:
			cancelled = append(cancelled, j.Job)
		default:
			t.Errorf("job %+v", j)
		}
	}
	if len(jobs) != 5 || metrics.Fallback.Total != 0 || metrics.Decisions.GiveUpMaxAttempts != len(cancelled) {
		t.Fatalf("jobs %+v, metrics %+v", jobs, metrics)
	}

	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, sqls[0])
	if err != nil {
		t.Fatal(err)
	}
	var found []int64
	for rows.Next() {
		var id, jobID int64
		var reason string
		var attempts int
		var args json.RawMessage
		if err := rows.Scan(&id, &jobID, &reason, &attempts, &args); err != nil {
			t.Fatal(err)
		}
		var a struct {
			URL   string `json:"url"`
			Event int    `json:"event"`
		}
		if err := json.Unmarshal(args, &a); err != nil || a.URL == "" || reason != "GIVE_UP_REASON_MAX_ATTEMPTS" || attempts != 2 {
			t.Errorf("dead letter %d of job %d: reason %s attempts %d args %s", id, jobID, reason, attempts, args)
		}
		found = append(found, jobID)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	sort.Slice(cancelled, func(i, j int) bool { return cancelled[i] < cancelled[j] })
	sort.Slice(found, func(i, j int) bool { return found[i] < found[j] }) // the query orders by dead letter
	if len(found) != len(cancelled) || (len(found) > 0 && !equal(found, cancelled)) {
		t.Fatalf("README query found dead letters of %v, the quick start gave up %v", found, cancelled)
	}

	// The Metrics section's program, in the quick start's module: the contract's 13 series
	// of adapter="river", scraped and parsed as Prometheus would.
	if err := os.MkdirAll(filepath.Join(app, "metrics"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(app, "metrics", "main.go"), []byte(metricsCode), 0o644); err != nil {
		t.Fatal(err)
	}
	run(app, "go mod tidy && go build -o metrics-bin ./metrics")
	addr := "127.0.0.1:" + strconv.Itoa(freePort(t))
	cmd := exec.Command(filepath.Join(app, "metrics-bin"))
	cmd.Env = append(env, "METRICS_ADDR="+addr)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	var families map[string]*dto.MetricFamily
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := http.Get("http://" + addr + "/metrics")
		if err == nil {
			parser := expfmt.NewTextParser(model.UTF8Validation)
			families, err = parser.TextToMetricFamilies(res.Body)
			res.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics endpoint: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	series := map[string]int{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "adapter" && l.GetValue() == "river" && f.GetType() == dto.MetricType_COUNTER {
					series[name]++
				}
			}
		}
	}
	want := map[string]int{"rebound_adapter_decisions_total": 2, "rebound_adapter_fallbacks_total": 8,
		"rebound_adapter_terminal_total": 2, "rebound_adapter_hook_errors_total": 1}
	if !reflect.DeepEqual(series, want) {
		t.Fatalf("scraped series %v, want %v", series, want)
	}
}

// freePort is a TCP port on 127.0.0.1 that nothing listens on right now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func equal(a, b []int64) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return len(a) == len(b)
}
