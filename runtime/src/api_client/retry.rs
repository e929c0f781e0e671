//! In-client retries of the API server's "try again later" answers (429, 503, 504).
//!
//! A 429 (API Priority and Fairness, or a watch cache still initialising) is never retried
//! sooner than its `Retry-After`: the server is up and rationing. A 503 is a server not
//! serving yet: one that is starting answers "not all HTTP paths installed" with a fixed
//! `Retry-After: 5`, a guess at its own start-up. Honoured, it would bring every client
//! that asked in the same second back in the same second, 5 s later, and keep the operator
//! from compiling an edit for most of 5 s after `/readyz`. A 503 (and a 504) therefore
//! waits the same jittered backoff as a refused connection, as short and as spread out.

use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::Body;
use tower::BoxError;
use tower::retry::Policy;

use crate::watch_backoff::{MAX_RETRY_AFTER, WatchBackoff};

/// Retries of one request (cloned per request by tower's retry layer).
#[derive(Clone, Debug)]
pub struct ServerRetry {
    backoff: WatchBackoff,
    retries: u32,
    max_retries: u32,
}

impl ServerRetry {
    /// At most `max_retries` retries, each at most `cap` after the last unless a 429 asks
    /// for longer.
    pub fn new(max_retries: u32, cap: Duration) -> Self {
        Self {
            backoff: WatchBackoff::new("api-client", cap),
            retries: 0,
            max_retries,
        }
    }

    /// The wait before the next try after `status`, or `None` when not to retry.
    fn delay(&mut self, status: StatusCode, retry_after: Option<Duration>) -> Option<Duration> {
        let retryable = matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS
                | StatusCode::SERVICE_UNAVAILABLE
                | StatusCode::GATEWAY_TIMEOUT
        );
        if !retryable || self.retries >= self.max_retries {
            return None;
        }
        self.retries += 1;
        let own = self.backoff.next().unwrap_or_default();
        Some(match (status, retry_after) {
            (StatusCode::TOO_MANY_REQUESTS, Some(asked)) => own.max(asked.min(MAX_RETRY_AFTER)),
            _ => own,
        })
    }
}

/// `Retry-After` in seconds (the API server never sends an HTTP date).
fn retry_after<T>(response: &Response<T>) -> Option<Duration> {
    let value = response.headers().get(http::header::RETRY_AFTER)?;
    let seconds: u64 = value.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(seconds))
}

impl<Res> Policy<Request<Body>, Response<Res>, BoxError> for ServerRetry {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _req: &mut Request<Body>,
        result: &mut Result<Response<Res>, BoxError>,
    ) -> Option<Self::Future> {
        let response = result.as_ref().ok()?;
        let delay = self.delay(response.status(), retry_after(response))?;
        Some(tokio::time::sleep(delay))
    }

    fn clone_request(&mut self, req: &Request<Body>) -> Option<Request<Body>> {
        let body = req.body().try_clone()?;
        let mut clone = Request::builder()
            .method(req.method().clone())
            .uri(req.uri().clone())
            .version(req.version())
            .body(body)
            .ok()?;
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_secs(4);
    const FIVE: Option<Duration> = Some(Duration::from_secs(5));

    #[test]
    fn a_429_waits_its_retry_after() {
        let mut r = ServerRetry::new(3, CAP);
        assert_eq!(
            r.delay(StatusCode::TOO_MANY_REQUESTS, FIVE),
            Some(Duration::from_secs(5))
        );
    }

    #[test]
    fn a_503_waits_the_jittered_backoff_not_its_retry_after() {
        // A fleet that got the starting server's `Retry-After: 5` in the same second
        // comes back spread over the backoff, not together 5 s later.
        let delays: Vec<Duration> = (0..200)
            .filter_map(|_| ServerRetry::new(3, CAP).delay(StatusCode::SERVICE_UNAVAILABLE, FIVE))
            .collect();
        assert_eq!(delays.len(), 200);
        assert!(delays.iter().all(|d| *d <= crate::watch_backoff::BASE));
        let distinct: std::collections::BTreeSet<_> = delays.iter().collect();
        assert!(distinct.len() > 100, "{} distinct delays", distinct.len());
    }

    #[test]
    fn retries_stop_at_the_limit_and_on_other_statuses() {
        let mut r = ServerRetry::new(2, CAP);
        assert!(r.delay(StatusCode::NOT_FOUND, None).is_none());
        assert!(r.delay(StatusCode::GATEWAY_TIMEOUT, None).is_some());
        assert!(r.delay(StatusCode::GATEWAY_TIMEOUT, None).is_some());
        assert!(r.delay(StatusCode::GATEWAY_TIMEOUT, None).is_none());
    }

    #[test]
    fn a_hostile_retry_after_is_bounded() {
        let mut r = ServerRetry::new(3, CAP);
        let d = r.delay(
            StatusCode::TOO_MANY_REQUESTS,
            Some(Duration::from_secs(u64::MAX / 2)),
        );
        assert_eq!(d, Some(MAX_RETRY_AFTER));
    }
}
