package reboundriver_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"

	rebound "github.com/rebound-dev/rebound/clients/go"
	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// The fault-injection scenarios of clients/conformance/faults.json that list "river", each a
// subtest of TestFaults named by its id (go test -run 'TestFaults/commit-reply-lost' ./river),
// against real River clients and worker processes, PostgreSQL and rebound-sidecars. For
// every job a scenario tallies where it ended (completed, waiting for a retry or running,
// discarded with its dead letter) and the runs the job itself counted.
var faults = map[string]func(*testing.T){
	"paused-past-every-timeout":          faultPausedPastEveryTimeout,
	"killed-on-every-run":                faultKilledOnEveryRun,
	"killed-while-deciding":              faultKilledWhileDeciding,
	"killed-between-dead-letter-and-ack": faultKilledBetweenDeadLetterAndAck,
	"dead-letter-write-refused":          faultDeadLetterWriteRefused,
	"database-down-past-timeouts":        faultDatabaseDownPastTimeouts,
	"commit-reply-lost":                  faultCommitReplyLost,
	"sidecar-hung":                       faultSidecarHung,
	"replay-after-crashes":               faultReplayAfterCrashes,
	"gives-up-twice":                     faultGivesUpTwice,
	"start-context-cancelled":            faultStartContextCancelled,
}

// window is the adapter's documented at-least-once window (clients/go/README.md): the
// duplicate runs one fault may add to a job.
const window = 1

type faultScenario struct {
	ID        string         `json:"id"`
	Libraries []string       `json:"libraries"`
	Policy    string         `json:"policy"`
	Expect    map[string]any `json:"expect"`
}

