//! The decision function: "attempt N of this job just failed — retry after how long, or
//! give up?". Every component of Rebound answers with this function and nothing else.
//!
//! It is total: any attempt number (0 is treated as 1), any context, any policy that passed
//! [`ResolvedPolicy::check`] gives an answer without panicking or overflowing. Delay
//! arithmetic is done in `f64` and saturates at the cap.

use std::cell::Cell;

use crate::{
    pattern::Stars,
    resolve::{Disposition, ResolvedPolicy},
    spec::{JitterKind, Strategy},
};

/// A resolved policy prepared for repeated decisions: bound to its identity, which seeds
/// deterministic jitter, with its non-retryable patterns compiled once. The adapters' ports
/// use the same name for the same thing.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedPolicy {
    identity: String,
    identity_seed: u64,
    params: ResolvedPolicy,
    /// The parts of each of `params.non_retryable_errors` (same order), prepared for
    /// linear-time matching against the text kept there: each pattern is stored once.
    non_retryable: Box<[Option<Stars>]>,
}

impl PreparedPolicy {
    /// `identity` names the policy stably across processes, e.g. `namespace/name`.
    pub fn new(identity: impl Into<String>, params: ResolvedPolicy) -> Self {
        let identity = identity.into();
        Self {
            identity_seed: hash_bytes(identity.as_bytes()),
            identity,
            non_retryable: params
                .non_retryable_errors
                .iter()
                .map(|p| Stars::of(p))
                .collect(),
            params,
        }
    }

    /// The first non-retryable pattern that `error_class` matches, adding the matching
    /// work to `steps` (for cost tests).
    pub fn non_retryable_match(&self, error_class: &str, steps: &mut u64) -> Option<&str> {
        first_match(
            self.params
                .non_retryable_errors
                .iter()
                .map(String::as_str)
                .zip(self.non_retryable.iter().map(Option::as_ref)),
            error_class,
            steps,
        )
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn params(&self) -> &ResolvedPolicy {
        &self.params
    }
}

/// The first of `patterns` (text and prepared parts) that `error_class` matches.
pub(crate) fn first_match<'p>(
    mut patterns: impl Iterator<Item = (&'p str, Option<&'p Stars>)>,
    error_class: &str,
    steps: &mut u64,
) -> Option<&'p str> {
    patterns
        .find(|(text, stars)| {
            Stars::matches(*stars, text.as_bytes(), error_class.as_bytes(), steps)
        })
        .map(|(text, _)| text)
}

/// What [`decide`] reads of a policy: a [`PreparedPolicy`] and a table entry (which keeps
/// its texts in its table's shared blocks) both answer through the one decide function.
pub trait PolicyView: std::fmt::Debug {
    fn identity(&self) -> &str;
    /// The hash of the identity that seeds deterministic jitter.
    fn identity_seed(&self) -> u64;
    fn core(&self) -> Core<'_>;
    /// The first non-retryable pattern that `error_class` matches, adding the matching
    /// work to `steps` (for cost tests).
    fn non_retryable_match(&self, error_class: &str, steps: &mut u64) -> Option<&str>;
}

/// The parameters of a policy that shape its delays, borrowed from wherever they are kept.
#[derive(Clone, Copy, Debug)]
pub struct Core<'a> {
    pub strategy: Strategy,
    pub base_ms: u64,
    pub multiplier: f64,
    pub cap_ms: u64,
    pub jitter: JitterKind,
    pub jitter_ratio: f64,
    pub schedule_ms: &'a [u64],
    pub max_attempts: u32,
    pub max_retry_duration_ms: Option<u64>,
    pub terminal: &'a Disposition,
}

impl Core<'_> {
    /// See [`MIN_PUSHBACK_LIMIT_MS`].
    pub fn pushback_limit_ms(&self) -> u64 {
        self.cap_ms.max(MIN_PUSHBACK_LIMIT_MS)
    }
}

impl ResolvedPolicy {
    /// The parameters [`decide`] reads, borrowed.
    pub fn core(&self) -> Core<'_> {
        Core {
            strategy: self.strategy,
            base_ms: self.base_ms,
            multiplier: self.multiplier,
            cap_ms: self.cap_ms,
            jitter: self.jitter,
            jitter_ratio: self.jitter_ratio,
            schedule_ms: &self.schedule_ms,
            max_attempts: self.max_attempts,
            max_retry_duration_ms: self.max_retry_duration_ms,
            terminal: &self.terminal,
        }
    }
}

impl<'a> From<&'a ResolvedPolicy> for Core<'a> {
    fn from(policy: &'a ResolvedPolicy) -> Self {
        policy.core()
    }
}

