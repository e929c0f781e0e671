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
//! - In-client retries of 429/503/504 that honour `Retry-After` (never retried faster) and
//!   stay short (at most 3, capped at 4 s), so a watch's own backoff sees the failure
//!   soon; kube's default would retry 15 times, growing to minutes.

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use kube::client::retry::RetryPolicy;
use kube::{Client, Config};
use tower::{BoxError, ServiceBuilder};

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

/// A client for `config`, with the keepalive and timeouts above.
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
    let retry = RetryPolicy::new(Duration::from_millis(200), Duration::from_secs(4), 3, true)
        .map_err(|e| kube::Error::Service(Box::new(e)))?;
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .layer(tower::retry::RetryLayer::new(retry))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper);
    Ok(Client::new(service, config.default_namespace))
}
