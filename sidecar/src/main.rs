//! `rebound-sidecar`: answers job workers' retry hooks over gRPC. See `docs/sidecar.md`.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Parser};
use rebound_policy::{KubeDuration, compiled::CONFIGMAP_KEY};
use rebound_runtime::{LogFormat, Logging, StopSignal, StopSignals, pod_namespace};
use rebound_sidecar::{
    metrics::Metrics,
    server::{self, ListenConfig, Listeners},
    service::Clock,
    source::files::FileSource,
    store::Store,
};

/// Serves RetryPolicy decisions to job workers over gRPC.
#[derive(Debug, Parser)]
#[command(name = "rebound-sidecar", version)]
#[command(group(ArgGroup::new("source").required(true).args(["policies_dir", "configmap", "policies_file"])))]
struct Args {
    /// A directory where the compiled-policies ConfigMap is mounted (without subPath).
    #[arg(long, env = "REBOUND_POLICIES_DIR", value_name = "DIR")]
    policies_dir: Option<PathBuf>,

    /// Watch this ConfigMap through the API server ([NAMESPACE/]NAME, by default in the
    /// namespace of --namespace); uses KUBECONFIG or the in-cluster service account.
    #[arg(long, env = "REBOUND_CONFIGMAP", value_name = "[NAMESPACE/]NAME")]
    configmap: Option<String>,

    /// RetryPolicy YAML manifests, compiled locally (development, demos). Repeatable.
    #[arg(
        long,
        env = "REBOUND_POLICIES_FILE",
        value_delimiter = ',',
        value_name = "FILE"
    )]
    policies_file: Vec<PathBuf>,

    /// The key (file name) holding the compiled document, for --policies-dir and --configmap.
    #[arg(long, env = "REBOUND_KEY", default_value = CONFIGMAP_KEY)]
    key: String,

    /// The Pod's namespace: what --policies-file manifests are compiled for and where
    /// --configmap NAME is watched. Default: POD_NAMESPACE (the downward API), else the
    /// service account's namespace file, else `default`.
    #[arg(long, env = "REBOUND_NAMESPACE")]
    namespace: Option<String>,

    /// This sidecar's Pod (set POD_NAME from the downward API). With --configmap it holds
    /// the Lease `rebound-sidecar-<pod>` and books only its share of every retry budget,
    /// split among the live sidecars serving the ConfigMap; without it each sidecar
    /// enforces the whole budget on its own (per Pod).
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,

    /// This sidecar's Pod UID (set POD_UID from the downward API `metadata.uid`): the
    /// owner of its Lease, so the garbage collector deletes the Lease with the Pod.
    #[arg(long, env = "POD_UID")]
    pod_uid: Option<String>,

    /// `leaseDurationSeconds` of the sidecar's Lease (whole seconds): a sidecar that stops
    /// renewing is counted out this long after its last renewal; renewed every third.
    #[arg(long, env = "REBOUND_LEASE_DURATION", default_value = "15s")]
    lease_duration: KubeDuration,

    /// gRPC address (TCP).
    #[arg(long, env = "REBOUND_LISTEN", default_value = "127.0.0.1:7411")]
    listen: SocketAddr,

    /// Do not listen on TCP (use with --uds).
    #[arg(long, env = "REBOUND_NO_TCP")]
    no_tcp: bool,

    /// Also serve gRPC on this Unix socket.
    #[arg(long, env = "REBOUND_UDS", value_name = "PATH")]
    uds: Option<PathBuf>,

    /// Permission bits of the Unix socket, in octal (connecting needs write permission).
    #[arg(long, env = "REBOUND_UDS_MODE", default_value = "0660", value_parser = parse_mode)]
    uds_mode: u32,

    /// Admin address: gRPC health (for kubelet's probe) and Prometheus /metrics.
    #[arg(long, env = "REBOUND_ADMIN_LISTEN", default_value = "127.0.0.1:7412")]
    admin_listen: SocketAddr,

    /// Do not serve the admin port.
    #[arg(long, env = "REBOUND_NO_ADMIN")]
    no_admin: bool,

    /// Allow listening on addresses other than loopback (e.g. the Pod IP for kubelet's probe).
    #[arg(long, env = "REBOUND_ALLOW_NON_LOOPBACK")]
    allow_non_loopback: bool,

    /// Also serve /metrics when --admin-listen is not a loopback address (by default such
    /// an admin port serves only gRPC health, for kubelet's probe).
    #[arg(long, env = "REBOUND_METRICS_BEYOND_LOOPBACK")]
    metrics_beyond_loopback: bool,

    /// How often files are re-checked besides change notifications.
    #[arg(long, env = "REBOUND_POLL_INTERVAL", default_value = "10s")]
    poll_interval: KubeDuration,

    /// How long in-flight calls may take to finish after SIGTERM.
    #[arg(long, env = "REBOUND_SHUTDOWN_GRACE", default_value = "10s")]
    shutdown_grace: KubeDuration,

    /// Runtime worker threads; 1 runs everything on one thread, which is all a sidecar needs.
    #[arg(long, env = "REBOUND_WORKER_THREADS", default_value_t = 1)]
    worker_threads: usize,

    /// Log format (as the operator's; level via RUST_LOG).
    #[arg(long, env = "REBOUND_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> Result<()> {
    rebound_runtime::tune_allocator();
    let args = Args::parse();
    Logging {
        format: args.log_format,
        default_filter: "info",
        flatten_json_fields: false,
        ansi_only_on_terminal: true,
    }
    .init();
    let runtime = if args.worker_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.worker_threads)
            .enable_all()
            .build()
    }
    .context("cannot start the async runtime")?;
    runtime.block_on(run(args))
}

