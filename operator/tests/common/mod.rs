//! Helpers for the operator's integration tests: run the real `rebound-operator` binary
//! against a real control plane, and read back what it did.
#![allow(dead_code)] // each test file uses a different subset

pub mod near_limit;
pub mod refusal;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::ListParams;
use rebound_policy::compiled::{CONFIGMAP_KEY, CompiledDocument};
use rebound_policy::spec::Condition;
use rebound_policy::{PolicySource, RetryPolicy, compile};
pub use rebound_test_support::{eventually, free_port, http_get};

pub const CM: &str = "rebound-policies";

/// A running `rebound-operator` process. Killed when dropped.
pub struct Operator {
    child: Child,
    pub metrics: SocketAddr,
    pub log: PathBuf,
    kubeconfig: PathBuf,
    args: Vec<String>,
}

impl Operator {
    /// Starts the operator with `KUBECONFIG=kubeconfig`, a free metrics port and `args`.
    pub fn start(kubeconfig: &Path, args: Vec<String>) -> Result<Operator> {
        Self::spawn(kubeconfig, args, free_port()?)
    }

    fn spawn(kubeconfig: &Path, args: Vec<String>, metrics: SocketAddr) -> Result<Operator> {
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", rebound_tests::unique_name("operator")));
        let file = std::fs::File::create(&log).context("creating the operator log")?;
        let child = Command::new(operator_bin())
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,rebound_operator=debug")
            .arg(format!("--metrics-addr={metrics}"))
            .arg("--log-format=json")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .context("starting rebound-operator")?;
        eprintln!(
            "started rebound-operator pid {} (log {})",
            child.id(),
            log.display()
        );
        Ok(Operator {
            child,
            metrics,
            log,
            kubeconfig: kubeconfig.to_path_buf(),
            args,
        })
    }

    /// A fresh process with the same settings (after [`Operator::kill`]).
    pub fn restart(&self) -> Result<Operator> {
        Self::spawn(&self.kubeconfig, self.args.clone(), free_port()?)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a node failure or OOM kill would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits up to `timeout` for a clean exit; returns whether it exited 0.
    pub fn terminate(&mut self, timeout: Duration) -> Result<bool> {
        Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .context("sending SIGTERM")?;
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("rebound-operator did not exit within {timeout:?} of SIGTERM")
    }

    /// Still running?
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The value of an unlabelled metric, or the sum over a labelled one's series.
    pub fn metric(&self, name: &str) -> Result<f64> {
        let text = http_get(self.metrics, "/metrics")?.ok()?;
        Ok(metric_sum(&text, name))
    }

    /// Write requests the operator made (ConfigMaps, statuses, events).
    pub fn writes(&self) -> Result<f64> {
        self.metric("rebound_operator_api_writes_total")
    }

    pub fn is_leader(&self) -> bool {
        self.metric("rebound_operator_leader")
            .is_ok_and(|v| v == 1.0)
    }

    /// Every record the operator logged so far (it runs with `--log-format=json`: one JSON
    /// object per line, event fields flattened next to `level`, `target`, `timestamp`).
    /// A last line still being written is skipped; any other line that is not a JSON
    /// object is an error.
    pub fn logs(&self) -> Result<Vec<LogRecord>> {
        let text = std::fs::read_to_string(&self.log).context("reading the operator log")?;
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str::<LogRecord>(l)
                    .with_context(|| format!("operator log line is not a JSON object: {l}"))
            })
            .collect()
    }

    /// The records logged at level WARN or ERROR.
    pub fn warnings(&self) -> Result<Vec<LogRecord>> {
        Ok(self
            .logs()?
            .into_iter()
            .filter(|r| matches!(field(r, "level"), Some("WARN" | "ERROR")))
            .collect())
    }

    /// The log so far, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The binary under test. REBOUND_OPERATOR_BIN runs the tests against another build (e.g.
/// an older one, to see a new test fail before its fix).
pub fn operator_bin() -> PathBuf {
    std::env::var_os("REBOUND_OPERATOR_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_rebound-operator")),
        PathBuf::from,
    )
}

/// One line of the operator's JSON log.
pub type LogRecord = serde_json::Map<String, serde_json::Value>;

/// A string field of a log record.
pub fn field<'a>(record: &'a LogRecord, name: &str) -> Option<&'a str> {
    record.get(name).and_then(serde_json::Value::as_str)
}

/// Sums the samples of `name` (any labels) in Prometheus text format.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A RetryPolicy manifest.
pub fn policy(name: &str, queues: &[&str], max_attempts: u32) -> String {
    let queues: Vec<String> = queues.iter().map(|q| format!("{q:?}")).collect();
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: {name}\nspec:\n  \
         queues: [{}]\n  maxAttempts: {max_attempts}\n  backoff:\n    base: 1s\n    cap: 5m\n---\n",
        queues.join(", ")
    )
}

/// The document the operator must have written: the policy crate's compilation of the
/// namespace's RetryPolicies as the API server has them now.
pub async fn expected_document(client: &kube::Client, ns: &str) -> Result<CompiledDocument> {
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let list = api.list(&ListParams::default()).await?;
    let sources = list
        .items
        .into_iter()
        .map(|p| PolicySource::from_object(&p, ns))
        .collect();
    Ok(compile(ns, sources).document)
}

