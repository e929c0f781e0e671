//! The retry-budget scheduler driven by arbitrary traffic: bytes choose the budget, the
//! run cap (small, so compaction runs often), and a sequence of asks with a moving clock
//! (forward, far forward, a lagging caller) and share changes. After every step: no slot
//! holds more than `burst`, no retry runs earlier than asked or in a slot not its
//! member's, and the book's invariants hold. Built with debug assertions, so any
//! arithmetic overflow fails too.

use std::collections::HashMap;

use rebound_policy::{
    Decision, ResolvedPolicy, RetryBudget, RetryPolicySpec, Scheduler, SlotShare, resolve,
    retry_budget::Ask,
};

/// Reads the input front to back; zeros once it runs out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
}

fn policy(max_retry_duration: Option<&str>) -> ResolvedPolicy {
    let mut spec = serde_json::json!({
        "queues": ["q"],
        "backoff": {"strategy": "constant", "base": "1s", "cap": "1s"},
    });
    if let Some(limit) = max_retry_duration {
        spec["maxRetryDuration"] = limit.into();
    }
    let spec: RetryPolicySpec = serde_json::from_value(spec).expect("a valid spec");
    resolve(&spec).expect("a valid policy")
}

/// One input: never panics; the budget holds after every step.
pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let budget = RetryBudget {
        rate_per_second: 1 + input.u32() % 100_000,
        burst: 1 + u32::from(input.u8() % 8),
    };
    if budget.check().is_err() {
        return;
    }
    let runs = 1 + usize::from(input.u8() % 16);
    let policy = policy(match input.u8() % 3 {
        0 => None,
        1 => Some("2s"),
        _ => Some("1h"),
    });
    let mut s = Scheduler::with_capacity(budget, 0, runs);
    let mut now = u64::from(input.u32()) << (input.u8() % 33);
    let mut per_slot: HashMap<u64, u32> = HashMap::new();
    while !input.0.is_empty() {
        let op = input.u8();
        match op % 16 {
            0 => {
                let members = 1 + u32::from(input.u8() % 4);
                let member = u32::from(input.u8()) % members;
                s.set_share(SlotShare { member, members });
                s.check_book().expect("book consistent");
                continue;
            }
            1 => now = now.saturating_add(u64::from(input.u32())),
            2 => now = now.saturating_sub(u64::from(input.u16())),
            _ => now = now.saturating_add(u64::from(input.u8())),
        }
        let delay_ms = match op >> 6 {
            0 => u64::from(input.u8()),
            1 | 2 => u64::from(input.u16()),
            _ => u64::from(input.u32()),
        };
        let ask = Ask {
            queue: "q",
            job_id: None,
            attempt: 1,
            now_ms: now,
            first_failure_ms: Some(now.saturating_sub(u64::from(input.u8()) * 10)),
        };
        let got = s.apply(&policy, Decision::Retry { delay_ms }, &ask);
        if let Decision::Retry { delay_ms: d } = got.decision {
            assert!(d >= delay_ms.min(u64::MAX - now), "moved earlier");
            let slot = budget.slot_of(now + d);
            assert!(s.share().owns(slot), "booked a slot of another member");
            let n = per_slot.entry(slot).or_default();
            *n += 1;
            assert!(*n <= budget.burst, "slot {slot} over burst");
        }
        s.check_book().expect("book consistent");
    }
}