func faultScenarios(t *testing.T) []faultScenario {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(devstack.RepoRoot(), "clients", "conformance", "faults.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Scenarios []faultScenario `json:"scenarios"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	var river []faultScenario
	for _, s := range doc.Scenarios {
		for _, l := range s.Libraries {
			if l == "river" {
				river = append(river, s)
			}
		}
	}
	if len(river) == 0 {
		t.Fatal("faults.json lists no scenario for river")
	}
	return river
}

// Every faults.json scenario listing river has a Go test, and every Go test a scenario.
func TestFaultsEveryScenarioHasAGoTest(t *testing.T) {
	ids := []string{}
	for _, s := range faultScenarios(t) {
		ids = append(ids, s.ID)
	}
	checkCoverage(t, "faults.json (river)", ids, faults)
}

func TestFaults(t *testing.T) {
	for _, s := range faultScenarios(t) {
		if fn := faults[s.ID]; fn != nil {
			t.Run(s.ID, fn)
		}
	}
}

// --- the job ---------------------------------------------------------------------------

// FaultArgs: a job that marks each run it starts with a file in $REBOUND_TEST_RUNS_DIR
// (<id>-<attempt>-<pid>-<ns>), sleeps SleepMs (on run SleepOn only, when set), then kills
// its own process while the file "kill" exists there (and it runs in a worker process),
// blocks until its context ends when Block is set, or fails (succeeds with Succeed).
type FaultArgs struct {
	SleepMs int  `json:"sleep_ms,omitempty"`
	SleepOn int  `json:"sleep_on,omitempty"`
	Succeed bool `json:"succeed,omitempty"`
	Block   bool `json:"block,omitempty"`
	N       int  `json:"n,omitempty"`
}

func (FaultArgs) Kind() string { return "rebound_test_fault" }

type faultWorker struct {
	river.WorkerDefaults[FaultArgs]
}

func (faultWorker) Work(ctx context.Context, job *river.Job[FaultArgs]) error {
	dir := os.Getenv(runsDirEnv)
	mark := filepath.Join(dir, fmt.Sprintf("%d-%d-%d-%d", job.ID, job.Attempt, os.Getpid(), time.Now().UnixNano()))
	if err := os.WriteFile(mark, nil, 0o644); err != nil {
		return err
	}
	if job.Args.SleepMs > 0 && (job.Args.SleepOn == 0 || job.Args.SleepOn == job.Attempt) {
		select {
		case <-time.After(time.Duration(job.Args.SleepMs) * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "kill")); err == nil && os.Getenv(crashWorkerEnv) != "" {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	if job.Args.Block {
		<-ctx.Done()
		return ctx.Err()
	}
	if job.Args.Succeed {
		return nil
	}
	return fmt.Errorf("run %d failed", job.Attempt)
}

// faultRun is one run a FaultArgs job marked.
type faultRun struct {
	attempt int
	pid     int
}

// faultRuns are the runs of job id marked in dir, in the order they started.
func faultRuns(t *testing.T, dir string, id int64) []faultRun {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	type marked struct {
		faultRun
		ns int64
	}
	var out []marked
	for _, e := range entries {
		f := strings.Split(e.Name(), "-")
		if len(f) != 4 || f[0] != strconv.FormatInt(id, 10) {
			continue
		}
		attempt, _ := strconv.Atoi(f[1])
		pid, _ := strconv.Atoi(f[2])
		ns, _ := strconv.ParseInt(f[3], 10, 64)
		out = append(out, marked{faultRun{attempt, pid}, ns})
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j].ns < out[j-1].ns; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	runs := make([]faultRun, len(out))
	for i, m := range out {
		runs[i] = m.faultRun
	}
	return runs
}

// --- the tally -------------------------------------------------------------------------

// ending is where one job ended, read from PostgreSQL.
type ending struct {
	state    rivertype.JobState
	attempt  int
	giveUp   *reboundriver.GiveUp
	dls      []deadLetter
	errors   int
	metadata string
}

// place is the job's place in the tally: completed, pending (waiting for a retry or
// running), deadLetter (discarded, its dead letter written) or lost (anything else).
func (e ending) place() string {
	switch {
	case e.state == rivertype.JobStateCompleted:
		return "completed"
	case e.state == rivertype.JobStateDiscarded && e.giveUp != nil && e.giveUp.Disposition == reboundriver.DispositionDeadLetter &&
		len(e.dls) > 0 && e.giveUp.DeadLetterJobID == e.dls[len(e.dls)-1].id:
		return "deadLetter"
	case e.state == rivertype.JobStateAvailable || e.state == rivertype.JobStateRetryable ||
		e.state == rivertype.JobStateScheduled || e.state == rivertype.JobStateRunning:
		return "pending"
	}
	return "lost"
}

func endingOf(t *testing.T, q *pgxpool.Pool, id int64) ending {
	t.Helper()
	var e ending
	var meta []byte
	var state string
	if err := q.QueryRow(context.Background(), `SELECT state::text, attempt, metadata, coalesce(array_length(errors, 1), 0)
		FROM river_job WHERE id = $1`, id).Scan(&state, &e.attempt, &meta, &e.errors); err != nil {
		t.Fatal(err)
	}
	e.state, e.metadata = rivertype.JobState(state), string(meta)
	e.giveUp = giveUpOf(t, &rivertype.JobRow{Metadata: meta})
	e.dls = deadLettersIn(t, q, id)
	return e
}

// deadLettersIn are the dead letters of job id in the database of q.
func deadLettersIn(t *testing.T, q *pgxpool.Pool, id int64) []deadLetter {
	t.Helper()
	return queryDeadLetters(t, q, "", id)
}

// waitEnded waits until job id is completed or discarded, then for `settle` more, and
// returns where it ended then.
func waitEnded(t *testing.T, q *pgxpool.Pool, id int64, within, settle time.Duration) ending {
	t.Helper()
	eventually(t, within, fmt.Sprintf("job %d ended", id), func() bool {
		e := endingOf(t, q, id)
		return e.state == rivertype.JobStateCompleted || e.state == rivertype.JobStateDiscarded
	})
	time.Sleep(settle)
	return endingOf(t, q, id)
}

// checkDeadLettered: the job ended as a dead letter, exactly one, carrying `runs` attempts,
// after at most maxAttempts+window runs.
func checkDeadLettered(t *testing.T, id int64, e ending, runs, maxAttempts int) {
	t.Helper()
	if e.place() != "deadLetter" || len(e.dls) != 1 {
		t.Fatalf("job %d: %s (state %s attempt %d), %d dead letters %+v, metadata %s",
			id, e.place(), e.state, e.attempt, len(e.dls), e.dls, e.metadata)
	}
	if runs > maxAttempts+window {
		t.Fatalf("job %d ran %d times, past maxAttempts %d + window %d", id, runs, maxAttempts, window)
	}
	if e.dls[0].Attempts != e.giveUp.Attempt || e.dls[0].Attempts > runs {
		t.Fatalf("job %d: dead letter attempts %d, record %d, runs %d", id, e.dls[0].Attempts, e.giveUp.Attempt, runs)
	}
}

// countedAttempts: every run started with the next attempt number, an unanswered one too.
func countedAttempts(t *testing.T, id int64, runs []faultRun) {
	t.Helper()
	for i, r := range runs {
		if r.attempt != i+1 {
			t.Fatalf("job %d: run %d had attempt %d (runs %+v)", id, i+1, r.attempt, runs)
		}
	}
}

func insertOn(t *testing.T, c *river.Client[pgx5Tx], queue string, args river.JobArgs) int64 {
	t.Helper()
	res, err := c.Insert(context.Background(), args, &river.InsertOpts{Queue: queue})
	if err != nil {
		t.Fatal(err)
	}
	return res.Job.ID
}

// confWorker runs runCrashWorker on fixed-3-dlq against target, with env added.
func confWorker(t *testing.T, target string, env ...string) *exec.Cmd {
	t.Helper()
	return startWorkerProcessEnv(t, "fixed-3-dlq", append([]string{"REBOUND_TARGET=" + target}, env...)...)
}

func waitExit(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("worker %d did not exit", cmd.Process.Pid)
	}
}

// withVar sets *v to val until the test ends.
func withVar[T any](t *testing.T, v *T, val T) {
	old := *v
	*v = val
	t.Cleanup(func() { *v = old })
}

// rescuer starts a River client (leader: its rescuer runs at start, its scheduler makes
// retries available) that works no job of the scenario's queue, and waits until job id is
// no longer running. The returned func stops it.
func rescuer(t *testing.T, id int64) func() {
	t.Helper()
	rb, _ := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "idle")
	eventually(t, 60*time.Second, fmt.Sprintf("job %d rescued", id), func() bool {
		return endingOf(t, pool, id).state != rivertype.JobStateRunning
	})
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.StopAndCancel(ctx)
	}
}

