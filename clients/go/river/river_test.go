package reboundriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	rebound "github.com/rebound-dev/rebound/clients/go"
	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// The gaps between runs are at least the delays the policy decided (equal jitter,
// exponential), and the job gives up after exactly maxAttempts runs.
func TestGapsBetweenAttemptsWithinBounds(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "gaps")
	c := startRiver(t, rb, "gaps")
	id := insert(t, c, "gaps", FailArgs{FailTimes: -1})
	job := waitFinal(t, c, id, 60*time.Second)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 5 || len(job.Errors) != 5 {
		t.Fatalf("state %s attempt %d errors %d", job.State, job.Attempt, len(job.Errors))
	}
	ref, resolved := rb.Policy("gaps")
	for i := 1; i < len(job.Errors); i++ {
		res, err := rebound.DecideLocal(resolved, ref.GetNamespace()+"/"+ref.GetName(), uint64(i),
			rebound.Context{JobID: jobID(id)})
		if err != nil {
			t.Fatal(err)
		}
		want := time.Duration(res.DelayMs) * time.Millisecond
		// A policy of base 300ms doubling to 2s, equal jitter: within [c/2, c].
		c := min(300*time.Millisecond<<(i-1), 2*time.Second)
		if want < c/2 || want > c {
			t.Fatalf("retry %d: decided %s, outside [%s, %s]", i, want, c/2, c)
		}
		gap := job.Errors[i].At.Sub(job.Errors[i-1].At)
		if gap < want || gap > want+10*time.Second {
			t.Errorf("gap before run %d: %s, decided delay %s", i+1, gap, want)
		}
	}
	g := giveUpOf(t, job)
	if g == nil || g.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" || g.Disposition != reboundriver.DispositionDeadLetter || g.DeadLetterQueue != "gaps-dead" {
		t.Fatalf("give-up %+v", g)
	}
}

// maxAttempts runs exactly, then the job ends discarded (River's state for exhausted
// jobs) with the give-up in its metadata, and a dead letter is inserted into the policy's
// deadLetterQueue carrying the job's kind, args, ID, queue, reason and runs. The README's
// query finds it, and Replay runs the same job again (it succeeds on that run).
func TestExactMaxAttemptsDeadLetterFoundAndReplayed(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "payments")
	c := startRiver(t, rb, "payments")
	id := insert(t, c, "payments", FailArgs{FailTimes: 4, Class: "http.503"})
	job := waitFinal(t, c, id, 30*time.Second)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 4 || len(job.Errors) != 4 {
		t.Fatalf("state %s attempt %d errors %d", job.State, job.Attempt, len(job.Errors))
	}
	g := giveUpOf(t, job)
	want := reboundriver.GiveUp{Disposition: "dead_letter", DeadLetterQueue: "payments-dead", Reason: "GIVE_UP_REASON_MAX_ATTEMPTS",
		Policy: "gotest/payments", Queue: "payments", Attempt: 4, ErrorClass: "http.503", Error: "run 4 failed", Source: "sidecar", PolicySource: "sidecar"}
	if g == nil {
		t.Fatal("no metadata.rebound")
	}
	got := *g
	got.ReasonMessage, got.ConfigHash, got.At, got.DeadLetterJobID = "", "", time.Time{}, 0
	if got != want || g.ConfigHash == "" || g.ReasonMessage == "" || g.DeadLetterJobID == 0 {
		t.Fatalf("give-up %+v, want %+v", *g, want)
	}
	if m := rb.Metrics(); m.DeadLettered != 1 || m.Decisions.GiveUpMaxAttempts != 1 || m.Decisions.Retry != 3 {
		t.Fatalf("metrics %+v", m)
	}
	dls := deadLettersOf(t, "payments-dead", id)
	if len(dls) != 1 || dls[0].id != g.DeadLetterJobID {
		t.Fatalf("dead letters of job %d: %+v (record names %d)", id, dls, g.DeadLetterJobID)
	}
	dl := dls[0]
	if dl.Queue != "payments" || dl.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" || dl.Attempts != 4 || dl.JobKind != "rebound_test_fail" ||
		dl.Error != "run 4 failed" || dl.Policy != "gotest/payments" || dl.Source != "sidecar" || dl.PolicySource != "sidecar" {
		t.Fatalf("dead letter %+v", dl)
	}
	var args FailArgs
	if err := json.Unmarshal(dl.Args, &args); err != nil || args != (FailArgs{FailTimes: 4, Class: "http.503"}) {
		t.Fatalf("dead letter args %s (%v)", dl.Args, err)
	}

	replayed, err := reboundriver.Replay(context.Background(), c, dl.id)
	if err != nil {
		t.Fatal(err)
	}
	if replayed.ID != id {
		t.Fatalf("replayed job %d, the dead letter's is %d", replayed.ID, id)
	}
	job = waitFinal(t, c, id, 30*time.Second)
	if job.State != rivertype.JobStateCompleted || job.Attempt != 5 {
		t.Fatalf("replayed: state %s attempt %d", job.State, job.Attempt)
	}
	if left := deadLettersOf(t, "payments-dead", id); len(left) != 0 {
		t.Fatalf("dead letters left after the replay: %+v", left)
	}
}

