//! Listeners and serving: the gRPC port (advisor, health, reflection) on loopback TCP
//! and/or a Unix socket, and a small admin port (gRPC health for kubelet's probe, and
//! Prometheus `/metrics`). Health is NOT_SERVING until a configuration is loaded and again
//! from the moment shutdown starts.

use std::{
    future::Future,
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use std::{pin::Pin, task::Poll};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, UnixListener},
    sync::watch,
    task::JoinSet,
};
use tokio_stream::{Stream, StreamExt};
use tonic::{
    service::Routes,
    transport::{Server, server::Connected},
};
use tonic_health::{ServingStatus, server::HealthReporter};

use crate::{
    answer::MAX_REQUEST_BYTES,
    body_limit::BodyLimit,
    pb::{self, server::retry_advisor_server::RetryAdvisorServer},
    service::{Advisor, Clock},
    store::Store,
};

/// Concurrent calls per HTTP/2 connection (more queue at the client); what they buffer
/// together is bounded by the server's [`BodyLimit`].
pub const MAX_CONCURRENT_STREAMS: u32 = 32;
/// A call (body included) that takes longer is cut off: real ones take microseconds, and a
/// half-sent message must not hold its buffer for ever.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle connections are probed this often and dropped when the probe is not answered
/// within [`KEEPALIVE_TIMEOUT`].
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 flow-control windows: how much a client may send ahead of the server reading
/// (the connection window is what h2 may buffer per connection: 64 × 128 KiB at the cap).
const STREAM_WINDOW: u32 = 64 * 1024;
const CONNECTION_WINDOW: u32 = 128 * 1024;
/// Connections served at once on each gRPC listener (a worker needs one or a few); further
/// ones are closed as they are accepted.
pub const MAX_CONNECTIONS: usize = 64;
/// The same for the admin port (kubelet's probes and a scraper).
pub const MAX_ADMIN_CONNECTIONS: usize = 16;
/// Request headers a client may send (gRPC needs a few hundred bytes).
const MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;
/// Health and reflection requests are tiny; refuse anything larger.
const MAX_SMALL_REQUEST_BYTES: usize = 16 * 1024;
/// Request bytes all calls on the gRPC listeners may hold at once (see [`BodyLimit`]):
/// eight largest batches; a worker's calls are a few hundred bytes each.
pub const GRPC_REQUEST_BYTES_IN_FLIGHT: usize = 4 * 1024 * 1024;
/// The same for the admin port, whose health requests are a few bytes.
pub const ADMIN_REQUEST_BYTES_IN_FLIGHT: usize = 256 * 1024;

/// The Unix socket's default mode: the owner and its group (the worker container shares
/// the Pod's `fsGroup`), nobody else.
pub const DEFAULT_UDS_MODE: u32 = 0o660;

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            tcp: None,
            uds: None,
            uds_mode: DEFAULT_UDS_MODE,
            admin: None,
            allow_non_loopback: false,
            metrics_beyond_loopback: false,
        }
    }
}

/// Where to listen.
#[derive(Clone, Debug)]
pub struct ListenConfig {
    pub tcp: Option<SocketAddr>,
    pub uds: Option<PathBuf>,
    /// Permission bits of the Unix socket; connecting needs write permission.
    pub uds_mode: u32,
    pub admin: Option<SocketAddr>,
    /// Without it, any address other than loopback is refused.
    pub allow_non_loopback: bool,
    /// Serve `/metrics` on an admin address that is not loopback; without it such an admin
    /// port (e.g. on the Pod IP for kubelet's probe) serves only gRPC health.
    pub metrics_beyond_loopback: bool,
}

