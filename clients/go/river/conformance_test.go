package reboundriver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	rebound "github.com/rebound-dev/rebound/clients/go"
	"github.com/rebound-dev/rebound/clients/go/internal/devstack"
	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
	reboundriver "github.com/rebound-dev/rebound/clients/go/river"
)

// The conformance scenarios of clients/conformance/scenarios.json, each run against real
// River clients, PostgreSQL and rebound-sidecars serving clients/conformance/policies.yaml.
// A scenario is a subtest of TestConformance named by its id
// (go test -run 'TestConformance/worker-sigkill' ./river).
var conformance = map[string]func(*testing.T){
	"retry-then-succeed":                    scenarioRetryThenSucceed,
	"exhausted-dead-letter":                 scenarioExhaustedDeadLetter,
	"exhausted-drop-keeps-job":              scenarioExhaustedDropKeepsJob,
	"non-retryable-error":                   scenarioNonRetryableError,
	"replayed-dead-letter":                  scenarioReplayedDeadLetter,
	"default-policy-keeps-job":              scenarioDefaultPolicyKeepsJob,
	"outage-every-process-uses-real-policy": scenarioOutageUsesRealPolicy,
	"sidecar-down-at-start":                 scenarioSidecarDownAtStart,
	"malformed-target-refused":              scenarioMalformedTargetRefused,
	"adapter-error-never-hands-to-library":  scenarioAdapterErrorNeverHandsToLibrary,
	"sidecar-restart-reconnects":            scenarioSidecarRestartReconnects,
	"worker-sigkill":                        scenarioWorkerSigkill,
	"broker-restart":                        scenarioBrokerRestart,
}

type scenario struct {
	ID     string         `json:"id"`
	Policy string         `json:"policy"`
	Expect map[string]any `json:"expect"`
}

func scenarios(t *testing.T) []scenario {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(devstack.RepoRoot(), "clients", "conformance", "scenarios.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Scenarios []scenario `json:"scenarios"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Scenarios) == 0 {
		t.Fatal("scenarios.json lists no scenario")
	}
	return doc.Scenarios
}

// Every scenario of scenarios.json has a Go test, and every Go test a scenario.
func TestConformanceEveryScenarioHasAGoTest(t *testing.T) {
	ids := []string{}
	for _, s := range scenarios(t) {
		ids = append(ids, s.ID)
	}
	checkCoverage(t, "scenarios.json", ids, conformance)
}

// checkCoverage fails t when a listed id of file has no test in tests, or a test no id.
func checkCoverage(t *testing.T, file string, ids []string, tests map[string]func(*testing.T)) {
	t.Helper()
	listed := map[string]bool{}
	for _, id := range ids {
		listed[id] = true
		if tests[id] == nil {
			t.Errorf("scenario %q (clients/conformance/%s) has no Go test", id, file)
		}
	}
	for id := range tests {
		if !listed[id] {
			t.Errorf("Go test %q is not a scenario of %s", id, file)
		}
	}
}

func TestConformance(t *testing.T) {
	for _, s := range scenarios(t) {
		if fn := conformance[s.ID]; fn != nil {
			t.Run(s.ID, fn)
		}
	}
}

// --- helpers -------------------------------------------------------------------------

// RecArgs: a job recording each of its runs under Tag; it fails its first FailRuns runs
// (every run when negative) with an error of class Class, the first run after SleepMs.
type RecArgs struct {
	Tag      string `json:"tag"`
	FailRuns int    `json:"fail_runs"`
	Class    string `json:"class,omitempty"`
	SleepMs  int    `json:"sleep_ms,omitempty"`
}

func (RecArgs) Kind() string { return "rebound_test_rec" }

type recRun struct {
	jobID   int64
	attempt int
	at      time.Time
}

var recorded = struct {
	sync.Mutex
	runs map[string][]recRun
}{runs: map[string][]recRun{}}

func runsOf(tag string) []recRun {
	recorded.Lock()
	defer recorded.Unlock()
	return append([]recRun(nil), recorded.runs[tag]...)
}

