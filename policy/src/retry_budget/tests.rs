//! The slot model's guarantees on fixed seeds: no slot ever holds more than `burst`,
//! nothing is moved earlier than asked, repeats take no slot, memory stays bounded.

use std::collections::HashMap;

use super::*;
use crate::resolve::ResolvedPolicy;
use crate::{
    Disposition,
    resolve::defaults,
    spec::{JitterKind, Strategy},
};

fn policy(max_retry_duration_ms: Option<u64>) -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: Strategy::Constant,
        base_ms: 1_000,
        multiplier: 1.0,
        cap_ms: 1_000,
        jitter: JitterKind::None,
        jitter_ratio: 0.0,
        schedule_ms: Vec::new(),
        max_attempts: defaults::MAX_ATTEMPTS,
        max_retry_duration_ms,
        non_retryable_errors: Vec::new(),
        terminal: Disposition::Drop,
        retry_budget: None,
    }
}

fn budget(rate_per_second: u32, burst: u32) -> RetryBudget {
    RetryBudget {
        rate_per_second,
        burst,
    }
}

fn ask(job: &str, now_ms: u64) -> Ask<'_> {
    Ask {
        queue: "q",
        job_id: Some(job),
        attempt: 1,
        now_ms,
        first_failure_ms: None,
    }
}

fn retry(delay_ms: u64) -> Decision {
    Decision::Retry { delay_ms }
}

fn delay(b: &Budgeted) -> u64 {
    match b.decision {
        Decision::Retry { delay_ms } => delay_ms,
        Decision::GiveUp { .. } => panic!("gave up: {b:?}"),
    }
}

/// A fixed-seed generator, so every run sees the same storm.
pub(super) type Rng = crate::decide::SplitMix64;

#[test]
fn slot_arithmetic_is_exact() {
    let b = budget(3, 1); // 333⅓ ms slots
    assert_eq!(b.slot_of(0), 0);
    assert_eq!(b.slot_of(333), 0);
    assert_eq!(b.slot_of(334), 1);
    assert_eq!(b.slot_of(999), 2);
    assert_eq!(b.slot_of(1000), 3);
    assert_eq!(b.slot_start(1), 334);
    assert_eq!(b.slot_start(3), 1000);
    for k in [0, 1, 2, 7, 1_000_000, 5_000_000_000] {
        assert_eq!(b.slot_of(b.slot_start(k)), k, "slot {k}");
    }
    let fast = budget(100_000, 100); // exactly 1 ms
    assert_eq!(fast.slot_of(1_800_000_000_123), 1_800_000_000_123);
    assert_eq!(b.slot_of(u64::MAX), u64::MAX / 1000 * 3 + 1);
}

#[test]
fn check_names_the_field() {
    assert_eq!(budget(10, 1).check(), Ok(()));
    assert_eq!(budget(0, 1).check().unwrap_err().0, "ratePerSecond");
    assert_eq!(budget(100_001, 200).check().unwrap_err().0, "ratePerSecond");
    assert_eq!(budget(10, 0).check().unwrap_err().0, "burst");
    assert_eq!(
        budget(5_000, 4).check().unwrap_err().0,
        "burst",
        "slot under 1ms"
    );
    assert_eq!(budget(5_000, 5).check(), Ok(()));
    assert_eq!(
        budget(2, 121).check().unwrap_err().0,
        "burst",
        "slot over 60s"
    );
    assert_eq!(budget(2, 120).check(), Ok(()));
}

#[test]
fn fitting_retries_are_unchanged_and_full_slots_stretch() {
    let mut s = Scheduler::new(budget(10, 1)); // 100 ms slots
    let p = policy(None);
    let now = 1_000_000;
    let first = s.apply(&p, retry(1_000), &ask("a", now));
    assert_eq!(
        (delay(&first), first.added_ms, first.stretched),
        (1_000, 0, false)
    );
    let second = s.apply(&p, retry(1_050), &ask("b", now));
    assert_eq!(
        (delay(&second), second.added_ms, second.stretched),
        (1_100, 50, true)
    );
    let third = s.apply(&p, retry(1_000), &ask("c", now));
    assert_eq!(delay(&third), 1_200);
    // A free slot later on is used as asked.
    let later = s.apply(&p, retry(5_030), &ask("d", now));
    assert_eq!((delay(&later), later.added_ms), (5_030, 0));
}