/// A listener that could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "refusing to listen on {addr} for {what}: not a loopback address (pass --allow-non-loopback to mean it)"
    )]
    NonLoopback {
        what: &'static str,
        addr: SocketAddr,
    },
    #[error("cannot listen on {addr} for {what}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("listener {0} stopped on its own")]
    Listener(&'static str),
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// Bound sockets, ready to serve; bound before serving so callers learn the ports.
#[derive(Debug)]
pub struct Listeners {
    tcp: Option<TcpListener>,
    uds: Option<(UnixListener, PathBuf)>,
    admin: Option<TcpListener>,
    /// Whether the admin port serves `/metrics`.
    admin_metrics: bool,
}

impl Listeners {
    pub async fn bind(cfg: &ListenConfig) -> Result<Self, ServeError> {
        let tcp = match cfg.tcp {
            Some(addr) => Some(bind_tcp("gRPC", addr, cfg.allow_non_loopback).await?),
            None => None,
        };
        let admin = match cfg.admin {
            Some(addr) => Some(bind_tcp("admin", addr, cfg.allow_non_loopback).await?),
            None => None,
        };
        let uds = match &cfg.uds {
            Some(path) => Some((bind_uds(path, cfg.uds_mode)?, path.clone())),
            None => None,
        };
        let admin_metrics =
            cfg.metrics_beyond_loopback || cfg.admin.is_some_and(|addr| addr.ip().is_loopback());
        Ok(Self {
            tcp,
            uds,
            admin,
            admin_metrics,
        })
    }

    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }
}

async fn bind_tcp(
    what: &'static str,
    addr: SocketAddr,
    allow_non_loopback: bool,
) -> Result<TcpListener, ServeError> {
    if !addr.ip().is_loopback() && !allow_non_loopback {
        return Err(ServeError::NonLoopback { what, addr });
    }
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            what,
            addr: addr.to_string(),
            source,
        })
}

/// Binds a Unix socket, replacing a stale socket file from an earlier run (but nothing
/// else), and gives it `mode` (0660 unless configured).
fn bind_uds(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
    let bind_err = |source| ServeError::Bind {
        what: "gRPC",
        addr: path.display().to_string(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path).map_err(bind_err)?,
        Ok(_) => return Err(ServeError::NotASocket(path.to_owned())),
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o777))
        .map_err(bind_err)?;
    Ok(listener)
}

async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    for name in ["", pb::ADVISOR_SERVICE] {
        reporter.set_service_status(name, status).await;
    }
}

