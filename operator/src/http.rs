//! The small HTTP server for /metrics, /livez and /readyz, on its own address so the
//! metrics port can stay on localhost or a separate network policy.
//!
//! Its clients are the kubelet and a scraper, so it is strict: one request per connection
//! (no keep-alive, hence no idle connections), the request head within
//! [`HEADER_TIMEOUT`], the whole exchange within [`CONNECTION_TIMEOUT`], and at most
//! [`MAX_CONNECTIONS`] at once; connections beyond that are closed at once. Memory stays
//! bounded however many half-sent requests arrive.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::{debug, warn};

use crate::metrics::Metrics;

/// Time to send the request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole connection: request, answer, close.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 256;

/// Binds `addr` (so a port clash fails start-up) and serves until `shutdown` turns true.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    Ok(tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!(error = %e, "metrics server: accept failed");
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                metrics.http_refused();
                drop(stream);
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| respond(req, metrics.clone()));
                let connection = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(stream), service);
                match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(error = %e, "metrics server: connection ended"),
                    Err(_) => debug!("metrics server: connection timed out"),
                }
                drop(slot);
            });
        }
    }))
}

async fn respond<B>(
    req: Request<B>,
    metrics: Arc<Metrics>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (code, body, content_type) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            metrics.encode(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        "/livez" => (StatusCode::OK, "ok\n".to_owned(), "text/plain"),
        "/readyz" if metrics.is_ready() => (StatusCode::OK, "ok\n".to_owned(), "text/plain"),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready\n".to_owned(),
            "text/plain",
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "not found\n".to_owned(),
            "text/plain",
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = code;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert("content-type", value);
    }
    Ok(response)
}
