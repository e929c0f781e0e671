// Package reboundriver lets Rebound decide River's retries.
//
// River asks its ClientRetryPolicy only when a job is to be retried, and the policy cannot
// end a job. So the adapter has two parts, installed together by Configure:
//
//   - a worker middleware that, after a failed run (an error or a panic), asks the sidecar
//     (through a rebound.Rebound). On GIVE_UP it ends the job in River's own state for
//     exhausted jobs, `discarded`, with the give-up recorded in its metadata under
//     "rebound", and for a dead letter inserts a job of kind DeadLetterKind into the
//     policy's deadLetterQueue, both in one transaction. A panic is passed on to River
//     after the decision, so ErrorHandler.HandlePanic sees it with its trace. On RETRY it
//     keeps the delay for
//   - the RetryPolicy, whose NextRetry is now + that delay. For jobs the middleware did not
//     see fail (River's rescuer retrying a job whose worker died), NextRetry asks itself,
//     and if Rebound gave up, the middleware gives the job up before its next run.
//
// River's own MaxAttempts is set to rebound.LibraryAttempts so it never decides.
package reboundriver

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	rebound "github.com/rebound-dev/rebound/clients/go"
	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

// MetadataKey is the job-metadata key holding a give-up's record.
const MetadataKey = "rebound"

// ReasonLibraryMaxAttempts is the record's reason when Rebound said RETRY but River's own
// MaxAttempts for the job (below the policy's) was reached first.
const ReasonLibraryMaxAttempts = "library_max_attempts"

// Disposition values in the metadata record.
const (
	DispositionDeadLetter = "dead_letter"
	DispositionDrop       = "drop"
)

// GiveUp is what the middleware writes to metadata.rebound when Rebound gives up on a job.
type GiveUp struct {
	// Disposition is "dead_letter" (a job was inserted into DeadLetterQueue) or "drop".
	Disposition string `json:"disposition"`
	// DeadLetterQueue is the policy's dead-letter queue (dead_letter only).
	DeadLetterQueue string `json:"dead_letter_queue,omitempty"`
	// DeadLetterJobID is the ID of the dead letter inserted there (dead_letter only).
	DeadLetterJobID int64 `json:"dead_letter_job_id,omitempty"`
	// Reason is the proto's GIVE_UP_REASON_MAX_ATTEMPTS, _DEADLINE or _NON_RETRYABLE, or
	// "library_max_attempts".
	Reason        string `json:"reason"`
	ReasonMessage string `json:"reason_message"`
	// Policy is "namespace/name" of the policy that decided ("" for the default policy).
	Policy     string `json:"policy"`
	ConfigHash string `json:"config_hash,omitempty"`
	Queue      string `json:"queue"`
	// Attempt is the number of runs made (River's attempt of the last run).
	Attempt    int    `json:"attempt"`
	ErrorClass string `json:"error_class,omitempty"`
	Error      string `json:"error"`
	// Source is "sidecar" or "fallback" (who decided); PolicySource is "sidecar", "cached"
	// or "default" (where the policy came from).
	Source       string    `json:"source"`
	PolicySource string    `json:"policy_source"`
	At           time.Time `json:"at"`
}

// DeadLetterKind is the kind of the job a dead letter is inserted as.
const DeadLetterKind = "rebound_dead_letter"

// DeadLetterArgs is the job inserted into the policy's deadLetterQueue when Rebound gives up
// with disposition dead letter: the original job's kind and args, its ID, queue, the reason
// and the number of runs made. Replay puts the original job back to work.
type DeadLetterArgs struct {
	JobKind       string          `json:"kind"`
	Args          json.RawMessage `json:"args"`
	JobID         int64           `json:"job_id" river:"unique"`
	Queue         string          `json:"queue"`
	Reason        string          `json:"reason"`
	ReasonMessage string          `json:"reason_message"`
	// Attempts is the number of runs made. With JobID it keys the dead letter: one per
	// give-up, however often its transaction is retried.
	Attempts     int       `json:"attempts" river:"unique"`
	Error        string    `json:"error"`
	ErrorClass   string    `json:"error_class,omitempty"`
	Policy       string    `json:"policy"`
	ConfigHash   string    `json:"config_hash,omitempty"`
	Source       string    `json:"source"`
	PolicySource string    `json:"policy_source"`
	At           time.Time `json:"at"`
}