/// Serves until `shutdown` completes, then flips health to NOT_SERVING, stops accepting,
/// lets in-flight calls finish for up to `grace`, and returns.
pub async fn serve(
    store: Arc<Store>,
    clock: Clock,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> Result<(), ServeError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    set_health(&reporter, ServingStatus::NotServing).await;
    let health = health.max_decoding_message_size(MAX_SMALL_REQUEST_BYTES);

    let follower = {
        let reporter = reporter.clone();
        let mut loaded = store.subscribe();
        tokio::spawn(async move {
            if loaded.wait_for(|l| *l).await.is_ok() {
                set_health(&reporter, ServingStatus::Serving).await;
                tracing::info!("health: SERVING");
            }
        })
    };

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let advisor = RetryAdvisorServer::new(Advisor::new(Arc::clone(&store), clock))
        .max_decoding_message_size(MAX_REQUEST_BYTES);
    let routes = Routes::new(advisor)
        .add_service(health.clone())
        .add_service(
            reflection()
                .build_v1()?
                .max_decoding_message_size(MAX_SMALL_REQUEST_BYTES),
        )
        .add_service(
            reflection()
                .build_v1alpha()?
                .max_decoding_message_size(MAX_SMALL_REQUEST_BYTES),
        );

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let grpc_budget = BodyLimit::new(GRPC_REQUEST_BYTES_IN_FLIGHT);
    let grpc = || {
        hardened(Server::builder())
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            .layer(budgeted(grpc_budget.clone()))
    };
    let mut servers = JoinSet::new();
    if let Some(listener) = listeners.tcp {
        let incoming = capped(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            MAX_CONNECTIONS,
            "tcp",
        );
        let server = grpc()
            .add_routes(routes.clone())
            .serve_with_incoming_shutdown(incoming, stopped());
        servers.spawn(async move { ("tcp", server.await) });
    }
    let mut socket_path = None;
    if let Some((listener, path)) = listeners.uds {
        let incoming = capped(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            MAX_CONNECTIONS,
            "uds",
        );
        let server = grpc()
            .add_routes(routes.clone())
            .serve_with_incoming_shutdown(incoming, stopped());
        servers.spawn(async move { ("uds", server.await) });
        socket_path = Some(path);
    }
    if let Some(listener) = listeners.admin {
        let mut router = Routes::new(health).into_axum_router();
        if listeners.admin_metrics {
            let metrics_store = Arc::clone(&store);
            router = router.route(
                "/metrics",
                axum::routing::get(move || metrics(Arc::clone(&metrics_store))),
            );
        }
        let incoming = capped(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            MAX_ADMIN_CONNECTIONS,
            "admin",
        );
        let server = hardened(Server::builder())
            .accept_http1(true)
            .max_concurrent_streams(16)
            .layer(budgeted(BodyLimit::new(ADMIN_REQUEST_BYTES_IN_FLIGHT)))
            .add_routes(Routes::from(router))
            .serve_with_incoming_shutdown(incoming, stopped());
        servers.spawn(async move { ("admin", server.await) });
    }

    let mut failed = None;
    tokio::select! {
        () = shutdown => {}
        Some(ended) = servers.join_next() => {
            // A listener stopped on its own (e.g. accept error): shut the rest down.
            failed = Some(ended.as_ref().map_or("task", |(name, _)| *name));
            log_ended(ended);
        }
    }
    follower.abort();
    set_health(&reporter, ServingStatus::NotServing).await;
    tracing::info!("shutting down: health NOT_SERVING, finishing in-flight calls");
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(grace, async {
        while let Some(ended) = servers.join_next().await {
            log_ended(ended);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(?grace, "grace period over; closing remaining connections");
        servers.abort_all();
    }
    if let Some(path) = socket_path {
        let _ = std::fs::remove_file(path);
    }
    match failed {
        Some(name) => Err(ServeError::Listener(name)),
        None => Ok(()),
    }
}

/// An accepted connection that holds one of its listener's connection slots.
struct Capped<IO> {
    io: IO,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl<IO: Connected> Connected for Capped<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Capped<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Capped<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Serves at most `max` connections from `incoming` at once; a connection accepted beyond
/// that is closed at once (dropped), so it costs no buffers.
fn capped<IO>(
    incoming: impl Stream<Item = std::io::Result<IO>>,
    max: usize,
    listener: &'static str,
) -> impl Stream<Item = std::io::Result<Capped<IO>>> {
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    incoming.filter_map(move |accepted| match accepted {
        Err(error) => Some(Err(error)),
        Ok(io) => match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => Some(Ok(Capped { io, _slot: slot })),
            Err(_) => {
                tracing::debug!(
                    listener,
                    max,
                    "connection limit reached; closing a new connection"
                );
                None
            }
        },
    })
}

/// Counts every request body of a server against `budget`.
fn budgeted(
    budget: BodyLimit,
) -> tower::util::MapRequestLayer<
    impl Fn(http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body> + Clone,
> {
    tower::util::MapRequestLayer::new(move |request| budget.wrap(request))
}

/// The limits every listener gets.
fn hardened(builder: Server) -> Server {
    builder
        .timeout(REQUEST_TIMEOUT)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
}

type Ended = Result<(&'static str, Result<(), tonic::transport::Error>), tokio::task::JoinError>;

fn log_ended(ended: Ended) {
    match ended {
        Ok((name, Ok(()))) => tracing::debug!(listener = name, "listener stopped"),
        Ok((name, Err(error))) => tracing::error!(listener = name, %error, "listener failed"),
        Err(error) => tracing::error!(%error, "listener task failed"),
    }
}

async fn metrics(store: Arc<Store>) -> impl axum::response::IntoResponse {
    let body = store.render_metrics();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        body,
    )
}