impl PolicyView for PreparedPolicy {
    fn identity(&self) -> &str {
        &self.identity
    }

    fn identity_seed(&self) -> u64 {
        self.identity_seed
    }

    fn core(&self) -> Core<'_> {
        self.params.core()
    }

    fn non_retryable_match(&self, error_class: &str, steps: &mut u64) -> Option<&str> {
        PreparedPolicy::non_retryable_match(self, error_class, steps)
    }
}

/// What the caller knows about the failure. Everything is optional.
#[derive(Clone, Copy, Debug, Default)]
pub struct Context<'a> {
    /// Seeds the jitter so the same question always gets the same answer.
    pub job_id: Option<&'a str>,
    /// Matched against the policy's non-retryable error classes.
    pub error_class: Option<&'a str>,
    /// When the job first failed, in milliseconds since the Unix epoch.
    pub first_failure_ms: Option<u64>,
    /// The current time, in milliseconds since the Unix epoch.
    pub now_ms: Option<u64>,
    /// A server's pushback (e.g. HTTP `Retry-After`): the delay is at least this, up to
    /// [`ResolvedPolicy::pushback_limit_ms`].
    pub retry_after_ms: Option<u64>,
}

/// Why the policy gave up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GiveUpReason {
    /// The attempt that failed was the last one allowed.
    MaxAttempts { max_attempts: u32, attempt: u32 },
    /// The next run would start after `maxRetryDuration` from the first failure.
    Deadline {
        max_retry_duration_ms: u64,
        next_start_after_ms: u64,
    },
    /// The error class matched a non-retryable pattern.
    NonRetryable {
        error_class: String,
        pattern: String,
    },
}

impl GiveUpReason {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            GiveUpReason::MaxAttempts { .. } => "MaxAttempts",
            GiveUpReason::Deadline { .. } => "Deadline",
            GiveUpReason::NonRetryable { .. } => "NonRetryable",
        }
    }
}

impl std::fmt::Display for GiveUpReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::duration::format_millis as d;
        match self {
            GiveUpReason::MaxAttempts {
                max_attempts,
                attempt,
            } if attempt == max_attempts => {
                write!(
                    f,
                    "attempt {attempt} of {max_attempts} failed (maxAttempts)"
                )
            }
            GiveUpReason::MaxAttempts {
                max_attempts,
                attempt,
            } => write!(
                f,
                "attempt {attempt} failed, past maxAttempts {max_attempts} (runs including the first)"
            ),
            GiveUpReason::Deadline {
                max_retry_duration_ms,
                next_start_after_ms,
            } => write!(
                f,
                "the next run would start {} after the first failure, past maxRetryDuration {}",
                d(*next_start_after_ms),
                d(*max_retry_duration_ms)
            ),
            GiveUpReason::NonRetryable {
                error_class,
                pattern,
            } => write!(
                f,
                "error class {} is non-retryable (matches {})",
                json_quoted(error_class),
                json_quoted(pattern)
            ),
        }
    }
}

/// A string as a JSON string literal (RFC 8259: `"` and `\` escaped, control characters
/// as `\n`-style or `\u00XX` escapes, everything else as is): every adapter's language
/// writes exactly this, so the fallbacks' reason messages equal the sidecar's.
fn json_quoted(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| format!("{text:?}"))
}

/// The answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Retry {
        delay_ms: u64,
    },
    GiveUp {
        disposition: Disposition,
        reason: GiveUpReason,
    },
}

/// Decides what happens after `attempt` (1-based: the run that just failed) failed.
pub fn decide<P: PolicyView + ?Sized>(policy: &P, attempt: u32, ctx: &Context<'_>) -> Decision {
    decide_with(
        policy,
        attempt,
        ctx,
        &Draws::new(policy, ctx.job_id),
        &mut Replay::default(),
    )
}

