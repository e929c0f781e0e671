//! Coalescing a burst of policy events in one namespace into one compile.
//!
//! The applier already merges the triggers that arrive while a namespace's reconcile runs,
//! but a reconcile that starts in the middle of a burst (`kubectl apply -f` of a directory,
//! a GitOps sync) compiles, compresses and writes a document that the next create makes
//! stale at once. So a reconcile that finds its namespace in a burst (two policy events
//! less than [`QUIET`] apart, the last one less than [`QUIET`] ago) is put off until the
//! burst pauses for [`QUIET`], or until [`MAX_WAIT`] has passed since the namespace's
//! last compile began: a burst costs one compile per second instead of one per reconcile,
//! and a long burst is compiled (and its policies' statuses written) as it goes, so only
//! the last second's policies are left when it ends. A reconcile that itself takes longer
//! than [`MAX_WAIT`] (the status writes of a large burst) is followed by the next compile
//! at once, without a pause in between. A lone change, and the first event of a burst,
//! are not delayed at all. A put-off reconcile returns at once with a requeue, so it holds
//! none of the applier's concurrent slots while it waits.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A pause this long ends a burst.
pub const QUIET: Duration = Duration::from_millis(100);

/// The most time between the starts of two compiles of a namespace in a burst, so a
/// namespace under a steady stream of changes is still compiled once a second.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// Namespaces held at most before quiet ones are dropped (each entry is a name and three
/// instants; the map is pruned, never grows with events).
const PRUNE_ABOVE: usize = 1024;

/// A namespace with recent policy events.
struct Recent {
    previous: Instant,
    last: Instant,
    /// When its last compile began (or, before its first, since when it has been put off):
    /// the next one in a burst begins at most [`MAX_WAIT`] later.
    since: Option<Instant>,
}

/// The recent policy events of each namespace.
#[derive(Default)]
pub struct Bursts {
    recent: Mutex<HashMap<String, Recent>>,
}

impl Bursts {
    /// A policy event in `namespace` (a create, an edit of the spec, a deletion).
    pub fn event(&self, namespace: &str, now: Instant) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        match recent.get_mut(namespace) {
            Some(r) => (r.previous, r.last) = (r.last, now),
            None => {
                if recent.len() >= PRUNE_ABOVE {
                    recent.retain(|_, r| now.saturating_duration_since(r.last) < QUIET);
                }
                recent.insert(
                    namespace.to_owned(),
                    Recent {
                        // No earlier event: far enough in the past to be no burst.
                        previous: now.checked_sub(QUIET).unwrap_or(now),
                        last: now,
                        since: None,
                    },
                );
            }
        }
    }

    /// `Some(wait)` when `namespace` is in a burst and its compile should be put off for
    /// `wait`; `None` to compile now.
    pub fn defer(&self, namespace: &str, now: Instant) -> Option<Duration> {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let r = recent.get_mut(namespace)?;
        let since = now.saturating_duration_since(r.last);
        if since >= QUIET {
            recent.remove(namespace);
            return None;
        }
        if r.last.saturating_duration_since(r.previous) >= QUIET {
            r.since = Some(now);
            return None;
        }
        let started = *r.since.get_or_insert(now);
        let left = MAX_WAIT.saturating_sub(now.saturating_duration_since(started));
        if left.is_zero() {
            // Compiled now; a burst that goes on waits for the next MAX_WAIT from here.
            r.since = Some(now);
            return None;
        }
        Some((QUIET - since).min(left))
    }

    /// Namespaces held.
    pub fn len(&self) -> usize {
        self.recent.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_lone_event_is_not_delayed() {
        let b = Bursts::default();
        let t = Instant::now();
        b.event("a", t);
        assert_eq!(b.defer("a", t), None);
        assert_eq!(b.defer("b", t), None);
    }

    #[test]
    fn a_burst_is_put_off_until_it_pauses() {
        let b = Bursts::default();
        let t = Instant::now();
        b.event("a", t);
        b.event("a", t + 5 * MS);
        assert_eq!(b.defer("a", t + 10 * MS), Some(QUIET - 5 * MS));
        // Paused: compiled, and forgotten.
        assert_eq!(b.defer("a", t + 5 * MS + QUIET), None);
        assert!(b.is_empty());
        // Events further apart than QUIET are no burst.
        b.event("a", t + 300 * MS);
        b.event("a", t + 450 * MS);
        assert_eq!(b.defer("a", t + 460 * MS), None);
    }

    #[test]
    fn a_steady_stream_is_compiled_once_per_max_wait() {
        let b = Bursts::default();
        let t = Instant::now();
        // An event every 10 ms never pauses for QUIET.
        let mut compiles = Vec::new();
        for i in 0..250u32 {
            let now = t + i * 10 * MS;
            b.event("a", now);
            if b.defer("a", now + MS).is_none() {
                compiles.push(now - t);
            }
        }
        // The first event alone is no burst; then one compile per MAX_WAIT, counted
        // from the start of the one before.
        assert_eq!(
            compiles,
            [Duration::ZERO, 1000 * MS, 2000 * MS],
            "{compiles:?}"
        );
    }

    #[test]
    fn a_reconcile_longer_than_max_wait_is_followed_by_a_compile_at_once() {
        let b = Bursts::default();
        let t = Instant::now();
        b.event("a", t);
        assert_eq!(b.defer("a", t), None, "a lone event is compiled at once");
        // That reconcile writes statuses for 3 s while the burst goes on.
        for i in 1..=300u32 {
            b.event("a", t + i * 10 * MS);
        }
        assert_eq!(
            b.defer("a", t + 3001 * MS),
            None,
            "no second pause between the compiles of a long burst"
        );
        // The next one waits for MAX_WAIT from that compile's start.
        b.event("a", t + 3005 * MS);
        b.event("a", t + 3010 * MS);
        assert_eq!(b.defer("a", t + 3020 * MS), Some(QUIET - 10 * MS));
        b.event("a", t + 3990 * MS);
        b.event("a", t + 4000 * MS);
        assert_eq!(b.defer("a", t + 4001 * MS), None);
    }

    #[test]
    fn quiet_namespaces_are_pruned() {
        let b = Bursts::default();
        let t = Instant::now();
        for i in 0..PRUNE_ABOVE {
            b.event(&format!("ns-{i}"), t);
        }
        b.event("late", t + QUIET);
        assert_eq!(b.len(), 1);
    }
}
