//! The slot book: which slots are taken, as runs of consecutive booked slots.

use std::collections::BTreeMap;

use super::{BookError, SlotShare};

/// A run of booked slots `[start, end)`: every slot full except the last, which holds
/// `fill` (1..=burst) retries. Runs never overlap; a run whose last slot is full never
/// touches the next run (they are merged), so the slot after it is free.
#[derive(Clone, Copy, Debug)]
pub(super) struct Run {
    end: u64,
    fill: u32,
}

/// With a share other than the whole, a run also covers the slots of other members between
/// this member's booked ones (they are "not ours", which books the same as full), so a
/// member's bookings still compress into runs.
#[derive(Debug)]
pub(super) struct Slots {
    burst: u32,
    pub(super) share: SlotShare,
    pub(super) max_runs: usize,
    /// Keyed by the run's first slot.
    pub(super) runs: BTreeMap<u64, Run>,
}

impl Slots {
    pub(super) fn new(burst: u32, max_runs: usize) -> Self {
        Self {
            burst,
            share: SlotShare::WHOLE,
            max_runs,
            runs: BTreeMap::new(),
        }
    }

    /// Before a change of share: every slot from `from` (the first not forgotten) to the
    /// end of the last run counts as full. The gaps between runs and before the first one
    /// hold slots of other members under the old share, which may be booked.
    pub(super) fn seal(&mut self, from: u64) {
        let Some(end) = self.runs.last_key_value().map(|(_, run)| run.end) else {
            return;
        };
        let start = self
            .runs
            .first_key_value()
            .map_or(from, |(start, _)| (*start).min(from));
        self.runs.clear();
        self.runs.insert(
            start,
            Run {
                end,
                fill: self.burst,
            },
        );
    }

    /// Whether `[from, to)` holds no slot this member owns.
    fn none_owned(&self, from: u64, to: u64) -> bool {
        self.share.next_owned(from) >= to
    }

    /// Runs within the cap, each non-empty and ending before the next starts, last-slot
    /// fill within `1..=burst`, and a run whose last slot is full never touching the next
    /// (with no slot of ours between, they are one run).
    pub(super) fn check(&self) -> Result<(), BookError> {
        let fail = |what: String| Err(BookError(what));
        if self.runs.len() > self.max_runs {
            return fail(format!(
                "{} runs over the cap {}",
                self.runs.len(),
                self.max_runs
            ));
        }
        let mut prev_end = None;
        for (&start, run) in &self.runs {
            if start >= run.end {
                return fail(format!("empty run [{start}, {})", run.end));
            }
            if !(1..=self.burst).contains(&run.fill) {
                return fail(format!(
                    "run at {start} fills {} of {}",
                    run.fill, self.burst
                ));
            }
            if let Some((end, fill)) = prev_end {
                if start < end {
                    return fail(format!(
                        "run at {start} starts inside the one ending at {end}"
                    ));
                }
                if fill == self.burst && self.none_owned(end, start) {
                    return fail(format!(
                        "full run ending at {end} touches the run at {start}"
                    ));
                }
            }
            prev_end = Some((run.end, run.fill));
        }
        Ok(())
    }

    /// Forgets runs that ended before slot `now`.
    pub(super) fn forget_before(&mut self, now: u64) {
        while let Some(entry) = self.runs.first_entry() {
            if entry.get().end > now {
                break;
            }
            entry.remove();
        }
    }

    /// The first slot at or after `slot` that this member owns and has room.
    pub(super) fn find_free(&self, slot: u64) -> u64 {
        let mut slot = self.share.next_owned(slot);
        // Each turn moves past one run, so this ends within the number of runs.
        while slot != u64::MAX {
            match self.runs.range(..=slot).next_back() {
                Some((_, run)) if slot < run.end => {
                    // A partial last slot was booked under the current share: it is ours.
                    if run.fill < self.burst {
                        return run.end - 1;
                    }
                    slot = self.share.next_owned(run.end);
                }
                _ => return slot,
            }
        }
        slot
    }

    /// Takes one place in `slot`, which [`Self::find_free`] returned. The run that takes
    /// it is picked after any compaction, which may have merged the gap `slot` lies in.
    pub(super) fn book(&mut self, slot: u64) {
        let burst = self.burst;
        let mut compacted = false;
        let start = loop {
            let prev = self.runs.range(..=slot).next_back().map(|(s, r)| (*s, *r));
            match prev {
                // The partial last slot of a run.
                Some((start, run)) if slot.saturating_add(1) == run.end && run.fill < burst => {
                    self.set(start, run.end, run.fill + 1);
                    break start;
                }
                // Inside a run otherwise: only after compaction merged the (free) gap
                // holding `slot`, which is now counted as full: the place is taken.
                Some((_, run)) if slot < run.end => {
                    debug_assert!(compacted, "find_free returned a full slot");
                    return;
                }
                // Right after a run whose last slot is full, with no slot of ours between:
                // the run grows.
                Some((start, run)) if run.fill == burst && self.none_owned(run.end, slot) => {
                    self.set(start, slot.saturating_add(1), 1);
                    break start;
                }
                _ if self.runs.len() < self.max_runs => {
                    self.set(slot, slot.saturating_add(1), 1);
                    break slot;
                }
                // At the cap: compact once, then pick the run again.
                _ if !compacted => {
                    compacted = true;
                    self.compact();
                }
                // Out of runs even after compacting (a cap of one run): the gap up to
                // `slot` is counted as full (conservative).
                Some((start, _)) => {
                    self.set(start, slot.saturating_add(1), 1);
                    break start;
                }
                // `slot` precedes every run: the first run now starts at `slot`, and the
                // slots in between count as full.
                None => {
                    let Some((first, run)) = self.runs.pop_first() else {
                        return;
                    };
                    debug_assert!(first > slot);
                    self.runs.insert(slot, run);
                    break slot;
                }
            }
        };
        self.merge_after(start);
    }