// Kind is DeadLetterKind.
func (DeadLetterArgs) Kind() string { return DeadLetterKind }

// DeadLetterWorker is registered by Configure for DeadLetterKind, so that a client can insert
// dead letters. A dead letter is not meant to run (nobody works a dead-letter queue): if a
// client does work the queue, the dead letter is snoozed, never lost; Replay runs it.
type DeadLetterWorker struct {
	river.WorkerDefaults[DeadLetterArgs]
}

// Work snoozes the dead letter for an hour.
func (DeadLetterWorker) Work(context.Context, *river.Job[DeadLetterArgs]) error {
	return river.JobSnooze(time.Hour)
}

// Classified is an error carrying its class for the policy's nonRetryableErrors.
type Classified interface {
	error
	ErrorClass() string
}

// RetryAfterer is an error carrying the server's pushback (e.g. an HTTP Retry-After).
type RetryAfterer interface {
	error
	RetryAfter() time.Duration
}

type classed struct {
	err   error
	class string
}

func (c *classed) Error() string      { return c.err.Error() }
func (c *classed) Unwrap() error      { return c.err }
func (c *classed) ErrorClass() string { return c.class }

// WithClass gives err the class `class` (matched against the policy's nonRetryableErrors).
func WithClass(err error, class string) error { return &classed{err: err, class: class} }

// ErrorClass is the default class of an error: the ErrorClass() of the first error in
// its chain that has one, else the type name of the innermost error (e.g. "*net.OpError").
func ErrorClass(err error) string {
	var c Classified
	if errors.As(err, &c) {
		return c.ErrorClass()
	}
	for {
		next := errors.Unwrap(err)
		if next == nil {
			break
		}
		err = next
	}
	if err == nil {
		return ""
	}
	return reflect.TypeOf(err).String()
}

func retryAfterOf(err error) time.Duration {
	var r RetryAfterer
	if errors.As(err, &r) {
		return r.RetryAfter()
	}
	return 0
}

// Options of the adapter; zero values take the defaults.
type Options struct {
	// ErrorClass maps an error to its class (default ErrorClass).
	ErrorClass func(error) string
	// RetryAfter maps an error to a pushback (default: RetryAfterer in the chain).
	RetryAfter func(error) time.Duration
}

// Adapter is the middleware and the retry policy; one per river.Client.
type Adapter struct {
	river.MiddlewareDefaults
	client     *rebound.Client
	errorClass func(error) string
	retryAfter func(error) time.Duration

	mu sync.Mutex
	// pending: job id → the delay decided by the middleware for that attempt.
	pending map[int64]pendingRetry
}

type pendingRetry struct {
	attempt int
	delay   time.Duration
}

var (
	_ rivertype.WorkerMiddleware = (*Adapter)(nil)
	_ river.ClientRetryPolicy    = (*Adapter)(nil)
)

// New makes an adapter asking through client.
func New(client *rebound.Rebound, o Options) *Adapter {
	a := &Adapter{client: client, errorClass: o.ErrorClass, retryAfter: o.RetryAfter, pending: map[int64]pendingRetry{}}
	if a.errorClass == nil {
		a.errorClass = ErrorClass
	}
	if a.retryAfter == nil {
		a.retryAfter = retryAfterOf
	}
	return a
}

// Configure installs the adapter in a River config: RetryPolicy, the worker middleware,
// MaxAttempts above every policy's, and DeadLetterWorker (so dead letters can be inserted).
// It prefetches the policies of cfg.Queues (Rebound.Prefetch), so that during a later
// sidecar outage every decision comes from the queues' real policies. Keep discarded jobs as
// long as they should be replayable (DiscardedJobRetentionPeriod; River's default is 7 days).
func Configure(cfg *river.Config, a *Adapter) {
	cfg.RetryPolicy = a
	cfg.MaxAttempts = rebound.LibraryAttempts
	cfg.Middleware = append(cfg.Middleware, a)
	if cfg.Workers != nil {
		_ = river.AddWorkerSafely(cfg.Workers, DeadLetterWorker{}) // already there: fine
	}
	queues := make([]string, 0, len(cfg.Queues))
	for q := range cfg.Queues {
		queues = append(queues, q)
	}
	a.client.Prefetch(context.Background(), queues...)
}

