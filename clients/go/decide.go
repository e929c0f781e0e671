package rebound

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"

	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

// A port of the policy crate's decision function for the local fallback. It gives the
// sidecar's answers bit for bit: the algorithm is specified in policy/testdata/README.md
// and checked against decide-vectors.json. Each float64 operation is written on its own
// (explicit float64 conversions) so that no compiler fuses a multiply and an add.

const (
	goldenGamma = 0x9E3779B97F4A7C15
	fnvOffset   = 0xCBF29CE484222325
	fnvPrime    = 0x100000001B3
	// maxRetries is spec::limits::MAX_ATTEMPTS: retry numbers are clamped to it.
	maxRetries = 10000
	// minPushbackLimitMs: a pushback is honoured up to max(cap, 24h).
	minPushbackLimitMs = 86400000
)

var twoPowMinus53 = math.Ldexp(1, -53)

func fnv1a64(s string) uint64 {
	h := uint64(fnvOffset)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint64(s[i])) * fnvPrime
	}
	return h
}

func mix64(z uint64) uint64 {
	z += goldenGamma
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// draws is the random stream of one (job id, identity); without a job id it is random,
// as the sidecar's is.
type draws struct {
	seed   uint64
	seeded bool
}

func (d draws) unit(i uint64) float64 {
	if !d.seeded {
		return rand.Float64()
	}
	return float64(mix64(d.seed+i*goldenGamma)>>11) * twoPowMinus53
}

// fmin and fmax are Rust's f64::min / f64::max: a NaN operand is ignored.
func fmin(a, b float64) float64 {
	switch {
	case math.IsNaN(a):
		return b
	case math.IsNaN(b):
		return a
	case a < b:
		return a
	default:
		return b
	}
}

func fmax(a, b float64) float64 {
	switch {
	case math.IsNaN(a):
		return b
	case math.IsNaN(b):
		return a
	case a > b:
		return a
	default:
		return b
	}
}

// toU64 is Rust's `f64 as u64`: truncation, saturating; NaN and negatives give 0.
func toU64(x float64) uint64 {
	if !(x > 0) {
		return 0
	}
	if x >= 18446744073709551616.0 {
		return math.MaxUint64
	}
	return uint64(x)
}

func satSub(a, b uint64) uint64 {
	if a > b {
		return a - b
	}
	return 0
}

func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxUint64
}

// glob is a non-retryable pattern split once at its "*"s; it matches like
// policy/src/pattern.rs: the whole name, leftmost literal runs between the prefix and the
// suffix.
type glob struct {
	pattern string
	// parts are the literal runs between the "*"s; nil for a pattern without one.
	parts []string
}

func compileGlob(pattern string) glob {
	g := glob{pattern: pattern}
	if strings.Contains(pattern, "*") {
		g.parts = strings.Split(pattern, "*")
	}
	return g
}

func (g glob) matches(name string) bool {
	if g.parts == nil {
		return name == g.pattern
	}
	prefix, suffix := g.parts[0], g.parts[len(g.parts)-1]
	if len(name) < len(prefix)+len(suffix) || !strings.HasPrefix(name, prefix) || !strings.HasSuffix(name, suffix) {
		return false
	}
	pos, end := len(prefix), len(name)-len(suffix)
	for _, run := range g.parts[1 : len(g.parts)-1] {
		if run == "" {
			continue
		}
		at := strings.Index(name[pos:end], run)
		if at < 0 {
			return false
		}
		pos += at + len(run)
	}
	return true
}

type affine struct{ add, mul, cap float64 }

func after(o, n affine) affine {
	return affine{
		add: o.add + float64(o.mul*n.add),
		mul: o.mul * n.mul,
		cap: fmin(o.cap, o.add+float64(o.mul*n.cap)),
	}
}

func (m affine) apply(x float64) float64 { return fmin(m.add+float64(m.mul*x), m.cap) }

func decorrelated(base, cap float64, k uint64, d draws) float64 {
	step := func(i uint64) affine {
		u := d.unit(i)
		return affine{add: base * (1.0 - u), mul: 3.0 * u, cap: cap}
	}
	whole := k - k%4
	v := base
	for i := uint64(0); i < whole; i += 4 {
		first := after(step(i+2), step(i+1))
		second := after(step(i+4), step(i+3))
		v = after(second, first).apply(v)
	}
	for i := whole + 1; i <= k; i++ {
		v = step(i).apply(v)
	}
	return v
}

