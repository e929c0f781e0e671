//! `rebound-operator`: compiles the RetryPolicies of each namespace into one ConfigMap.

use std::sync::Arc;

use anyhow::{Context as _, anyhow};
use clap::Parser;
use futures::FutureExt;
use rebound_operator::{
    Flags, bindings, controller, events::Events, http, leader, metrics::Metrics,
};
use rebound_runtime::{LogFormat, Logging, StopSignal, StopSignals};
use tokio::sync::watch;
use tracing::info;

fn main() -> anyhow::Result<()> {
    rebound_runtime::tune_allocator();
    few_arenas();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run())
}

/// Two malloc arenas instead of eight per core: watch events, reconciles and status
/// writes move between the runtime's worker threads, and memory one thread frees stays
/// in its own arena for that thread. At 20,000 policies the peak RSS was 5 MiB lower
/// (docs/operator.md, Benchmarks); the operator's allocations are few and short.
fn few_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before other threads start.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

async fn run() -> anyhow::Result<()> {
    let flags = Arc::new(Flags::parse());
    flags.check().map_err(|e| anyhow!(e))?;
    init_tracing(flags.log_format);

    // HTTP/2 keepalive: a hung connection fails the Lease renewals and the watches within
    // seconds instead of minutes.
    let client = rebound_runtime::api_client::infer()
        .await
        .context("connecting to the Kubernetes API (KUBECONFIG or in-cluster)")?;
    let metrics = Arc::new(Metrics::new());
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = http::serve(flags.metrics_addr, metrics.clone(), stop_rx.clone())
        .await
        .with_context(|| format!("listening on {}", flags.metrics_addr))?;
    info!(metrics = %flags.metrics_addr, namespaces = ?flags.scope(), configmap = %flags.configmap_name, "starting");

    let mut signals = StopSignals::install()?;
    tokio::spawn(async move {
        match signals.recv().await {
            StopSignal::Terminate => {
                info!("SIGTERM: finishing running reconciles, then releasing the Lease")
            }
            StopSignal::Interrupt => info!("SIGINT: shutting down"),
        }
        let _ = stop_tx.send(true);
    });

    let events = Events::start(client.clone(), flags.identity(), metrics.clone());
    let lead: leader::Lead = {
        let (client, flags, metrics) = (client.clone(), flags.clone(), metrics.clone());
        Box::new(move |stop| {
            // The leader also keeps the sidecars' RoleBindings; both stop with the term.
            let stop = stop.shared();
            let compile = controller::run(
                client.clone(),
                flags.clone(),
                metrics.clone(),
                events.clone(),
                stop.clone(),
            );
            let bind = bindings::run(client.clone(), flags.clone(), stop);
            futures::future::join(compile, bind).map(|_| ()).boxed()
        })
    };
    leader::run(client, flags, metrics, stop_rx, lead).await?;
    server.abort();
    info!("stopped");
    Ok(())
}

fn init_tracing(format: LogFormat) {
    Logging {
        format,
        default_filter: "info,kube_lease_manager=warn",
        flatten_json_fields: true,
        ansi_only_on_terminal: false,
    }
    .init();
}