#[test]
fn give_ups_pass_through_untouched() {
    let mut s = Scheduler::new(budget(10, 1));
    let gave_up = Decision::GiveUp {
        disposition: Disposition::Drop,
        reason: GiveUpReason::MaxAttempts {
            max_attempts: 3,
            attempt: 3,
        },
    };
    let b = s.apply(&policy(None), gave_up.clone(), &ask("a", 0));
    assert_eq!(b.decision, gave_up);
    assert_eq!(s.runs(), 0);
}

/// Many seeds of storms with random delays, rates and bursts: no slot over `burst`, no
/// retry earlier than `decide` said, and each retry in the first slot with room.
#[test]
fn never_more_than_burst_in_any_slot() {
    for seed in 0..40u64 {
        let mut rng = Rng::new(seed);
        let rate: u32 = [1, 3, 7, 10, 250, 1_000, 20_000][rng.below(7) as usize];
        let min_burst = rate.div_ceil(1000);
        let burst = (min_burst + rng.below(5) as u32).min(60 * rate);
        let b = budget(rate, burst);
        assert_eq!(b.check(), Ok(()), "seed {seed}");
        let mut s = Scheduler::new(b);
        let p = policy(None);
        let mut per_slot: HashMap<u64, u32> = HashMap::new();
        let mut now = 1_700_000_000_000 + rng.below(1_000);
        for i in 0..3_000 {
            now += rng.below(3);
            let wanted = rng.below(20_000);
            let job = format!("{seed}-{i}");
            let answer = s.apply(&p, retry(wanted), &ask(&job, now));
            let d = delay(&answer);
            assert!(d >= wanted, "seed {seed}: earlier than asked");
            assert_eq!(d - wanted, answer.added_ms);
            let slot = b.slot_of(now + d);
            let n = per_slot.entry(slot).or_default();
            *n += 1;
            assert!(*n <= burst, "seed {seed}: slot {slot} holds {n} > {burst}");
            // Every slot between the wanted one and the booked one was full.
            if answer.stretched {
                for k in b.slot_of(now + wanted)..slot {
                    assert_eq!(
                        per_slot.get(&k).copied(),
                        Some(burst),
                        "seed {seed}: slot {k}"
                    );
                }
            }
        }
    }
}

/// With slots dividing the second, no 1-second bucket of scheduled time exceeds the rate.
#[test]
fn aligned_slots_bound_every_second() {
    let b = budget(50, 5); // 100 ms slots
    let mut s = Scheduler::new(b);
    let p = policy(None);
    let mut rng = Rng::new(7);
    let now = 1_700_000_000_000;
    let mut per_second: HashMap<u64, u32> = HashMap::new();
    for i in 0..2_000 {
        let d = delay(&s.apply(&p, retry(rng.below(1_000)), &ask(&i.to_string(), now)));
        *per_second.entry((now + d) / 1000).or_default() += 1;
    }
    assert!(per_second.values().all(|&n| n <= 50), "{per_second:?}");
    assert_eq!(per_second.values().sum::<u32>(), 2_000, "none dropped");
}

