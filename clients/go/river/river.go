// Package reboundriver lets Rebound decide River's retries.
//
// River asks its ClientRetryPolicy only when a job is to be retried, and the policy cannot
// cancel. So the adapter has two parts, installed together by Configure:
//
//   - a worker middleware that, after a failed run, asks the sidecar (through a
//     rebound.Client); on GIVE_UP it records the disposition in the job's metadata under
//     "rebound" and returns river.JobCancel, so the job ends in state `cancelled`; on
//     RETRY it keeps the delay for
//   - the RetryPolicy, whose NextRetry is now + that delay. For jobs the middleware did not
//     see fail (River's rescuer retrying a job whose worker died), NextRetry asks itself,
//     and if Rebound gave up, the middleware cancels the job before its next run.
//
// River's own MaxAttempts is set to rebound.LibraryAttempts so it never decides.
package reboundriver

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"time"

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
	// Disposition is "dead_letter" (keep for replay) or "drop".
	Disposition string `json:"disposition"`
	// DeadLetterQueue is the policy's dead-letter queue (dead_letter only).
	DeadLetterQueue string `json:"dead_letter_queue,omitempty"`
	// Reason is "max_attempts", "deadline", "non_retryable" or "library_max_attempts".
	Reason        string `json:"reason"`
	ReasonMessage string `json:"reason_message"`
	// Policy is "namespace/name" of the policy that decided ("" for the default policy).
	Policy     string `json:"policy"`
	ConfigHash string `json:"config_hash,omitempty"`
	Queue      string `json:"queue"`
	Attempt    int    `json:"attempt"`
	ErrorClass string `json:"error_class,omitempty"`
	Error      string `json:"error"`
	// Source is "sidecar" or "fallback".
	Source string    `json:"source"`
	At     time.Time `json:"at"`
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
func New(client *rebound.Client, o Options) *Adapter {
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
// and MaxAttempts above every policy's. Keep cancelled jobs as long as dead letters
// should be replayable (CancelledJobRetentionPeriod; River's default is 24h, -1 keeps them).
func Configure(cfg *river.Config, a *Adapter) {
	cfg.RetryPolicy = a
	cfg.MaxAttempts = rebound.LibraryAttempts
	cfg.Middleware = append(cfg.Middleware, a)
}

// Client is the rebound client the adapter asks.
func (a *Adapter) Client() *rebound.Client { return a.client }

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

func reasonName(r pb.GiveUpReason) string {
	switch r {
	case pb.GiveUpReason_GIVE_UP_REASON_MAX_ATTEMPTS:
		return "max_attempts"
	case pb.GiveUpReason_GIVE_UP_REASON_DEADLINE:
		return "deadline"
	case pb.GiveUpReason_GIVE_UP_REASON_NON_RETRYABLE:
		return "non_retryable"
	default:
		return "unspecified"
	}
}

// rescuedError is the error River's rescuer records for a run whose worker vanished.
const rescuedError = "Stuck job rescued by JobRescuer"

// rescuedAttempt is the attempt River's rescuer last rescued, if the job's latest error is
// the rescuer's (its worker died mid-run, and the middleware never saw that run fail).
func rescuedAttempt(job *rivertype.JobRow) (rivertype.AttemptError, bool) {
	if len(job.Errors) == 0 {
		return rivertype.AttemptError{}, false
	}
	last := job.Errors[len(job.Errors)-1]
	return last, last.Error == rescuedError && last.Trace == "" && last.Attempt > 0 && last.Attempt < job.Attempt
}

// Work runs the job; after a failure it asks Rebound and carries out a give-up. A job
// River's rescuer put back after Rebound gave up on the rescued run is given up here,
// before it runs: its next run could die as well and never reach the failure path.
func (a *Adapter) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) (err error) {
	if last, ok := rescuedAttempt(job); ok {
		now := time.Now()
		f := rebound.Failure{
			Queue:        job.Queue,
			Attempt:      last.Attempt,
			JobID:        strconv.FormatInt(job.ID, 10),
			FirstFailure: firstFailure(job, now),
		}
		if ans := a.client.Decide(context.WithoutCancel(ctx), f); !ans.Retry() {
			return a.giveUp(ctx, job, f, ans, "", errors.New(last.Error), now)
		}
	}
	func() {
		// A panic becomes an error here, so that it is decided like any failure.
		defer func() {
			if r := recover(); r != nil {
				err = WithClass(fmt.Errorf("panic: %v", r), "panic")
			}
		}()
		err = doInner(ctx)
	}()
	if err == nil {
		return nil
	}
	var cancel *rivertype.JobCancelError
	var snooze *rivertype.JobSnoozeError
	if errors.As(err, &cancel) || errors.As(err, &snooze) {
		return err
	}
	if softStop(ctx, err) {
		// River's soft stop (the run does not count) or a cancelled run: NextRetry decides.
		return err
	}
	now := time.Now()
	f := rebound.Failure{
		Queue:        job.Queue,
		Attempt:      job.Attempt,
		JobID:        strconv.FormatInt(job.ID, 10),
		ErrorClass:   a.safeClass(err),
		FirstFailure: firstFailure(job, now),
		RetryAfter:   a.safeRetryAfter(err),
	}
	ans := a.client.Decide(context.WithoutCancel(ctx), f)
	if ans.Retry() && job.MaxAttempts > 0 && job.Attempt >= job.MaxAttempts {
		// River would discard the job (no record) without asking the retry policy: the
		// job was inserted with a MaxAttempts below its policy's. Give up the policy's way.
		a.client.HookError(job.Queue, f.JobID, "maxAttempts", fmt.Errorf(
			"river's MaxAttempts %d reached before the policy's maxAttempts; insert with the adapter's MaxAttempts (Configure)", job.MaxAttempts))
		return a.giveUp(ctx, job, f, a.terminal(job.Queue, ans), ReasonLibraryMaxAttempts, err, now)
	}
	if ans.Retry() {
		a.mu.Lock()
		a.pending[job.ID] = pendingRetry{attempt: job.Attempt, delay: ans.Delay}
		a.mu.Unlock()
		return err
	}
	return a.giveUp(ctx, job, f, ans, "", err, now)
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

// softStop tells whether the run ended because its context was cancelled: the error is
// context.Canceled or the context's cause (River's stop cancels with a cause of its own,
// which context-aware code returns). A timeout (cause DeadlineExceeded) is a failure.
func softStop(ctx context.Context, err error) bool {
	if ctx.Err() == nil {
		return false
	}
	if errors.Is(err, context.Canceled) {
		return true
	}
	cause := context.Cause(ctx)
	return !errors.Is(cause, context.DeadlineExceeded) && errors.Is(err, cause)
}

// giveUp records the give-up in metadata.rebound and cancels the job. reason, when set,
// replaces the answer's (the answer was not a give-up but the job cannot run again).
func (a *Adapter) giveUp(ctx context.Context, job *rivertype.JobRow, f rebound.Failure, ans rebound.Answer, reason string, err error, now time.Time) error {
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
		At:            now.UTC(),
	}
	if reason != "" {
		g.Reason = reason
	}
	if ans.Policy.GetName() != "" {
		g.Policy = ans.Policy.GetNamespace() + "/" + ans.Policy.GetName()
	}
	if ans.Disposition == pb.Disposition_DISPOSITION_DEAD_LETTER {
		g.Disposition, g.DeadLetterQueue = DispositionDeadLetter, ans.DeadLetterQueue
	}
	if merr := river.MetadataSet(ctx, MetadataKey, g); merr != nil {
		a.client.HookError(job.Queue, f.JobID, "metadata", merr)
	}
	if ans.Disposition == pb.Disposition_DISPOSITION_DEAD_LETTER {
		a.client.CountDisposition(pb.Disposition_DISPOSITION_DEAD_LETTER)
	} else {
		a.client.CountDisposition(pb.Disposition_DISPOSITION_DROP)
	}
	return river.JobCancel(err)
}

// NextRetry is River's retry policy: now + the delay the middleware was told for this
// attempt. Otherwise (a rescued job) it asks Rebound itself; a give-up there becomes one
// more run right away, which the middleware gives up before it starts (see Work).
func (a *Adapter) NextRetry(job *rivertype.JobRow) time.Time {
	a.mu.Lock()
	p, ok := a.pending[job.ID]
	delete(a.pending, job.ID)
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
	return now
}