fn parse_mode(text: &str) -> Result<u32, String> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(format!(
            "expected octal permission bits such as 0600 or 0660, got {text:?}"
        )),
    }
}

async fn run(args: Args) -> Result<()> {
    let listen = ListenConfig {
        tcp: (!args.no_tcp).then_some(args.listen),
        uds: args.uds.clone(),
        uds_mode: args.uds_mode,
        admin: (!args.no_admin).then_some(args.admin_listen),
        allow_non_loopback: args.allow_non_loopback,
        metrics_beyond_loopback: args.metrics_beyond_loopback,
    };
    if listen.tcp.is_none() && listen.uds.is_none() {
        bail!("--no-tcp needs --uds: there would be nothing to serve on");
    }
    // Listen for stop signals before serving, so a SIGTERM right after start is not lost.
    let signals = StopSignals::install()?;
    let listeners = Listeners::bind(&listen).await?;
    // The bound addresses as plain `ip:port` (empty when off): with port 0 in the
    // arguments, this line is where a supervisor learns them.
    let shown =
        |addr: Option<std::net::SocketAddr>| addr.map_or_else(String::new, |a| a.to_string());
    tracing::info!(
        grpc = %shown(listeners.tcp_addr()),
        uds = ?listen.uds,
        admin = %shown(listeners.admin_addr()),
        "listening"
    );

    let metrics = Arc::new(Metrics::default());
    let fleet_share = Arc::clone(metrics.fleet());
    let store = Store::new(metrics);
    let poll = Duration::from_millis(args.poll_interval.as_millis().max(1));
    let mut _file_source = None;
    let mut watch_task = None;
    let mut fleet = None;
    let lease_duration = Duration::from_millis(args.lease_duration.as_millis());
    let pod_name = args.pod_name.filter(|p| !p.trim().is_empty());
    if args.configmap.is_none() || pod_name.is_none() {
        tracing::info!(
            scope = "pod",
            reason = if args.configmap.is_none() {
                "file mode"
            } else {
                "no --pod-name (POD_NAME)"
            },
            "retry budgets are enforced per Pod: this sidecar holds no Lease and books the whole budget"
        );
    }
    if let Some(dir) = args.policies_dir {
        let source = FileSource::mounted_dir(dir, &args.key, poll);
        _file_source = Some(source.spawn(Arc::clone(&store))?);
    } else if !args.policies_file.is_empty() {
        let source = FileSource::manifests(
            args.policies_file,
            pod_namespace(args.namespace.as_deref()),
            poll,
        );
        _file_source = Some(source.spawn(Arc::clone(&store))?);
    } else if let Some(target) = args.configmap {
        let target = match target.split_once('/') {
            Some(_) => target,
            None => format!("{}/{target}", pod_namespace(args.namespace.as_deref())),
        };
        // The Pod's namespace only when told (a default would rename the Lease).
        let pod_ns = args
            .namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .filter(|n| !n.trim().is_empty());
        let pod = pod_name.map(|name| PodIdentity {
            name,
            uid: args.pod_uid.filter(|u| !u.trim().is_empty()),
            namespace: pod_ns,
        });
        let started = configmap(
            &target,
            args.key,
            pod,
            lease_duration,
            fleet_share,
            Arc::clone(&store),
        )
        .await?;
        watch_task = Some(started.0);
        fleet = started.1;
    }

    let clock: Clock = Arc::new(rebound_sidecar::system_now_ms);
    let grace = Duration::from_millis(args.shutdown_grace.as_millis());
    server::serve(store, clock, listeners, shutdown_signal(signals), grace).await?;
    if let Some(task) = watch_task {
        task.abort();
    }
    if let Some(fleet) = fleet {
        release(fleet).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// The Pod this sidecar runs in, for its fleet Lease.
struct PodIdentity {
    name: String,
    uid: Option<String>,
    /// `None`: not told; taken to be the ConfigMap's.
    namespace: Option<String>,
}

#[cfg(feature = "kubernetes")]
type FleetHandle = rebound_sidecar::fleet::Fleet;
#[cfg(not(feature = "kubernetes"))]
type FleetHandle = ();

/// Starts the ConfigMap watch; with a Pod name, first the fleet membership, so the first
/// budgeted answers already book this sidecar's share.
#[cfg(feature = "kubernetes")]
async fn configmap(
    target: &str,
    key: String,
    pod: Option<PodIdentity>,
    lease_duration: Duration,
    fleet_share: Arc<rebound_sidecar::fleet_share::FleetShare>,
    store: Arc<Store>,
) -> Result<(tokio::task::JoinHandle<()>, Option<FleetHandle>)> {
    use rebound_sidecar::fleet::{Fleet, FleetConfig};
    use rebound_sidecar::source::kubernetes::{ConfigMapRef, ConfigMapSource};
    let target: ConfigMapRef = target
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--configmap: {e}"))?;
    let client = ConfigMapSource::client().await?;
    let mut fleet = None;
    if let Some(pod) = pod {
        let config = FleetConfig {
            namespace: target.namespace.clone(),
            configmap: target.name.clone(),
            pod: pod.name,
            pod_namespace: pod.namespace.unwrap_or_else(|| target.namespace.clone()),
            pod_uid: pod.uid,
            lease_duration,
        };
        config
            .check()
            .map_err(|e| anyhow::anyhow!("--pod-name/--lease-duration: {e}"))?;
        tracing::info!(
            scope = "fleet",
            namespace = %config.namespace,
            configmap = %config.configmap,
            pod = %config.pod,
            lease = %config.lease_name(),
            owned = config.pod_uid.is_some(),
            lease_duration_s = lease_duration.as_secs(),
            "retry budgets are split among the sidecars serving the ConfigMap"
        );
        let loaded = Arc::clone(&store);
        fleet = Some(Fleet::start(client.clone(), config, fleet_share, loaded).await);
    }
    let source = ConfigMapSource::new(target, Some(key));
    Ok((tokio::spawn(source.run(client, store)), fleet))
}

#[cfg(not(feature = "kubernetes"))]
async fn configmap(
    _target: &str,
    _key: String,
    _pod: Option<PodIdentity>,
    _lease_duration: Duration,
    _fleet_share: Arc<rebound_sidecar::fleet_share::FleetShare>,
    _store: Arc<Store>,
) -> Result<(tokio::task::JoinHandle<()>, Option<FleetHandle>)> {
    bail!("--configmap needs the `kubernetes` feature, which this build leaves out")
}

#[cfg(feature = "kubernetes")]
async fn release(fleet: FleetHandle) {
    fleet.release().await;
}

#[cfg(not(feature = "kubernetes"))]
async fn release(_fleet: FleetHandle) {}

/// Completes on SIGTERM (kubelet) or SIGINT (Ctrl-C), saying which.
async fn shutdown_signal(mut signals: StopSignals) {
    match signals.recv().await {
        StopSignal::Terminate => tracing::info!("SIGTERM"),
        StopSignal::Interrupt => tracing::info!("SIGINT"),
    }
}