// A panicking worker: River's ErrorHandler.HandlePanic is called on every run with the
// panic's value and a trace naming the worker, the run is decided like a failure (class
// "panic"), and the trace is kept in the job's errors.
func TestPanicReachesRiversHandlePanic(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "dropme")
	handler := &panicRecorder{}
	c := startRiverWith(t, rb, func(cfg *river.Config) { cfg.ErrorHandler = handler }, "dropme")
	id := insert(t, c, "dropme", PanicArgs{})
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 2 || g == nil || g.ErrorClass != "panic" ||
		g.Error != "panic: worker bug" || g.Disposition != reboundriver.DispositionDrop {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
	panics := handler.all()
	if len(panics) != 2 {
		t.Fatalf("HandlePanic called %d times, want 2 (one per run)", len(panics))
	}
	for i, p := range panics {
		if p.jobID != id || p.value != "worker bug" || !strings.Contains(p.trace, "panicWorker.Work") {
			t.Fatalf("HandlePanic %d: job %d value %v trace:\n%s", i+1, p.jobID, p.value, p.trace)
		}
	}
	for i, e := range job.Errors {
		if !strings.Contains(e.Trace, "panicWorker.Work") {
			t.Fatalf("run %d recorded without the panic's trace: %+v", i+1, e)
		}
	}
}

type recordedPanic struct {
	jobID int64
	value any
	trace string
}

type panicRecorder struct {
	mu     sync.Mutex
	panics []recordedPanic
}

func (p *panicRecorder) HandleError(context.Context, *rivertype.JobRow, error) *river.ErrorHandlerResult {
	return nil
}

func (p *panicRecorder) HandlePanic(_ context.Context, job *rivertype.JobRow, value any, trace string) *river.ErrorHandlerResult {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.panics = append(p.panics, recordedPanic{jobID: job.ID, value: value, trace: trace})
	return nil
}

func (p *panicRecorder) all() []recordedPanic {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]recordedPanic(nil), p.panics...)
}

// A policy whose terminal action is drop: discarded after maxAttempts (kept in River's
// state for exhausted jobs), recorded as drop, no dead letter.
func TestDropAfterMaxAttempts(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "dropme")
	c := startRiver(t, rb, "dropme")
	id := insert(t, c, "dropme", FailArgs{FailTimes: -1})
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 2 || g == nil ||
		g.Disposition != reboundriver.DispositionDrop || g.DeadLetterQueue != "" || g.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
	if m := rb.Metrics(); m.Dropped != 1 {
		t.Fatalf("metrics %+v", m)
	}
	if g.DeadLetterJobID != 0 || len(deadLettersOf(t, "", id)) != 0 {
		t.Fatalf("a drop made a dead letter: %+v", g)
	}
}

// A non-retryable error class gives up after the first run.
func TestNonRetryableErrorClass(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "payments")
	c := startRiver(t, rb, "payments")
	id := insert(t, c, "payments", FailArgs{FailTimes: -1, Class: "card.expired"})
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 1 || g == nil ||
		g.Reason != "GIVE_UP_REASON_NON_RETRYABLE" || g.ErrorClass != "card.expired" || g.DeadLetterQueue != "payments-dead" {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
}