#[test]
fn a_repeated_question_gets_the_same_answer_and_no_slot() {
    let mut s = Scheduler::new(budget(1, 1));
    let p = policy(None);
    let first = s.apply(&p, retry(0), &ask("a", 10_000));
    let stretched = s.apply(&p, retry(0), &ask("b", 10_000));
    assert!(stretched.stretched);
    let again = s.apply(&p, retry(0), &ask("b", 10_002));
    // The same answer: the same run time (so the same slot), counted from the repeat's now.
    assert_eq!(10_002 + delay(&again), 10_000 + delay(&stretched));
    assert_eq!(again.stretched, stretched.stretched);
    let unstretched = s.apply(&p, retry(0), &ask("a", 10_001));
    assert!(unstretched.repeat && !unstretched.stretched && !first.stretched);
    assert!(again.repeat && !stretched.repeat);
    // The next new job goes after b's slot: b's repeat did not take one.
    let c = s.apply(&p, retry(0), &ask("c", 10_002));
    assert_eq!(10_002 + delay(&c), 12_000);
    // Another attempt of the same job is a new question.
    let next_attempt = s.apply(
        &p,
        retry(0),
        &Ask {
            attempt: 2,
            ..ask("a", 10_002)
        },
    );
    assert_eq!(10_002 + delay(&next_attempt), 13_000);
    assert_eq!(delay(&first), 0);
    // No job id: never a repeat.
    let anon = |now| Ask {
        job_id: None,
        ..ask("", now)
    };
    let x = s.apply(&p, retry(0), &anon(10_002));
    let y = s.apply(&p, retry(0), &anon(10_002));
    assert_ne!(x.decision, y.decision);
}

/// A repeat arriving later must not move its retry into a later (possibly full) slot.
#[test]
fn a_late_repeat_keeps_its_booked_slot() {
    let b = budget(10, 1); // 100 ms slots
    let mut s = Scheduler::new(b);
    let p = policy(None);
    let a = s.apply(&p, retry(1_099), &ask("a", 0)); // slot 10
    let other = s.apply(&p, retry(1_100), &ask("b", 0)); // slot 11
    assert_eq!((b.slot_of(delay(&a)), b.slot_of(delay(&other))), (10, 11));
    let again = s.apply(&p, retry(1_099), &ask("a", 2));
    assert!(again.repeat);
    assert_eq!(b.slot_of(2 + delay(&again)), 10);
    // Asked again after its run time: now.
    assert_eq!(delay(&s.apply(&p, retry(1_099), &ask("a", 5_000))), 0);
}

/// At the run cap, merging must not count a long stretch of free slots as full.
#[test]
fn the_run_cap_costs_little_delay() {
    let mut s = Scheduler::with_capacity(budget(1_000, 1), 0, 2);
    let (p, n) = (policy(None), 1_000_000);
    s.apply(&p, retry(10_000), &ask("", n));
    s.apply(&p, retry(10_002), &ask("", n));
    s.apply(&p, retry(0), &ask("", n));
    assert!(delay(&s.apply(&p, retry(0), &ask("", n))) <= 1);
    // A storm's retries spread thinly over an hour, then new failures wanting "now".
    let mut s = Scheduler::with_capacity(budget(1_000, 1), 0, 256);
    let mut rng = Rng::new(7);
    for _ in 0..2_000 {
        s.apply(&p, retry(60_000 + rng.below(3_600_000)), &ask("", n));
        assert!(s.runs() <= 256);
    }
    let mut per_slot: HashMap<u64, u32> = HashMap::new();
    for i in 0..100u64 {
        let d = delay(&s.apply(&p, retry(i * 10), &ask("", n)));
        assert!(d <= i * 10 + 100, "retry {i}: {d} ms");
        *per_slot.entry(n + d).or_default() += 1;
    }
    assert!(per_slot.values().all(|&c| c == 1));
}

#[test]
fn the_memo_is_bounded_and_forgets_the_oldest() {
    let mut s = Scheduler::with_capacity(budget(1_000, 1), 100, limits::MAX_RUNS);
    let p = policy(None);
    for i in 0..1_000 {
        s.apply(&p, retry(0), &ask(&i.to_string(), 0));
        assert_eq!(s.memo_len(), (i + 1).min(100));
    }
    assert!(s.apply(&p, retry(0), &ask("999", 0)).repeat);
    assert!(!s.apply(&p, retry(0), &ask("0", 0)).repeat, "evicted");
}

