//! One memory budget for the request bytes every call of a server holds at once.
//!
//! Per-call message limits and HTTP/2 windows bound one stream, but a decoder buffers a
//! message until it is whole, so connections × streams × message limit half-sent messages
//! would all be held at once (64 connections × 32 streams × 512 KiB is 1 GiB). Every
//! request body is counted here as its frames arrive; a frame that would take the total
//! past the budget ends its call with `RESOURCE_EXHAUSTED`, and a body gives its bytes back
//! when it is dropped (decoded, finished or cut off).

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The shared count of request bytes held by the calls of one server.
#[derive(Clone, Debug)]
pub struct BodyLimit {
    limit: usize,
    held: Arc<AtomicUsize>,
}

impl BodyLimit {
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            held: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Request bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Counts `request`'s body against the budget.
    pub fn wrap(
        &self,
        request: http::Request<tonic::body::Body>,
    ) -> http::Request<tonic::body::Body> {
        let budget = self.clone();
        request.map(|inner| {
            tonic::body::Body::new(CountedBody {
                inner,
                budget,
                taken: 0,
            })
        })
    }

    fn try_take(&self, bytes: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }
}

/// A request body whose data frames are counted against a [`BodyLimit`].
struct CountedBody {
    inner: tonic::body::Body,
    budget: BodyLimit,
    /// Bytes this body has taken from the budget so far.
    taken: usize,
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.taken, Ordering::AcqRel);
    }
}

impl Body for CountedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let bytes = frame.data_ref().map_or(0, Bytes::len);
                if !this.budget.try_take(bytes) {
                    return Poll::Ready(Some(Err(tonic::Status::resource_exhausted(format!(
                        "request bodies in flight are over the sidecar's budget of {} bytes; try again",
                        this.budget.limit
                    )))));
                }
                this.taken += bytes;
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full};

    use super::*;

    fn request(bytes: usize) -> http::Request<tonic::body::Body> {
        http::Request::new(tonic::body::Body::new(Full::new(Bytes::from(vec![
            0;
            bytes
        ]))))
    }

    #[tokio::test]
    async fn a_body_past_the_budget_fails_and_a_dropped_one_gives_its_bytes_back() {
        let budget = BodyLimit::new(10);
        let mut first = budget.wrap(request(8)).into_body();
        let frame = first
            .frame()
            .await
            .expect("a frame")
            .expect("within the budget");
        assert_eq!(frame.data_ref().map(Bytes::len), Some(8));
        assert_eq!(budget.held(), 8);

        let mut second = budget.wrap(request(8)).into_body();
        let refused = second
            .frame()
            .await
            .expect("a frame")
            .expect_err("over the budget");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(budget.held(), 8, "a refused frame takes nothing");

        drop(first);
        drop(second);
        assert_eq!(budget.held(), 0);
        let mut third = budget.wrap(request(10)).into_body();
        assert!(third.frame().await.expect("a frame").is_ok());
        assert_eq!(budget.held(), 10);
    }
}