func exponential(base, multiplier float64, k uint64) float64 {
	p, sq, e := 1.0, multiplier, k-1
	for e > 0 {
		if e&1 == 1 {
			p = p * sq
		}
		e >>= 1
		if e > 0 {
			sq = sq * sq
		}
	}
	return base * p
}

// delay is the policy's delay for retry k, within remaining (when hasRemaining).
func delay(p *pb.ResolvedPolicy, k uint64, remaining uint64, hasRemaining bool, d draws) (uint64, error) {
	k = min(max(k, 1), maxRetries)
	base, cap := float64(p.GetBaseMs()), float64(p.GetCapMs())
	window := cap
	if hasRemaining {
		window = fmin(cap, float64(remaining))
	}
	var c float64
	switch p.GetStrategy() {
	case pb.Strategy_STRATEGY_EXPONENTIAL:
		c = fmin(exponential(base, p.GetMultiplier(), k), cap)
	case pb.Strategy_STRATEGY_LINEAR:
		c = fmin(base*float64(k), cap)
	case pb.Strategy_STRATEGY_CONSTANT:
		c = fmin(base, cap)
	case pb.Strategy_STRATEGY_SCHEDULE:
		s := p.GetScheduleMs()
		if len(s) == 0 {
			c = fmin(base, cap)
		} else {
			c = fmin(float64(s[min(k, uint64(len(s)))-1]), cap)
		}
	case pb.Strategy_STRATEGY_DECORRELATED:
		return toU64(fmin(decorrelated(base, cap, k, d), window)), nil
	default:
		return 0, fmt.Errorf("policy.strategy: unknown strategy %v", p.GetStrategy())
	}
	var j float64
	switch p.GetJitter() {
	case pb.Jitter_JITTER_NONE:
		return toU64(c), nil
	case pb.Jitter_JITTER_FULL:
		c = fmin(c, window)
		j = c * d.unit(k)
	case pb.Jitter_JITTER_EQUAL:
		c = fmin(c, window)
		j = c/2.0 + float64((c/2.0)*d.unit(k))
	case pb.Jitter_JITTER_PROPORTIONAL:
		c = fmin(c, window)
		r := p.GetJitterRatio()
		j = c * ((1.0 - r) + float64((2.0*r)*d.unit(k)))
	default:
		return 0, fmt.Errorf("policy.jitter: unknown jitter %v", p.GetJitter())
	}
	if math.IsNaN(j) {
		return 0, nil
	}
	return toU64(math.Min(math.Max(j, 0.0), window)), nil
}

// formatMillis is the policy crate's format_millis: "1h2m3s4ms", exact.
func formatMillis(ms uint64) string {
	if ms == 0 {
		return "0s"
	}
	var b strings.Builder
	for _, u := range []struct {
		name string
		size uint64
	}{{"h", 3600000}, {"m", 60000}, {"s", 1000}, {"ms", 1}} {
		if n := ms / u.size; n > 0 {
			b.WriteString(strconv.FormatUint(n, 10) + u.name)
			ms -= n * u.size
		}
	}
	return b.String()
}

// Context is what a decision may depend on besides the attempt; zero values mean "not given".
type Context struct {
	JobID              string
	ErrorClass         string
	FirstFailureUnixMs uint64
	NowUnixMs          uint64
	RetryAfterMs       uint64
}

// PreparedPolicy is a resolved policy ready for repeated decisions: the identity hash that
// seeds the jitter and the non-retryable patterns are computed once, when the policy is
// loaded, not on every decision.
type PreparedPolicy struct {
	params       *pb.ResolvedPolicy
	identity     string
	identitySeed uint64
	globs        []glob
}

// PreparePolicy prepares policy p under its identity "namespace/name". p is kept, not
// copied: do not change it afterwards.
func PreparePolicy(p *pb.ResolvedPolicy, identity string) *PreparedPolicy {
	globs := make([]glob, 0, len(p.GetNonRetryableErrors()))
	for _, pattern := range p.GetNonRetryableErrors() {
		globs = append(globs, compileGlob(pattern))
	}
	return &PreparedPolicy{params: p, identity: identity, identitySeed: fnv1a64(identity), globs: globs}
}