/// Adversarial spacing (every other slot) past the run cap: memory stays at the cap and
/// the budget still holds (gaps are counted as full).
#[test]
fn runs_are_capped_and_past_slots_forgotten() {
    let b = budget(1_000, 1); // 1 ms slots
    let mut s = Scheduler::with_capacity(b, 0, 64);
    let p = policy(None);
    let mut per_slot: HashMap<u64, u32> = HashMap::new();
    let now = 5_000;
    for i in 0..500u64 {
        let d = delay(&s.apply(&p, retry((i * 7919) % 4_000 * 2), &ask("", now)));
        assert!(s.runs() <= 64);
        let n = per_slot.entry(b.slot_of(now + d)).or_default();
        *n += 1;
        assert_eq!(*n, 1);
    }
    // Far later, everything booked is in the past and forgotten.
    s.apply(&p, retry(0), &ask("", now + 1_000_000));
    assert_eq!(s.runs(), 1);
}

#[test]
fn stretching_past_the_deadline_gives_up_with_deadline() {
    let mut s = Scheduler::new(budget(1, 1));
    let p = policy(Some(3_000));
    let a = Ask {
        first_failure_ms: Some(9_000),
        ..ask("a", 10_000)
    };
    assert_eq!(delay(&s.apply(&p, retry(1_000), &a)), 1_000);
    // 11 s is taken; 12 s would be 3 s after the first failure: still fits.
    let b = s.apply(
        &p,
        retry(1_000),
        &Ask {
            job_id: Some("b"),
            ..a
        },
    );
    assert_eq!(delay(&b), 2_000);
    let c = s.apply(
        &p,
        retry(1_000),
        &Ask {
            job_id: Some("c"),
            ..a
        },
    );
    assert_eq!(
        c.decision,
        Decision::GiveUp {
            disposition: Disposition::Drop,
            reason: GiveUpReason::Deadline {
                max_retry_duration_ms: 3_000,
                next_start_after_ms: 4_000,
            },
        }
    );
    assert!(c.stretched);
    let again = s.apply(
        &p,
        retry(1_000),
        &Ask {
            job_id: Some("c"),
            ..a
        },
    );
    assert_eq!(
        (again.decision, again.stretched, again.repeat),
        (c.decision, true, true)
    );
    // The give-up took no slot: a retry that fits still gets 13 s.
    let d = s.apply(
        &p,
        retry(3_000),
        &Ask {
            job_id: Some("d"),
            first_failure_ms: None,
            ..a
        },
    );
    assert_eq!(delay(&d), 3_000);
}

/// The budget refuses only what it stretched: a retry that fits its slot passes unchanged,
/// even one `decide` would not have given (the scheduler takes any answer).
#[test]
fn an_unstretched_retry_is_never_refused() {
    let mut s = Scheduler::new(budget(1, 1));
    let far = limits::MAX_BOOK_AHEAD_MS + 1_000;
    assert_eq!(
        delay(&s.apply(&policy(None), retry(far), &ask("a", 0))),
        far
    );
    let late = Ask {
        first_failure_ms: Some(0),
        ..ask("b", 10_000)
    };
    let b = s.apply(&policy(Some(3_000)), retry(5_000), &late);
    assert_eq!((delay(&b), b.stretched), (5_000, false));
}

/// The last slot of representable time can be booked; the one after it is the horizon.
#[test]
fn the_last_slot_of_time_is_bookable() {
    let mut s = Scheduler::new(budget(1, 1));
    let p = policy(None);
    let now = u64::MAX - 10;
    assert_eq!(delay(&s.apply(&p, retry(10), &ask("a", now))), 10);
    let b = s.apply(&p, retry(10), &ask("b", now));
    assert!(
        matches!(
            b.decision,
            Decision::GiveUp {
                reason: GiveUpReason::Deadline { .. },
                ..
            }
        ),
        "{b:?}"
    );
    s.check_book().expect("book consistent");
}

