package reboundriver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	if len(sh) < 2 || !strings.HasPrefix(sh[0], "mkdir rebound-quickstart") || sh[1] != "go mod tidy\ngo run .\n" ||
		!strings.Contains(code[0], "package main") || len(sqls) != 1 || len(code) < 2 ||
		!strings.Contains(code[1], "reboundriver.Replay(ctx, client, deadLetterID)") {
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
	s, err := devstack.NewFileSidecar(filepath.Join(runDir, "quickstart-sidecar"), "demo", quickPolicy, "webhooks")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)

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
}

func equal(a, b []int64) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return len(a) == len(b)
}
