package reboundriver_test

import (
	"context"
	"strconv"

	"github.com/riverqueue/river"
)

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

func runCrashWorker() int { return 0 }