/// `check_book` is the book's own check: a book over its run cap is reported.
#[test]
fn check_book_reports_a_broken_book() {
    let mut s = Scheduler::new(budget(1_000, 1));
    let p = policy(None);
    for i in 0..3 {
        s.apply(&p, retry(i * 10), &ask(&i.to_string(), 0));
    }
    assert_eq!(s.runs(), 3);
    assert_eq!(s.check_book(), Ok(()));
    s.slots.max_runs = 1;
    assert!(s.check_book().is_err());
}

#[test]
fn without_a_deadline_the_horizon_is_the_longest_duration() {
    let mut s = Scheduler::new(budget(1, 1));
    let p = policy(None);
    let far = limits::MAX_BOOK_AHEAD_MS - 200;
    assert_eq!(delay(&s.apply(&p, retry(far), &ask("a", 0))), far);
    // The next slot starts exactly at the horizon: still within it.
    assert_eq!(
        delay(&s.apply(&p, retry(far), &ask("b", 0))),
        limits::MAX_BOOK_AHEAD_MS
    );
    let third = s.apply(&p, retry(far), &ask("c", 0));
    assert!(matches!(
        third.decision,
        Decision::GiveUp {
            reason: GiveUpReason::Deadline { max_retry_duration_ms, .. },
            ..
        } if max_retry_duration_ms == limits::MAX_BOOK_AHEAD_MS
    ));
}

#[test]
fn the_storm_simulation_is_deterministic_and_within_budget() {
    use crate::{decide::PreparedPolicy, simulate::simulate_budget};
    let mut params = policy(Some(3_600_000));
    params.strategy = Strategy::Exponential;
    params.multiplier = 2.0;
    params.cap_ms = 60_000;
    params.jitter = JitterKind::Full;
    params.max_attempts = 4;
    params.retry_budget = Some(budget(10, 1));
    let p = PreparedPolicy::new("ns/storm", params.clone());
    let a = simulate_budget(&p, 1_000, 42).expect("budgeted");
    assert_eq!(Some(&a), simulate_budget(&p, 1_000, 42).as_ref());
    assert_eq!(
        a.retries + a.gave_up_deadline,
        3_000,
        "three retries per job"
    );
    assert!(a.stretched > 2_000, "{a:?}");
    // 3,000 retries at 10/s cannot be done in under 300 s.
    assert!(a.last_retry_at_ms >= 299_000, "{a:?}");
    params.retry_budget = None;
    assert_eq!(
        simulate_budget(&PreparedPolicy::new("ns/storm", params), 10, 1),
        None
    );
}

/// Like `decide`, the scheduler is total: an unchecked budget and extreme times and
/// delays give answers, never a panic or an overflow.
#[test]
fn extreme_inputs_do_not_panic() {
    let p = policy(None);
    for b in [
        budget(100_000, 1),
        budget(1, 100_000),
        budget(0, 0),
        budget(u32::MAX, 1),
        budget(1_000, 1),
        budget(10, 1),
    ] {
        let mut s = Scheduler::new(b);
        let mut per_slot: HashMap<u64, u32> = HashMap::new();
        // In time order: a clock stepping back may rebook forgotten slots (documented).
        for (now, d) in [
            (0, 0),
            (0, u64::MAX),
            (5, 7),
            (u64::MAX - 1, 0),
            (u64::MAX, 0),
            (u64::MAX, u64::MAX),
        ] {
            for k in 0..5 {
                let job = format!("{now}-{d}-{k}");
                if let Decision::Retry { delay_ms } =
                    s.apply(&p, retry(d), &ask(&job, now)).decision
                {
                    *per_slot
                        .entry(b.slot_of(now.saturating_add(delay_ms)))
                        .or_default() += 1;
                }
            }
        }
        if b.check().is_ok() {
            assert!(
                per_slot.values().all(|&c| c <= b.burst),
                "{b:?}: {per_slot:?}"
            );
        }
        let _ = b.to_string();
    }
}

