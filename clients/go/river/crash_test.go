package reboundriver_test

import (
	"context"
	"fmt"
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

func jobID(id int64) string { return strconv.FormatInt(id, 10) }

// SleepArgs: a job that blocks on its first run (until its worker is killed) and
// succeeds on the next.
type SleepArgs struct{}

func (SleepArgs) Kind() string { return "rebound_test_sleep" }

type sleepWorker struct {
	river.WorkerDefaults[SleepArgs]
}

func (*sleepWorker) Work(ctx context.Context, job *river.Job[SleepArgs]) error {
	if job.Attempt == 1 {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

// runCrashWorker works queue "crash" (DATABASE_URL, REBOUND_TARGET) until it is killed.
func runCrashWorker() int {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rb, err := rebound.New(rebound.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, &sleepWorker{})
	cfg := &river.Config{
		Queues:                 map[string]river.QueueConfig{"crash": {MaxWorkers: 1}},
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

// A worker process killed mid-job (SIGKILL): River's rescuer in another client asks the
// retry policy, and the job runs again and completes.
func TestWorkerKilledMidJobIsRescued(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "crash")
	log, err := os.Create(filepath.Join(runDir, "crash-worker.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	worker := exec.Command(os.Args[0], "-test.run=^$")
	worker.Env = append(os.Environ(), crashWorkerEnv+"=1", "DATABASE_URL="+pool.Config().ConnString(),
		"REBOUND_TARGET="+sidecar.Target)
	worker.Stdout, worker.Stderr = log, log
	worker.SysProcAttr = devstack.DieWithParent()
	if err := worker.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = worker.Process.Kill(); _ = worker.Wait() })

	// Only insert (no queues): a client that does not work jobs.
	inserter, err := river.NewClient(riverpgxv5.New(pool), &river.Config{MaxAttempts: rebound.LibraryAttempts})
	if err != nil {
		t.Fatal(err)
	}
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
