package rebound

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

// LibraryAttempts is above every valid maxAttempts (10000): a job library's own attempt
// limit set to it never decides before Rebound does.
const LibraryAttempts = 10001

// DefaultIdentity seeds the default policy's jitter.
const DefaultIdentity = "rebound/default"

// LastResortDelay is answered when even the local fallback fails (it should not).
const LastResortDelay = 5 * time.Second

const (
	maxJobIDBytes      = 512
	maxErrorClassBytes = 253
	logEvery           = time.Minute
)

// DefaultPolicy is what a RetryPolicy with an empty spec resolves to (the policy crate's
// defaults): the fallback for a queue whose policy was never fetched.
func DefaultPolicy() *pb.ResolvedPolicy {
	return &pb.ResolvedPolicy{
		Strategy:    pb.Strategy_STRATEGY_EXPONENTIAL,
		BaseMs:      1000,
		Multiplier:  2,
		CapMs:       600000,
		Jitter:      pb.Jitter_JITTER_FULL,
		MaxAttempts: 10,
		Terminal:    pb.Disposition_DISPOSITION_DROP,
	}
}

// Options configure a Client; zero values take the defaults.
type Options struct {
	// Target is "unix:///abs/path.sock" or "host:port"; default $REBOUND_TARGET, else 127.0.0.1:7411.
	Target string
	// Deadline of each call to the sidecar (default 250ms): a hook must answer quickly.
	Deadline time.Duration
	// RefreshInterval is how often cached policies are fetched again (default 30s).
	RefreshInterval time.Duration
	// DefaultPolicy answers for queues with nothing cached (default DefaultPolicy()).
	DefaultPolicy *pb.ResolvedPolicy
	// Logger gets the fallback and policy-cache lines (default slog.Default()).
	Logger *slog.Logger
}

// Failure is one failed run, as a job library reports it.
type Failure struct {
	Queue string
	// Attempt is the 1-based number of the run that just failed (0 reads as 1).
	Attempt int
	// JobID seeds the jitter, so repeated questions get equal answers.
	JobID        string
	ErrorClass   string
	FirstFailure time.Time
	RetryAfter   time.Duration
}

// Source says who answered: the sidecar, or the local fallback.
type Source string

const (
	SourceSidecar  Source = "sidecar"
	SourceFallback Source = "fallback"
)

// PolicySource says which policy answered: the sidecar's, the cached copy, or the default.
type PolicySource string

const (
	PolicySidecar PolicySource = "sidecar"
	PolicyCached  PolicySource = "cached"
	PolicyDefault PolicySource = "default"
)

// Answer is a decision; Delay is set only for DECISION_RETRY.
type Answer struct {
	Decision pb.Decision
	Delay    time.Duration
	// BudgetStretched says the policy's retryBudget moved this retry later, by
	// BudgetDelay (included in Delay). A budget is one sidecar's schedule: never set
	// on a fallback answer.
	BudgetStretched bool
	BudgetDelay     time.Duration
	Disposition     pb.Disposition
	DeadLetterQueue string
	Reason          pb.GiveUpReason
	ReasonMessage   string
	Policy          *pb.PolicyRef
	Source          Source
	PolicySource    PolicySource
	// Revision is the id of the revision that answered while the policy rolls out ("" when
	// it does not): the sidecar's DecideResponse.revision, or the fallback's own pick.
	Revision string
}

// Retry tells whether the job runs again.
func (a Answer) Retry() bool { return a.Decision == pb.Decision_DECISION_RETRY }

// Metrics are the client's counters since it was made.
type Metrics struct {
	Decisions struct{ Retry, GiveUpMaxAttempts, GiveUpDeadline, GiveUpNonRetryable int }
	// Sources counts the answers by who decided them.
	Sources  struct{ Sidecar, Fallback int }
	Fallback struct {
		Total, Unavailable, DeadlineExceeded, NotFound, Other, DefaultPolicy int
		// FromDefault counts the fallbacks of each cause decided by the default policy
		// (the rest used the queue's cached policy).
		FromDefault FallbackCauses
	}
	DeadLettered, Dropped, HookErrors int
}

// FallbackCauses counts fallbacks by the gRPC status of the failed call.
type FallbackCauses struct{ Unavailable, DeadlineExceeded, NotFound, Other int }

// add counts one fallback of cause.
func (f *FallbackCauses) add(cause string) {
	switch cause {
	case "unavailable":
		f.Unavailable++
	case "deadline_exceeded":
		f.DeadlineExceeded++
	case "not_found":
		f.NotFound++
	default:
		f.Other++
	}
}