/// [`decide`] with explicit random draws and a replay memo, for callers that walk a whole
/// schedule (simulation) and would otherwise replay decorrelated jitter from retry 1 each time.
pub fn decide_with<P: PolicyView + ?Sized>(
    policy: &P,
    attempt: u32,
    ctx: &Context<'_>,
    draws: &Draws,
    replay: &mut Replay,
) -> Decision {
    let p = policy.core();
    let attempt = attempt.max(1);
    let give_up = |reason| Decision::GiveUp {
        disposition: p.terminal.clone(),
        reason,
    };

    if let Some(class) = ctx.error_class
        && let Some(pattern) = policy.non_retryable_match(class, &mut 0)
    {
        return give_up(GiveUpReason::NonRetryable {
            error_class: class.to_owned(),
            pattern: pattern.to_owned(),
        });
    }
    if attempt >= p.max_attempts {
        return give_up(GiveUpReason::MaxAttempts {
            max_attempts: p.max_attempts,
            attempt,
        });
    }

    // With a deadline, a random delay is drawn within the time that remains, so a retry
    // that fits is never lost to an unlucky draw; an exact delay (no jitter) is kept as
    // written and gives up when it does not fit.
    let elapsed = match (ctx.first_failure_ms, ctx.now_ms) {
        (Some(first), Some(now)) => now.saturating_sub(first),
        _ => 0,
    };
    let remaining = p
        .max_retry_duration_ms
        .map(|limit| limit.saturating_sub(elapsed));
    let mut delay_ms = delay_for_retry(&p, attempt, remaining, draws, replay);
    if let Some(pushback) = ctx.retry_after_ms {
        delay_ms = delay_ms.max(pushback.min(p.pushback_limit_ms()));
    }

    if let Some(limit) = p.max_retry_duration_ms {
        let next_start = elapsed.saturating_add(delay_ms);
        if next_start > limit {
            return give_up(GiveUpReason::Deadline {
                max_retry_duration_ms: limit,
                next_start_after_ms: next_start,
            });
        }
    }
    Decision::Retry { delay_ms }
}

/// The longest server pushback (`Retry-After`) honoured: the cap or one day, whichever is
/// longer. A longer pushback is cut to this; past a deadline it gives up instead.
pub const MIN_PUSHBACK_LIMIT_MS: u64 = 24 * 3_600_000;

impl ResolvedPolicy {
    /// See [`MIN_PUSHBACK_LIMIT_MS`].
    pub fn pushback_limit_ms(&self) -> u64 {
        self.core().pushback_limit_ms()
    }
}

/// The jittered delay before retry `k` (which follows attempt `k`), in milliseconds.
/// Never above the cap; a random delay (jitter, decorrelated) never above `remaining`
/// either.
fn delay_for_retry(
    p: &Core<'_>,
    k: u32,
    remaining: Option<u64>,
    draws: &Draws,
    replay: &mut Replay,
) -> u64 {
    // Retries beyond the largest maxAttempts never happen; clamping bounds the replay
    // even for a ResolvedPolicy that was built by hand and never checked.
    let k = k.clamp(1, crate::limits::MAX_ATTEMPTS);
    let cap = p.cap_ms as f64;
    let base = p.base_ms as f64;
    // Durations are at most 8760h, so `remaining` converts exactly.
    let window = remaining.map_or(cap, |r| cap.min(r as f64));
    let capped = match p.strategy {
        Strategy::Exponential => exponential(base, p.multiplier, k).min(cap),
        Strategy::Linear => (base * f64::from(k)).min(cap),
        Strategy::Constant => base.min(cap),
        Strategy::Schedule => {
            let index = (k as usize - 1).min(p.schedule_ms.len().saturating_sub(1));
            (p.schedule_ms.get(index).copied().unwrap_or(p.base_ms) as f64).min(cap)
        }
        Strategy::Decorrelated => {
            return replay.decorrelated(base, cap, k, draws).min(window) as u64;
        }
    };
    if p.jitter == JitterKind::None {
        return capped as u64;
    }
    let capped = capped.min(window);
    let jittered = match p.jitter {
        JitterKind::None => capped,
        JitterKind::Full => capped * draws.unit(k),
        JitterKind::Equal => capped / 2.0 + capped / 2.0 * draws.unit(k),
        JitterKind::Proportional => {
            capped * (1.0 - p.jitter_ratio + 2.0 * p.jitter_ratio * draws.unit(k))
        }
    };
    // f64 -> u64 casts saturate and map NaN to 0, so this cannot overflow.
    jittered.clamp(0.0, window) as u64
}

/// `base × multiplier^(k−1)`, the power by binary exponentiation in one fixed order
/// (lowest bit first) using only IEEE-754 multiplications, so every language with `f64`
/// gets the same bits (`powi`/`pow` give no such guarantee). Past ~1100 doublings the
/// power is +inf, which `min(cap)` absorbs; multipliers are ≥ 1, so never NaN.
fn exponential(base: f64, multiplier: f64, k: u32) -> f64 {
    let mut power = 1.0;
    let mut square = multiplier;
    let mut exponent = k.saturating_sub(1);
    while exponent > 0 {
        if exponent & 1 == 1 {
            power *= square;
        }
        exponent >>= 1;
        if exponent > 0 {
            square *= square;
        }
    }
    base * power
}

/// Where a replay of decorrelated jitter stopped, so a caller walking retries 1, 2, 3…
/// (simulation) does a few steps per retry instead of replaying from the start.
#[derive(Clone, Copy, Debug, Default)]
pub struct Replay {
    /// Retries folded in so far; always a multiple of [`CHUNK`].
    folded: u32,
    value: f64,
}

