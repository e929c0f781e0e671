package reboundriver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"

	rebound "github.com/rebound-dev/rebound/clients/go"
	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// The stack every test shares: PostgreSQL from dev/postgres.sh with River's migrations,
// and one sidecar compiling policies; tests that kill a sidecar start their own.
var (
	pool    *pgxpool.Pool
	sidecar *devstack.Sidecar
	runDir  string
	// confSidecar serves clients/conformance/policies.yaml (namespace conformance).
	confSidecar *devstack.Sidecar
)

const policies = `
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: gaps}
spec:
  queues: ["gaps"]
  backoff: {strategy: exponential, base: 300ms, multiplier: 2, cap: 2s, jitter: {kind: equal}}
  maxAttempts: 5
  terminal: {action: deadLetter, deadLetterQueue: gaps-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: payments}
spec:
  queues: ["payments", "failover"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 4
  nonRetryableErrors: ["CardDeclined", "card.*"]
  terminal: {action: deadLetter, deadLetterQueue: payments-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: dropme}
spec:
  queues: ["dropme"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 2
  terminal: {action: drop}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: deadline}
spec:
  queues: ["deadline"]
  backoff: {strategy: constant, base: 400ms, jitter: {kind: none}}
  maxAttempts: 100
  maxRetryDuration: 1500ms
  terminal: {action: deadLetter, deadLetterQueue: deadline-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: crash}
spec:
  queues: ["crash"]
  backoff: {strategy: constant, base: 200ms, jitter: {kind: none}}
  maxAttempts: 3
  terminal: {action: deadLetter, deadLetterQueue: crash-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: rescued}
spec:
  queues: ["rescued"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 2
  terminal: {action: deadLetter, deadLetterQueue: rescued-dead}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: stopping}
spec:
  queues: ["stopping"]
  backoff: {strategy: constant, base: 100ms, jitter: {kind: none}}
  maxAttempts: 1
  terminal: {action: deadLetter, deadLetterQueue: stopping-dead}
`

func TestMain(m *testing.M) {
	if os.Getenv(crashWorkerEnv) != "" {
		os.Exit(runCrashWorker())
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	runDir = devstack.StateDir(fmt.Sprintf("river-%d", os.Getpid()))
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "setup:", err); return 1 }
	pg, err := devstack.StartPostgres(filepath.Join(runDir, "pg"))
	if err != nil {
		return fail(err)
	}
	defer pg.Stop()
	ctx := context.Background()
	pool, err = pgxpool.New(ctx, pg.URL)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return fail(err)
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fail(err)
	}
	sidecar, err = devstack.NewFileSidecar(filepath.Join(runDir, "sidecar"), "gotest", policies, "payments")
	if err != nil {
		return fail(err)
	}
	if err := sidecar.Start(); err != nil {
		return fail(err)
	}
	defer sidecar.Kill()
	confPolicies, err := os.ReadFile(filepath.Join(devstack.RepoRoot(), "clients", "conformance", "policies.yaml"))
	if err != nil {
		return fail(err)
	}
	confSidecar, err = devstack.NewFileSidecar(filepath.Join(runDir, "conformance-sidecar"), "conformance", string(confPolicies), "fixed-3")
	if err != nil {
		return fail(err)
	}
	if err := confSidecar.Start(); err != nil {
		return fail(err)
	}
	defer confSidecar.Kill()
	code := m.Run()
	// Stopped before the state dir goes (the deferred calls would run after it).
	sidecar.Kill()
	confSidecar.Kill()
	pool.Close()
	if err := pg.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "teardown:", err)
		code = 1
	}
	if code == 0 {
		os.RemoveAll(runDir)
	}
	return code
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// FailArgs: a job that fails its first FailTimes runs (all of them when negative) with
// an error of class Class, then succeeds.
// A first run with SleepMs sleeps that long before failing.
type FailArgs struct {
	FailTimes int    `json:"fail_times"`
	Class     string `json:"class"`
	SleepMs   int    `json:"sleep_ms,omitempty"`
}

func (FailArgs) Kind() string { return "rebound_test_fail" }

// PanicArgs: a job whose every run panics.
type PanicArgs struct{}

func (PanicArgs) Kind() string { return "rebound_test_panic" }

type panicWorker struct {
	river.WorkerDefaults[PanicArgs]
}

func (panicWorker) Work(context.Context, *river.Job[PanicArgs]) error { panic("worker bug") }

type failWorker struct {
	river.WorkerDefaults[FailArgs]
}

func (failWorker) Work(_ context.Context, job *river.Job[FailArgs]) error {
	if job.Attempt == 1 {
		time.Sleep(time.Duration(job.Args.SleepMs) * time.Millisecond)
	}
	if job.Args.FailTimes < 0 || job.Attempt <= job.Args.FailTimes {
		err := fmt.Errorf("run %d failed", job.Attempt)
		if job.Args.Class != "" {
			return reboundriver.WithClass(err, job.Args.Class)
		}
		return err
	}
	return nil
}

// newRebound is a rebound client for target (warmed for queues) closed at the end of the test.
// startSidecar starts a file-mode sidecar of its own under runDir/name, serving policies
// for namespace ns, ready once readyQueue resolves; killed when the test ends.
func startSidecar(t *testing.T, name, ns, policies, readyQueue string) *devstack.Sidecar {
	t.Helper()
	s, err := devstack.NewFileSidecar(filepath.Join(runDir, name), ns, policies, readyQueue)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return s
}