// TargetError is a malformed sidecar address, refused by New before any job runs.
type TargetError struct {
	// Setting is where the address came from: "REBOUND_TARGET" or "Options.Target".
	Setting string
	Target  string
	Problem string
}

func (e *TargetError) Error() string {
	return fmt.Sprintf("%s=%q: %s (want \"unix:///abs/path.sock\" or \"host:port\")", e.Setting, e.Target, e.Problem)
}

type cachedPolicy struct {
	ref *pb.PolicyRef
	// prepared holds the resolved policy and its identity, prepared when fetched.
	prepared *PreparedPolicy
	// rollout is set while the policy rolls out, so the fallback picks the revision the
	// sidecar picks for each job.
	rollout *cachedRollout
}

// Rebound asks the sidecar and falls back to the last GetPolicy answer for the queue (or
// the default policy) with the local port of the decision function. Safe for concurrent use.
type Rebound struct {
	target   string
	deadline time.Duration
	logger   *slog.Logger
	def      *PreparedPolicy
	conn     *grpc.ClientConn
	rpc      pb.RetryAdvisorClient

	mu       sync.Mutex
	policies map[string]cachedPolicy
	queues   map[string]bool
	inflight map[string]chan struct{}
	lastLog  map[string]time.Time
	metrics  Metrics
	closed   bool

	stop      chan struct{}
	stopWatch context.CancelFunc
	wg        sync.WaitGroup
}

// Client is the former name of Rebound.
//
// Deprecated: use Rebound.
type Client = Rebound

var hostPort = regexp.MustCompile(`^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})$`)

// dialTarget checks a sidecar address and gives what grpc dials ("" and a problem if bad).
func dialTarget(target string) (string, string) {
	if rest, ok := strings.CutPrefix(target, "unix:"); ok {
		path := strings.TrimPrefix(rest, "//")
		if !strings.HasPrefix(path, "/") || len(path) < 2 {
			return "", "a unix socket needs an absolute path"
		}
		return target, ""
	}
	m := hostPort.FindStringSubmatch(target)
	if m == nil {
		return "", "not a unix socket nor host:port (no scheme, host, port)"
	}
	if port, _ := strconv.Atoi(m[2]); port < 1 || port > 65535 {
		return "", "the port is not within 1..65535"
	}
	return "passthrough:///" + target, ""
}

// New makes a Rebound; it connects lazily, at the first call. An error only for bad
// options: a malformed target is a *TargetError naming REBOUND_TARGET (or Options.Target).
func New(o Options) (*Rebound, error) {
	target, setting := o.Target, "Options.Target"
	if target == "" {
		target, setting = os.Getenv("REBOUND_TARGET"), "REBOUND_TARGET"
	}
	if target == "" {
		target = "127.0.0.1:7411"
	}
	dial, problem := dialTarget(target)
	if problem != "" {
		return nil, &TargetError{Setting: setting, Target: target, Problem: problem}
	}
	if o.Deadline < 0 || o.RefreshInterval < 0 {
		return nil, errors.New("Deadline and RefreshInterval must not be negative")
	}
	c := &Rebound{
		target:   target,
		deadline: o.Deadline,
		logger:   o.Logger,
		policies: map[string]cachedPolicy{},
		queues:   map[string]bool{},
		inflight: map[string]chan struct{}{},
		lastLog:  map[string]time.Time{},
		stop:     make(chan struct{}),
	}
	if c.deadline == 0 {
		c.deadline = 250 * time.Millisecond
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	if o.DefaultPolicy == nil {
		c.def = PreparePolicy(DefaultPolicy(), DefaultIdentity)
	} else {
		c.def = PreparePolicy(proto.Clone(o.DefaultPolicy).(*pb.ResolvedPolicy), DefaultIdentity)
		if _, err := c.def.Decide(1, Context{JobID: "check"}); err != nil {
			return nil, fmt.Errorf("DefaultPolicy: %w", err)
		}
	}
	// Reconnect quickly once the sidecar is back; calls never wait for a connection.
	bo := backoff.DefaultConfig
	bo.BaseDelay, bo.MaxDelay = 100*time.Millisecond, time.Second
	conn, err := grpc.NewClient(dial,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bo, MinConnectTimeout: time.Second}),
		grpc.WithDisableRetry())
	if err != nil {
		return nil, fmt.Errorf("target %q: %w", target, err)
	}
	c.conn, c.rpc = conn, pb.NewRetryAdvisorClient(conn)
	refresh := o.RefreshInterval
	if refresh == 0 {
		refresh = 30 * time.Second
	}
	watchCtx, stopWatch := context.WithCancel(context.Background())
	c.stopWatch = stopWatch
	c.wg.Add(2)
	go c.refreshLoop(refresh)
	go c.watchConnection(watchCtx)
	return c, nil
}