// --- scenarios -------------------------------------------------------------------------

// A worker process SIGSTOPped while four jobs run, past River's rescue threshold; the jobs
// are rescued and run in another client; the process is resumed while those runs go on.
// Three jobs fail always, one succeeds.
func faultPausedPastEveryTimeout(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	ins := inserter(t)
	workerLog := filepath.Join(dir, "worker.log")
	worker := confWorker(t, confSidecar.Target, "REBOUND_TEST_WORKERS=4", "REBOUND_TEST_LOG="+workerLog)
	var ids []int64
	for i := range 4 {
		ids = append(ids, insertOn(t, ins, "fixed-3-dlq", FaultArgs{SleepMs: 1500, Succeed: i == 0}))
	}
	eventually(t, 30*time.Second, "four runs in the worker process", func() bool {
		for _, id := range ids {
			if len(faultRuns(t, dir, id)) == 0 {
				return false
			}
		}
		return true
	})
	if err := worker.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = worker.Process.Signal(syscall.SIGCONT) })
	time.Sleep(3500 * time.Millisecond) // past RescueStuckJobsAfter (3s)
	rb, _ := loggedRebound(t, confSidecar.Target)
	startRiver(t, rb, "fixed-3-dlq") // leader: rescues the four jobs and runs them
	eventually(t, 30*time.Second, "the rescued runs", func() bool {
		for _, id := range ids[1:] {
			if len(faultRuns(t, dir, id)) < 2 {
				return false
			}
		}
		return true
	})
	if err := worker.Process.Signal(syscall.SIGCONT); err != nil { // while the rescued runs go on
		t.Fatal(err)
	}
	for i, id := range ids {
		e := waitEnded(t, pool, id, 90*time.Second, 0)
		if i == 0 {
			if e.place() != "completed" || len(e.dls) != 0 {
				t.Fatalf("job %d succeeded, yet %s with %d dead letters", id, e.place(), len(e.dls))
			}
		}
	}
	time.Sleep(4 * time.Second) // a stale run's retry would run by now
	most := 0
	for i, id := range ids {
		e := endingOf(t, pool, id)
		runs := faultRuns(t, dir, id)
		most = max(most, len(runs))
		if i == 0 {
			if e.place() != "completed" || len(e.dls) != 0 || len(runs) > 3+window {
				t.Fatalf("job %d (succeeds): %s, %d dead letters, %d runs", id, e.place(), len(e.dls), len(runs))
			}
			continue
		}
		checkDeadLettered(t, id, e, len(runs), 3)
	}
	// The fault as meant: resumed runs ended while the rescued ones went on.
	raw, err := os.ReadFile(workerLog)
	if err != nil {
		t.Fatal(err)
	}
	stale := &logBuffer{}
	stale.buf.Write(raw)
	if len(stale.events(t, "rebound.stale_run")) == 0 {
		t.Fatal("no resumed run overlapped a rescued one (no rebound.stale_run line)")
	}
	t.Logf("most runs of one job: %d (maxAttempts 3); %d resumed runs overlapped rescued ones",
		most, len(stale.events(t, "rebound.stale_run")))
}