// Client is the Rebound the adapter asks.
func (a *Adapter) Client() *rebound.Rebound { return a.client }

// firstFailure is when the job's first failed run started: its first recorded error's At
// (River records the run's start there), else this run's start, else now.
func firstFailure(job *rivertype.JobRow, now time.Time) time.Time {
	if len(job.Errors) > 0 && !job.Errors[0].At.IsZero() {
		return job.Errors[0].At
	}
	if job.AttemptedAt != nil && !job.AttemptedAt.IsZero() && !job.AttemptedAt.After(now) {
		return *job.AttemptedAt
	}
	return now
}

func (a *Adapter) safeClass(err error) (class string) {
	defer func() {
		if r := recover(); r != nil {
			a.client.HookError("", "", "errorClass", fmt.Errorf("panic: %v", r))
			class = ""
		}
	}()
	return a.errorClass(err)
}

func (a *Adapter) safeRetryAfter(err error) (d time.Duration) {
	defer func() {
		if r := recover(); r != nil {
			a.client.HookError("", "", "retryAfter", fmt.Errorf("panic: %v", r))
			d = 0
		}
	}()
	return a.retryAfter(err)
}

func reasonName(r pb.GiveUpReason) string { return r.String() }

// rescuedError is the error River's rescuer records for a run whose worker vanished.
const rescuedError = "Stuck job rescued by JobRescuer"

// DeferredKey is the job-metadata key marking a give-up that could not be written (the
// database did not answer, or refused the dead letter): the next run is given up instead.
const DeferredKey = "rebound_deferred"

// deferred is metadata.rebound_deferred: the give-up of the run Attempt, Runs runs made.
type deferred struct {
	Attempt int `json:"attempt"`
	Runs    int `json:"runs"`
}

// unanswered is the previous run of the job if it ended without a decision carried out:
// River's rescuer put it back after its worker vanished, or its give-up could not be
// written. It returns that run's number (the runs made) and its error.
func unanswered(job *rivertype.JobRow) (int, error, bool) {
	var meta map[string]json.RawMessage
	if json.Unmarshal(job.Metadata, &meta) == nil && meta[DeferredKey] != nil {
		var d deferred
		if json.Unmarshal(meta[DeferredKey], &d) == nil && d.Attempt == job.Attempt-1 && d.Runs > 0 {
			return d.Runs, errors.New("rebound: the give-up of this run could not be written"), true
		}
	}
	if len(job.Errors) == 0 {
		return 0, nil, false
	}
	last := job.Errors[len(job.Errors)-1]
	if last.Error == rescuedError && last.Trace == "" && last.Attempt > 0 && last.Attempt == job.Attempt-1 {
		return last.Attempt, fmt.Errorf("rebound: run %d ended without an answer (%s)", last.Attempt, last.Error), true
	}
	return 0, nil, false
}

// decide asks Rebound and logs the answer (debug level, event "rebound.decision").
func (a *Adapter) decide(ctx context.Context, f rebound.Failure) rebound.Answer {
	ans := a.client.Decide(context.WithoutCancel(ctx), f)
	a.client.Logger().DebugContext(ctx, "rebound decided", "event", "rebound.decision", "queue", f.Queue,
		"jobId", f.JobID, "attempt", f.Attempt, "errorClass", f.ErrorClass, "decision", ans.Decision.String(),
		"delayMs", ans.Delay.Milliseconds(), "disposition", ans.Disposition.String(), "reason", ans.Reason.String(),
		"policy", ans.Policy.GetNamespace()+"/"+ans.Policy.GetName(), "source", string(ans.Source),
		"policySource", string(ans.PolicySource))
	return ans
}