// Target is the sidecar's address as configured.
func (c *Rebound) Target() string { return c.target }

func truncateUTF8(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// Normalise gives the question the sidecar and the fallback both see: attempt within
// 1..2^32-1, a long job id replaced by its SHA-256, the error class cut to 253 bytes,
// a first failure before 2001 (likely seconds) dropped.
func Normalise(f Failure) *pb.DecideRequest {
	attempt := uint32(1)
	if f.Attempt > 1 {
		attempt = uint32(min(int64(f.Attempt), int64(^uint32(0))))
	}
	r := &pb.DecideRequest{Queue: f.Queue, Attempt: attempt}
	if f.JobID != "" {
		r.JobId = f.JobID
		if len(f.JobID) > maxJobIDBytes {
			sum := sha256.Sum256([]byte(f.JobID))
			r.JobId = hex.EncodeToString(sum[:])
		}
	}
	r.ErrorClass = truncateUTF8(strings.ToValidUTF8(f.ErrorClass, "\uFFFD"), maxErrorClassBytes)
	if !f.FirstFailure.IsZero() {
		if ms := f.FirstFailure.UnixMilli(); ms >= 1e12 {
			r.FirstFailureUnixMs = uint64(ms)
		}
	}
	if f.RetryAfter > 0 {
		r.RetryAfterMs = uint64((f.RetryAfter + time.Millisecond - 1) / time.Millisecond)
	}
	return r
}

// Decide asks the sidecar what to do after a failure; when it cannot answer (down,
// too slow, no policy for the queue) the answer comes from the fallback. It never fails.
func (c *Rebound) Decide(ctx context.Context, f Failure) Answer {
	req := Normalise(f)
	c.noteQueue(req.Queue)
	cctx, cancel := context.WithTimeout(ctx, c.deadline)
	res, err := c.rpc.Decide(cctx, req)
	cancel()
	var a Answer
	if err != nil {
		a = c.fallback(req, err)
	} else {
		a = Answer{
			Decision:        res.GetDecision(),
			Disposition:     res.GetDisposition(),
			DeadLetterQueue: res.GetDeadLetterQueue(),
			Reason:          res.GetReason(),
			ReasonMessage:   res.GetReasonMessage(),
			Policy:          res.GetPolicy(),
			Source:          SourceSidecar,
			PolicySource:    PolicySidecar,
			Revision:        res.GetRevision(),
		}
		if a.Retry() {
			a.Delay = millis(res.GetDelayMs())
			a.BudgetStretched, a.BudgetDelay = res.GetBudgetStretched(), millis(res.GetBudgetDelayMs())
		}
		c.mu.Lock()
		cached, ok := c.policies[req.Queue]
		c.mu.Unlock()
		if !ok || cached.ref.GetConfigHash() != a.Policy.GetConfigHash() {
			c.refreshAsync(req.Queue)
		}
	}
	c.count(a)
	return a
}

func millis(ms uint64) time.Duration {
	const maxMs = uint64(1<<63-1) / uint64(time.Millisecond)
	return time.Duration(min(ms, maxMs)) * time.Millisecond
}

func causeOf(err error) string {
	switch status.Code(err) {
	case codes.Unavailable:
		return "unavailable"
	case codes.DeadlineExceeded:
		return "deadline_exceeded"
	case codes.NotFound:
		return "not_found"
	default:
		return "other"
	}
}

// fallback is the local answer: the cached policy, else the default.
func (c *Rebound) fallback(req *pb.DecideRequest, err error) Answer {
	cause := causeOf(err)
	c.mu.Lock()
	if cause == "not_found" {
		delete(c.policies, req.Queue)
	}
	cached, ok := c.policies[req.Queue]
	fb := &c.metrics.Fallback
	fb.Total++
	switch cause {
	case "unavailable":
		fb.Unavailable++
	case "deadline_exceeded":
		fb.DeadlineExceeded++
	case "not_found":
		fb.NotFound++
	default:
		fb.Other++
	}
	if !ok {
		fb.DefaultPolicy++
		fb.FromDefault.add(cause)
	}
	logKey := req.Queue + "\x00" + cause
	shouldLog := time.Since(c.lastLog[logKey]) >= logEvery
	if shouldLog {
		c.lastLog[logKey] = time.Now()
	}
	c.mu.Unlock()

	now := uint64(time.Now().UnixMilli())
	first := min(req.FirstFailureUnixMs, now)
	prepared, ref, src, revision := c.def, &pb.PolicyRef{}, PolicyDefault, ""
	if ok {
		prepared, revision = cached.pick(req.JobId, first, now)
		ref, src = cached.ref, PolicyCached
	}
	if shouldLog {
		c.logger.Warn("sidecar did not answer; decided locally", "event", "rebound.fallback",
			"queue", req.Queue, "cause", cause, "code", status.Code(err).String(),
			"policySource", string(src), "target", c.target)
	}
	res, derr := prepared.Decide(uint64(req.Attempt), Context{
		JobID:              req.JobId,
		ErrorClass:         req.ErrorClass,
		FirstFailureUnixMs: first,
		NowUnixMs:          now,
		RetryAfterMs:       req.RetryAfterMs,
	})
	a := Answer{Policy: ref, Source: SourceFallback, PolicySource: src, Revision: revision}
	if derr != nil {
		c.HookError(req.Queue, req.JobId, "fallback", derr)
		a.Decision, a.Delay = pb.Decision_DECISION_RETRY, LastResortDelay
		return a
	}
	a.Decision, a.Disposition, a.DeadLetterQueue = res.Decision, res.Disposition, res.DeadLetterQueue
	a.Reason, a.ReasonMessage = res.Reason, res.ReasonMessage
	if a.Retry() {
		a.Delay = millis(res.DelayMs)
	}
	return a
}

func (c *Rebound) count(a Answer) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if a.Source == SourceSidecar {
		c.metrics.Sources.Sidecar++
	} else {
		c.metrics.Sources.Fallback++
	}
	d := &c.metrics.Decisions
	switch {
	case a.Retry():
		d.Retry++
	case a.Reason == pb.GiveUpReason_GIVE_UP_REASON_MAX_ATTEMPTS:
		d.GiveUpMaxAttempts++
	case a.Reason == pb.GiveUpReason_GIVE_UP_REASON_DEADLINE:
		d.GiveUpDeadline++
	case a.Reason == pb.GiveUpReason_GIVE_UP_REASON_NON_RETRYABLE:
		d.GiveUpNonRetryable++
	}
}