    /// At the run cap: merges the runs separated by the smallest gaps until a quarter of
    /// the cap is free, counting those gaps as full (conservative: it can only slow
    /// retries down, by at most the merged gaps, the shortest there were). Runs once per
    /// quarter of the cap new runs, so its O(n log n) is O(log n) per booking.
    fn compact(&mut self) {
        debug_assert!(self.check().is_ok(), "{:?}", self.check());
        let target = (self.max_runs - self.max_runs / 4).min(self.max_runs - 1);
        if target == 0 || self.runs.len() < 2 {
            return;
        }
        let runs: Vec<(u64, Run)> = self.runs.iter().map(|(s, r)| (*s, *r)).collect();
        let merges = runs.len() - target;
        // Gap i lies between run i and run i + 1; merge the `merges` smallest (ties by
        // position, so the result is a function of the book alone).
        let mut gaps: Vec<(u64, usize)> = runs
            .windows(2)
            .enumerate()
            // Runs are disjoint, so this never saturates; if they were not, an overlap
            // is the smallest gap, merged first, which repairs it.
            .map(|(i, w)| (w[1].0.saturating_sub(w[0].1.end), i))
            .collect();
        gaps.select_nth_unstable(merges - 1);
        let mut merge_after = vec![false; runs.len()];
        for &(_, i) in &gaps[..merges] {
            merge_after[i] = true;
        }
        self.runs.clear();
        let mut current = runs[0];
        for (i, next) in runs.into_iter().enumerate().skip(1) {
            if merge_after[i - 1] {
                // The merged run ends where the later of the two does.
                if next.1.end >= current.1.end {
                    current.1 = next.1;
                }
            } else {
                self.runs.insert(current.0, current.1);
                current = next;
            }
        }
        self.runs.insert(current.0, current.1);
    }

    fn set(&mut self, start: u64, end: u64, fill: u32) {
        self.runs.insert(start, Run { end, fill });
    }

    /// Joins the run at `start` with the next one when its last slot is full and they touch.
    fn merge_after(&mut self, start: u64) {
        let Some(run) = self.runs.get(&start).copied() else {
            return;
        };
        if run.fill < self.burst {
            return;
        }
        let Some((&next_start, _)) = self.runs.range(run.end..).next() else {
            return;
        };
        if !self.none_owned(run.end, next_start) {
            return;
        }
        if let Some(next) = self.runs.remove(&next_start)
            && let Some(r) = self.runs.get_mut(&start)
        {
            *r = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book_of(runs: &[(u64, u64, u32)]) -> Slots {
        let mut slots = Slots::new(2, 8);
        for &(start, end, fill) in runs {
            slots.runs.insert(start, Run { end, fill });
        }
        slots
    }

    /// The check the property tests rely on sees each kind of broken book.
    #[test]
    fn the_check_sees_every_broken_book() {
        assert_eq!(book_of(&[(1, 3, 1), (5, 6, 2)]).check(), Ok(()));
        for broken in [
            vec![(10, 14, 2), (12, 13, 1)], // overlap: the book
            vec![(1, 3, 2), (3, 4, 1)],     // a full run touching the next
            vec![(5, 5, 1)],                // empty
            vec![(5, 6, 0)],                // fill 0
            vec![(5, 6, 3)],                // over burst
        ] {
            assert!(book_of(&broken).check().is_err(), "{broken:?}");
        }
        let mut over = book_of(&[]);
        for k in 0..9 {
            over.runs.insert(
                k * 3,
                Run {
                    end: k * 3 + 1,
                    fill: 1,
                },
            );
        }
        assert!(over.check().is_err(), "over the cap");
    }

    /// A run is forgotten once its last slot is in the past, not one slot later.
    #[test]
    fn runs_are_forgotten_as_soon_as_they_end() {
        let mut slots = book_of(&[(1, 3, 1), (5, 6, 2)]);
        slots.forget_before(5);
        assert_eq!(slots.runs.keys().copied().collect::<Vec<_>>(), [5]);
        slots.forget_before(6);
        assert!(slots.runs.is_empty());
    }
}
