package reboundriver_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	rebound "github.com/rebound-dev/rebound/clients/go"
	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// crashWorkerEnv makes the test binary a River worker process (see runCrashWorker).
const crashWorkerEnv = "REBOUND_TEST_CRASH_WORKER"

// runsDirEnv is where block workers mark the runs they start.
const runsDirEnv = "REBOUND_TEST_RUNS_DIR"

func jobID(id int64) string { return strconv.FormatInt(id, 10) }

// SleepArgs: a job that blocks on its first run (until its worker is killed) and
// succeeds on the next.
type SleepArgs struct{}

func (SleepArgs) Kind() string { return "rebound_test_sleep" }

type sleepWorker struct {
	river.WorkerDefaults[SleepArgs]
}

func (*sleepWorker) Work(ctx context.Context, job *river.Job[SleepArgs]) error {
	if os.Getenv(runsDirEnv) != "" {
		if err := os.WriteFile(runMark(job.ID, job.Attempt), nil, 0o644); err != nil {
			return err
		}
	}
	if job.Attempt == 1 {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

// BlockArgs: a job whose every run blocks until its worker is stopped or killed. Each run
// that starts is marked by a file <id>-<attempt> in runsDir.
type BlockArgs struct{}

func (BlockArgs) Kind() string { return "rebound_test_block" }

type blockWorker struct {
	river.WorkerDefaults[BlockArgs]
}

func (*blockWorker) Work(ctx context.Context, job *river.Job[BlockArgs]) error {
	if err := os.WriteFile(runMark(job.ID, job.Attempt), nil, 0o644); err != nil {
		return err
	}
	<-ctx.Done()
	return ctx.Err()
}

// runCrashWorker works queue "crash" (or REBOUND_TEST_QUEUE; DATABASE_URL, REBOUND_TARGET)
// until it is killed.
func runCrashWorker() int {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var deadline time.Duration
	if ms, err := strconv.Atoi(os.Getenv("REBOUND_TEST_DEADLINE_MS")); err == nil {
		deadline = time.Duration(ms) * time.Millisecond
	}
	var logger *slog.Logger
	if path := os.Getenv("REBOUND_TEST_LOG"); path != "" {
		// The adapter's JSON lines, for the test to read.
		f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		logger = slog.New(slog.NewJSONHandler(f, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	rb, err := rebound.New(rebound.Options{Deadline: deadline, Logger: logger})
	if err != nil {
		// Refused before any River client exists: no job runs.
		line := map[string]any{"event": "worker.refused", "error": err.Error()}
		var te *rebound.TargetError
		if errors.As(err, &te) {
			line["setting"], line["target"] = te.Setting, te.Target
		}
		raw, _ := json.Marshal(line)
		fmt.Fprintln(os.Stderr, string(raw))
		return 2
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, &sleepWorker{})
	river.AddWorker(workers, &blockWorker{})
	river.AddWorker(workers, faultWorker{})
	queue := cmp.Or(os.Getenv("REBOUND_TEST_QUEUE"), "crash")
	slots, err := strconv.Atoi(cmp.Or(os.Getenv("REBOUND_TEST_WORKERS"), "1"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cfg := &river.Config{
		Queues:                 map[string]river.QueueConfig{queue: {MaxWorkers: slots}},
		Workers:                workers,
		FetchCooldown:          20 * time.Millisecond,
		FetchPollInterval:      50 * time.Millisecond,
		JobTimeout:             -1,
		LeaderElectionDisabled: true,
	}
	reboundriver.Configure(cfg, reboundriver.New(rb, reboundriver.Options{}))
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := client.Start(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	select {}
}

// runMark is the file marking that run attempt of job id started (see BlockArgs).
func runMark(id int64, attempt int) string {
	return filepath.Join(os.Getenv(runsDirEnv), fmt.Sprintf("%d-%d", id, attempt))
}

// startWorkerProcess runs runCrashWorker on queue in a child process, killed at the end
// of the test if still running.
func startWorkerProcess(t *testing.T, queue string) *exec.Cmd {
	t.Helper()
	return startWorkerProcessEnv(t, queue)
}

// startWorkerProcessEnv is startWorkerProcess with env (KEY=VALUE) added last.
func startWorkerProcessEnv(t *testing.T, queue string, env ...string) *exec.Cmd {
	t.Helper()
	log, err := os.OpenFile(filepath.Join(runDir, "worker-"+queue+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	worker := exec.Command(os.Args[0], "-test.run=^$")
	worker.Env = append(os.Environ(), crashWorkerEnv+"=1", "DATABASE_URL="+pool.Config().ConnString(),
		"REBOUND_TARGET="+sidecar.Target, "REBOUND_TEST_QUEUE="+queue)
	worker.Env = append(worker.Env, env...)
	worker.Stdout, worker.Stderr = log, log
	worker.SysProcAttr = devstack.DieWithParent()
	if err := worker.Start(); err != nil {
		log.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = worker.Process.Kill(); _ = worker.Wait(); log.Close() })
	return worker
}

// A worker process killed mid-job (SIGKILL): River's rescuer in another client asks the
// retry policy, and the job runs again and completes.
func TestWorkerKilledMidJobIsRescued(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "crash")
	worker := startWorkerProcess(t, "crash")

	// Only insert (no queues): a client that does not work jobs.
	inserter := inserter(t)
	res, err := inserter.Insert(context.Background(), SleepArgs{}, &river.InsertOpts{Queue: "crash"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Job.ID
	end := time.Now().Add(30 * time.Second)
	for {
		job, err := inserter.JobGet(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if job.State == rivertype.JobStateRunning && job.Attempt == 1 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("job %d not running in the worker process: %s", id, job.State)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := worker.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = worker.Wait()
	// Stuck for longer than RescueStuckJobsAfter before the rescuing client starts.
	time.Sleep(3500 * time.Millisecond)

	c := startRiver(t, rb, "crash")
	job := waitFinal(t, c, id, 60*time.Second)
	if job.State != rivertype.JobStateCompleted || job.Attempt != 2 || len(job.Errors) != 1 {
		t.Fatalf("state %s attempt %d errors %+v", job.State, job.Attempt, job.Errors)
	}
}

// A job whose worker is killed on every run: after River's rescuer retries it past the
// policy's maxAttempts (2), the next run is given up before it starts (cancelled, with the
// record), instead of running again without limit.
func TestRescuedPastMaxAttemptsIsGivenUp(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "rescued")
	t.Setenv(runsDirEnv, t.TempDir())
	inserter := inserter(t)
	ctx := context.Background()
	res, err := inserter.Insert(ctx, BlockArgs{}, &river.InsertOpts{Queue: "rescued"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Job.ID
	// The client that rescues the job (leader: rescuer and scheduler); it works no job
	// of queue "rescued".
	var rescuer *river.Client[pgx5Tx]
	stopRescuer := func() {
		if rescuer != nil {
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			_ = rescuer.StopAndCancel(sctx)
			rescuer = nil
		}
	}
	defer stopRescuer()
	var job *rivertype.JobRow
	for run := 1; ; run++ {
		worker := startWorkerProcess(t, "rescued")
		end := time.Now().Add(60 * time.Second)
		for {
			job, err = inserter.JobGet(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if finalised(job.State) {
				break
			}
			if _, err := os.Stat(runMark(id, run)); err == nil {
				break
			}
			if time.Now().After(end) {
				t.Fatalf("run %d: job %d %s at attempt %d", run, id, job.State, job.Attempt)
			}
			time.Sleep(50 * time.Millisecond)
		}
		stopRescuer()
		if finalised(job.State) {
			break
		}
		if run > 3 {
			t.Fatalf("job %d runs again (attempt %d) after its policy's maxAttempts 2; errors %+v", id, job.Attempt, job.Errors)
		}
		if err := worker.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		_ = worker.Wait()
		// Stuck for longer than RescueStuckJobsAfter before the rescuing client starts.
		time.Sleep(3500 * time.Millisecond)
		rescuer = startRiver(t, rb, "idle")
		for {
			job, err = inserter.JobGet(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if job.State != rivertype.JobStateRunning {
				break
			}
			if time.Now().After(end) {
				t.Fatalf("job %d of run %d not rescued", id, run)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if job.State != rivertype.JobStateDiscarded || job.Attempt > 3 {
		t.Fatalf("state %s attempt %d errors %+v", job.State, job.Attempt, job.Errors)
	}
	g := giveUpOf(t, job)
	if g == nil {
		t.Fatalf("no metadata.rebound: %s", job.Metadata)
	}
	if g.Disposition != reboundriver.DispositionDeadLetter || g.DeadLetterQueue != "rescued-dead" ||
		g.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" || g.Policy != "gotest/rescued" || g.Attempt != 2 {
		t.Fatalf("record %+v", g)
	}
}
