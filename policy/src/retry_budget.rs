//! Retry budgets: how fast one sidecar may schedule a policy's retries.
//!
//! Time is cut into slots of `1000 × burst / ratePerSecond` milliseconds, aligned to the
//! Unix epoch; each slot admits at most `burst` retries. A retry is counted in the slot of
//! the time it is *scheduled to run* (now + delay), not when it is asked for, so retries
//! waiting in backoff count against the budget. A retry whose wanted time falls in a full
//! slot is not dropped: it moves to the first slot at or after that time with room, and
//! its delay is stretched to that slot's start.
//!
//! [`Scheduler`] is pure and clock-injected (every call says what time it is); it never
//! touches `decide`, which stays a function of policy and request. Slot arithmetic is done
//! in integers: slot `k` covers `[k × 1000 × burst / rate, (k+1) × 1000 × burst / rate)`
//! ms exactly, with no rounding of the slot length.
//!
//! Memory is bounded whatever the input: booked slots are held as runs (consecutive full
//! slots with a possibly partial last one), slots in the past are forgotten, the number of
//! runs is capped (at the cap, the runs with the smallest gaps between them are merged,
//! those gaps counted as full, which can only lower the rate), and the memo of answers is a
//! fixed-capacity map evicting its oldest.

use std::{
    collections::{HashMap, VecDeque},
    hash::{BuildHasher, RandomState},
};

use serde::{Deserialize, Serialize};

use self::slots::Slots;
use crate::{
    decide::{Core, Decision, GiveUpReason},
    limits,
    resolve::RetryBudget,
};

/// Which slots this sidecar may book: slot `k` is booked only by member `k % members`.
///
/// Members of one budget (sidecars serving the same policy in a namespace, in one stable
/// order) each hold a different `member` of the same `members`, so no two ever book the
/// same slot and together they schedule at most `burst` per slot without exchanging a
/// word per retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlotShare {
    pub member: u32,
    pub members: u32,
}

impl SlotShare {
    /// The whole budget: member 0 of 1 (file mode, or a fleet of one).
    pub const WHOLE: SlotShare = SlotShare {
        member: 0,
        members: 1,
    };

    /// `member` of `members`, or `None` unless `members >= 1` and `member < members`.
    pub fn new(member: u32, members: u32) -> Option<Self> {
        (member < members).then_some(Self { member, members })
    }

    /// Whether this member may book `slot`.
    pub fn owns(&self, slot: u64) -> bool {
        let members = u64::from(self.members.max(1));
        slot % members == u64::from(self.member) % members
    }

    /// The first slot at or after `slot` that this member owns (`u64::MAX` when none is
    /// representable).
    pub fn next_owned(&self, slot: u64) -> u64 {
        let members = u64::from(self.members.max(1));
        let member = u64::from(self.member) % members;
        let rem = slot % members;
        let ahead = (member + members - rem) % members;
        slot.saturating_add(ahead)
    }
}

impl Default for SlotShare {
    fn default() -> Self {
        Self::WHOLE
    }
}

/// `member 2 of 6`, or `whole` for [`SlotShare::WHOLE`].
impl std::fmt::Display for SlotShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::WHOLE {
            f.write_str("whole")
        } else {
            write!(f, "member {} of {}", self.member, self.members)
        }
    }
}

/// Who asks: a repeated question for the same failure is recognised by these.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub queue: &'a str,
    /// Without a job id every question is a new one (its jitter is random too).
    pub job_id: Option<&'a str>,
    pub attempt: u32,
    pub now_ms: u64,
    /// When the job first failed; the deadline counts from it (from now when unknown).
    pub first_failure_ms: Option<u64>,
}

/// A decision after the budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budgeted {
    /// `decide`'s answer, with the delay stretched, or a `Deadline` give-up when the
    /// stretched run would start past the deadline.
    pub decision: Decision,
    /// Milliseconds the budget added to `decide`'s delay (0 when it fitted).
    pub added_ms: u64,
    /// The budget changed the answer (stretched the delay or gave up).
    pub stretched: bool,
    /// The answer came from the memo: no slot was taken.
    pub repeat: bool,
}

