//! The Kubernetes API client both binaries use. It differs from kube's default client in
//! what a control-plane client needs to survive a faulty API server:
//!
//! - HTTP/2 (ALPN `h2`, HTTP/1.1 as the fallback) with PING keepalive: a connection that
//!   silently drops packets (no RST) fails within [`KEEPALIVE_INTERVAL`] +
//!   [`KEEPALIVE_TIMEOUT`], so every watch and Lease renewal on it errors and reconnects,
//!   instead of waiting for the watch's 5-minute timeout. All requests of a process share
//!   the one connection, as client-go's do.
//! - A connect timeout that covers the TLS handshake, so a reconnect into a black hole
//!   fails too.
//! - In-client retries of 429/503/504 ([`ServerRetry`]: a 429 is never retried sooner than its
//!   `Retry-After`, a 503 waits the jittered backoff) that stay short (at most 3, capped at
//!   4 s), so a watch's own backoff sees the failure soon; kube's default would retry 15
//!   times, growing to minutes.

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use kube::{Client, Config};
use tower::{BoxError, ServiceBuilder};

mod retry;
pub use retry::ServerRetry;

/// A PING is sent after this long without frames from the server.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(4);
/// The connection is closed when a PING is not answered within this long.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(4);
/// TCP connect plus TLS handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The client could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum ApiClientError {
    #[error("cannot find a Kubernetes client configuration (KUBECONFIG or in-cluster): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("cannot build the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
}

/// A client from `KUBECONFIG` (or `~/.kube/config`) or the in-cluster service account.
pub async fn infer() -> Result<Client, ApiClientError> {
    let config = Config::infer().await?;
    Ok(from_config(config)?)
}

/// A client for `config`, with the keepalive, timeouts and retries above.
pub fn from_config(config: Config) -> Result<Client, kube::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    let tls = config.rustls_client_config()?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    let hyper: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .http2_keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build(connector);
    let retry = ServerRetry::new(3, Duration::from_secs(4));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .layer(tower::retry::RetryLayer::new(retry))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper);
    Ok(Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A server that answers 429 with `Retry-After: 1` twice, then 200: the client's own
    /// retries wait at least the second asked for (no API server sends 429 on demand, so
    /// this one error path is tested against a stand-in).
    #[tokio::test]
    async fn a_429_is_retried_no_sooner_than_retry_after() -> Result<(), Box<dyn std::error::Error>>
    {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            let mut arrivals = Vec::new();
            for n in 0..3 {
                let Ok((mut stream, _)) = listener.accept().await else {
                    break;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.ends_with(b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => head.extend_from_slice(&buf[..k]),
                    }
                }
                arrivals.push(Instant::now());
                let response: &[u8] = if n < 2 {
                    b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                };
                let _ = stream.write_all(response).await;
                let _ = stream.shutdown().await;
            }
            arrivals
        });
        let client = from_config(Config::new(format!("http://{addr}").parse()?))?;
        let text = client
            .request_text(http::Request::get("/healthz").body(Vec::new())?)
            .await?;
        assert_eq!(text, "ok");
        let arrivals = server.await?;
        assert_eq!(arrivals.len(), 3);
        for pair in arrivals.windows(2) {
            assert!(
                pair[1] - pair[0] >= Duration::from_secs(1),
                "retried sooner than Retry-After"
            );
        }
        Ok(())
    }
}