/// Retries folded into one map before it is applied; see [`Replay::decorrelated`].
const CHUNK: u32 = 4;

/// One decorrelated step as a map `x ↦ min(cap, add + mul·x)`. Composing two such maps
/// (with `mul ≥ 0`) gives another, which lets a replay fold independent steps together
/// and shorten the chain of dependent arithmetic fourfold.
#[derive(Clone, Copy)]
struct StepMap {
    add: f64,
    mul: f64,
    cap: f64,
}

impl StepMap {
    /// `uniform(base, 3x) = base + u·(3x − base) = base·(1 − u) + 3u·x`, capped.
    fn step(base: f64, cap: f64, u: f64) -> Self {
        Self {
            add: base * (1.0 - u),
            mul: 3.0 * u,
            cap,
        }
    }

    /// `self ∘ inner`: `min(c₂, a₂ + m₂·min(c₁, a₁ + m₁x)) = min(min(c₂, a₂ + m₂c₁), a₂ + m₂a₁ + m₂m₁x)`.
    fn after(self, inner: StepMap) -> Self {
        Self {
            add: self.add + self.mul * inner.add,
            mul: self.mul * inner.mul,
            cap: self.cap.min(self.add + self.mul * inner.cap),
        }
    }

    fn apply(self, x: f64) -> f64 {
        (self.add + self.mul * x).min(self.cap)
    }
}

impl Replay {
    /// Brooker's decorrelated jitter, replayed from retry 1 so no state is stored:
    /// `d₀ = base`, `dᵢ = min(cap, uniform(base, 3·dᵢ₋₁))`.
    ///
    /// The value for retry `k` is defined as: whole chunks of [`CHUNK`] steps, each folded
    /// into one map (pairwise, in a fixed order) and applied in turn, then the remaining
    /// `k mod CHUNK` steps one by one. Every caller computes it this way, so answers are
    /// identical everywhere; the folding only changes float rounding, never the law.
    fn decorrelated(&mut self, base: f64, cap: f64, k: u32, draws: &Draws) -> f64 {
        let whole = k - k % CHUNK;
        if self.folded == 0 || self.folded > whole {
            *self = Replay {
                folded: 0,
                value: base,
            };
        }
        let step = |i: u32| StepMap::step(base, cap, draws.unit(i));
        while self.folded < whole {
            let i = self.folded;
            let first = step(i + 2).after(step(i + 1));
            let second = step(i + 4).after(step(i + 3));
            self.value = second.after(first).apply(self.value);
            self.folded += CHUNK;
        }
        let mut value = self.value;
        for i in whole + 1..=k {
            value = step(i).apply(value);
        }
        value
    }
}

/// The random numbers behind one decision: a stream indexed by retry number, seeded by
/// (job id, policy identity) — or randomly when there is no job id.
///
/// SplitMix64 over a 64-bit FNV-1a hash: tiny, fast and easy to reimplement bit-for-bit in
/// an adapter's local fallback.
pub struct Draws {
    seed: u64,
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl Draws {
    pub fn new<P: PolicyView + ?Sized>(policy: &P, job_id: Option<&str>) -> Self {
        let seed = match job_id {
            Some(id) => mix64(hash_bytes(id.as_bytes()) ^ policy.identity_seed()),
            None => thread_random_u64(),
        };
        Self { seed }
    }

    /// Draws from an explicit seed (simulation).
    pub fn from_seed(seed: u64) -> Self {
        Self { seed }
    }

    /// A uniform number in `[0, 1)` for retry `i`.
    pub fn unit(&self, i: u32) -> f64 {
        let bits = mix64(
            self.seed
                .wrapping_add(u64::from(i).wrapping_mul(GOLDEN_GAMMA)),
        );
        (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The SplitMix64 finaliser.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A fixed-seed SplitMix64 stream: the same numbers on every run and platform, for
/// simulations and for tests that generate cases.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let value = mix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        value
    }

    /// A number in `[0, n)` (`n` > 0; modulo bias is below 2⁻³² for `n` < 2³²).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// One of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// 64-bit FNV-1a; stable across platforms and releases (unlike `DefaultHasher`).
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

thread_local! {
    static THREAD_RNG_STATE: Cell<u64> = Cell::new(rand::random());
}

/// A fresh random `u64` from a per-thread SplitMix64 stream seeded once from the OS.
fn thread_random_u64() -> u64 {
    THREAD_RNG_STATE.with(|state| {
        let next = state.get().wrapping_add(GOLDEN_GAMMA);
        state.set(next);
        mix64(next)
    })
}