/// A late caller (its clock read before another thread's, its call after) may not book a
/// slot the scheduler already forgot: that slot may be full.
#[test]
fn a_late_caller_cannot_rebook_a_forgotten_slot() {
    let b = budget(10, 1); // 100 ms slots
    let mut s = Scheduler::new(b);
    let p = policy(None);
    assert_eq!(delay(&s.apply(&p, retry(0), &ask("a", 1_000))), 0); // slot 10, now full
    // A caller at 1 250 ms forgets slots before 12.
    assert_eq!(delay(&s.apply(&p, retry(0), &ask("b", 1_250))), 0);
    // A caller that read 1 000 ms before the one above but arrives after it.
    let late = s.apply(&p, retry(0), &ask("c", 1_000));
    let slot = b.slot_of(1_000 + delay(&late));
    assert!(
        slot >= 12,
        "late caller booked slot {slot}, which was forgotten (full)"
    );
    assert!(late.stretched);
}

#[test]
fn slot_share_owns_every_nth_slot() {
    assert!(SlotShare::WHOLE.owns(0) && SlotShare::WHOLE.owns(7));
    let s = SlotShare::new(2, 6).expect("valid");
    assert!(s.owns(2) && s.owns(8) && !s.owns(3));
    assert_eq!(
        (s.next_owned(0), s.next_owned(2), s.next_owned(3)),
        (2, 2, 8)
    );
    assert_eq!(SlotShare::new(6, 6), None);
    assert_eq!(SlotShare::new(0, 0), None);
    assert_eq!(SlotShare::default(), SlotShare::WHOLE);
    assert_eq!(s.to_string(), "member 2 of 6");
    assert_eq!(SlotShare::new(0, 1).unwrap().next_owned(u64::MAX), u64::MAX);
    let last = SlotShare::new(5, 6).unwrap();
    assert_eq!(last.next_owned(u64::MAX - 1), u64::MAX);
}

/// `members` schedulers, member i with share i of `members`, one storm spread unevenly
/// over them (member 0 gets half); returns (run time ms, scheduler) per admitted retry.
fn fleet_storm(seed: u64, b: RetryBudget, members: u32, jobs: usize) -> Vec<(u64, u32)> {
    let mut rng = Rng::new(seed);
    let mut fleet: Vec<Scheduler> = (0..members)
        .map(|i| {
            let mut s = Scheduler::new(b);
            s.set_share(SlotShare::new(i, members).expect("valid"));
            s
        })
        .collect();
    let p = policy(None);
    let mut now = 1_700_000_000_000 + rng.below(1_000);
    let mut runs = Vec::new();
    for i in 0..jobs {
        now += rng.below(3);
        let member = if rng.below(2) == 0 {
            0
        } else {
            rng.below(u64::from(members)) as u32
        };
        let wanted = rng.below(5_000);
        let job = format!("{seed}-{i}");
        let answer = fleet[member as usize].apply(&p, retry(wanted), &ask(&job, now));
        let d = delay(&answer);
        assert!(d >= wanted, "seed {seed}: earlier than asked");
        runs.push((now + d, member));
    }
    runs
}

/// The fleet guarantee: N schedulers with shares 0..N of one budget never schedule more
/// than `burst` in a slot together, nor `rate + burst` in any 1 s window.
#[test]
fn shares_of_one_budget_hold_it_together() {
    for seed in 0..24u64 {
        let mut rng = Rng::new(seed ^ 0xf1ee7);
        let rate: u32 = [10, 100, 250, 1_000, 5_000][rng.below(5) as usize];
        let burst = (rate.div_ceil(1000) + rng.below(10) as u32).min(60 * rate);
        let members = 1 + rng.below(8) as u32;
        let b = budget(rate, burst);
        assert_eq!(b.check(), Ok(()));
        let runs = fleet_storm(seed, b, members, 4_000);
        let mut per_slot: HashMap<u64, (u32, u32)> = HashMap::new();
        for &(at, member) in &runs {
            let slot = b.slot_of(at);
            let e = per_slot.entry(slot).or_insert((0, member));
            e.0 += 1;
            assert_eq!(
                e.1, member,
                "seed {seed}: slot {slot} booked by two members"
            );
            assert!(SlotShare::new(member, members).unwrap().owns(slot));
        }
        assert!(per_slot.values().all(|&(n, _)| n <= burst), "seed {seed}");
        let mut times: Vec<u64> = runs.iter().map(|r| r.0).collect();
        times.sort_unstable();
        let limit = (rate + burst) as usize;
        for (i, &t) in times.iter().enumerate() {
            let in_window = times[i..].partition_point(|&u| u < t + 1_000);
            assert!(
                in_window <= limit,
                "seed {seed}: {in_window} in 1 s from {t}"
            );
        }
    }
}