// PermanentError is the class the conformance policies list as non-retryable.
type PermanentError struct{ msg string }

func (e *PermanentError) Error() string      { return e.msg }
func (e *PermanentError) ErrorClass() string { return "PermanentError" }

type recWorker struct {
	river.WorkerDefaults[RecArgs]
}

func (recWorker) Work(ctx context.Context, job *river.Job[RecArgs]) error {
	recorded.Lock()
	recorded.runs[job.Args.Tag] = append(recorded.runs[job.Args.Tag], recRun{jobID: job.ID, attempt: job.Attempt, at: time.Now()})
	recorded.Unlock()
	if job.Attempt == 1 && job.Args.SleepMs > 0 {
		select {
		case <-time.After(time.Duration(job.Args.SleepMs) * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if job.Args.FailRuns < 0 || job.Attempt <= job.Args.FailRuns {
		if job.Args.Class == "PermanentError" {
			return &PermanentError{msg: fmt.Sprintf("run %d failed for good", job.Attempt)}
		}
		return fmt.Errorf("run %d failed", job.Attempt)
	}
	return nil
}

func tag(t *testing.T) string { return fmt.Sprintf("%s-%d", t.Name(), time.Now().UnixNano()) }

// logBuffer collects a JSON slog handler's lines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// events are the parsed lines whose "event" is event (all when empty).
func (l *logBuffer) events(t *testing.T, event string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	raw := append([]byte(nil), l.buf.Bytes()...)
	l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if event == "" || m["event"] == event {
			out = append(out, m)
		}
	}
	return out
}

// decisions are the adapter's decision lines about job id.
func (l *logBuffer) decisions(t *testing.T, id int64) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, d := range l.events(t, "rebound.decision") {
		if d["jobId"] == strconv.FormatInt(id, 10) {
			out = append(out, d)
		}
	}
	return out
}

// loggedRebound is a Rebound on target whose JSON log (debug level) the test reads.
func loggedRebound(t *testing.T, target string) (*rebound.Rebound, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	rb, err := rebound.New(rebound.Options{Target: target, Deadline: 2 * time.Second,
		Logger: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rb.Close() })
	return rb, logs
}

// ownConfSidecar is a sidecar of its own serving the conformance policies (killed at the end).
func ownConfSidecar(t *testing.T) *devstack.Sidecar {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(devstack.RepoRoot(), "clients", "conformance", "policies.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := devstack.NewFileSidecar(filepath.Join(runDir, "sidecar-"+filepath.Base(t.Name())), "conformance", string(raw), "fixed-3")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return s
}

func num(v any) int64 {
	f, _ := v.(float64)
	return int64(f)
}

// checkRuns: the job ran exactly `runs` times, every run with the job's own ID.
func checkRuns(t *testing.T, tag string, id int64, runs int) []recRun {
	t.Helper()
	got := runsOf(tag)
	if len(got) != runs {
		t.Fatalf("job %d ran %d times, want %d: %+v", id, len(got), runs, got)
	}
	for i, r := range got {
		if r.jobID != id || r.attempt != i+1 {
			t.Fatalf("run %d: job %d attempt %d, want job %d attempt %d", i+1, r.jobID, r.attempt, id, i+1)
		}
	}
	return got
}

// --- scenarios -----------------------------------------------------------------------

func scenarioRetryThenSucceed(t *testing.T) {
	rb, logs := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3")
	tg := tag(t)
	id := insert(t, c, "fixed-3", RecArgs{Tag: tg, FailRuns: 2})
	job := waitFinal(t, c, id, 30*time.Second)
	if job.State != rivertype.JobStateCompleted || giveUpOf(t, job) != nil {
		t.Fatalf("state %s metadata %s", job.State, job.Metadata)
	}
	runs := checkRuns(t, tg, id, 3)
	ds := logs.decisions(t, id)
	if len(ds) != 2 {
		t.Fatalf("decisions %v", ds)
	}
	_, policy := rb.Cached("fixed-3")
	for i, d := range ds {
		delay := time.Duration(num(d["delayMs"])) * time.Millisecond
		if d["decision"] != "DECISION_RETRY" || d["source"] != "sidecar" || d["policySource"] != "sidecar" ||
			delay > time.Duration(policy.GetCapMs())*time.Millisecond || delay > 200*time.Millisecond {
			t.Fatalf("decision %d: %v", i+1, d)
		}
		if gap := runs[i+1].at.Sub(runs[i].at); gap < delay || gap > delay+10*time.Second {
			t.Fatalf("gap before run %d: %s, decided %s", i+2, gap, delay)
		}
	}
}

// exhausted checks a job given up after `runs` runs: discarded, with its record.
func exhausted(t *testing.T, c *river.Client[pgx5Tx], tg string, id int64, runs int, disposition string) *reboundriver.GiveUp {
	t.Helper()
	job := waitFinal(t, c, id, 30*time.Second)
	checkRuns(t, tg, id, runs)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != runs || len(job.Errors) != runs || g == nil ||
		g.Disposition != disposition || g.Attempt != runs {
		t.Fatalf("state %s attempt %d errors %d give-up %+v", job.State, job.Attempt, len(job.Errors), g)
	}
	return g
}

func checkDeadLetter(t *testing.T, id int64, reason string, attempts int, args RecArgs) deadLetter {
	t.Helper()
	dls := deadLettersOf(t, "", id)
	if len(dls) != 1 {
		t.Fatalf("dead letters of job %d: %+v, want 1", id, dls)
	}
	dl := dls[0]
	var got RecArgs
	if err := json.Unmarshal(dl.Args, &got); err != nil || got != args {
		t.Fatalf("dead letter args %s, want %+v (%v)", dl.Args, args, err)
	}
	var queue string
	if err := pool.QueryRow(context.Background(), "SELECT queue FROM river_job WHERE id = $1", dl.id).Scan(&queue); err != nil {
		t.Fatal(err)
	}
	if queue != "fixed-3-dead" || dl.JobID != id || dl.Queue != "fixed-3-dlq" || dl.Reason != reason ||
		dl.Attempts != attempts || dl.JobKind != "rebound_test_rec" {
		t.Fatalf("dead letter in %s: %+v", queue, dl)
	}
	return dl
}

func scenarioExhaustedDeadLetter(t *testing.T) {
	rb, _ := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-dlq")
	tg := tag(t)
	args := RecArgs{Tag: tg, FailRuns: -1}
	id := insert(t, c, "fixed-3-dlq", args)
	g := exhausted(t, c, tg, id, 3, reboundriver.DispositionDeadLetter)
	dl := checkDeadLetter(t, id, "GIVE_UP_REASON_MAX_ATTEMPTS", 3, args)
	if g.DeadLetterJobID != dl.id || g.DeadLetterQueue != "fixed-3-dead" {
		t.Fatalf("record %+v, dead letter %d", g, dl.id)
	}
}

func scenarioExhaustedDropKeepsJob(t *testing.T) {
	rb, _ := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-drop")
	tg := tag(t)
	id := insert(t, c, "fixed-3-drop", RecArgs{Tag: tg, FailRuns: -1})
	exhausted(t, c, tg, id, 3, reboundriver.DispositionDrop)
	if dls := deadLettersOf(t, "", id); len(dls) != 0 {
		t.Fatalf("a drop made dead letters: %+v", dls)
	}
}

// The reason is the proto's enum name, GIVE_UP_REASON_NON_RETRYABLE.
func scenarioNonRetryableError(t *testing.T) {
	rb, _ := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-dlq")
	tg := tag(t)
	args := RecArgs{Tag: tg, FailRuns: -1, Class: "PermanentError"}
	id := insert(t, c, "fixed-3-dlq", args)
	g := exhausted(t, c, tg, id, 1, reboundriver.DispositionDeadLetter)
	reason := pb.GiveUpReason_GIVE_UP_REASON_NON_RETRYABLE.String()
	if g.Reason != reason || g.ErrorClass != "PermanentError" {
		t.Fatalf("record %+v", g)
	}
	checkDeadLetter(t, id, reason, 1, args)
}

func scenarioReplayedDeadLetter(t *testing.T) {
	rb, _ := loggedRebound(t, confSidecar.Target)
	c := startRiver(t, rb, "fixed-3-dlq")
	tg := tag(t)
	args := RecArgs{Tag: tg, FailRuns: 3}
	id := insert(t, c, "fixed-3-dlq", args)
	exhausted(t, c, tg, id, 3, reboundriver.DispositionDeadLetter)
	dl := checkDeadLetter(t, id, "GIVE_UP_REASON_MAX_ATTEMPTS", 3, args)
	// The README's command.
	job, err := reboundriver.Replay(context.Background(), c, dl.id)
	if err != nil {
		t.Fatal(err)
	}
	if job.ID != id {
		t.Fatalf("replay made job %d, the dead letter's is %d", job.ID, id)
	}
	job = waitFinal(t, c, id, 30*time.Second)
	runs := checkRuns(t, tg, id, 4) // one run after the replay
	if job.State != rivertype.JobStateCompleted || runs[3].jobID != id {
		t.Fatalf("replayed: state %s attempt %d", job.State, job.Attempt)
	}
	if left := deadLettersOf(t, "", id); len(left) != 0 {
		t.Fatalf("dead letters left after the replay: %+v", left)
	}
}

// No sidecar ever reachable, a job's 10th run fails: the default policy gives up with
// drop, and the job stays in River's discarded state.
func scenarioDefaultPolicyKeepsJob(t *testing.T) {
	port, err := devstack.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	rb, logs := loggedRebound(t, fmt.Sprintf("127.0.0.1:%d", port))
	c := startRiver(t, rb, "no-policy")
	tg := tag(t)
	ctx := context.Background()
	res, err := c.Insert(ctx, RecArgs{Tag: tg, FailRuns: -1}, &river.InsertOpts{Queue: "no-policy", ScheduledAt: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Job.ID
	// Nine runs already made (the default policy's delays would take minutes): the next is the 10th.
	if _, err := pool.Exec(ctx, "UPDATE river_job SET attempt = 9, state = 'available', scheduled_at = now() WHERE id = $1", id); err != nil {
		t.Fatal(err)
	}
	job := waitFinal(t, c, id, 30*time.Second)
	g := giveUpOf(t, job)
	if job.State != rivertype.JobStateDiscarded || job.Attempt != 10 || g == nil || g.Disposition != reboundriver.DispositionDrop ||
		g.Source != "fallback" || g.PolicySource != "default" || g.Reason != "GIVE_UP_REASON_MAX_ATTEMPTS" {
		t.Fatalf("state %s attempt %d give-up %+v", job.State, job.Attempt, g)
	}
	ds := logs.decisions(t, id)
	if len(ds) != 1 || ds[0]["decision"] != "DECISION_GIVE_UP" || ds[0]["disposition"] != "DISPOSITION_DROP" ||
		ds[0]["source"] != "fallback" || ds[0]["policySource"] != "default" {
		t.Fatalf("decisions %v", ds)
	}
	if w := logs.events(t, "rebound.prefetch"); len(w) != 1 || w[0]["target"] != rb.Target() {
		t.Fatalf("prefetch warnings %v", w)
	}
}

// The sidecar is killed after the worker started (Configure prefetched the policies) and
// before any job failed. Every River client of the process decides from the cached policy,
// including one started after the kill: the sidecar's delays exactly, 3 runs, a dead letter.
// (A Go worker is one process: its clients and goroutines share the Rebound and its cache.)
func scenarioOutageUsesRealPolicy(t *testing.T) {
	s := ownConfSidecar(t)
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	rb, logs := loggedRebound(t, s.Target)
	first := startRiver(t, rb, "fixed-3-dlq")
	s.Kill()
	second := startRiver(t, rb, "fixed-3-dlq") // started after the kill
	tg := tag(t)
	var ids []int64
	for i := range 4 {
		c := first
		if i%2 == 1 {
			c = second
		}
		ids = append(ids, insert(t, c, "fixed-3-dlq", RecArgs{Tag: fmt.Sprintf("%s-%d", tg, i), FailRuns: -1}))
	}
	for i, id := range ids {
		job := waitFinal(t, first, id, 30*time.Second)
		checkRuns(t, fmt.Sprintf("%s-%d", tg, i), id, 3)
		if g := giveUpOf(t, job); job.State != rivertype.JobStateDiscarded || g == nil || g.Source != "fallback" ||
			g.PolicySource != "cached" || g.Policy != "conformance/fixed-3-dlq" {
			t.Fatalf("job %d: state %s give-up %+v", id, job.State, g)
		}
		if dls := deadLettersOf(t, "fixed-3-dead", id); len(dls) != 1 {
			t.Fatalf("job %d: dead letters %+v", id, dls)
		}
	}
	// The sidecar back: it answers every question exactly as the fallback did.
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	check := newRebound(t, s.Target)
	for _, id := range ids {
		ds := logs.decisions(t, id)
		if len(ds) != 3 {
			t.Fatalf("job %d: decisions %v", id, ds)
		}
		for _, d := range ds {
			if d["source"] != "fallback" || d["policySource"] != "cached" {
				t.Fatalf("job %d: %v", id, d)
			}
			a := check.Decide(context.Background(), rebound.Failure{Queue: "fixed-3-dlq", Attempt: int(num(d["attempt"])), JobID: strconv.FormatInt(id, 10)})
			if a.Source != rebound.SourceSidecar || a.Decision.String() != d["decision"] || a.Delay.Milliseconds() != num(d["delayMs"]) {
				t.Fatalf("job %d attempt %v: fallback said %v / %vms, the sidecar %s / %s", id, d["attempt"], d["decision"], d["delayMs"], a.Decision, a.Delay)
			}
		}
	}
}

// The sidecar starts only after the worker: the worker starts, logs one warning naming the
// target, decides with the default policy meanwhile, and is on the sidecar (policies
// prefetched) soon after it is up.
func scenarioSidecarDownAtStart(t *testing.T) {
	s := ownConfSidecar(t)
	rb, logs := loggedRebound(t, s.Target)
	c := startRiver(t, rb, "fixed-3") // Start returned: the worker runs
	w := logs.events(t, "rebound.prefetch")
	if len(w) != 1 || w[0]["target"] != s.Target || w[0]["level"] != "WARN" {
		t.Fatalf("prefetch warnings %v", w)
	}
	tg := tag(t)
	early := insert(t, c, "fixed-3", RecArgs{Tag: tg + "-early", FailRuns: 1})
	eventually(t, 30*time.Second, "the first decision", func() bool { return len(logs.decisions(t, early)) > 0 })
	if d := logs.decisions(t, early)[0]; d["source"] != "fallback" || d["policySource"] != "default" || d["decision"] != "DECISION_RETRY" {
		t.Fatalf("decision before the sidecar: %v", d)
	}
	spawned := time.Now()
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	up := time.Now()
	for {
		if ref, _ := rb.Cached("fixed-3"); ref != nil {
			break
		}
		if time.Since(up) > 5*time.Second {
			t.Fatalf("policy of fixed-3 not fetched %s after the sidecar was up", time.Since(up))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("on the sidecar %s after it was ready (%s after it was spawned; the contract's bound is 2000ms)",
		time.Since(up).Round(time.Millisecond), time.Since(spawned).Round(time.Millisecond))
	id := insert(t, c, "fixed-3", RecArgs{Tag: tg, FailRuns: 1})
	if job := waitFinal(t, c, id, 30*time.Second); job.State != rivertype.JobStateCompleted {
		t.Fatalf("state %s", job.State)
	}
	if ds := logs.decisions(t, id); len(ds) != 1 || ds[0]["source"] != "sidecar" || ds[0]["policySource"] != "sidecar" {
		t.Fatalf("decisions %v", ds)
	}
	if job := waitFinal(t, c, early, 30*time.Second); job.State != rivertype.JobStateCompleted || job.Attempt != 2 {
		t.Fatalf("early job: state %s attempt %d", job.State, job.Attempt)
	}
}

// REBOUND_TARGET=http://127.0.0.1:1: the worker process refuses to start, naming
// REBOUND_TARGET, and a job waiting in its queue never runs.
func scenarioMalformedTargetRefused(t *testing.T) {
	t.Setenv(runsDirEnv, t.TempDir())
	inserter := inserter(t)
	ctx := context.Background()
	res, err := inserter.Insert(ctx, SleepArgs{}, &river.InsertOpts{Queue: "refused"})
	if err != nil {
		t.Fatal(err)
	}
	worker := startWorkerProcessEnv(t, "refused", "REBOUND_TARGET=http://127.0.0.1:1")
	err = worker.Wait()
	var exit interface{ ExitCode() int }
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("worker process: %v, want exit code 2", err)
	}
	raw, err := os.ReadFile(filepath.Join(runDir, "worker-refused.log"))
	if err != nil {
		t.Fatal(err)
	}
	var refused map[string]any
	for _, l := range bytes.Split(bytes.TrimSpace(raw), []byte("\n")) {
		var m map[string]any
		if json.Unmarshal(l, &m) == nil && m["event"] == "worker.refused" {
			refused = m
		}
	}
	if refused == nil || refused["setting"] != "REBOUND_TARGET" || refused["target"] != "http://127.0.0.1:1" {
		t.Fatalf("worker log:\n%s", raw)
	}
	job, err := inserter.JobGet(ctx, res.Job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if job.State != rivertype.JobStateAvailable || job.Attempt != 0 {
		t.Fatalf("job %s at attempt %d", job.State, job.Attempt)
	}
	if _, err := os.Stat(runMark(job.ID, 1)); !os.IsNotExist(err) {
		t.Fatalf("the job ran: %v", err)
	}
	if _, err := inserter.JobDelete(ctx, job.ID); err != nil {
		t.Fatal(err)
	}
}

// erringAdvisor serves GetPolicy from a real sidecar's answers and answers every Decide
// with an error.
type erringAdvisor struct {
	pb.UnimplementedRetryAdvisorServer
	policies map[string]*pb.GetPolicyResponse
}

func (e *erringAdvisor) GetPolicy(_ context.Context, r *pb.GetPolicyRequest) (*pb.GetPolicyResponse, error) {
	if p := e.policies[r.GetQueue()]; p != nil {
		return p, nil
	}
	return nil, status.Error(codes.NotFound, "no policy")
}

func (e *erringAdvisor) Decide(context.Context, *pb.DecideRequest) (*pb.DecideResponse, error) {
	return nil, status.Error(codes.Internal, "the advisor failed")
}

// A sidecar answering errors on the retry path and an adapter hook (ErrorClass) that
// panics: the fallback decides every run from the policy (3 runs and a dead letter, never
// River's own 25 attempts), the hook problems are counted, nothing panics out to River.
func scenarioAdapterErrorNeverHandsToLibrary(t *testing.T) {
	real := newRebound(t, confSidecar.Target)
	ref, resolved := real.Policy("fixed-3-dlq")
	if ref == nil {
		t.Fatal("no policy for fixed-3-dlq")
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterRetryAdvisorServer(srv, &erringAdvisor{policies: map[string]*pb.GetPolicyResponse{
		"fixed-3-dlq": {Policy: ref, Resolved: resolved}}})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	rb, logs := loggedRebound(t, lis.Addr().String())
	handler := &panicRecorder{}
	workers := river.NewWorkers()
	river.AddWorker(workers, recWorker{})
	cfg := &river.Config{
		Queues:            map[string]river.QueueConfig{"fixed-3-dlq": {MaxWorkers: 2}},
		Workers:           workers,
		Logger:            quiet(),
		FetchCooldown:     20 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
		ErrorHandler:      handler,
	}
	c := startClient(t, context.Background(), pool, cfg, reboundriver.New(rb, reboundriver.Options{
		ErrorClass: func(error) string { panic("a bug in the error classifier") },
	}))
	tg := tag(t)
	args := RecArgs{Tag: tg, FailRuns: -1}
	id := insert(t, c, "fixed-3-dlq", args)
	g := exhausted(t, c, tg, id, 3, reboundriver.DispositionDeadLetter)
	if g.Source != "fallback" || g.PolicySource != "cached" {
		t.Fatalf("record %+v", g)
	}
	checkDeadLetter(t, id, "GIVE_UP_REASON_MAX_ATTEMPTS", 3, args)
	for _, d := range logs.decisions(t, id) {
		if d["source"] != "fallback" || d["policySource"] != "cached" {
			t.Fatalf("decision %v", d)
		}
	}
	if m := rb.Metrics(); m.HookErrors < 3 || m.Fallback.Other != 3 {
		t.Fatalf("metrics %+v", m)
	}
	if n := len(handler.all()); n != 0 {
		t.Fatalf("%d panics reached River", n)
	}
}

// The sidecar SIGKILLed and restarted on the same address while jobs fail: every job ends
// after exactly its policy's runs (none lost), and the worker is back on the sidecar soon
// after it is up.
func scenarioSidecarRestartReconnects(t *testing.T) {
	s := ownConfSidecar(t)
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	rb, logs := loggedRebound(t, s.Target)
	c := startRiver(t, rb, "fixed-3")
	tg := tag(t)
	var ids []int64
	stop := make(chan struct{})
	done := make(chan struct{})
	var mu sync.Mutex
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			res, err := c.Insert(context.Background(), RecArgs{Tag: fmt.Sprintf("%s-%d", tg, i), FailRuns: -1}, &river.InsertOpts{Queue: "fixed-3"})
			if err == nil {
				mu.Lock()
				ids = append(ids, res.Job.ID)
				mu.Unlock()
			}
		}
	}()
	time.Sleep(time.Second)
	s.Kill()
	time.Sleep(1500 * time.Millisecond)
	if err := s.Start(); err != nil {
		close(stop)
		t.Fatal(err)
	}
	up := time.Now()
	time.Sleep(2500 * time.Millisecond)
	close(stop)
	<-done
	mu.Lock()
	defer mu.Unlock()
	var fallbacks int
	for i, id := range ids {
		job := waitFinal(t, c, id, 30*time.Second)
		checkRuns(t, fmt.Sprintf("%s-%d", tg, i), id, 3)
		if job.State != rivertype.JobStateDiscarded || job.Attempt != 3 {
			t.Fatalf("job %d: state %s attempt %d", id, job.State, job.Attempt)
		}
		for _, d := range logs.decisions(t, id) {
			if d["source"] == "fallback" {
				fallbacks++
			}
		}
	}
	if fallbacks == 0 {
		t.Fatalf("no decision during the outage was the fallback's (%d jobs)", len(ids))
	}
	var back time.Duration = -1
	for _, d := range logs.events(t, "rebound.decision") {
		at, err := time.Parse(time.RFC3339Nano, d["time"].(string))
		if err != nil {
			t.Fatal(err)
		}
		if at.After(up) && d["source"] == "sidecar" {
			back = at.Sub(up)
			break
		}
	}
	if back < 0 || back > 5*time.Second {
		t.Fatalf("first sidecar answer %s after the sidecar was up", back)
	}
	t.Logf("%d jobs, %d fallback decisions; first sidecar answer %s after the sidecar was up (the contract's bound is 2000ms)",
		len(ids), fallbacks, back.Round(time.Millisecond))
}

// A worker process SIGKILLed while its job runs: River's rescuer (in another client) puts
// the job back, it runs again with the same ID and completes; no more runs than the policy's.
func scenarioWorkerSigkill(t *testing.T) {
	t.Setenv(runsDirEnv, t.TempDir())
	rb, _ := loggedRebound(t, confSidecar.Target)
	worker := startWorkerProcessEnv(t, "fixed-3-dlq", "REBOUND_TARGET="+confSidecar.Target)
	inserter := inserter(t)
	ctx := context.Background()
	res, err := inserter.Insert(ctx, SleepArgs{}, &river.InsertOpts{Queue: "fixed-3-dlq"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Job.ID
	eventually(t, 30*time.Second, "the job running in the worker process", func() bool {
		_, err := os.Stat(runMark(id, 1))
		return err == nil
	})
	if err := worker.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = worker.Wait()
	time.Sleep(3500 * time.Millisecond) // stuck longer than RescueStuckJobsAfter (3s)
	c := startRiver(t, rb, "fixed-3-dlq")
	job := waitFinal(t, c, id, 60*time.Second)
	if job.State != rivertype.JobStateCompleted || job.Attempt != 2 || job.Attempt > 3 {
		t.Fatalf("state %s attempt %d errors %+v", job.State, job.Attempt, job.Errors)
	}
	if _, err := os.Stat(runMark(id, 2)); err != nil {
		t.Fatalf("run 2 of job %d not seen: %v", id, err)
	}
	if dls := deadLettersOf(t, "", id); len(dls) != 0 {
		t.Fatalf("dead letters %+v", dls)
	}
}

// PostgreSQL stopped (fast shutdown) and started again while jobs run and fail: every job
// ends (completed, or discarded with exactly one dead letter), none past maxAttempts.
func scenarioBrokerRestart(t *testing.T) {
	pg, err := devstack.StartPostgres(filepath.Join(runDir, "pg-restart"))
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
	rb, _ := loggedRebound(t, confSidecar.Target)
	workers := river.NewWorkers()
	river.AddWorker(workers, recWorker{})
	cfg := &river.Config{
		Queues:               map[string]river.QueueConfig{"fixed-3-dlq": {MaxWorkers: 10}},
		Workers:              workers,
		Logger:               quiet(),
		FetchCooldown:        20 * time.Millisecond,
		FetchPollInterval:    50 * time.Millisecond,
		RescueStuckJobsAfter: 5 * time.Second,
		JobTimeout:           4 * time.Second,
	}
	c := startClient(t, ctx, own, cfg, reboundriver.New(rb, reboundriver.Options{}))
	tg := tag(t)
	type queued struct {
		id   int64
		args RecArgs
	}
	var jobs []queued
	for i := range 8 {
		args := RecArgs{Tag: fmt.Sprintf("%s-%d", tg, i), FailRuns: 1, SleepMs: 1500}
		if i%2 == 1 {
			args.FailRuns = -1
		}
		res, err := c.Insert(ctx, args, &river.InsertOpts{Queue: "fixed-3-dlq"})
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, queued{res.Job.ID, args})
	}
	eventually(t, 30*time.Second, "every job's first run", func() bool {
		for _, j := range jobs {
			if len(runsOf(j.args.Tag)) == 0 {
				return false
			}
		}
		return true
	})
	if err := pg.Restart(time.Second); err != nil {
		t.Fatal(err)
	}
	for _, j := range jobs {
		var job *rivertype.JobRow
		eventually(t, 90*time.Second, fmt.Sprintf("job %d finalised", j.id), func() bool {
			row, err := c.JobGet(ctx, j.id)
			if err != nil {
				return false
			}
			job = row
			return finalised(row.State)
		})
		runs := len(runsOf(j.args.Tag))
		if job.Attempt > 3 || runs > 3 {
			t.Fatalf("job %d ran %d times (attempt %d), past maxAttempts 3", j.id, runs, job.Attempt)
		}
		var dls int
		if err := own.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE kind = 'rebound_dead_letter' AND (args->>'job_id')::bigint = $1", j.id).Scan(&dls); err != nil {
			t.Fatal(err)
		}
		switch {
		case j.args.FailRuns == 1 && job.State == rivertype.JobStateCompleted && dls == 0:
		case j.args.FailRuns < 0 && job.State == rivertype.JobStateDiscarded && dls == 1:
		default:
			t.Fatalf("job %d %+v: state %s attempt %d, %d dead letters, errors %+v", j.id, j.args, job.State, job.Attempt, dls, job.Errors)
		}
	}
}