func newRebound(t *testing.T, target string, queues ...string) *rebound.Rebound {
	t.Helper()
	c, err := rebound.New(rebound.Options{Target: target, Deadline: 2 * time.Second, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	for _, q := range queues {
		c.Warm(q)
	}
	return c
}

// startRiver runs a River client working queues with the adapter installed.
func startRiver(t *testing.T, rb *rebound.Rebound, queues ...string) *river.Client[pgx5Tx] {
	t.Helper()
	return startRiverWith(t, rb, nil, queues...)
}

// startRiverWith is startRiver with the config changed by edit before the adapter is installed.
func startRiverWith(t *testing.T, rb *rebound.Rebound, edit func(*river.Config), queues ...string) *river.Client[pgx5Tx] {
	t.Helper()
	workers := river.NewWorkers()
	river.AddWorker(workers, failWorker{})
	river.AddWorker(workers, &sleepWorker{})
	river.AddWorker(workers, panicWorker{})
	river.AddWorker(workers, &blockWorker{})
	river.AddWorker(workers, causeWorker{})
	river.AddWorker(workers, recWorker{})
	river.AddWorker(workers, faultWorker{})
	cfg := &river.Config{
		Queues:               map[string]river.QueueConfig{},
		Workers:              workers,
		Logger:               quiet(),
		FetchCooldown:        20 * time.Millisecond,
		FetchPollInterval:    50 * time.Millisecond,
		JobTimeout:           2 * time.Second,
		RescueStuckJobsAfter: 3 * time.Second,
	}
	for _, q := range queues {
		cfg.Queues[q] = river.QueueConfig{MaxWorkers: 4}
	}
	if edit != nil {
		edit(cfg)
	}
	client := startClient(t, context.Background(), pool, cfg, reboundriver.New(rb, reboundriver.Options{}))
	return client
}

// inserter is a River client that only inserts and reads jobs.
func inserter(t *testing.T) *river.Client[pgx5Tx] {
	t.Helper()
	c, err := river.NewClient(riverpgxv5.New(pool), &river.Config{MaxAttempts: rebound.LibraryAttempts})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// startClient installs the adapter on cfg, starts a River client on pool p with ctx (its
// cancellation stops the client, as in a worker's main), and stops it when the test ends.
func startClient(t *testing.T, ctx context.Context, p *pgxpool.Pool, cfg *river.Config, adapter *reboundriver.Adapter) *river.Client[pgx5Tx] {
	t.Helper()
	reboundriver.Configure(cfg, adapter)
	c, err := river.NewClient(riverpgxv5.New(p), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.StopAndCancel(stopCtx)
	})
	return c
}

func insert(t *testing.T, c *river.Client[pgx5Tx], queue string, args river.JobArgs) int64 {
	t.Helper()
	res, err := c.Insert(context.Background(), args, &river.InsertOpts{Queue: queue})
	if err != nil {
		t.Fatal(err)
	}
	if res.Job.MaxAttempts != rebound.LibraryAttempts {
		t.Fatalf("job inserted with max_attempts %d", res.Job.MaxAttempts)
	}
	return res.Job.ID
}

func finalised(s rivertype.JobState) bool {
	return s == rivertype.JobStateCompleted || s == rivertype.JobStateCancelled || s == rivertype.JobStateDiscarded
}

// waitFinal polls the job until it is completed, cancelled or discarded.
func waitFinal(t *testing.T, c *river.Client[pgx5Tx], id int64, within time.Duration) *rivertype.JobRow {
	t.Helper()
	end := time.Now().Add(within)
	for {
		job, err := c.JobGet(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if finalised(job.State) {
			return job
		}
		if time.Now().After(end) {
			t.Fatalf("job %d still %s at attempt %d after %s", id, job.State, job.Attempt, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func giveUpOf(t *testing.T, job *rivertype.JobRow) *reboundriver.GiveUp {
	t.Helper()
	var meta map[string]json.RawMessage
	if err := json.Unmarshal(job.Metadata, &meta); err != nil {
		t.Fatal(err)
	}
	raw, ok := meta[reboundriver.MetadataKey]
	if !ok {
		return nil
	}
	var g reboundriver.GiveUp
	if err := json.Unmarshal(raw, &g); err != nil {
		t.Fatal(err)
	}
	return &g
}

type pgx5Tx = pgx.Tx

// deadLetter is a dead-letter job as the README's query reads it, with its args decoded.
type deadLetter struct {
	id int64
	reboundriver.DeadLetterArgs
}

// deadLettersOf are the dead letters of job id (in queue dlq, any queue when empty).
func deadLettersOf(t *testing.T, dlq string, id int64) []deadLetter {
	t.Helper()
	return queryDeadLetters(t, pool, dlq, id)
}

// queryDeadLetters are the dead letters of job id in the database of q (in queue dlq, any
// queue when empty).
func queryDeadLetters(t *testing.T, q *pgxpool.Pool, dlq string, id int64) []deadLetter {
	t.Helper()
	rows, err := q.Query(context.Background(), `SELECT id, args FROM river_job
		WHERE kind = 'rebound_dead_letter' AND ($1 = '' OR queue = $1) AND (args->>'job_id')::bigint = $2 ORDER BY id`, dlq, id)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []deadLetter
	for rows.Next() {
		var d deadLetter
		var raw []byte
		if err := rows.Scan(&d.id, &raw); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(raw, &d.DeadLetterArgs); err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	return out
}