/// A broken invariant of the slot book (a bug, never the caller's input).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("retry budget book broken: {0}")]
pub struct BookError(pub(crate) String);

/// One policy's slot book and memo.
#[derive(Debug)]
pub struct Scheduler {
    budget: RetryBudget,
    slots: Slots,
    memo: Memo,
    /// Slots before it have been forgotten: never booked again, whatever time a late
    /// caller says it is (forgetting is monotonic).
    forgotten_before: u64,
}

impl Scheduler {
    pub fn new(budget: RetryBudget) -> Self {
        Self::with_capacity(budget, limits::MEMO_CAPACITY, limits::MAX_RUNS)
    }

    /// Explicit bounds, for tests of the bounds.
    pub fn with_capacity(budget: RetryBudget, memo: usize, runs: usize) -> Self {
        Self {
            budget,
            slots: Slots::new(budget.burst, runs.max(1)),
            memo: Memo::new(memo),
            forgotten_before: 0,
        }
    }

    pub fn budget(&self) -> RetryBudget {
        self.budget
    }

    /// Which slots new bookings may take; [`SlotShare::WHOLE`] until set.
    pub fn share(&self) -> SlotShare {
        self.slots.share
    }

    /// Changes the slots new bookings may take. Bookings already made stay where they
    /// are, and every slot not forgotten up to the end of the last run booked under an
    /// earlier share counts as full (a slot this member did not own then may hold another member's
    /// bookings), so a change never puts a slot this member already passed over at risk:
    /// overlap with another member is only possible past this member's furthest booking.
    pub fn set_share(&mut self, share: SlotShare) {
        let share = SlotShare::new(share.member, share.members).unwrap_or(SlotShare::WHOLE);
        if share != self.slots.share {
            self.slots.seal(self.forgotten_before);
            self.slots.share = share;
        }
    }

    /// Runs of booked slots held now (for the memory bound).
    pub fn runs(&self) -> usize {
        self.slots.runs.len()
    }

    pub fn memo_len(&self) -> usize {
        self.memo.map.len()
    }

    /// Checks the book's invariants, in O(runs): for property tests and fuzzing, which
    /// call it after every step.
    pub fn check_book(&self) -> Result<(), BookError> {
        self.slots.check()
    }

    /// Applies the budget to `decide`'s answer. Only `Retry` answers take a slot; give-ups
    /// pass through unchanged.
    pub fn apply<'p>(
        &mut self,
        policy: impl Into<Core<'p>>,
        decision: Decision,
        ask: &Ask<'_>,
    ) -> Budgeted {
        let policy = policy.into();
        let Decision::Retry { delay_ms } = decision else {
            return Budgeted {
                decision,
                added_ms: 0,
                stretched: false,
                repeat: false,
            };
        };
        let key = ask
            .job_id
            .map(|job| self.memo.key(ask.queue, job, ask.attempt));
        if let Some(key) = key
            && let Some(answer) = self.memo.get(key)
        {
            return answer.expand(policy, ask.now_ms);
        }
        let answer = self.book(policy, delay_ms, ask);
        if let Some(key) = key {
            self.memo.insert(key, Remembered::of(&answer, ask.now_ms));
        }
        answer
    }

    fn book(&mut self, policy: Core<'_>, delay_ms: u64, ask: &Ask<'_>) -> Budgeted {
        let now = ask.now_ms;
        self.forgotten_before = self.forgotten_before.max(self.budget.slot_of(now));
        self.slots.forget_before(self.forgotten_before);
        let wanted = now.saturating_add(delay_ms);
        // A caller whose clock lags another's may not book a slot already forgotten.
        let first = self.budget.slot_of(wanted).max(self.forgotten_before);
        let slot = self.slots.find_free(first);
        // Past the last representable millisecond (or the last slot number, which has no
        // end to book up to): past the horizon.
        let slot_past_horizon = slot == u64::MAX || slot > self.budget.slot_of(u64::MAX);
        let at = if slot == self.budget.slot_of(wanted) {
            wanted
        } else {
            self.budget.slot_start(slot)
        };
        let stretched_delay = at.saturating_sub(now);
        let added_ms = stretched_delay - delay_ms.min(stretched_delay);

        let elapsed = ask
            .first_failure_ms
            .map_or(0, |first| now.saturating_sub(first));
        let (limit, from) = match policy.max_retry_duration_ms {
            Some(limit) => (limit, elapsed),
            None => (limits::MAX_BOOK_AHEAD_MS, 0),
        };
        let next_start = from.saturating_add(stretched_delay);
        if slot_past_horizon || (added_ms > 0 && next_start > limit) {
            return Budgeted {
                decision: Decision::GiveUp {
                    disposition: policy.terminal.clone(),
                    reason: GiveUpReason::Deadline {
                        max_retry_duration_ms: limit,
                        next_start_after_ms: next_start,
                    },
                },
                added_ms: 0,
                stretched: true,
                repeat: false,
            };
        }
        self.slots.book(slot);
        Budgeted {
            decision: Decision::Retry {
                delay_ms: stretched_delay,
            },
            added_ms,
            stretched: added_ms > 0,
            repeat: false,
        }
    }
}

