//! The book's invariants under random traffic (`proptest`, fixed seed, bounded cases):
//! after every step no slot holds more than `burst`, no retry runs earlier than asked,
//! runs stay sorted, disjoint and within the cap, and (in a debug build) nothing
//! overflows. `PROPTEST_CASES=5000 cargo test -p rebound-policy --lib retry_budget::props`
//! is the long run (5,000 short sequences, 78 storms: about 20 min); `PROPTEST_RNG_SEED` picks another
//! seed.

use std::collections::HashMap;

use proptest::{prelude::*, test_runner::RngSeed};

use super::*;
use crate::resolve::ResolvedPolicy;
use crate::{
    Disposition,
    resolve::defaults,
    spec::{JitterKind, Strategy as Curve},
};

fn policy() -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: Curve::Constant,
        base_ms: 1_000,
        multiplier: 1.0,
        cap_ms: 1_000,
        jitter: JitterKind::None,
        jitter_ratio: 0.0,
        schedule_ms: Vec::new(),
        max_attempts: defaults::MAX_ATTEMPTS,
        max_retry_duration_ms: None,
        non_retryable_errors: Vec::new(),
        terminal: Disposition::Drop,
        retry_budget: None,
    }
}

fn ask(now_ms: u64) -> Ask<'static> {
    Ask {
        queue: "q",
        job_id: None,
        attempt: 1,
        now_ms,
        first_failure_ms: None,
    }
}

/// The configuration every property here runs with: a fixed seed unless
/// `PROPTEST_RNG_SEED` says otherwise, `cases` unless `PROPTEST_CASES` does (divided by
/// `per`, for the properties whose cases are long storms).
fn config(cases: u32, per: u64) -> ProptestConfig {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    ProptestConfig {
        cases: env("PROPTEST_CASES").map_or(cases, |n| {
            u32::try_from((n / per).max(1)).unwrap_or(u32::MAX)
        }),
        rng_seed: RngSeed::Fixed(env("PROPTEST_RNG_SEED").unwrap_or(0x5eed_b0d9)),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A scheduler with a model of what it admitted: retries per slot, from its answers alone.
struct Checked {
    s: Scheduler,
    per_slot: HashMap<u64, u32>,
    policy: ResolvedPolicy,
}

impl Checked {
    fn new(b: RetryBudget, runs: usize) -> Self {
        Self {
            s: Scheduler::with_capacity(b, 0, runs),
            per_slot: HashMap::new(),
            policy: policy(),
        }
    }

    /// One retry wanting `delay_ms` at `now_ms`; checks the answer against the model.
    fn ask(&mut self, now_ms: u64, delay_ms: u64) -> Result<(), TestCaseError> {
        let b = self.s.budget();
        let got = self
            .s
            .apply(&self.policy, Decision::Retry { delay_ms }, &ask(now_ms));
        if let Decision::Retry { delay_ms: d } = got.decision {
            // The run time saturates at the last millisecond.
            let asked = delay_ms.min(u64::MAX - now_ms);
            prop_assert!(d >= asked, "moved earlier: asked {delay_ms}, got {d}");
            let slot = b.slot_of(now_ms + d);
            prop_assert!(self.s.share().owns(slot), "slot {slot} not owned");
            let n = self.per_slot.entry(slot).or_default();
            *n += 1;
            prop_assert!(
                *n <= b.burst,
                "slot {slot} holds {n} > burst {}, asked {delay_ms} at {now_ms}",
                b.burst
            );
        }
        Ok(())
    }

    fn check_book(&self) -> Result<(), TestCaseError> {
        self.s
            .check_book()
            .map_err(|e| TestCaseError::fail(e.to_string()))
    }
}

/// The exact sequence that over-admitted: 4 runs, the 5th booking compacts, and the slot
/// it wanted lay inside the merged gap.
#[test]
fn a_booking_that_compacts_does_not_hide_the_merged_run() {
    let mut c = Checked::new(budget(1_000, 1), 4);
    for wanted in [10, 13, 20, 30, 12, 13] {
        c.ask(0, wanted).expect("within budget");
    }
    c.check_book().expect("book consistent");
}

/// At the default cap: every third millisecond booked, one retry that compacts, then
/// retries aimed at full slots must all move.
#[test]
fn at_the_default_cap_retries_aimed_at_full_slots_move() {
    let mut c = Checked::new(budget(1_000, 1), limits::MAX_RUNS);
    let n = limits::MAX_RUNS as u64;
    for i in 0..n {
        c.ask(0, 10 + 3 * i).expect("within budget");
    }
    c.ask(0, 12).expect("within budget");
    for i in 0..4_000 {
        c.ask(0, 10 + 3 * i).expect("within budget");
    }
    c.check_book().expect("book consistent");
}

fn budget(rate_per_second: u32, burst: u32) -> RetryBudget {
    RetryBudget {
        rate_per_second,
        burst,
    }
}

/// A valid budget: slots between 1 ms and 60 s.
fn budgets() -> impl Strategy<Value = RetryBudget> {
    (1u32..=100_000, 1u32..=100)
        .prop_map(|(rate, burst)| budget(rate, burst))
        .prop_filter("slot between 1ms and 60s", |b| b.check().is_ok())
}

/// One step: the clock moves (mostly a little, sometimes far, sometimes back: a lagging
/// caller), then a retry asks for a delay (mostly within a window, sometimes far).
#[derive(Clone, Debug)]
enum Step {
    Ask { dt: i64, delay_ms: u64 },
    Share { member: u32, members: u32 },
}

fn steps(len: usize) -> impl Strategy<Value = Vec<Step>> {
    let dt = prop_oneof![
        8 => 0i64..50,
        1 => 0i64..10_000_000,
        1 => -2_000i64..0,
    ];
    let delay = prop_oneof![
        8 => 0u64..5_000,
        2 => 0u64..600_000,
        1 => Just(u64::MAX),
        1 => any::<u64>(),
    ];
    let step = prop_oneof![
        30 => (dt, delay).prop_map(|(dt, delay_ms)| Step::Ask { dt, delay_ms }),
        1 => (1u32..5).prop_flat_map(|members| (0..members, Just(members)))
            .prop_map(|(member, members)| Step::Share { member, members }),
    ];
    proptest::collection::vec(step, 1..len)
}

fn run(c: &mut Checked, start: u64, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut now = start;
    for step in steps {
        match *step {
            Step::Ask { dt, delay_ms } => {
                now = now.saturating_add_signed(dt);
                c.ask(now, delay_ms)?;
            }
            Step::Share { member, members } => {
                c.s.set_share(SlotShare { member, members });
            }
        }
        c.check_book()?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256, 1))]

    #[test]
    fn small_books_hold_the_budget(
        b in budgets(),
        runs in prop_oneof![Just(1usize), Just(2), Just(4), Just(64)],
        start in prop_oneof![Just(0u64), 0u64..1 << 45, Just(u64::MAX - 1_000_000)],
        steps in steps(600),
    ) {
        let mut c = Checked::new(b, runs);
        run(&mut c, start, &steps)?;
    }
}

