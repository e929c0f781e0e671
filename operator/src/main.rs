//! `rebound-operator`: compiles the RetryPolicies of each namespace into one ConfigMap.

use std::sync::Arc;

use anyhow::{Context as _, anyhow};
use clap::Parser;
use futures::FutureExt;
use rebound_operator::config::LogFormat;
use rebound_operator::{Config, controller, events::Events, http, leader, metrics::Metrics};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tracing::info;

fn main() -> anyhow::Result<()> {
    tune_allocator();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run())
}

/// Keeps glibc from holding on to freed memory: fixed mmap and trim thresholds, so a large
/// object decoded and then slimmed (a 1 MiB ConfigMap of someone else) does not stay
/// resident (glibc otherwise raises both thresholds after the first large buffer is freed).
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before other threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 * 1024);
    }
}

async fn run() -> anyhow::Result<()> {
    let config = Arc::new(Config::parse());
    config.check().map_err(|e| anyhow!(e))?;
    init_tracing(config.log_format);

    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (KUBECONFIG or in-cluster)")?;
    let metrics = Arc::new(Metrics::new());
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = http::serve(config.metrics_addr, metrics.clone(), stop_rx.clone())
        .await
        .with_context(|| format!("listening on {}", config.metrics_addr))?;
    info!(metrics = %config.metrics_addr, namespaces = ?config.scope(), configmap = %config.configmap_name, "starting");

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: finishing running reconciles, then releasing the Lease"),
            _ = int.recv() => info!("SIGINT: shutting down"),
        }
        let _ = stop_tx.send(true);
    });

    let events = Events::start(client.clone(), config.identity(), metrics.clone());
    let lead: leader::Lead = {
        let (client, config, metrics) = (client.clone(), config.clone(), metrics.clone());
        Box::new(move |stop| {
            controller::run(
                client.clone(),
                config.clone(),
                metrics.clone(),
                events.clone(),
                stop,
            )
            .boxed()
        })
    };
    leader::run(client, config, metrics, stop_rx, lead).await?;
    server.abort();
    info!("stopped");
    Ok(())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_lease_manager=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == LogFormat::Text {
        builder.init();
    } else {
        builder.json().flatten_event(true).init();
    }
}