// maxRetryDuration counts from the first failure, taken from the job's recorded errors:
// the policy gives up (reason deadline) once the next run would start past it, long
// before maxAttempts.
func TestGivesUpAtMaxRetryDuration(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "deadline")
	c := startRiver(t, rb, "deadline")
	id := insert(t, c, "deadline", FailArgs{FailTimes: -1})
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || g == nil || g.Reason != "GIVE_UP_REASON_DEADLINE" || job.Attempt < 2 || job.Attempt >= 100 {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
	// At the give-up, the next run (400ms later) would have started past 1500ms.
	if elapsed := g.At.Sub(job.Errors[0].At); elapsed+400*time.Millisecond <= 1500*time.Millisecond {
		t.Fatalf("gave up %s after the first failure", elapsed)
	}
}

// A job that fails twice then succeeds completes on its third run, with no give-up record.
func TestRetriesUntilSuccess(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "payments")
	c := startRiver(t, rb, "payments")
	id := insert(t, c, "payments", FailArgs{FailTimes: 2})
	job := waitFinal(t, c, id, 30*time.Second)
	if job.State != rivertype.JobStateCompleted || job.Attempt != 3 || len(job.Errors) != 2 || giveUpOf(t, job) != nil {
		t.Fatalf("state %s attempt %d errors %d", job.State, job.Attempt, len(job.Errors))
	}
}

// With its sidecar killed, the worker decides from the cached policy: still exactly
// maxAttempts runs and a dead letter, answered by the fallback.
func TestSidecarKilledFallback(t *testing.T) {
	s := startSidecar(t, "failover-sidecar", "gotest", policies, "failover")
	rb := newRebound(t, s.Target, "failover")
	if ref, _ := rb.Policy("failover"); ref.GetName() != "payments" {
		t.Fatalf("cached policy %v", ref)
	}
	s.Kill()
	c := startRiver(t, rb, "failover")
	id := insert(t, c, "failover", FailArgs{FailTimes: -1})
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 4 || g == nil || g.Source != "fallback" ||
		g.Policy != "gotest/payments" || g.DeadLetterQueue != "payments-dead" || g.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
	if fb := rb.Metrics().Fallback; fb.Unavailable != 4 || fb.DefaultPolicy != 0 {
		t.Fatalf("fallback %+v", fb)
	}
}