// CountDisposition counts a give-up carried out by an adapter (dead-lettered or dropped).
func (c *Rebound) CountDisposition(d pb.Disposition) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch d {
	case pb.Disposition_DISPOSITION_DEAD_LETTER:
		c.metrics.DeadLettered++
	case pb.Disposition_DISPOSITION_DROP:
		c.metrics.Dropped++
	}
}

// HookError records a problem an adapter absorbed instead of failing the library's hook.
func (c *Rebound) HookError(queue, jobID, where string, err error) {
	c.mu.Lock()
	c.metrics.HookErrors++
	c.mu.Unlock()
	c.logger.Error("hook problem absorbed", "event", "rebound.hook_error", "queue", queue,
		"jobId", jobID, "where", where, "error", err.Error())
}

// Metrics returns a copy of the counters.
func (c *Rebound) Metrics() Metrics {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.metrics
}

func (c *Rebound) noteQueue(queue string) {
	c.mu.Lock()
	seen := c.queues[queue]
	c.queues[queue] = true
	c.mu.Unlock()
	if !seen {
		c.refreshAsync(queue)
	}
}

// refreshAll refetches the policy of every queue asked about so far, in the background.
func (c *Rebound) refreshAll() {
	c.mu.Lock()
	qs := make([]string, 0, len(c.queues))
	for q := range c.queues {
		qs = append(qs, q)
	}
	c.mu.Unlock()
	for _, q := range qs {
		c.refreshAsync(q)
	}
}

func (c *Rebound) refreshAsync(queue string) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	if _, busy := c.inflight[queue]; busy {
		c.mu.Unlock()
		return
	}
	done := make(chan struct{})
	c.inflight[queue] = done
	c.wg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.wg.Done()
		c.refresh(queue)
		c.mu.Lock()
		delete(c.inflight, queue)
		c.mu.Unlock()
		close(done)
	}()
}

