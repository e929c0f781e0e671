//! Coalescing a burst of policy events in one namespace into one compile.
//!
//! The applier already merges the triggers that arrive while a namespace's reconcile runs,
//! but a reconcile that starts in the middle of a burst (`kubectl apply -f` of a directory,
//! a GitOps sync) compiles, compresses and writes a document that the next create makes
//! stale at once. So a reconcile that finds its namespace in a burst (two policy events
//! less than [`QUIET`] apart, the last one less than [`QUIET`] ago) waits until the burst
//! pauses for [`QUIET`], at most [`MAX_WAIT`]: a burst costs one compile per second
//! instead of one per reconcile. A lone change, and the first event of a burst, are not
//! delayed at all.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A pause this long ends a burst.
pub const QUIET: Duration = Duration::from_millis(100);

/// The longest a reconcile waits for a burst to pause, so a namespace under a steady
/// stream of changes is still compiled once a second.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// Namespaces held at most before quiet ones are dropped (each entry is a name and two
/// instants; the map is pruned, never grows with events).
const PRUNE_ABOVE: usize = 1024;

/// The last two policy events of each namespace with recent ones.
#[derive(Default)]
pub struct Bursts {
    recent: Mutex<HashMap<String, (Instant, Instant)>>,
}

impl Bursts {
    /// A policy event in `namespace` (a create, an edit of the spec, a deletion).
    pub fn event(&self, namespace: &str, now: Instant) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        match recent.get_mut(namespace) {
            Some((previous, last)) => (*previous, *last) = (*last, now),
            None => {
                if recent.len() >= PRUNE_ABOVE {
                    recent.retain(|_, (_, last)| now.saturating_duration_since(*last) < QUIET);
                }
                // No earlier event: far enough in the past to be no burst.
                let long_ago = now.checked_sub(QUIET).unwrap_or(now);
                recent.insert(namespace.to_owned(), (long_ago, now));
            }
        }
    }

    /// How long to wait before compiling `namespace` for its burst to pause; `None` when
    /// it is in none.
    pub fn pause_due(&self, namespace: &str, now: Instant) -> Option<Duration> {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let (previous, last) = *recent.get(namespace)?;
        let since = now.saturating_duration_since(last);
        if since >= QUIET {
            recent.remove(namespace);
            return None;
        }
        (last.saturating_duration_since(previous) < QUIET).then(|| QUIET - since)
    }

    /// Waits while `namespace` is in a burst, at most [`MAX_WAIT`].
    pub async fn settle(&self, namespace: &str) {
        let deadline = Instant::now() + MAX_WAIT;
        while let Some(wait) = self.wait(namespace, Instant::now(), deadline) {
            tokio::time::sleep(wait).await;
        }
    }

    /// The next sleep of [`Bursts::settle`]: until the burst may have paused, never past
    /// `deadline`.
    fn wait(&self, namespace: &str, now: Instant, deadline: Instant) -> Option<Duration> {
        let left = deadline.saturating_duration_since(now);
        let due = self.pause_due(namespace, now)?;
        (!left.is_zero()).then(|| due.min(left))
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
        assert_eq!(b.pause_due("a", t), None);
        assert_eq!(b.pause_due("b", t), None);
    }

    #[test]
    fn a_burst_waits_until_it_pauses() {
        let b = Bursts::default();
        let t = Instant::now();
        b.event("a", t);
        b.event("a", t + 5 * MS);
        assert_eq!(b.pause_due("a", t + 10 * MS), Some(QUIET - 5 * MS));
        // Paused: compiled, and forgotten.
        assert_eq!(b.pause_due("a", t + 5 * MS + QUIET), None);
        assert!(b.is_empty());
        // Events further apart than QUIET are no burst.
        b.event("a", t + 300 * MS);
        b.event("a", t + 450 * MS);
        assert_eq!(b.pause_due("a", t + 460 * MS), None);
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

    #[test]
    fn a_steady_stream_is_compiled_after_max_wait() {
        let b = Bursts::default();
        let t = Instant::now();
        let deadline = t + MAX_WAIT;
        let mut now = t;
        // An event every 10 ms never pauses for QUIET: the waits end at the deadline.
        while let Some(wait) = {
            b.event("a", now);
            b.event("a", now);
            b.wait("a", now, deadline)
        } {
            assert!(wait <= QUIET);
            now += wait.min(10 * MS);
        }
        assert_eq!(now, deadline);
    }
}