func contains(xs []int64, x int64) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// A job inserted with a MaxAttempts (3) below its policy's (5), as a producer not using
// Configure or the adapter's defaults may do: River would discard it when Rebound says
// RETRY at its last attempt. The adapter gives up instead, the policy's way.
func TestRiverMaxAttemptsBelowPolicysIsGivenUp(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "gaps")
	c := startRiver(t, rb, "gaps")
	res, err := c.Insert(context.Background(), FailArgs{FailTimes: -1}, &river.InsertOpts{Queue: "gaps", MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	job := waitFinal(t, c, res.Job.ID, 60*time.Second)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 3 || len(job.Errors) != 3 {
		t.Fatalf("state %s attempt %d errors %d", job.State, job.Attempt, len(job.Errors))
	}
	g := giveUpOf(t, job)
	if g == nil {
		t.Fatalf("no metadata.rebound: %s", job.Metadata)
	}
	if g.Reason != reboundriver.ReasonLibraryMaxAttempts || g.Disposition != reboundriver.DispositionDeadLetter ||
		g.DeadLetterQueue != "gaps-dead" || g.Policy != "gotest/gaps" || g.Attempt != 3 || g.ReasonMessage == "" {
		t.Fatalf("give-up %+v", g)
	}
	if m := rb.Metrics(); m.HookErrors != 1 || m.DeadLettered != 1 {
		t.Fatalf("metrics %+v", m)
	}
}

// CauseArgs: a job whose run waits for its context to end and returns its cause, as
// context-aware code does (River's stop cancels with a cause of its own).
type CauseArgs struct{}

func (CauseArgs) Kind() string { return "rebound_test_cause" }

type causeWorker struct {
	river.WorkerDefaults[CauseArgs]
}

func (causeWorker) Work(ctx context.Context, job *river.Job[CauseArgs]) error {
	if err := os.WriteFile(runMark(job.ID, job.Attempt), nil, 0o644); err != nil {
		return err
	}
	<-ctx.Done()
	return context.Cause(ctx)
}

// StopAndCancel during a run that returns context.Cause(ctx): River does not count the
// run (soft stop), so Rebound is not asked, and a policy of maxAttempts 1 does not give up.
func TestSoftStopWithCauseIsNotDecided(t *testing.T) {
	t.Setenv(runsDirEnv, t.TempDir())
	rb := newRebound(t, sidecar.Target, "stopping")
	c := startRiver(t, rb, "stopping")
	id := insert(t, c, "stopping", CauseArgs{})
	end := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(runMark(id, 1)); err == nil {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("job %d did not start", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.StopAndCancel(ctx); err != nil {
		t.Fatal(err)
	}
	job, err := c.JobGet(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if job.State != rivertype.JobStateAvailable || giveUpOf(t, job) != nil {
		t.Fatalf("state %s attempt %d metadata %s", job.State, job.Attempt, job.Metadata)
	}
	if m := rb.Metrics(); m.Decisions.GiveUpMaxAttempts != 0 || m.Decisions.Retry != 0 {
		t.Fatalf("metrics %+v", m)
	}
}

// A run that River's JobTimeout (2s here) ends, returning context.Cause(ctx)
// (DeadlineExceeded), is a failure Rebound decides: maxAttempts 1 gives up.
func TestTimeoutWithCauseIsDecided(t *testing.T) {
	t.Setenv(runsDirEnv, t.TempDir())
	rb := newRebound(t, sidecar.Target, "stopping")
	c := startRiver(t, rb, "stopping")
	id := insert(t, c, "stopping", CauseArgs{})
	job := waitFinal(t, c, id, 30*time.Second)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 1 {
		t.Fatalf("state %s attempt %d errors %+v", job.State, job.Attempt, job.Errors)
	}
	if g := giveUpOf(t, job); g == nil || g.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" || g.DeadLetterQueue != "stopping-dead" {
		t.Fatalf("give-up %+v", g)
	}
}

// The first failure is when the first run started (as River records AttemptError.At),
// not when it failed: a first run longer than maxRetryDuration (1.5s) gives up at once.
func TestFirstFailureIsFirstRunsStart(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "deadline")
	c := startRiver(t, rb, "deadline")
	id := insert(t, c, "deadline", FailArgs{FailTimes: -1, SleepMs: 1600})
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 1 || g == nil || g.Reason != "GIVE_UP_REASON_DEADLINE" {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
}

// Replay of a dead letter whose job River has deleted meanwhile (its retention): a new job
// of the same kind and args is inserted into the original queue, and runs.
func TestReplayAfterTheJobWasDeletedInsertsItAgain(t *testing.T) {
	rb := newRebound(t, sidecar.Target, "payments")
	c := startRiver(t, rb, "payments")
	id := insert(t, c, "payments", FailArgs{FailTimes: 4})
	if job := waitFinal(t, c, id, 30*time.Second); job.State != rivertype.JobStateDiscarded {
		t.Fatalf("state %s", job.State)
	}
	dls := deadLettersOf(t, "payments-dead", id)
	if len(dls) != 1 {
		t.Fatalf("dead letters %+v", dls)
	}
	ctx := context.Background()
	if _, err := c.JobDelete(ctx, id); err != nil {
		t.Fatal(err)
	}
	job, err := reboundriver.Replay(ctx, c, dls[0].id)
	if err != nil {
		t.Fatal(err)
	}
	if job.ID == id || job.Kind != "rebound_test_fail" || job.Queue != "payments" {
		t.Fatalf("replayed as job %d kind %s queue %s", job.ID, job.Kind, job.Queue)
	}
	var args FailArgs
	if err := json.Unmarshal(job.EncodedArgs, &args); err != nil || args != (FailArgs{FailTimes: 4}) {
		t.Fatalf("args %s (%v)", job.EncodedArgs, err)
	}
	// A new job: it fails its first 4 runs again, and is a dead letter again.
	if final := waitFinal(t, c, job.ID, 30*time.Second); final.State != rivertype.JobStateDiscarded || final.Attempt != 4 {
		t.Fatalf("state %s attempt %d", final.State, final.Attempt)
	}
	if _, err := c.JobGet(ctx, dls[0].id); !errors.Is(err, rivertype.ErrNotFound) {
		t.Fatalf("the replayed dead letter is still there: %v", err)
	}
	// Not a dead letter: refused.
	if _, err := reboundriver.Replay(ctx, c, job.ID); err == nil {
		t.Fatal("Replay of a job that is not a dead letter was accepted")
	}
}