/// Long traffic at the big caps, driven from a seed: bookings spread thin enough to fill
/// the cap many times over, with hot spots aimed at booked slots and clock jumps.
/// Returns how many times the book compacted.
fn storm(c: &mut Checked, seed: u64, asks: usize, spread_ms: u64) -> Result<u32, TestCaseError> {
    let mut rng = super::tests::Rng::new(seed);
    let mut now = 1_000_000u64;
    let mut recent: Vec<u64> = Vec::new();
    let full_check_every = if c.s.slots.max_runs > 1_024 { 256 } else { 1 };
    let mut compactions = 0;
    let step_ms = spread_ms / asks as u64 / 5;
    for i in 0..asks {
        // The clock crosses about a tenth of the spread in all, plus a few jumps, so the
        // book keeps far more runs than the cap whatever the slot length.
        now += match rng.below(10_000) {
            0 => rng.below(spread_ms / 20 + 1),
            1..=100 => 0,
            _ => rng.below(step_ms + 1),
        };
        let at = match rng.below(4) {
            0 if !recent.is_empty() => recent[rng.below(recent.len() as u64) as usize],
            _ => now + rng.below(spread_ms),
        };
        let delay_ms = at.saturating_sub(now);
        recent.push(now + delay_ms);
        if recent.len() > 64 {
            recent.swap_remove(rng.below(64) as usize);
        }
        let runs_before = c.s.runs();
        c.ask(now, delay_ms)?;
        // A compaction merges a quarter of the runs at once; forgetting drops a few.
        let compacted = runs_before == c.s.slots.max_runs && c.s.runs() + 1 < runs_before;
        compactions += u32::from(compacted);
        if i % full_check_every == 0 || compacted {
            c.check_book()?;
        }
    }
    c.check_book()?;
    Ok(compactions)
}

proptest! {
    #![proptest_config(config(4, 64))]

    #[test]
    fn big_books_hold_the_budget(
        b in budgets(),
        runs in prop_oneof![Just(1_024usize), Just(limits::MAX_RUNS)],
        seed in any::<u64>(),
        sparseness in 4u64..16,
    ) {
        let mut c = Checked::new(b, runs);
        let asks = runs * 2 + 2_000;
        // Wanted times spread over `sparseness` slots per ask: far more runs than the cap.
        let spread_ms = b.slot_start(asks as u64 * sparseness).max(1);
        let compactions = storm(&mut c, seed, asks, spread_ms)?;
        prop_assert!(compactions > 0, "the cap was never reached");
    }
}