// Identity is the "namespace/name" the policy was prepared under.
func (pp *PreparedPolicy) Identity() string { return pp.identity }

// Params is the resolved policy.
func (pp *PreparedPolicy) Params() *pb.ResolvedPolicy { return pp.params }

// DecideLocal answers like the sidecar for policy p (identity "namespace/name" seeds the
// jitter) after run attempt (1-based; 0 reads as 1) failed: the one-shot form of
// [PreparedPolicy.Decide]. An error only for an unknown strategy or jitter.
func DecideLocal(p *pb.ResolvedPolicy, identity string, attempt uint64, c Context) (*pb.DecideResponse, error) {
	return PreparePolicy(p, identity).Decide(attempt, c)
}

// Decide answers like the sidecar after run attempt (1-based; 0 reads as 1) failed. An
// error only for an unknown strategy or jitter.
func (pp *PreparedPolicy) Decide(attempt uint64, c Context) (*pb.DecideResponse, error) {
	p := pp.params
	k := max(attempt, 1)
	giveUp := func(reason pb.GiveUpReason, message string) *pb.DecideResponse {
		r := &pb.DecideResponse{
			Decision:      pb.Decision_DECISION_GIVE_UP,
			Disposition:   p.GetTerminal(),
			Reason:        reason,
			ReasonMessage: message,
		}
		if p.GetTerminal() == pb.Disposition_DISPOSITION_DEAD_LETTER {
			r.DeadLetterQueue = p.GetDeadLetterQueue()
		}
		return r
	}
	if c.ErrorClass != "" {
		for _, g := range pp.globs {
			if g.matches(c.ErrorClass) {
				return giveUp(pb.GiveUpReason_GIVE_UP_REASON_NON_RETRYABLE,
					fmt.Sprintf("error class %s is non-retryable (matches %s)", jsonQuote(c.ErrorClass), jsonQuote(g.pattern))), nil
			}
		}
	}
	maxAttempts := uint64(p.GetMaxAttempts())
	if k >= maxAttempts {
		msg := fmt.Sprintf("attempt %d of %d failed (maxAttempts)", k, maxAttempts)
		if k > maxAttempts {
			msg = fmt.Sprintf("attempt %d failed, past maxAttempts %d (runs including the first)", k, maxAttempts)
		}
		return giveUp(pb.GiveUpReason_GIVE_UP_REASON_MAX_ATTEMPTS, msg), nil
	}
	var elapsed uint64
	if c.FirstFailureUnixMs != 0 && c.NowUnixMs != 0 {
		elapsed = satSub(c.NowUnixMs, c.FirstFailureUnixMs)
	}
	limit := p.GetMaxRetryDurationMs()
	d := draws{}
	if c.JobID != "" {
		d = draws{seed: mix64(fnv1a64(c.JobID) ^ pp.identitySeed), seeded: true}
	}
	ms, err := delay(p, k, satSub(limit, elapsed), limit > 0, d)
	if err != nil {
		return nil, err
	}
	if c.RetryAfterMs != 0 {
		ms = max(ms, min(c.RetryAfterMs, max(p.GetCapMs(), minPushbackLimitMs)))
	}
	if limit > 0 {
		if next := satAdd(elapsed, ms); next > limit {
			return giveUp(pb.GiveUpReason_GIVE_UP_REASON_DEADLINE,
				fmt.Sprintf("the next run would start %s after the first failure, past maxRetryDuration %s",
					formatMillis(next), formatMillis(limit))), nil
		}
	}
	return &pb.DecideResponse{Decision: pb.Decision_DECISION_RETRY, DelayMs: ms}, nil
}

// jsonQuote writes text as a JSON string literal the way the policy crate does (serde_json,
// like JSON.stringify): '"' and '\\' escaped, control characters as \n-style or lowercase
// \u00XX escapes, everything else as is (encoding/json would also escape <, >, & and
// U+2028/U+2029).
func jsonQuote(text string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range text {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if r < 0x20 {
				fmt.Fprintf(&b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}