// Every run SIGKILLs its worker process; a new one is started each time, and River's
// rescuer (in another client) puts the job back.
func faultKilledOnEveryRun(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	if err := os.WriteFile(filepath.Join(dir, "kill"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	id := insertOn(t, inserter(t), "fixed-3-dlq", FaultArgs{})
	crashUntilEnded(t, dir, id)
	e := endingOf(t, pool, id)
	runs := faultRuns(t, dir, id)
	countedAttempts(t, id, runs)
	checkDeadLettered(t, id, e, len(runs), 3)
	if e.dls[0].Attempts != len(runs) {
		t.Fatalf("dead letter attempts %d, runs %d", e.dls[0].Attempts, len(runs))
	}
	t.Logf("runs %d, dead letter attempts %d", len(runs), e.dls[0].Attempts)
}

// crashUntilEnded starts a worker process on fixed-3-dlq for each run of job id until the
// job ends, each run killing its process, rescuing the job after each kill.
func crashUntilEnded(t *testing.T, dir string, id int64) {
	t.Helper()
	stop := func() {}
	defer func() { stop() }()
	for start := 1; ; start++ {
		worker := confWorker(t, confSidecar.Target)
		end := time.Now().Add(60 * time.Second)
		for len(faultRuns(t, dir, id)) < start && !ended(endingOf(t, pool, id)) {
			if time.Now().After(end) {
				t.Fatalf("worker start %d: job %d never ran nor ended", start, id)
			}
			time.Sleep(50 * time.Millisecond)
		}
		stop()
		if ended(endingOf(t, pool, id)) {
			_ = worker.Process.Kill()
			waitExit(t, worker)
			return
		}
		if start > 3+window+1 {
			t.Fatalf("job %d started %d runs, past maxAttempts 3 + window %d", id, start, window)
		}
		waitExit(t, worker) // the run kills it
		time.Sleep(3500 * time.Millisecond)
		stop = rescuer(t, id)
	}
}

func ended(e ending) bool {
	return e.state == rivertype.JobStateCompleted || e.state == rivertype.JobStateDiscarded
}

// The sidecar hung (SIGSTOP) and the worker process SIGKILLed while its hook waits for the
// answer; the job is rescued and runs on in another client.
func faultKilledWhileDeciding(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	sc := ownConfSidecar(t)
	if err := sc.Start(); err != nil {
		t.Fatal(err)
	}
	// The hook's deadline is long enough that the kill lands while it waits.
	worker := confWorker(t, sc.Target, "REBOUND_TEST_DEADLINE_MS=30000")
	time.Sleep(time.Second) // the worker's policies fetched
	if err := sc.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	id := insertOn(t, inserter(t), "fixed-3-dlq", FaultArgs{})
	eventually(t, 30*time.Second, "the run", func() bool { return len(faultRuns(t, dir, id)) == 1 })
	time.Sleep(500 * time.Millisecond) // the run failed; the hook waits for the hung sidecar
	if e := endingOf(t, pool, id); e.state != rivertype.JobStateRunning {
		t.Fatalf("job %d %s while its hook waits", id, e.state)
	}
	_ = worker.Process.Kill()
	waitExit(t, worker)
	if err := sc.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3500 * time.Millisecond)
	rb, _ := loggedRebound(t, sc.Target)
	startRiver(t, rb, "fixed-3-dlq")
	e := waitEnded(t, pool, id, 60*time.Second, time.Second)
	runs := faultRuns(t, dir, id)
	countedAttempts(t, id, runs)
	checkDeadLettered(t, id, e, len(runs), 3)
	t.Logf("runs %d, dead letter attempts %d", len(runs), e.dls[0].Attempts)
}

// The worker process SIGKILLed inside the give-up's transaction, after the dead letter's
// insert and before the commit (a trigger holds the insert for 3 s).
func faultKilledBetweenDeadLetterAndAck(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	ctx := context.Background()
	id := insertOn(t, inserter(t), "fixed-3-dlq", FaultArgs{})
	trigger(t, fmt.Sprintf(`IF NEW.kind = 'rebound_dead_letter' AND (NEW.args->>'job_id')::bigint = %d THEN
		IF nextval('rebound_fault_seq') = 1 THEN PERFORM pg_sleep(3); END IF; END IF; RETURN NEW;`, id))
	worker := confWorker(t, confSidecar.Target)
	eventually(t, 60*time.Second, "the give-up's insert held", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	_ = worker.Process.Kill()
	waitExit(t, worker)
	if dls := deadLettersIn(t, pool, id); len(dls) != 0 {
		t.Fatalf("dead letters of job %d after the kill: %+v", id, dls)
	}
	time.Sleep(6 * time.Second) // the transaction aborted, the job stuck past the threshold
	rescuer(t, id)()
	rb, _ := loggedRebound(t, confSidecar.Target)
	startRiver(t, rb, "fixed-3-dlq")
	e := waitEnded(t, pool, id, 60*time.Second, time.Second)
	runs := faultRuns(t, dir, id)
	checkDeadLettered(t, id, e, len(runs), 3)
	t.Logf("runs %d, dead letters %d", len(runs), len(e.dls))
}

// trigger installs a BEFORE INSERT trigger on river_job with body `body` (PL/pgSQL), and a
// sequence rebound_fault_seq it may use, both removed at the end of the test.
func trigger(t *testing.T, body string) {
	t.Helper()
	ctx := context.Background()
	for _, q := range []string{
		`CREATE SEQUENCE rebound_fault_seq`,
		`CREATE FUNCTION rebound_fault() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN ` + body + ` END $$`,
		`CREATE TRIGGER rebound_fault BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION rebound_fault()`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, q := range []string{`DROP TRIGGER IF EXISTS rebound_fault ON river_job`,
			`DROP FUNCTION IF EXISTS rebound_fault()`, `DROP SEQUENCE IF EXISTS rebound_fault_seq`} {
			if _, err := pool.Exec(context.Background(), q); err != nil {
				t.Error(err)
			}
		}
	})
}

// The dead letter's insert refused (a trigger raises) during the last run, then allowed.
func faultDeadLetterWriteRefused(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	withVar(t, &reboundriver.SettleFor, 2*time.Second)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE rebound_fault_refuse (job_id bigint)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS rebound_fault_refuse`) })
	trigger(t, `IF NEW.kind = 'rebound_dead_letter' AND EXISTS (SELECT 1 FROM rebound_fault_refuse
		WHERE job_id = (NEW.args->>'job_id')::bigint) THEN RAISE EXCEPTION 'dead letters refused'; END IF; RETURN NEW;`)
	rb, logs := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-dlq")
	id := insertOn(t, c, "fixed-3-dlq", FaultArgs{})
	if _, err := pool.Exec(ctx, `INSERT INTO rebound_fault_refuse VALUES ($1)`, id); err != nil {
		t.Fatal(err)
	}
	eventually(t, 60*time.Second, "a give-up deferred", func() bool {
		return len(logs.events(t, "rebound.give_up_deferred")) >= 2
	})
	e := endingOf(t, pool, id)
	if e.place() != "pending" || len(e.dls) != 0 || len(logs.events(t, "rebound.dead_lettered")) != 0 ||
		rb.Metrics().DeadLettered != 0 {
		t.Fatalf("while refused: job %d %s (%s), %d dead letters, %d dead_lettered lines, metrics %+v",
			id, e.place(), e.state, len(e.dls), len(logs.events(t, "rebound.dead_lettered")), rb.Metrics())
	}
	if runs := faultRuns(t, dir, id); len(runs) != 3 {
		t.Fatalf("job %d ran %d times while its give-up was refused, want 3", id, len(runs))
	}
	if _, err := pool.Exec(ctx, `DELETE FROM rebound_fault_refuse`); err != nil {
		t.Fatal(err)
	}
	e = waitEnded(t, pool, id, 60*time.Second, time.Second)
	runs := faultRuns(t, dir, id)
	checkDeadLettered(t, id, e, len(runs), 3)
	if n := len(logs.events(t, "rebound.dead_lettered")); n != 1 || rb.Metrics().DeadLettered != 1 {
		t.Fatalf("%d dead_lettered lines, metrics %+v", n, rb.Metrics())
	}
	t.Logf("runs %d, deferred give-ups %d, dead letters %d", len(runs), len(logs.events(t, "rebound.give_up_deferred")), len(e.dls))
}

// PostgreSQL (a server of its own) stopped during the job's last run for longer than the
// settle window, then started again.
func faultDatabaseDownPastTimeouts(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	withVar(t, &reboundriver.SettleFor, 3*time.Second)
	pg, err := devstack.StartPostgres(filepath.Join(runDir, "pg-down"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	ctx := context.Background()
	own, err := pgxpool.New(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(own.Close)
	migrator, err := rivermigrate.New(riverpgxv5.New(own), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		t.Fatal(err)
	}
	rb, logs := loggedRebound(t, confSidecar.Target)
	c := ownRiver(t, rb, own, "fixed-3-dlq")
	res, err := c.Insert(ctx, FaultArgs{SleepMs: 1000, SleepOn: 3}, &river.InsertOpts{Queue: "fixed-3-dlq"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Job.ID
	eventually(t, 30*time.Second, "the last run", func() bool { return len(faultRuns(t, dir, id)) == 3 })
	if err := pg.Restart(8 * time.Second); err != nil { // down past SettleFor (3s)
		t.Fatal(err)
	}
	e := waitEnded(t, own, id, 120*time.Second, time.Second)
	runs := faultRuns(t, dir, id)
	checkDeadLettered(t, id, e, len(runs), 3)
	if n := len(logs.events(t, "rebound.dead_lettered")); n != 1 || rb.Metrics().DeadLettered != 1 {
		t.Fatalf("%d dead_lettered lines, metrics %+v", n, rb.Metrics())
	}
	t.Logf("runs %d, deferred give-ups %d, dead letters %d", len(runs), len(logs.events(t, "rebound.give_up_deferred")), len(e.dls))
}

func jsonLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// ownRiver runs a River client on pool p working queue with the adapter installed.
func ownRiver(t *testing.T, rb *rebound.Rebound, p *pgxpool.Pool, queue string) *river.Client[pgx5Tx] {
	t.Helper()
	workers := river.NewWorkers()
	river.AddWorker(workers, faultWorker{})
	cfg := &river.Config{
		Queues:               map[string]river.QueueConfig{queue: {MaxWorkers: 4}},
		Workers:              workers,
		Logger:               quiet(),
		FetchCooldown:        20 * time.Millisecond,
		FetchPollInterval:    50 * time.Millisecond,
		RescueStuckJobsAfter: 3 * time.Second,
		JobTimeout:           2 * time.Second,
	}
	c := startClient(t, context.Background(), p, cfg, reboundriver.New(rb, reboundriver.Options{}))
	return c
}

// The reply to the give-up's COMMIT dropped by a proxy between the worker and PostgreSQL,
// after PostgreSQL applied it.
func faultCommitReplyLost(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	proxy := startCommitProxy(t, pool.Config().ConnConfig.Host, pool.Config().ConnConfig.Port)
	cfg := pool.Config().Copy()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", proxy.port
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	through, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(through.Close)
	rb, logs := loggedRebound(t, confSidecar.Target)
	c := ownRiver(t, rb, through, "fixed-3-dlq")
	id := insertOn(t, c, "fixed-3-dlq", FaultArgs{})
	e := waitEnded(t, pool, id, 60*time.Second, 2*time.Second)
	if proxy.dropped.Load() != 1 {
		t.Fatalf("the proxy dropped %d COMMIT replies, want 1", proxy.dropped.Load())
	}
	runs := faultRuns(t, dir, id)
	checkDeadLettered(t, id, e, len(runs), 3)
	if n := len(logs.events(t, "rebound.dead_lettered")); n != 1 {
		t.Fatalf("%d dead_lettered lines", n)
	}
	t.Logf("runs %d, dead letters %d", len(runs), len(e.dls))
}

// commitProxy forwards PostgreSQL connections; on the first connection that sends a dead
// letter's insert, it forwards the next COMMIT, swallows its reply and closes the connection.
type commitProxy struct {
	port    uint16
	dropped atomic.Int32
	armed   atomic.Bool
}

func startCommitProxy(t *testing.T, host string, port uint16) *commitProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &commitProxy{port: uint16(l.Addr().(*net.TCPAddr).Port)}
	p.armed.Store(true)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) { mu.Lock(); conns = append(conns, c); mu.Unlock() }
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			client, err := l.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", net.JoinHostPort(host, strconv.Itoa(int(port))))
			if err != nil {
				client.Close()
				continue
			}
			track(client)
			track(server)
			wg.Add(1)
			go func() { defer wg.Done(); p.serve(client, server) }()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return p
}

// serve forwards one connection, reading the client's messages (PostgreSQL's protocol:
// an untyped start-up message, then a type byte and a length).
func (p *commitProxy) serve(client, server net.Conn) {
	defer client.Close()
	defer server.Close()
	var drop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 32<<10)
		for {
			n, err := server.Read(buf)
			if n > 0 && drop.Load() {
				// The COMMIT's reply: PostgreSQL has applied it. Lost on the way back.
				client.Close()
				server.Close()
				return
			}
			if n > 0 {
				if _, werr := client.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	sawDeadLetter := false
	readFull := func(n int) ([]byte, error) {
		b := make([]byte, n)
		_, err := io.ReadFull(client, b)
		return b, err
	}
	for started := false; ; {
		var msg []byte
		if !started {
			head, err := readFull(4)
			if err != nil {
				break
			}
			body, err := readFull(int(binary.BigEndian.Uint32(head)) - 4)
			if err != nil {
				break
			}
			// SSLRequest or GSSENCRequest come before the start-up message.
			code := binary.BigEndian.Uint32(body[:4])
			started = code != 80877103 && code != 80877104
			msg = append(head, body...)
		} else {
			head, err := readFull(5)
			if err != nil {
				break
			}
			body, err := readFull(int(binary.BigEndian.Uint32(head[1:])) - 4)
			if err != nil {
				break
			}
			msg = append(head, body...)
			if bytes.Contains(body, []byte(reboundriver.DeadLetterKind)) {
				sawDeadLetter = true
			}
			if head[0] == 'Q' && strings.EqualFold(strings.TrimRight(string(body), "\x00; "), "commit") {
				if sawDeadLetter && p.armed.CompareAndSwap(true, false) {
					drop.Store(true)
					p.dropped.Add(1)
				}
				sawDeadLetter = false
			}
		}
		if _, err := server.Write(msg); err != nil {
			break
		}
	}
	server.Close()
	<-done
}

// The sidecar SIGSTOPped for 20 s while 80 jobs fail: the adapter decides with its local
// fallback (the queue's cached policy), and every job ends with one dead letter.
func faultSidecarHung(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	sc := ownConfSidecar(t)
	if err := sc.Start(); err != nil {
		t.Fatal(err)
	}
	logs := &logBuffer{}
	rb, err := rebound.New(rebound.Options{Target: sc.Target, Logger: jsonLogger(logs)}) // the default 250 ms deadline
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rb.Close() })
	c := startRiverWith(t, rb, func(cfg *river.Config) {
		cfg.Queues["fixed-3-dlq"] = river.QueueConfig{MaxWorkers: 20}
	}, "fixed-3-dlq")
	if err := sc.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	hungAt := time.Now()
	var ids []int64
	for i := range 80 {
		ids = append(ids, insertOn(t, c, "fixed-3-dlq", FaultArgs{N: i}))
	}
	time.Sleep(20*time.Second - time.Since(hungAt))
	if err := sc.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	most := 0
	for _, id := range ids {
		e := waitEnded(t, pool, id, 60*time.Second, 0)
		runs := faultRuns(t, dir, id)
		most = max(most, len(runs))
		checkDeadLettered(t, id, e, len(runs), 3)
	}
	fallback := 0
	for _, d := range logs.events(t, "rebound.decision") {
		if d["source"] == "fallback" {
			fallback++
		}
	}
	if fallback == 0 {
		t.Fatal("no fallback decision while the sidecar was hung")
	}
	t.Logf("80 jobs dead-lettered once each; %d fallback decisions; most runs of one job %d", fallback, most)
}

// Given up after its runs were killed, then replayed with reboundriver.Replay: it runs once.
func faultReplayAfterCrashes(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	kill := filepath.Join(dir, "kill")
	if err := os.WriteFile(kill, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	id := insertOn(t, inserter(t), "fixed-3-dlq", FaultArgs{Succeed: true})
	crashUntilEnded(t, dir, id)
	e := endingOf(t, pool, id)
	before := len(faultRuns(t, dir, id))
	checkDeadLettered(t, id, e, before, 3)
	if err := os.Remove(kill); err != nil {
		t.Fatal(err)
	}
	rb, _ := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-dlq")
	job, err := reboundriver.Replay(context.Background(), c, e.dls[0].id) // the README's command
	if err != nil {
		t.Fatal(err)
	}
	if job.ID != id {
		t.Fatalf("replay made job %d, the dead letter's is %d", job.ID, id)
	}
	e = waitEnded(t, pool, id, 60*time.Second, time.Second)
	replayRuns := len(faultRuns(t, dir, id)) - before
	if e.state != rivertype.JobStateCompleted || replayRuns != 1 || len(e.dls) != 0 {
		t.Fatalf("after the replay: job %d %s, %d replay runs, dead letters %+v", id, e.state, replayRuns, e.dls)
	}
	t.Logf("runs before the replay %d, replay runs %d", before, replayRuns)
}

// Given up, retried from River's discarded state (River UI: Retry), and given up again.
func faultGivesUpTwice(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	rb, logs := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-dlq")
	id := insertOn(t, c, "fixed-3-dlq", FaultArgs{})
	e := waitEnded(t, pool, id, 60*time.Second, time.Second)
	checkDeadLettered(t, id, e, len(faultRuns(t, dir, id)), 3)
	if _, err := c.JobRetry(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the retried run", func() bool { return len(faultRuns(t, dir, id)) == 4 })
	e = waitEnded(t, pool, id, 60*time.Second, time.Second)
	runs := faultRuns(t, dir, id)
	if len(runs) != 4 || e.place() != "deadLetter" || len(e.dls) != 2 || e.dls[0].Attempts != 3 || e.dls[1].Attempts != 4 {
		t.Fatalf("job %d: %d runs, %s, dead letters %+v", id, len(runs), e.place(), e.dls)
	}
	if n := len(logs.events(t, "rebound.dead_lettered")); n != 2 {
		t.Fatalf("%d dead_lettered lines, want 2", n)
	}
}

// client.Start's context cancelled (signal.NotifyContext, no SoftStopTimeout) while a job of
// fixed-1-dlq (maxAttempts 1) runs: its run ends, is decided, and the job never runs again.
func faultStartContextCancelled(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(runsDirEnv, dir)
	rb, _ := loggedRebound(t, confSidecar.Target)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGUSR1)
	defer stop()
	workers := river.NewWorkers()
	river.AddWorker(workers, faultWorker{})
	cfg := &river.Config{
		Queues:            map[string]river.QueueConfig{"fixed-1-dlq": {MaxWorkers: 1}},
		Workers:           workers,
		Logger:            quiet(),
		FetchCooldown:     20 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
	}
	c := startClient(t, ctx, pool, cfg, reboundriver.New(rb, reboundriver.Options{}))
	id := insertOn(t, c, "fixed-1-dlq", FaultArgs{Block: true})
	eventually(t, 30*time.Second, "the run", func() bool { return len(faultRuns(t, dir, id)) == 1 })
	if err := syscall.Kill(os.Getpid(), syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Stopped():
	case <-time.After(30 * time.Second):
		t.Fatal("the River client did not stop")
	}
	// Another worker on the queue, as after a rolling restart.
	rb2, _ := loggedRebound(t, confSidecar.Target)
	startRiver(t, rb2, "fixed-1-dlq")
	time.Sleep(2 * time.Second)
	e := waitEnded(t, pool, id, 30*time.Second, time.Second)
	runs := faultRuns(t, dir, id)
	if len(runs) != 1 {
		t.Fatalf("job %d ran %d times, maxAttempts 1", id, len(runs))
	}
	if e.place() != "deadLetter" || len(e.dls) != 1 || e.dls[0].Attempts != 1 {
		t.Fatalf("job %d: %s (state %s), dead letters %+v", id, e.place(), e.state, e.dls)
	}
}