// Work runs the job; after a failure it asks Rebound and carries out a give-up. A job
// whose previous run ended without an answer (its worker died, or its give-up could not
// be written) is decided for that run first, and given up here before it runs: its next
// run could die as well and never reach the failure path.
func (a *Adapter) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) (err error) {
	if runs, lastErr, ok := unanswered(job); ok {
		now := time.Now()
		f := rebound.Failure{
			Queue:        job.Queue,
			Attempt:      runs,
			JobID:        strconv.FormatInt(job.ID, 10),
			FirstFailure: firstFailure(job, now),
		}
		if ans := a.decide(ctx, f); !ans.Retry() {
			return a.giveUp(ctx, job, f, ans, "", lastErr, "", now)
		}
	}
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		// Decided like any failure (class "panic"), then passed on to River (from inside
		// this deferred call, so the stack still holds the panicking frames): River's
		// ErrorHandler.HandlePanic gets the value and the trace.
		_ = a.failed(ctx, job, WithClass(fmt.Errorf("panic: %v", r), "panic"), string(debug.Stack()))
		panic(r)
	}()
	err = doInner(ctx)
	if err == nil {
		return nil
	}
	var cancel *rivertype.JobCancelError
	var snooze *rivertype.JobSnoozeError
	if errors.As(err, &cancel) || errors.As(err, &snooze) || errors.Is(context.Cause(ctx), rivertype.ErrJobCancelledRemotely) {
		return err
	}
	if softStop(ctx, err) {
		// River's soft stop: River puts the job back without counting the run.
		return err
	}
	return a.failed(ctx, job, err, "")
}

// failed decides after a failed run: RETRY keeps the delay for NextRetry, GIVE_UP ends the
// job (giveUp). It returns what the middleware returns to River.
func (a *Adapter) failed(ctx context.Context, job *rivertype.JobRow, err error, trace string) error {
	now := time.Now()
	f := rebound.Failure{
		Queue:        job.Queue,
		Attempt:      job.Attempt,
		JobID:        strconv.FormatInt(job.ID, 10),
		ErrorClass:   a.safeClass(err),
		FirstFailure: firstFailure(job, now),
		RetryAfter:   a.safeRetryAfter(err),
	}
	ans := a.decide(ctx, f)
	if ans.Retry() && job.MaxAttempts > 0 && job.Attempt >= job.MaxAttempts {
		// River would discard the job (no record) without asking the retry policy: the
		// job was inserted with a MaxAttempts below its policy's. Give up the policy's way.
		a.client.HookError(job.Queue, f.JobID, "maxAttempts", fmt.Errorf(
			"river's MaxAttempts %d reached before the policy's maxAttempts; insert with the adapter's MaxAttempts (Configure)", job.MaxAttempts))
		return a.giveUp(ctx, job, f, a.terminal(job.Queue, ans), ReasonLibraryMaxAttempts, err, trace, now)
	}
	if ans.Retry() {
		a.keep(job, ans.Delay)
		a.yieldIfStale(ctx, job)
		return err
	}
	return a.giveUp(ctx, job, f, ans, "", err, trace, now)
}

// keep is the delay NextRetry answers for this run of the job.
func (a *Adapter) keep(job *rivertype.JobRow, delay time.Duration) {
	a.mu.Lock()
	a.pending[job.ID] = pendingRetry{attempt: job.Attempt, delay: delay}
	a.mu.Unlock()
}

// StaleWait bounds how long a run that River's rescuer has meanwhile handed to another run
// (its worker paused past RescueStuckJobsAfter) waits for the job to end before it returns
// to River. River writes a run's end to the job's row whenever the row is running, whichever
// run it belongs to: returned while a newer run goes on, or just before one starts (River
// writes a moment after the middleware returns), it would put that run's job back to retry
// while it runs, and each such overlap could start another.
var StaleWait = 2 * time.Minute

