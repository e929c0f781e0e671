//! Real `rebound-sidecar` processes in watch mode and Leases written by hand, for the
//! fleet tests.

#![allow(dead_code)]

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use rebound_sidecar::pb::v1::{
    BudgetScope, DecideRequest, Decision, GetPolicyRequest,
    retry_advisor_client::RetryAdvisorClient,
};
use rebound_test_support::workspace_binary;
use rebound_tests::lease::labels;
use rebound_tests::process::wait_listening;
use rebound_tests::unique_name;
use serde_json::{Value, json};
use tonic::transport::Channel;

pub const CM: &str = rebound_tests::compiled::CONFIGMAP;
/// Short, so expiries are seen quickly: renewals every second.
pub const LEASE_S: u64 = 3;
pub const QUEUE: &str = "q";

/// A sidecar process, stopped (SIGKILL) when dropped, whatever happens.
pub struct Sidecar {
    pub pod: String,
    pub child: Child,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sidecar {
    /// Starts a sidecar serving `namespace`/[`CM`] as Pod `pod`, authenticated by
    /// `kubeconfig`, with JSON logs; `env` adds variables (POD_UID, POD_NAMESPACE).
    pub fn spawn(
        kubeconfig: &Path,
        namespace: &str,
        pod: &str,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", unique_name(&pod[..pod.len().min(40)])));
        // A build of another revision, to show what a test sees there.
        let bin = match std::env::var_os("REBOUND_SIDECAR_BIN") {
            Some(path) => PathBuf::from(path),
            None => workspace_binary("rebound-sidecar")?,
        };
        let mut child = Command::new(bin)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .args([
                format!("--configmap={namespace}/{CM}"),
                format!("--pod-name={pod}"),
                format!("--lease-duration={LEASE_S}s"),
                "--listen=127.0.0.1:0".to_owned(),
                "--admin-listen=127.0.0.1:0".to_owned(),
                "--shutdown-grace=1s".to_owned(),
                "--log-format=json".to_owned(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting rebound-sidecar")?;
        // The sidecar binds port 0 itself: no port chosen here can be taken meanwhile.
        let listening = wait_listening(&mut child, &log, Duration::from_secs(30))?;
        let mut sidecar = Sidecar {
            pod: pod.to_owned(),
            child,
            grpc: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            log,
        };
        sidecar.grpc = listening.grpc.context("no gRPC address")?;
        sidecar.admin = listening.admin.context("no admin address")?;
        Ok(sidecar)
    }

    pub async fn connect(&self) -> Result<RetryAdvisorClient<Channel>> {
        let start = Instant::now();
        loop {
            match rebound_sidecar::client::tcp_channel(self.grpc).await {
                Ok(channel) => return Ok(RetryAdvisorClient::new(channel)),
                Err(e) if start.elapsed() > Duration::from_secs(30) => {
                    return Err(e).context(format!("connecting to {}", self.log.display()));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// The unlabelled sample `name` of the admin port's metrics.
    pub fn metric(&self, name: &str) -> Result<f64> {
        rebound_test_support::metrics::scrape_value(self.admin, name)
    }

    /// The sample `name` with exactly `labels` of the admin port's metrics.
    pub fn metric_with(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        rebound_test_support::metrics::scrape(self.admin)?
            .value(name, labels)
            .with_context(|| format!("no sample {name} {labels:?}"))
    }

    /// SIGTERM, as the kubelet stops a Pod; the sidecar must exit cleanly.
    pub fn stop(&mut self) -> Result<()> {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status()?;
        let exit = self.child.wait()?;
        ensure!(exit.success(), "{} exited with {exit}", self.log.display());
        Ok(())
    }
}

/// Decides `attempt` of `job` on `queue`, its first failure at `first_failure_ms`:
/// whether it was given up, and the revision that answered (`""` outside a rollout).
pub async fn decide_job(
    client: &mut RetryAdvisorClient<Channel>,
    queue: &str,
    job: &str,
    attempt: u32,
    first_failure_ms: u64,
) -> Result<(bool, String)> {
    let answer = client
        .decide(DecideRequest {
            queue: queue.to_owned(),
            attempt,
            job_id: job.to_owned(),
            first_failure_unix_ms: first_failure_ms,
            ..DecideRequest::default()
        })
        .await?
        .into_inner();
    Ok((
        answer.decision == i32::from(Decision::GiveUp),
        answer.revision,
    ))
}

/// The budget scope `GetPolicy` reports.
pub async fn scope(client: &mut RetryAdvisorClient<Channel>) -> Result<BudgetScope> {
    let request = GetPolicyRequest {
        queue: QUEUE.to_owned(),
    };
    client
        .get_policy(request)
        .await?
        .into_inner()
        .budget_scope
        .context("no budget scope")
}

/// Polls until the sidecar reports a current fleet scope with `want`.
pub async fn wait_for(
    client: &mut RetryAdvisorClient<Channel>,
    timeout: Duration,
    want: impl Fn(&BudgetScope) -> bool,
) -> Result<BudgetScope> {
    let start = Instant::now();
    loop {
        // Unavailable until the configuration is loaded.
        let s = scope(client).await;
        if let Ok(s) = &s
            && !s.stale
            && !s.per_pod
            && want(s)
        {
            return Ok(*s);
        }
        if start.elapsed() > timeout {
            bail!("after {timeout:?}: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The ConfigMap of one budgeted policy for queue [`QUEUE`], as the operator writes it.
pub async fn create_configmap(client: &kube::Client, namespace: &str) -> Result<()> {
    let yaml = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {QUEUE}}}\nspec:\n  queues: [{QUEUE}]\n  backoff: {{strategy: constant, base: 1s, jitter: {{kind: none}}}}\n  maxAttempts: 100\n  retryBudget: {{ratePerSecond: 100, burst: 10}}\n"
    );
    let doc = rebound_sidecar::store::compile_manifests(
        &[(PathBuf::from("fleet.yaml"), yaml)],
        namespace,
    )?;
    rebound_tests::compiled::put(&Api::namespaced(client.clone(), namespace), &doc).await
}

/// A sidecar Lease `rebound-sidecar-<pod>` serving [`CM`] as another node would write it,
/// renewed `at` (that node's clock).
pub fn renewal(pod: &str, at: Timestamp, seconds: u64) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": format!("rebound-sidecar-{pod}"), "labels": labels(CM)},
        "spec": {
            "holderIdentity": pod,
            "leaseDurationSeconds": seconds,
            "renewTime": MicroTime(at),
        },
    })
}

/// Writes `lease` (any JSON the API server accepts) as the cluster admin.
pub async fn apply_lease(client: &kube::Client, ns: &str, pod: &str, lease: Value) -> Result<()> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::erase::<Lease>(&()));
    let params = PatchParams::apply("rebound-tests").force();
    api.patch(
        &format!("rebound-sidecar-{pod}"),
        &params,
        &Patch::Apply(lease),
    )
    .await
    .with_context(|| format!("writing the Lease of {pod}"))?;
    Ok(())
}

/// The JSON lines of a sidecar's log.
pub fn json_logs(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// A kubeconfig of `cluster` that authenticates as Pod `pod` only (a Pod-bound token of
/// ServiceAccount `sa`, which the Pod runs as), and the Pod's UID.
pub async fn pod_kubeconfig(
    cluster: &rebound_tests::Cluster,
    client: &kube::Client,
    ns: &str,
    pod: &str,
    sa: &str,
) -> Result<(PathBuf, String)> {
    use rebound_tests::lease::{create_pod, token};
    let object = create_pod(client, ns, pod, sa).await?;
    let uid = object.metadata.uid.clone().context("a Pod without uid")?;
    let token = token(client, ns, sa, Some(&object)).await?;
    let mut kubeconfig = kube::config::Kubeconfig::read_from(cluster.kubeconfig())?;
    let user = kubeconfig
        .auth_infos
        .first_mut()
        .context("the kubeconfig has no user")?;
    user.auth_info = Some(serde_json::from_value(json!({ "token": token }))?);
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "{}.kubeconfig",
        unique_name(&pod[..pod.len().min(40)])
    ));
    std::fs::write(&path, serde_json::to_vec(&kubeconfig)?)?;
    Ok((path, uid))
}

/// The sidecar Leases of [`CM`] in `ns`, by name.
pub async fn sidecar_leases(client: &kube::Client, ns: &str) -> Result<Vec<Lease>> {
    let params = kube::api::ListParams::default().labels(&format!(
        "app.kubernetes.io/component=sidecar,rebound.dev/configmap={CM}"
    ));
    Ok(Api::<Lease>::namespaced(client.clone(), ns)
        .list(&params)
        .await?
        .items)
}
