//! A TCP proxy between a client and the API server that can black-hole the traffic (no
//! RST, no FIN): what a dropped route or a stuck load balancer looks like to a client.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use anyhow::{Context, Result};
use kube::config::Kubeconfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::{Cluster, unique_name};

/// A TCP proxy that can stop forwarding without closing anything: data read while it
/// black-holes is held, and delivered when it forwards again (as TCP retransmission would).
pub struct Proxy {
    addr: SocketAddr,
    blackhole: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let blackhole = Arc::new(AtomicBool::new(false));
        let hole = Arc::clone(&blackhole);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((down, _)) = listener.accept().await {
                let hole = Arc::clone(&hole);
                connections.spawn(async move {
                    let Ok(up) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(forward(dr, uw, Arc::clone(&hole)), forward(ur, dw, hole));
                });
            }
        });
        Ok(Proxy {
            addr,
            blackhole,
            task,
        })
    }

    /// The address to connect to instead of the upstream.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops (`true`) or resumes (`false`) forwarding, on every connection at once.
    pub fn blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::Relaxed);
    }
}

async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hole: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while hole.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The cluster's kubeconfig with its server replaced by the proxy's address (the serving
/// certificate names the IP, so TLS still verifies).
pub fn kubeconfig_through(cluster: &Cluster, proxy: SocketAddr, dir: &Path) -> Result<PathBuf> {
    let mut kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())?;
    for named in &mut kubeconfig.clusters {
        if let Some(c) = named.cluster.as_mut() {
            c.server = Some(format!("https://{proxy}"));
        }
    }
    let path = dir.join(format!("{}.kubeconfig", unique_name("proxied")));
    std::fs::write(&path, serde_json::to_vec(&kubeconfig)?)?;
    Ok(path)
}

pub fn api_server_addr(cluster: &Cluster) -> Result<SocketAddr> {
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())?;
    let server = kubeconfig
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.server.clone())
        .context("the kubeconfig names no server")?;
    let hostport = server.trim_start_matches("https://").trim_end_matches('/');
    Ok(hostport.parse()?)
}
