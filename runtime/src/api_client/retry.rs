//! In-client retries of the API server's "try again later" answers (429, 503, 504).
//!
//! A 429 (API Priority and Fairness, or a watch cache still initialising) is never retried
//! sooner than its `Retry-After`. A 503 carries one too: an API server that is starting
//! answers "not all HTTP paths installed yet" with `Retry-After: 5`, a guess at its own
//! start-up. Thousands of sidecars honour it (their reconnects spread over the wait); the
//! operator, one or two processes that must compile an edit within 2 s of the server's
//! return, waits at most [`Profile::Operator`]'s cap instead, so it is not left waiting
//! for most of 5 s after `/readyz`. Without `Retry-After` the delay comes from the same
//! backoff as the watches.

use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::Body;
use tower::BoxError;
use tower::retry::Policy;

use crate::watch_backoff::{MAX_RETRY_AFTER, WatchBackoff};

/// Which process the client serves: how far it trusts a 503's `Retry-After`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// One of a fleet of sidecars: every `Retry-After` is honoured.
    Sidecar,
    /// The operator: a 503 waits at most [`OPERATOR_UNAVAILABLE_CAP`].
    Operator,
}

/// The longest the operator waits after a 503, whatever its `Retry-After` says.
pub const OPERATOR_UNAVAILABLE_CAP: Duration = Duration::from_secs(1);

/// Retries of one request (cloned per request by tower's retry layer).
#[derive(Clone, Debug)]
pub struct ServerRetry {
    backoff: WatchBackoff,
    retries: u32,
    max_retries: u32,
    unavailable_cap: Option<Duration>,
}

impl ServerRetry {
    /// At most `max_retries` retries, `cap` apart at most when the server names no delay.
    pub fn new(profile: Profile, max_retries: u32, cap: Duration) -> Self {
        Self {
            backoff: WatchBackoff::new("api-client", cap),
            retries: 0,
            max_retries,
            unavailable_cap: match profile {
                Profile::Sidecar => None,
                Profile::Operator => Some(OPERATOR_UNAVAILABLE_CAP),
            },
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
        let asked = retry_after.map(|d| d.min(MAX_RETRY_AFTER));
        let asked = match (status, self.unavailable_cap) {
            (StatusCode::SERVICE_UNAVAILABLE, Some(cap)) => asked.map(|d| d.min(cap)),
            _ => asked,
        };
        Some(asked.map_or(own, |d| d.max(own.min(d))))
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

    #[test]
    fn a_429_waits_its_retry_after_for_both_profiles() {
        for profile in [Profile::Sidecar, Profile::Operator] {
            let mut r = ServerRetry::new(profile, 3, CAP);
            let asked = Some(Duration::from_secs(5));
            assert_eq!(
                r.delay(StatusCode::TOO_MANY_REQUESTS, asked),
                Some(Duration::from_secs(5))
            );
        }
    }

    #[test]
    fn a_503_waits_its_retry_after_only_for_the_sidecar() {
        let asked = Some(Duration::from_secs(5));
        let mut sidecar = ServerRetry::new(Profile::Sidecar, 3, CAP);
        assert_eq!(
            sidecar.delay(StatusCode::SERVICE_UNAVAILABLE, asked),
            Some(Duration::from_secs(5))
        );
        let mut operator = ServerRetry::new(Profile::Operator, 3, CAP);
        let d = operator.delay(StatusCode::SERVICE_UNAVAILABLE, asked);
        assert!(d.is_some_and(|d| d <= OPERATOR_UNAVAILABLE_CAP), "{d:?}");
    }

    #[test]
    fn retries_stop_at_the_limit_and_on_other_statuses() {
        let mut r = ServerRetry::new(Profile::Sidecar, 2, CAP);
        assert!(r.delay(StatusCode::NOT_FOUND, None).is_none());
        assert!(r.delay(StatusCode::GATEWAY_TIMEOUT, None).is_some());
        assert!(r.delay(StatusCode::GATEWAY_TIMEOUT, None).is_some());
        assert!(r.delay(StatusCode::GATEWAY_TIMEOUT, None).is_none());
    }

    #[test]
    fn a_hostile_retry_after_is_bounded() {
        let mut r = ServerRetry::new(Profile::Sidecar, 3, CAP);
        let d = r.delay(
            StatusCode::TOO_MANY_REQUESTS,
            Some(Duration::from_secs(u64::MAX / 2)),
        );
        assert_eq!(d, Some(MAX_RETRY_AFTER));
    }
}