/// One member holding all the failures still books only its own slots: 1/N of the rate.
#[test]
fn a_share_books_only_its_slots_and_still_compresses() {
    let b = budget(100, 10); // 100 ms slots
    let mut s = Scheduler::new(b);
    s.set_share(SlotShare::new(1, 4).expect("valid"));
    let p = policy(None);
    let now = 1_000_000;
    let mut last = 0;
    for i in 0..400 {
        let d = delay(&s.apply(&p, retry(0), &ask(&i.to_string(), now)));
        let slot = b.slot_of(now + d);
        assert_eq!(slot % 4, 1);
        last = slot;
    }
    // 40 full slots of ours, every fourth: 160 slots from the first.
    assert_eq!(last, b.slot_of(now) + 1 + 39 * 4);
    assert_eq!(s.runs(), 1, "not-ours slots between ours join one run");
}

/// A change of share never books a slot this member passed over under the old one (it may
/// hold another member's bookings), and books only slots of the new share afterwards.
#[test]
fn a_new_share_keeps_clear_of_the_old_partition_below_the_old_book() {
    let b = budget(100, 10); // 100 ms slots
    let p = policy(None);
    let now = 1_000_000;
    let first = b.slot_of(now);
    let mut s = Scheduler::new(b);
    s.set_share(SlotShare::new(0, 2).expect("valid"));
    for i in 0..50 {
        s.apply(&p, retry(0), &ask(&format!("a{i}"), now)); // 5 full slots: first + 0,2,..,8
    }
    // A partial slot: 5 more in the next slot of ours.
    for i in 0..5 {
        s.apply(&p, retry(0), &ask(&format!("b{i}"), now));
    }
    s.set_share(SlotShare::new(1, 3).expect("valid"));
    let d = delay(&s.apply(&p, retry(0), &ask("c", now)));
    let slot = b.slot_of(now + d);
    assert!(slot > first + 10, "slot {slot} lies under the old book");
    assert!(SlotShare::new(1, 3).unwrap().owns(slot));
}

/// Nor a slot before its first booking or between two runs: under the old share those
/// were other members' slots (before the fix, the next booking under the whole budget
/// took slot 110, another member's, below this member's furthest booking).
#[test]
fn a_new_share_books_past_the_whole_old_book_gaps_included() {
    let b = budget(10, 1); // 100 ms slots, 1 each
    let p = policy(None);
    let now = 10_000;
    let mut s = Scheduler::new(b);
    s.set_share(SlotShare::new(1, 3).expect("valid"));
    let mut slots = Vec::new();
    for i in 0..3 {
        slots.push(b.slot_of(now + delay(&s.apply(&p, retry(1_000), &ask(&format!("a{i}"), now)))));
    }
    // A second run further on, with free slots of ours in between.
    slots.push(b.slot_of(now + delay(&s.apply(&p, retry(10_000), &ask("far", now)))));
    assert_eq!(slots, [112, 115, 118, 202]);
    s.set_share(SlotShare::WHOLE);
    let d = delay(&s.apply(&p, retry(1_000), &ask("c", now)));
    assert_eq!(b.slot_of(now + d), 203);
}