// yieldIfStale returns at once when this run is the job's current one. Otherwise it waits
// until the job has ended (completed, discarded, cancelled), so that River's write of this
// run's end finds nothing to change; after StaleWait, until no run of the job is going
// on; after twice that, it returns anyway.
func (a *Adapter) yieldIfStale(ctx context.Context, job *rivertype.JobRow) {
	read, ok := a.rowReader(context.WithoutCancel(ctx))
	if !ok {
		return
	}
	start := time.Now()
	for waited := false; ; waited = true {
		state, attempt, err := read(job.ID)
		if err != nil || attempt == job.Attempt || state == rivertype.JobStateCompleted ||
			state == rivertype.JobStateDiscarded || state == rivertype.JobStateCancelled {
			return
		}
		if !waited {
			a.client.Logger().WarnContext(ctx, "rebound: a newer run of the job took over; waiting for the job to end",
				"event", "rebound.stale_run", "queue", job.Queue, "jobId", strconv.FormatInt(job.ID, 10),
				"attempt", job.Attempt, "currentAttempt", attempt)
		}
		if ctx.Err() != nil && !errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
			return // the client stops (StopAndCancel, Start's context) or the job was cancelled
		}
		if since := time.Since(start); since > 2*StaleWait || since > StaleWait && state != rivertype.JobStateRunning {
			a.client.HookError(job.Queue, strconv.FormatInt(job.ID, 10), "staleRun",
				fmt.Errorf("run %d returns while the job (at run %d, %s) has not ended after %s", job.Attempt, attempt, state, since.Round(time.Second)))
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// rowReader reads the job's state and attempt through the River client running the job.
func (a *Adapter) rowReader(ctx context.Context) (func(id int64) (rivertype.JobState, int, error), bool) {
	if c, err := river.ClientFromContextSafely[pgx.Tx](ctx); err == nil {
		return func(id int64) (rivertype.JobState, int, error) { return readRow(ctx, c, id) }, true
	}
	if c, err := river.ClientFromContextSafely[*sql.Tx](ctx); err == nil {
		return func(id int64) (rivertype.JobState, int, error) { return readRow(ctx, c, id) }, true
	}
	return nil, false
}

func readRow[TTx any](ctx context.Context, client *river.Client[TTx], id int64) (rivertype.JobState, int, error) {
	tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var state string
	var attempt int
	err := client.Driver().GetExecutor().QueryRow(tctx,
		"SELECT state::text, attempt FROM "+table(client.Schema())+" WHERE id = $1", id).Scan(&state, &attempt)
	return rivertype.JobState(state), attempt, err
}

func table(schema string) string {
	if schema == "" {
		return "river_job"
	}
	return pgx.Identifier{schema, "river_job"}.Sanitize()
}

// softStop tells whether River will treat the run as stopped by its client, not counted:
// River's own stop (StopAndCancel, SoftStopTimeout) cancels the run with a cause of its
// own, which the run returns or turns into context.Canceled. Any other end is a run River
// counts and Rebound decides: a timeout, and Start's context cancelled without
// SoftStopTimeout (the usual signal.NotifyContext), whose cause is context.Canceled.
func softStop(ctx context.Context, err error) bool {
	if ctx.Err() == nil {
		return false
	}
	cause := context.Cause(ctx)
	if errors.Is(cause, context.Canceled) || errors.Is(cause, context.DeadlineExceeded) {
		return false
	}
	return errors.Is(err, context.Canceled) || errors.Is(err, cause)
}

// terminal turns a RETRY answer into the give-up of the queue's policy (its terminal
// action), for a job that cannot run again.
func (a *Adapter) terminal(queue string, ans rebound.Answer) rebound.Answer {
	_, p := a.client.Policy(queue)
	if p == nil {
		p = rebound.DefaultPolicy()
	}
	ans.Decision = pb.Decision_DECISION_GIVE_UP
	ans.Disposition, ans.DeadLetterQueue = p.GetTerminal(), p.GetDeadLetterQueue()
	ans.ReasonMessage = fmt.Sprintf("Rebound would retry, but River's MaxAttempts for the job was reached first (policy maxAttempts %d)", p.GetMaxAttempts())
	return ans
}

// holdDelay is how long a job whose give-up is not carried out by this run waits before
// River hands it out again (to give it up then): the policy's first backoff for the job,
// never an immediate retry.
func (a *Adapter) holdDelay(job *rivertype.JobRow) time.Duration {
	p, identity := rebound.DefaultPolicy(), rebound.DefaultIdentity
	if ref, cached := a.client.Cached(job.Queue); cached != nil {
		p, identity = cached, ref.GetNamespace()+"/"+ref.GetName()
	}
	r, err := rebound.DecideLocal(p, identity, 1, rebound.Context{JobID: strconv.FormatInt(job.ID, 10),
		NowUnixMs: uint64(time.Now().UnixMilli())})
	if err == nil && r.GetDecision() == pb.Decision_DECISION_RETRY && r.GetDelayMs() > 0 {
		return time.Duration(r.GetDelayMs()) * time.Millisecond
	}
	return rebound.LastResortDelay
}

// SettleFor bounds how long a give-up keeps trying to write the job's end (its state and
// the dead letter) while the database does not answer or refuses, before deferring it.
var SettleFor = 30 * time.Second

var errNotRunning = errors.New("another run of the job owns it now (rescued, retried or ended meanwhile)")

// giveUp ends the job in River's `discarded` state with metadata.rebound, and for a dead
// letter inserts the DeadLetterArgs job into the policy's deadLetterQueue, in one
// transaction keyed by (job id, run): retried after a lost reply, or run by a stale copy
// of the job, it writes nothing twice. reason, when set, replaces the answer's (the answer
// was not a give-up but the job cannot run again). It returns err: River then finds the
// job no longer running. When the transaction cannot be written within SettleFor, the
// give-up is deferred: the job goes back to River (metadata.rebound_deferred) and its
// next run is given up before it starts.
func (a *Adapter) giveUp(ctx context.Context, job *rivertype.JobRow, f rebound.Failure, ans rebound.Answer, reason string, err error, trace string, now time.Time) error {
	g := GiveUp{
		Disposition:   DispositionDrop,
		Reason:        reasonName(ans.Reason),
		ReasonMessage: ans.ReasonMessage,
		ConfigHash:    ans.Policy.GetConfigHash(),
		Queue:         job.Queue,
		Attempt:       f.Attempt,
		ErrorClass:    f.ErrorClass,
		Error:         err.Error(),
		Source:        string(ans.Source),
		PolicySource:  string(ans.PolicySource),
		At:            now.UTC(),
	}
	if reason != "" {
		g.Reason = reason
	}
	if ans.Policy.GetName() != "" {
		g.Policy = ans.Policy.GetNamespace() + "/" + ans.Policy.GetName()
	}
	var dl *DeadLetterArgs
	if ans.Disposition == pb.Disposition_DISPOSITION_DEAD_LETTER && ans.DeadLetterQueue != "" {
		g.Disposition, g.DeadLetterQueue = DispositionDeadLetter, ans.DeadLetterQueue
		dl = &DeadLetterArgs{
			JobKind: job.Kind, Args: json.RawMessage(job.EncodedArgs), JobID: job.ID, Queue: job.Queue,
			Reason: g.Reason, ReasonMessage: g.ReasonMessage, Attempts: f.Attempt, Error: g.Error,
			ErrorClass: g.ErrorClass, Policy: g.Policy, ConfigHash: g.ConfigHash, Source: g.Source,
			PolicySource: g.PolicySource, At: g.At,
		}
		if len(dl.Args) == 0 {
			dl.Args = json.RawMessage("{}")
		}
	}
	at := now
	if job.AttemptedAt != nil && !job.AttemptedAt.IsZero() {
		at = *job.AttemptedAt
	}
	s := settlement{job: job, dl: dl, dlq: g.DeadLetterQueue, now: now,
		attemptErr: rivertype.AttemptError{At: at, Attempt: job.Attempt, Error: err.Error(), Trace: trace}}
	settled, id, serr := a.settle(context.WithoutCancel(ctx), &s, g)
	switch {
	case settled:
		g.DeadLetterJobID = id
		// NextRetry, which River still calls when the middleware returns an error, has
		// nothing to decide: River's write finds the job no longer running.
		a.keep(job, 0)
	case serr == nil:
		// No transaction: the River client's driver is neither pgx nor database/sql. River
		// discards the job (its attempt limit reached) with the record; no dead letter can
		// be inserted, so the record says drop.
		a.client.HookError(job.Queue, f.JobID, "giveUp", errors.New("no transaction for this River driver: the dead letter was not inserted"))
		g.Disposition, g.DeadLetterQueue = DispositionDrop, ""
		if merr := river.MetadataSet(ctx, MetadataKey, g); merr != nil {
			a.client.HookError(job.Queue, f.JobID, "metadata", merr)
		}
		job.MaxAttempts = job.Attempt
	case errors.Is(serr, errNotRunning):
		// A newer run owns the job (this one was rescued while its worker was paused):
		// that run decides. This one hands back without touching it.
		a.client.HookError(job.Queue, f.JobID, "giveUp", serr)
		a.keep(job, a.holdDelay(job))
		a.yieldIfStale(ctx, job)
		return err
	default:
		// Not written (the database down past SettleFor, or the dead letter refused):
		// nothing is dead-lettered. The job goes back to River, marked, and its next run
		// is given up before it starts; if River cannot write either, its rescuer puts the
		// job back and the same happens.
		a.client.HookError(job.Queue, f.JobID, "giveUp", serr)
		if merr := river.MetadataSet(ctx, DeferredKey, deferred{Attempt: job.Attempt, Runs: f.Attempt}); merr != nil {
			a.client.HookError(job.Queue, f.JobID, "metadata", merr)
		}
		a.keep(job, a.holdDelay(job))
		a.client.Logger().WarnContext(ctx, "rebound could not write the give-up; deferred to the job's next run",
			"event", "rebound.give_up_deferred", "queue", job.Queue, "jobId", f.JobID, "kind", job.Kind,
			"attempts", f.Attempt, "disposition", g.Disposition, "deadLetterQueue", g.DeadLetterQueue, "error", serr.Error())
		return err
	}
	event := "rebound.dropped"
	if g.Disposition == DispositionDeadLetter {
		event = "rebound.dead_lettered"
		a.client.CountDisposition(pb.Disposition_DISPOSITION_DEAD_LETTER)
	} else {
		a.client.CountDisposition(pb.Disposition_DISPOSITION_DROP)
	}
	a.client.Logger().WarnContext(ctx, "rebound gave up on the job", "event", event, "queue", job.Queue,
		"jobId", f.JobID, "kind", job.Kind, "attempts", f.Attempt, "reason", g.Reason, "deadLetterQueue", g.DeadLetterQueue,
		"deadLetterJobId", g.DeadLetterJobID, "policy", g.Policy, "source", g.Source, "policySource", g.PolicySource)
	return err
}

type settlement struct {
	job        *rivertype.JobRow
	dl         *DeadLetterArgs
	dlq        string
	now        time.Time
	attemptErr rivertype.AttemptError
}

// settle writes the give-up in a transaction of the River client running the job (pgx or
// database/sql), retrying while the database does not answer or refuses. settled is false
// when there is no such client.
func (a *Adapter) settle(ctx context.Context, s *settlement, g GiveUp) (settled bool, id int64, err error) {
	errData, err := json.Marshal(s.attemptErr)
	if err != nil {
		return false, 0, err
	}
	var try func() (int64, error)
	if c, cerr := river.ClientFromContextSafely[pgx.Tx](ctx); cerr == nil {
		try = func() (int64, error) { return settleTx(ctx, c, s, errData, g) }
	} else if c, cerr := river.ClientFromContextSafely[*sql.Tx](ctx); cerr == nil {
		try = func() (int64, error) { return settleTx(ctx, c, s, errData, g) }
	} else {
		return false, 0, nil
	}
	end := time.Now().Add(SettleFor)
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		id, err = try()
		if err == nil {
			return true, id, nil
		}
		if errors.Is(err, errNotRunning) || time.Now().Add(wait).After(end) {
			return false, 0, err
		}
		time.Sleep(wait)
	}
}

// settleTx is the give-up's transaction. It locks the job's row and writes only if the row
// is still this run's (same attempt, not ended); if the row already holds this run's
// give-up (a commit whose reply was lost), it returns that give-up's dead letter.
func settleTx[TTx any](ctx context.Context, client *river.Client[TTx], s *settlement, errData []byte, g GiveUp) (int64, error) {
	drv := client.Driver()
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	execTx, err := drv.GetExecutor().Begin(tctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = execTx.Rollback(tctx) }()
	var state string
	var attempt int
	var rec []byte
	if err := execTx.QueryRow(tctx, "SELECT state::text, attempt, metadata->'"+MetadataKey+"' FROM "+table(client.Schema())+
		" WHERE id = $1 FOR UPDATE", s.job.ID).Scan(&state, &attempt, &rec); err != nil {
		return 0, err
	}
	if attempt != s.job.Attempt {
		return 0, errNotRunning
	}
	switch rivertype.JobState(state) {
	case rivertype.JobStateDiscarded:
		var done GiveUp
		if len(rec) > 0 && json.Unmarshal(rec, &done) == nil && done.Attempt == g.Attempt {
			return done.DeadLetterJobID, nil // this very give-up, committed before
		}
		return 0, errNotRunning
	case rivertype.JobStateCompleted, rivertype.JobStateCancelled:
		return 0, errNotRunning
	}
	if s.dl != nil {
		res, err := client.InsertTx(tctx, drv.UnwrapTx(execTx), *s.dl, &river.InsertOpts{Queue: s.dlq, UniqueOpts: river.UniqueOpts{
			ByArgs: true, ByQueue: true, ByState: rivertype.JobStates(),
		}})
		if err != nil {
			return 0, err
		}
		g.DeadLetterJobID = res.Job.ID
	}
	meta, err := json.Marshal(map[string]GiveUp{MetadataKey: g})
	if err != nil {
		return 0, err
	}
	if err := execTx.Exec(tctx, "UPDATE "+table(client.Schema())+` SET state = 'discarded', finalized_at = $2,
		errors = array_append(errors, $3::jsonb), metadata = (metadata - '`+DeferredKey+`') || $4::jsonb WHERE id = $1`,
		s.job.ID, s.now, string(errData), string(meta)); err != nil {
		return 0, err
	}
	return g.DeadLetterJobID, execTx.Commit(tctx)
}

// NextRetry is River's retry policy: now + the delay the middleware was told for this
// attempt. Otherwise (a rescued job) it asks Rebound itself; on a give-up it holds the job
// for the policy's first backoff, and the middleware gives it up before its next run.
func (a *Adapter) NextRetry(job *rivertype.JobRow) time.Time {
	a.mu.Lock()
	p, ok := a.pending[job.ID]
	if ok && p.attempt == job.Attempt {
		delete(a.pending, job.ID)
	}
	a.mu.Unlock()
	now := time.Now()
	if ok && p.attempt == job.Attempt {
		return now.Add(p.delay)
	}
	ans := a.client.Decide(context.Background(), rebound.Failure{
		Queue:        job.Queue,
		Attempt:      job.Attempt,
		JobID:        strconv.FormatInt(job.ID, 10),
		FirstFailure: firstFailure(job, now),
	})
	if ans.Retry() {
		return now.Add(ans.Delay)
	}
	return now.Add(a.holdDelay(job))
}

// Replay puts a dead letter's job back to work: the original job (same ID) is made available
// at once with River's JobRetry, and the dead letter deleted, in one transaction. If River
// has deleted the original meanwhile (DiscardedJobRetentionPeriod), a new job of the same
// kind and args is inserted into its queue instead. It returns the job that will run.
func Replay[TTx any](ctx context.Context, client *river.Client[TTx], deadLetterID int64) (*rivertype.JobRow, error) {
	drv := client.Driver()
	execTx, err := drv.GetExecutor().Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = execTx.Rollback(ctx) }()
	tx := drv.UnwrapTx(execTx)
	row, err := client.JobGetTx(ctx, tx, deadLetterID)
	if err != nil {
		return nil, err
	}
	if row.Kind != DeadLetterKind {
		return nil, fmt.Errorf("job %d is a %q, not a dead letter (%s)", deadLetterID, row.Kind, DeadLetterKind)
	}
	var dl DeadLetterArgs
	if err := json.Unmarshal(row.EncodedArgs, &dl); err != nil {
		return nil, fmt.Errorf("dead letter %d: %w", deadLetterID, err)
	}
	job, err := client.JobRetryTx(ctx, tx, dl.JobID)
	if errors.Is(err, rivertype.ErrNotFound) {
		var res *rivertype.JobInsertResult
		res, err = client.InsertTx(ctx, tx, rawArgs{kind: dl.JobKind, args: dl.Args}, &river.InsertOpts{Queue: dl.Queue})
		if res != nil {
			job = res.Job
		}
	}
	if err != nil {
		return nil, err
	}
	if _, err := client.JobDeleteTx(ctx, tx, deadLetterID); err != nil {
		return nil, err
	}
	return job, execTx.Commit(ctx)
}

// rawArgs are already encoded args of a kind.
type rawArgs struct {
	kind string
	args json.RawMessage
}

func (r rawArgs) Kind() string                 { return r.kind }
func (r rawArgs) MarshalJSON() ([]byte, error) { return r.args, nil }
