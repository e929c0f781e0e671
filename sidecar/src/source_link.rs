//! Whether the configuration source is reachable, for `GetPolicy`, the metrics and the
//! logs. Only watch mode can lose its source (the API server); file mode is always
//! connected. While disconnected the sidecar keeps answering from the last good
//! configuration, and says since when it has not been able to see changes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The link's state; one log line per transition.
#[derive(Debug, Default)]
pub struct SourceLink {
    /// `0` while connected, else when the source was lost, in Unix ms (at least 1).
    disconnected_since_ms: AtomicU64,
    /// The current disconnection was logged (a start that fails is logged once too).
    announced: AtomicBool,
    disconnects: AtomicU64,
}

/// A reading of [`SourceLink`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkStatus {
    pub connected: bool,
    /// When the source was lost, Unix ms; `None` while connected.
    pub disconnected_since_ms: Option<u64>,
    /// Times the source was lost since the process started.
    pub disconnects: u64,
}

impl SourceLink {
    /// Not connected yet, since `now_ms` (a watch that has not listed its ConfigMap yet). No
    /// log line: starting is not a transition.
    pub fn starting(&self, now_ms: u64) {
        self.disconnected_since_ms
            .store(now_ms.max(1), Ordering::Relaxed);
        self.announced.store(false, Ordering::Relaxed);
    }

    /// The source answered. Returns `true` (and logs one line) on the transition from a
    /// logged disconnection; a first connection after [`SourceLink::starting`] is quiet.
    pub fn connected(&self, origin: &str, now_ms: u64, serving: Option<&str>) -> bool {
        let since = self.disconnected_since_ms.swap(0, Ordering::Relaxed);
        let announced = self.announced.swap(false, Ordering::Relaxed);
        if since == 0 || !announced {
            return false;
        }
        tracing::info!(
            origin,
            disconnected_for_s = now_ms.saturating_sub(since) as f64 / 1e3,
            serving = serving.unwrap_or(""),
            "configuration source connected; changes are seen again"
        );
        true
    }

    /// The source failed. Returns `true` (and logs one line) on the transition from
    /// connected, or on the first failure after [`SourceLink::starting`]; further failures
    /// while disconnected are not logged here. `state` is the configuration's (`none`: no
    /// answer can be given until the source is back; else the last good one answers).
    pub fn disconnected(
        &self,
        origin: &str,
        now_ms: u64,
        error: &dyn std::fmt::Display,
        serving: Option<&str>,
        state: &str,
    ) -> bool {
        let _ = self.disconnected_since_ms.compare_exchange(
            0,
            now_ms.max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        let lost = !self.announced.swap(true, Ordering::Relaxed);
        if lost {
            self.disconnects.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                origin,
                %error,
                serving = serving.unwrap_or(""),
                state,
                "configuration source disconnected; changes are not seen until it is back"
            );
        }
        lost
    }

    pub fn status(&self) -> LinkStatus {
        let since = self.disconnected_since_ms.load(Ordering::Relaxed);
        LinkStatus {
            connected: since == 0,
            disconnected_since_ms: (since != 0).then_some(since),
            disconnects: self.disconnects.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions_are_reported_once_each() {
        let link = SourceLink::default();
        assert!(link.status().connected, "file mode: connected");
        link.starting(1_000);
        assert_eq!(link.status().disconnected_since_ms, Some(1_000));
        assert!(
            link.disconnected("o", 1_200, &"refused", None, "none"),
            "a failed start"
        );
        assert!(!link.disconnected("o", 1_300, &"refused", None, "none"));
        assert_eq!(link.status().disconnected_since_ms, Some(1_000));
        assert!(link.connected("o", 1_500, None));
        assert!(!link.connected("o", 1_600, None));
        link.starting(1_700);
        assert!(!link.connected("o", 1_800, None), "a clean start is quiet");
        assert!(link.status().connected);
        assert!(link.disconnected("o", 2_000, &"refused", Some("h"), "active"));
        assert!(!link.disconnected("o", 3_000, &"refused", Some("h"), "active"));
        assert_eq!(
            link.status(),
            LinkStatus {
                connected: false,
                disconnected_since_ms: Some(2_000),
                disconnects: 2
            }
        );
        assert!(link.connected("o", 4_000, Some("h")));
        assert!(link.status().connected);
    }
}