/// The document in the namespace's ConfigMap, checked by the sidecar's own parser, and the
/// hash annotation; `None` if there is no ConfigMap.
pub async fn configmap_document(
    client: &kube::Client,
    ns: &str,
) -> Result<Option<(CompiledDocument, Option<String>)>> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let Some(cm) = api.get_opt(CM).await? else {
        return Ok(None);
    };
    let doc = CompiledDocument::from_json(&stored_document(&cm)?.0)?;
    let annotation = cm
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("rebound.dev/hash"))
        .cloned();
    Ok(Some((doc, annotation)))
}

/// The document's JSON in a ConfigMap and whether it was stored compressed: `data` holds it
/// as text, or `binaryData` gzip'd (a namespace whose document passes 900 KiB).
pub fn stored_document(cm: &ConfigMap) -> Result<(Vec<u8>, bool)> {
    if let Some(json) = cm.data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY)) {
        return Ok((json.clone().into_bytes(), false));
    }
    let gz = cm
        .binary_data
        .as_ref()
        .and_then(|d| d.get(CONFIGMAP_KEY))
        .ok_or_else(|| anyhow!("ConfigMap {CM} has no {CONFIGMAP_KEY}"))?;
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz.0[..]), &mut json)?;
    Ok((json, true))
}

/// Waits until the ConfigMap holds exactly the expected document and every policy says
/// Ready=True for its current generation. Returns the document.
pub async fn converged(
    client: &kube::Client,
    ns: &str,
    timeout: Duration,
) -> Result<CompiledDocument> {
    eventually("the namespace to converge", timeout, || async {
        let expected = expected_document(client, ns).await?;
        let Some((doc, annotation)) = configmap_document(client, ns).await? else {
            return Ok(None);
        };
        if doc != expected || annotation.as_deref() != Some(expected.hash.as_str()) {
            return Ok(None);
        }
        let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
        for p in api.list(&ListParams::default()).await?.items {
            let generation = p.metadata.generation;
            let status = p.status.unwrap_or_default();
            let ready = ready_condition(&status.conditions);
            if status.observed_generation != generation
                || ready.is_none_or(|c| c.status != "True" || c.observed_generation != generation)
            {
                return Ok(None);
            }
        }
        Ok(Some(doc))
    })
    .await
}

pub fn ready_condition(conditions: &[Condition]) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == "Ready")
}

pub fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Waits until policy `name` has a Ready condition with `reason` for its current generation.
pub async fn wait_for_reason(
    client: &kube::Client,
    ns: &str,
    name: &str,
    reason: &str,
    timeout: Duration,
) -> Result<RetryPolicy> {
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    eventually(
        &format!("RetryPolicy {name} to report {reason}"),
        timeout,
        || async {
            let p = api.get(name).await?;
            let status = p.status.clone().unwrap_or_default();
            let hit = ready_condition(&status.conditions).is_some_and(|c| {
                c.reason == reason && c.observed_generation == p.metadata.generation
            });
            Ok(hit.then_some(p))
        },
    )
    .await
}

/// One Event (events.k8s.io) as the tests look at it.
#[derive(Debug)]
pub struct SeenEvent {
    pub reason: String,
    pub regarding: String,
    pub note: String,
    /// Occurrences: repeats within a few minutes are one Event with a series count.
    pub count: i32,
}

pub async fn events(client: &kube::Client, ns: &str) -> Result<Vec<SeenEvent>> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|e| SeenEvent {
            reason: e.reason.unwrap_or_default(),
            regarding: e.regarding.and_then(|r| r.name).unwrap_or_default(),
            note: e.note.unwrap_or_default(),
            count: e.series.map_or(1, |s| s.count),
        })
        .collect())
}

/// A cluster of its own whose RetryPolicy CRD has every CEL rule (x-kubernetes-validations)
/// removed, as an older CRD or disabled validation would admit specs: those the Rust
/// validation refuses get in.
pub async fn relaxed_cluster(dir: PathBuf) -> Result<rebound_tests::DedicatedCluster> {
    fn strip_cel(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.remove("x-kubernetes-validations");
                map.values_mut().for_each(strip_cel);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip_cel),
            _ => {}
        }
    }
    let cluster =
        tokio::task::spawn_blocking(move || rebound_tests::DedicatedCluster::start(&dir)).await??;
    let mut crd = cluster.retry_policy_crd()?;
    strip_cel(&mut crd);
    if crd.to_string().contains("x-kubernetes-validations") {
        bail!("CEL rules left in the CRD");
    }
    cluster.apply_crd(&crd)?;
    Ok(cluster)
}

/// Arguments that confine an operator to one test namespace (and its Lease to it too), so
/// tests sharing the cluster do not see each other.
pub fn scoped(ns: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        format!("--namespaces={ns}"),
        format!("--lease-namespace={ns}"),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// `len` lowercase letters drawn by iterating `mix64` from `*state` (a fixed seed): text
/// gzip cannot shrink much, for documents near the ConfigMap's size limits.
pub fn incompressible(state: &mut u64, len: usize) -> String {
    (0..len)
        .map(|_| {
            *state = rebound_policy::decide::mix64(*state);
            char::from(b'a' + (*state % 26) as u8)
        })
        .collect()
}
