//! Channels to a running sidecar over TCP or its Unix socket, for Rust callers, the tests
//! and the load benchmark.

use std::{net::SocketAddr, path::PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// A channel to `addr` over TCP.
pub async fn tcp_channel(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect()
        .await
}

/// A channel over the Unix socket at `path`; the URI is a placeholder that HTTP/2 needs.
pub async fn uds_channel(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
}