// refresh fetches a queue's policy with GetPolicy into the cache; a NOT_FOUND empties it.
func (c *Rebound) refresh(queue string) { _ = c.fetch(context.Background(), queue) }

func (c *Rebound) fetch(ctx context.Context, queue string) error {
	ctx, cancel := context.WithTimeout(ctx, c.deadline)
	defer cancel()
	res, err := c.rpc.GetPolicy(ctx, &pb.GetPolicyRequest{Queue: queue})
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		if status.Code(err) == codes.NotFound {
			delete(c.policies, queue)
		}
		return err
	}
	ref := res.GetPolicy()
	if old, ok := c.policies[queue]; ok && old.ref.GetConfigHash() == ref.GetConfigHash() && old.ref.GetName() == ref.GetName() {
		return nil
	}
	identity := ref.GetNamespace() + "/" + ref.GetName()
	c.policies[queue] = cachedPolicy{
		ref:      ref,
		prepared: PreparePolicy(res.GetResolved(), identity),
		rollout:  prepareRollout(res.GetRollout(), identity),
	}
	c.logger.Info("fallback policy cached", "event", "rebound.policy", "queue", queue,
		"policy", ref.GetName(), "namespace", ref.GetNamespace(), "configHash", ref.GetConfigHash())
	return nil
}

func (c *Rebound) refreshLoop(every time.Duration) {
	defer c.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
			c.refreshAll()
		}
	}
}

// Warm fetches a queue's policy now (the first time the queue is seen it is fetched in
// the background anyway), so a fallback right after start has the queue's policy.
func (c *Rebound) Warm(queue string) {
	c.noteQueue(queue)
	c.mu.Lock()
	done := c.inflight[queue]
	c.mu.Unlock()
	if done != nil {
		<-done
	}
}

// Policy is the cached policy of a queue (fetched first if not cached); nil if none.
func (c *Rebound) Policy(queue string) (*pb.PolicyRef, *pb.ResolvedPolicy) {
	c.mu.Lock()
	c.queues[queue] = true
	cached, ok := c.policies[queue]
	c.mu.Unlock()
	if !ok {
		c.refreshAsync(queue)
		c.Warm(queue)
		c.mu.Lock()
		cached, ok = c.policies[queue]
		c.mu.Unlock()
	}
	if !ok {
		return nil, nil
	}
	return cached.ref, cached.prepared.Params()
}

// Close stops the background refresh and closes the connection.
func (c *Rebound) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	close(c.stop)
	c.stopWatch()
	c.wg.Wait()
	return c.conn.Close()
}

// Prefetch fetches the policies of the queues a worker consumes (GetPolicy), in parallel,
// and waits for the answers (each within Options.Deadline): call it when the worker starts,
// before any job runs, so that every decision during a later outage comes from the
// namespace's real policy (policySource "cached"). If the sidecar cannot be reached it logs
// one warning naming the target (event "rebound.prefetch"); the queues are fetched again
// as soon as the connection is back, and meanwhile answered with the default policy.
func (c *Rebound) Prefetch(ctx context.Context, queues ...string) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed []string
	var cause codes.Code
	for _, q := range queues {
		c.mu.Lock()
		c.queues[q] = true
		c.mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.fetch(ctx, q); err != nil && status.Code(err) != codes.NotFound {
				mu.Lock()
				failed, cause = append(failed, q), status.Code(err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(failed) > 0 {
		c.logger.Warn("sidecar not reachable at start; deciding with the default policy until it is",
			"event", "rebound.prefetch", "target", c.target, "queues", failed, "code", cause.String(),
			"policySource", string(PolicyDefault))
	}
}

// Cached is the cached policy of a queue, without fetching it; nil if none.
func (c *Rebound) Cached(queue string) (*pb.PolicyRef, *pb.ResolvedPolicy) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p, ok := c.policies[queue]; ok {
		return p.ref, p.prepared.Params()
	}
	return nil, nil
}

// Logger is the logger the client writes to (Options.Logger).
func (c *Rebound) Logger() *slog.Logger { return c.logger }

// watchConnection fetches every known queue's policy again each time the connection
// becomes ready (the sidecar came up after the worker, or came back after an outage).
func (c *Rebound) watchConnection(ctx context.Context) {
	defer c.wg.Done()
	state := c.conn.GetState()
	for {
		if !c.conn.WaitForStateChange(ctx, state) {
			return
		}
		prev := state
		state = c.conn.GetState()
		if state == connectivity.Ready && prev != connectivity.Ready {
			c.refreshAll()
		}
	}
}
