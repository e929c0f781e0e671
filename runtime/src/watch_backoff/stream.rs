//! [`WatchBackoff`] applied to a kube-runtime `watcher` stream, in place of kube's
//! `.default_backoff()` / `.backoff()`. Those reset only on an event, and a watch that
//! resumes quietly after an outage emits none: the delays kept growing across outages, and
//! the `410 Gone` an API server answers after a restart (its watch cache starts at a newer
//! version) waited one more, longer step before the relist. Here:
//!
//! - an event resets the backoff, and so does a failure more than [`RESET_AFTER`] after
//!   the previous one (the watch was up in between);
//! - a first `410 Gone` relists at once (a second in a row backs off);
//! - a `Retry-After` the server put in a 429's `Status` is a floor under the next delay
//!   (a 503's is not: see [`crate::api_client::ServerRetry`]).

use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::runtime::watcher;
use tokio::time::Instant;

use super::WatchBackoff;

/// A failure this long after the previous one starts the backoff again.
pub const RESET_AFTER: Duration = Duration::from_secs(30);

struct State<T> {
    stream: BoxStream<'static, Result<T, watcher::Error>>,
    backoff: WatchBackoff,
    /// Slept before the next poll: the delay chosen after the last error.
    pending: Option<Duration>,
    last_failure: Option<Instant>,
    gone: bool,
}

/// `stream` with `backoff` between its failures; errors are still passed on (to be
/// logged), the stream itself never ends on one.
pub fn with_backoff<S, T>(
    stream: S,
    backoff: WatchBackoff,
) -> impl Stream<Item = Result<T, watcher::Error>> + Send
where
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    T: Send + 'static,
{
    let state = State {
        stream: stream.boxed(),
        backoff,
        pending: None,
        last_failure: None,
        gone: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        if let Some(delay) = st.pending.take() {
            tokio::time::sleep(delay).await;
        }
        let item = st.stream.next().await?;
        match &item {
            Ok(_) => {
                st.backoff.reset();
                st.gone = false;
            }
            Err(error) => {
                let now = Instant::now();
                if st
                    .last_failure
                    .is_some_and(|t| now.duration_since(t) > RESET_AFTER)
                {
                    st.backoff.reset();
                }
                st.last_failure = Some(now);
                let gone = is_gone(error);
                if gone && !st.gone {
                    // The watcher relists on its next poll: at once, once.
                    st.gone = true;
                } else {
                    st.gone = gone;
                    if let Some(wait) = retry_after(error) {
                        st.backoff.retry_after(wait);
                    }
                    st.pending = st.backoff.next();
                }
            }
        }
        Some((item, st))
    })
}

/// `.with_watch_backoff(b)` on a watcher stream: [`with_backoff`] in method form.
pub trait WatchBackoffExt<T: Send + 'static>:
    Stream<Item = Result<T, watcher::Error>> + Send + Sized + 'static
{
    fn with_watch_backoff(
        self,
        backoff: WatchBackoff,
    ) -> BoxStream<'static, Result<T, watcher::Error>> {
        with_backoff(self, backoff).boxed()
    }
}

impl<S, T> WatchBackoffExt<T> for S
where
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    T: Send + 'static,
{
}

fn status(error: &watcher::Error) -> Option<&kube::core::Status> {
    match error {
        watcher::Error::WatchError(status) => Some(status),
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status),
        _ => None,
    }
}

fn is_gone(error: &watcher::Error) -> bool {
    status(error).is_some_and(|s| s.code == 410)
}

fn retry_after(error: &watcher::Error) -> Option<Duration> {
    let status = status(error).filter(|s| s.code == 429)?;
    let seconds = status.details.as_ref()?.retry_after_seconds;
    (seconds > 0).then(|| Duration::from_secs(u64::from(seconds)))
}

#[cfg(test)]
mod tests {
    use kube::core::Status;

    use super::*;
    use crate::watch_backoff::SIDECAR_CAP;

    fn gone() -> watcher::Error {
        watcher::Error::WatchError(Status::failure("too old", "Expired").with_code(410).boxed())
    }

    fn refused() -> watcher::Error {
        watcher::Error::NoResourceVersion
    }

    /// Times each item is delivered at, on a paused clock.
    async fn delivery_times(items: Vec<Result<u8, watcher::Error>>) -> Vec<Duration> {
        let start = Instant::now();
        let stream = with_backoff(
            futures::stream::iter(items),
            WatchBackoff::seeded("t", SIDECAR_CAP, 1),
        );
        stream.map(|_| start.elapsed()).collect().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_gone_relists_at_once_a_second_backs_off() {
        let t = delivery_times(vec![
            Ok(1),
            Err(gone()),
            Ok(2),
            Err(gone()),
            Err(gone()),
            Ok(3),
        ])
        .await;
        assert_eq!(t[2], t[1], "the relist after one 410 is not delayed");
        assert_eq!(t[4], t[3]);
        assert!(t[5] > t[4], "a second 410 in a row waits");
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_within_the_cap_and_an_event_resets() {
        let mut items: Vec<Result<u8, watcher::Error>> = (0..20).map(|_| Err(refused())).collect();
        items.push(Ok(1));
        items.push(Err(refused()));
        items.push(Ok(2));
        let t = delivery_times(items).await;
        for pair in t.windows(2) {
            assert!(pair[1] - pair[0] <= SIDECAR_CAP);
        }
        // After the event, the next failure waits at most the base delay.
        assert!(t[22] - t[21] <= crate::watch_backoff::BASE);
    }
}