/// An answer as the memo keeps it: numbers only (the disposition is the policy's), so an
/// entry is a few words whatever the policy. A retry is kept as the time it runs, the
/// time its slot was booked for, so a repeat asked later still runs in that slot.
#[derive(Clone, Copy, Debug)]
enum Remembered {
    Retry { at_ms: u64, added_ms: u64 },
    Deadline { limit_ms: u64, next_start_ms: u64 },
}

impl Remembered {
    fn of(answer: &Budgeted, now_ms: u64) -> Self {
        match &answer.decision {
            Decision::Retry { delay_ms } => Self::Retry {
                at_ms: now_ms.saturating_add(*delay_ms),
                added_ms: answer.added_ms,
            },
            // `book` gives up only at the deadline; any other reason is kept as one too
            // rather than as a retry.
            Decision::GiveUp { reason, .. } => match reason {
                GiveUpReason::Deadline {
                    max_retry_duration_ms,
                    next_start_after_ms,
                } => Self::Deadline {
                    limit_ms: *max_retry_duration_ms,
                    next_start_ms: *next_start_after_ms,
                },
                _ => Self::Deadline {
                    limit_ms: 0,
                    next_start_ms: 0,
                },
            },
        }
    }

    /// The same answer again, at `now_ms`, marked as a repeat: a retry runs at the time
    /// booked for it (now, if that has passed).
    fn expand(self, policy: Core<'_>, now_ms: u64) -> Budgeted {
        match self {
            Self::Retry { at_ms, added_ms } => {
                let delay_ms = at_ms.saturating_sub(now_ms);
                Budgeted {
                    decision: Decision::Retry { delay_ms },
                    added_ms: added_ms.min(delay_ms),
                    stretched: added_ms > 0,
                    repeat: true,
                }
            }
            Self::Deadline {
                limit_ms,
                next_start_ms,
            } => Budgeted {
                decision: Decision::GiveUp {
                    disposition: policy.terminal.clone(),
                    reason: GiveUpReason::Deadline {
                        max_retry_duration_ms: limit_ms,
                        next_start_after_ms: next_start_ms,
                    },
                },
                added_ms: 0,
                stretched: true,
                repeat: true,
            },
        }
    }
}

/// Fixed-capacity answers by key, oldest evicted first.
#[derive(Debug)]
struct Memo {
    capacity: usize,
    /// Keys are (queue, job id, attempt) hashed with per-process random keys (SipHash), so
    /// clients cannot craft two failures that share one; two share a key with probability
    /// about 2⁻⁶⁴ per pair.
    keys: RandomState,
    map: HashMap<u64, Remembered>,
    order: VecDeque<u64>,
}

impl Memo {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            keys: RandomState::new(),
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn key(&self, queue: &str, job_id: &str, attempt: u32) -> u64 {
        self.keys.hash_one((queue, job_id, attempt))
    }

    fn get(&self, key: u64) -> Option<Remembered> {
        self.map.get(&key).copied()
    }

    fn insert(&mut self, key: u64, answer: Remembered) {
        if self.capacity == 0 {
            return;
        }
        while self.map.len() >= self.capacity {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.map.remove(&old);
        }
        if self.map.insert(key, answer).is_none() {
            self.order.push_back(key);
        }
    }
}

mod slots;

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
