//! The small HTTP server for /metrics, /livez and /readyz, on its own address so the
//! metrics port can stay on localhost or a separate network policy.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::metrics::Metrics;

/// Binds `addr` (so a port clash fails start-up) and serves until `shutdown` turns true.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
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
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| respond(req, metrics.clone()));
                if let Err(e) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    debug!(error = %e, "metrics server: connection ended");
                }
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
