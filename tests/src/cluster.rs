//! A real local control plane (etcd + kube-apiserver) shared by all tests of a process.
//!
//! The first test that asks for it gets the cluster ready:
//!
//! 1. If `REBOUND_KUBECONFIG` is set, that cluster is used as it is (nothing is started).
//! 2. Otherwise `dev/build-control-plane.sh` builds the binaries if they are not cached
//!    yet (a cold build takes several minutes) and `dev/cluster-up.sh STATE_DIR` starts
//!    the cluster, or only checks it if it is already up. `STATE_DIR` is
//!    `REBOUND_CLUSTER_STATE_DIR` (relative paths are taken from the repository root), by
//!    default `<repo>/.state/cluster`. Both scripts hold
//!    file locks, so several test binaries running at once share one cluster.
//! 3. Every `crds/*.yaml` is applied with `kubectl apply --server-side` and waited on
//!    until `Established`.
//!
//! The cluster is left running when the process exits so the next test binary reuses
//! it. Stop it with `dev/cluster-down.sh [STATE_DIR]` (CI does so after the tests).
//!
//! Without kube-controller-manager deleted namespaces stay `Terminating`, so each test
//! works in a fresh namespace of its own ([`TestEnv::new`]).

use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// Field manager the harness uses for server-side apply of the CRDs.
pub const FIELD_MANAGER: &str = "rebound-tests";

/// Label put on every namespace created by [`TestEnv::new`].
pub const TEST_NAMESPACE_LABEL: &str = "rebound.dev/test";

/// The repository root (the parent of the `tests/` crate).
pub fn repo_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest_dir.to_path_buf())
}

/// The repository's `crds/` directory.
pub fn crds_dir() -> PathBuf {
    repo_root().join("crds")
}

/// Output of a finished command.
#[derive(Debug, Clone)]
pub struct CmdOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// `Ok(self)` if the command exited 0, else an error carrying its output.
    pub fn ok(self) -> Result<Self> {
        if self.success() {
            Ok(self)
        } else {
            Err(anyhow!(
                "command failed ({}):\nstdout:\n{}\nstderr:\n{}",
                self.status,
                self.stdout,
                self.stderr
            ))
        }
    }
}

/// A running control plane and how to talk to it.
#[derive(Debug)]
pub struct Cluster {
    kubeconfig: PathBuf,
    state_dir: Option<PathBuf>,
    kubectl: PathBuf,
    crds: Vec<String>,
}

static SHARED: OnceLock<std::result::Result<Cluster, String>> = OnceLock::new();
/// The state dir of a shared cluster this process started, stopped when it exits.
static STOP_AT_EXIT: OnceLock<PathBuf> = OnceLock::new();

/// Whether the kube-apiserver recorded in `state_dir` still runs.
fn apiserver_running(state_dir: &Path) -> bool {
    std::fs::read_to_string(state_dir.join("kube-apiserver.pid"))
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

/// Stops the cluster of `state_dir` when the test process exits, failed tests included
/// (the harness ends with `exit`, which runs `atexit` handlers).
fn stop_at_exit(state_dir: &Path) {
    extern "C" fn stop() {
        if let Some(dir) = STOP_AT_EXIT.get() {
            let _ = Command::new(repo_root().join("dev/cluster-down.sh"))
                .arg(dir)
                .stdout(Stdio::null())
                .status();
        }
    }
    if STOP_AT_EXIT.set(state_dir.to_path_buf()).is_ok() {
        // SAFETY: registers a plain function with no captured state.
        unsafe {
            libc::atexit(stop);
        }
    }
}

impl Cluster {
    /// The cluster shared by every test of this process, started (or found) on first use.
    ///
    /// Blocks; from async code prefer [`TestEnv::new`], which runs this on a blocking
    /// thread.
    pub fn shared() -> Result<&'static Cluster> {
        SHARED
            .get_or_init(|| Cluster::bring_up().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("the local control plane is not available: {e}"))
    }

    fn bring_up() -> Result<Cluster> {
        match std::env::var_os("REBOUND_KUBECONFIG") {
            Some(path) if !path.is_empty() => {
                let started = Instant::now();
                let path = repo_root().join(path);
                let bin_dir = run_script(
                    &repo_root().join("dev/build-control-plane.sh"),
                    ["--print-bin-dir"],
                )
                .ok()
                .map(PathBuf::from);
                Cluster::prepare(path, None, bin_dir.as_deref(), started)
            }
            _ => match std::env::var_os("REBOUND_CLUSTER_STATE_DIR") {
                // Relative to the repository root, wherever cargo runs the test from; the
                // caller (dev/test.sh) owns that cluster and stops it.
                Some(dir) if !dir.is_empty() => Cluster::start(&repo_root().join(dir)),
                _ => {
                    // The checkout's default cluster: one this process starts, it stops.
                    let state_dir = repo_root().join(".state/cluster");
                    let was_running = apiserver_running(&state_dir);
                    let cluster = Cluster::start(&state_dir)?;
                    if !was_running {
                        stop_at_exit(&state_dir);
                    }
                    Ok(cluster)
                }
            },
        }
    }

    /// Builds the binaries if needed, starts (or reuses) the cluster of `state_dir` and
    /// installs the CRDs.
    fn start(state_dir: &Path) -> Result<Cluster> {
        Cluster::start_with(state_dir, &[])
    }

    /// [`Cluster::start`] with extra `dev/cluster-up.sh` flags (`--node`).
    pub(crate) fn start_with(state_dir: &Path, flags: &[&str]) -> Result<Cluster> {
        let started = Instant::now();
        let root = repo_root();
        let bin_dir = match std::env::var_os("REBOUND_CONTROLPLANE_BIN") {
            // Binaries from elsewhere: cluster-up.sh uses them too, nothing to build.
            Some(dir) if !dir.is_empty() => repo_root().join(dir),
            _ => PathBuf::from(run_script(
                &root.join("dev/build-control-plane.sh"),
                std::iter::empty::<&str>(),
            )?),
        };
        let args = flags.iter().map(OsStr::new).chain([state_dir.as_os_str()]);
        let kubeconfig = PathBuf::from(run_script(&root.join("dev/cluster-up.sh"), args)?);
        // cluster-up.sh prints STATE_DIR/kubeconfig with STATE_DIR made absolute.
        let state_dir = kubeconfig
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| state_dir.to_path_buf());
        Cluster::prepare(kubeconfig, Some(state_dir), Some(&bin_dir), started)
    }

    fn prepare(
        kubeconfig: PathBuf,
        state_dir: Option<PathBuf>,
        bin_dir: Option<&Path>,
        started: Instant,
    ) -> Result<Cluster> {
        if !kubeconfig.is_file() {
            bail!("kubeconfig {} does not exist", kubeconfig.display());
        }
        let mut cluster = Cluster {
            kubeconfig,
            state_dir,
            kubectl: pick_kubectl(bin_dir),
            crds: Vec::new(),
        };
        cluster
            .kubectl(["get", "--raw", "/readyz"])?
            .ok()
            .context("the API server is not ready")?;
        cluster.crds = cluster.install_crds()?;
        eprintln!(
            "rebound-tests: control plane ready in {:.1}s (kubeconfig {}, CRDs: {})",
            started.elapsed().as_secs_f64(),
            cluster.kubeconfig.display(),
            if cluster.crds.is_empty() {
                "none".to_string()
            } else {
                cluster.crds.join(", ")
            }
        );
        Ok(cluster)
    }

    /// Applies every `crds/*.yaml` server-side and waits until each CRD is Established.
    fn install_crds(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for file in crd_files()? {
            let mut last_err = None;
            // Another test binary may apply the same CRD at the same moment.
            for _ in 0..3 {
                let out = self.kubectl([
                    OsStr::new("apply"),
                    OsStr::new("--server-side"),
                    OsStr::new("--field-manager"),
                    OsStr::new(FIELD_MANAGER),
                    OsStr::new("--force-conflicts"),
                    OsStr::new("-o"),
                    OsStr::new("name"),
                    OsStr::new("-f"),
                    file.as_os_str(),
                ])?;
                if out.success() {
                    names.extend(
                        out.stdout
                            .lines()
                            .map(str::trim)
                            .filter(|l| !l.is_empty())
                            .map(String::from),
                    );
                    last_err = None;
                    break;
                }
                last_err = Some(out);
                std::thread::sleep(Duration::from_millis(500));
            }
            if let Some(out) = last_err {
                out.ok()
                    .with_context(|| format!("applying {}", file.display()))?;
            }
        }
        for name in names
            .iter()
            .filter(|n| n.starts_with("customresourcedefinition"))
        {
            self.kubectl([
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                name.as_str(),
            ])?
            .ok()
            .with_context(|| format!("waiting for {name} to be Established"))?;
        }
        Ok(names)
    }

    /// The RetryPolicy CRD of this checkout as JSON, to change before [`Cluster::apply_crd`]
    /// (an older or newer release's schema).
    pub fn retry_policy_crd(&self) -> Result<serde_json::Value> {
        let out = self
            .kubectl([
                "create",
                "--dry-run=client",
                "-o",
                "json",
                "-f",
                &crate::retry_policy_crd_file().to_string_lossy(),
            ])?
            .ok()?;
        serde_json::from_str(&out.stdout).context("the CRD as JSON")
    }

    /// Applies `crd` (server-side, taking every field) and waits until it is Established.
    pub fn apply_crd(&self, crd: &serde_json::Value) -> Result<()> {
        self.kubectl_stdin(
            [
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager",
                FIELD_MANAGER,
                "-f",
                "-",
            ],
            &crd.to_string(),
        )?
        .ok()?;
        let name = crd
            .pointer("/metadata/name")
            .and_then(serde_json::Value::as_str)
            .context("the CRD has no name")?;
        self.kubectl([
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &format!("crd/{name}"),
        ])?
        .ok()?;
        Ok(())
    }

    /// Path of the admin kubeconfig (embedded certificates).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The state dir of the cluster, if this process started it (`None` with `REBOUND_KUBECONFIG`).
    pub fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    /// The kubectl binary the helpers run.
    pub fn kubectl_path(&self) -> &Path {
        &self.kubectl
    }

    /// Objects applied from `crds/` (as `kubectl -o name` prints them).
    pub fn installed_crds(&self) -> &[String] {
        &self.crds
    }

    /// Runs kubectl against this cluster and returns its output (whatever its exit status).
    pub fn kubectl<I, S>(&self, args: I) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.kubectl_with_stdin(args, None)
    }

    /// Runs kubectl with `input` on its standard input (e.g. `apply -f -`).
    pub fn kubectl_stdin<I, S>(&self, args: I, input: &str) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.kubectl_with_stdin(args, Some(input))
    }

    fn kubectl_with_stdin<I, S>(&self, args: I, input: Option<&str>) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(&self.kubectl);
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .arg("--request-timeout=60s")
            .args(args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("could not run {}", self.kubectl.display()))?;
        if let Some(input) = input {
            let mut stdin = child.stdin.take().context("kubectl stdin is not piped")?;
            // kubectl may exit before reading its input (e.g. a bad flag): its output says why.
            if let Err(e) = stdin.write_all(input.as_bytes())
                && e.kind() != std::io::ErrorKind::BrokenPipe
            {
                return Err(e).context("writing to kubectl's stdin");
            }
        }
        let out = child.wait_with_output().context("waiting for kubectl")?;
        Ok(CmdOutput {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// Writes a kubeconfig for `user` (client certificate with CN = `user`, O = `groups`)
    /// into the state dir, e.g. `system:serviceaccount:<ns>:<name>` with the groups
    /// `system:serviceaccounts` and `system:serviceaccounts:<ns>`.
    ///
    /// Needs the cluster's CA key, so not available with `REBOUND_KUBECONFIG`.
    pub fn mint_user_kubeconfig(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let state_dir = self.state_dir.as_deref().context(
            "minting user certificates needs the cluster's state dir (not available with REBOUND_KUBECONFIG)",
        )?;
        let out = state_dir.join(format!("{}.kubeconfig", unique_name(user)));
        let mut args: Vec<std::ffi::OsString> = vec![state_dir.into(), user.into()];
        args.extend(groups.iter().map(Into::into));
        args.push(out.clone().into());
        run_script(&repo_root().join("dev/mint-user-kubeconfig.sh"), args)?;
        Ok(out)
    }

    /// A new `kube::Client` for the admin user. Create one per test (per tokio runtime).
    pub async fn client(&self) -> Result<kube::Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Creates a namespace with a unique name starting with `prefix`.
    pub async fn create_namespace(&self, client: &kube::Client, prefix: &str) -> Result<String> {
        let name = unique_name(prefix);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([(TEST_NAMESPACE_LABEL.to_string(), "true".to_string())].into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(name)
    }
}

/// A cluster of its own for a test that disrupts it (e.g. restarts the API server).
/// Stopped and its state dir removed when dropped.
pub struct DedicatedCluster {
    cluster: Cluster,
    state_dir: PathBuf,
}

impl DedicatedCluster {
    /// Starts a new cluster in `state_dir` (which should not be in use) and installs the CRDs.
    pub fn start(state_dir: &Path) -> Result<DedicatedCluster> {
        let cluster = Cluster::start(state_dir)?;
        Ok(DedicatedCluster {
            cluster,
            state_dir: state_dir.to_path_buf(),
        })
    }

    /// Stops only the API server (etcd keeps running); clients see connection errors.
    pub fn stop_apiserver(&self) -> Result<()> {
        run_script(
            &repo_root().join("dev/apiserver-restart.sh"),
            [OsStr::new("--stop-only"), self.state_dir.as_os_str()],
        )
        .map(drop)
    }

    /// Starts the API server again on the same port with the same certificates.
    pub fn start_apiserver(&self) -> Result<()> {
        run_script(
            &repo_root().join("dev/cluster-up.sh"),
            [self.state_dir.as_os_str()],
        )
        .map(drop)
    }

    /// Stops and starts the API server; returns when it is ready again.
    pub fn restart_apiserver(&self) -> Result<()> {
        run_script(
            &repo_root().join("dev/apiserver-restart.sh"),
            [self.state_dir.as_os_str()],
        )
        .map(drop)
    }
}

impl std::ops::Deref for DedicatedCluster {
    type Target = Cluster;

    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

impl Drop for DedicatedCluster {
    fn drop(&mut self) {
        if let Err(e) = run_script(
            &repo_root().join("dev/cluster-down.sh"),
            [self.state_dir.as_os_str()],
        ) {
            eprintln!("rebound-tests: stopping the dedicated cluster failed: {e:#}");
        }
    }
}

/// What an integration test works with: the shared cluster, a client, a fresh namespace.
pub struct TestEnv {
    pub cluster: &'static Cluster,
    pub client: kube::Client,
    pub namespace: String,
}

impl TestEnv {
    /// Gets the shared cluster ready (first call only) and creates a fresh namespace
    /// named `<prefix>-<unique suffix>`.
    pub async fn new(prefix: &str) -> Result<TestEnv> {
        let cluster = tokio::task::spawn_blocking(Cluster::shared)
            .await
            .context("the cluster start-up thread panicked")??;
        let client = cluster.client().await?;
        let namespace = cluster.create_namespace(&client, prefix).await?;
        Ok(TestEnv {
            cluster,
            client,
            namespace,
        })
    }

    /// Runs kubectl with `-n <namespace>` added.
    pub fn kubectl<I, S>(&self, args: I) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut all: Vec<std::ffi::OsString> = vec!["-n".into(), self.namespace.clone().into()];
        all.extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self.cluster.kubectl(all)
    }

    /// Runs kubectl with `-n <namespace>` added and `input` on its standard input.
    pub fn kubectl_stdin<I, S>(&self, args: I, input: &str) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut all: Vec<std::ffi::OsString> = vec!["-n".into(), self.namespace.clone().into()];
        all.extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self.cluster.kubectl_stdin(all, input)
    }

    /// `kubectl apply` of `manifest` in the namespace, then waits (60 s at most) until
    /// `retrypolicy/<policy>` is Ready.
    pub fn apply_until_ready(&self, manifest: &str, policy: &str) -> Result<()> {
        self.kubectl_stdin(["apply", "-f", "-"], manifest)?.ok()?;
        self.kubectl([
            "wait",
            "--for=condition=Ready",
            &format!("retrypolicy/{policy}"),
            "--timeout=60s",
        ])?
        .ok()?;
        Ok(())
    }
}

/// Builds a client from a kubeconfig file, as `kube::Client::try_default()` would with
/// `KUBECONFIG` pointing at it (without touching the process environment).
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(path)
        .with_context(|| format!("reading kubeconfig {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading kubeconfig {}", path.display()))?;
    kube::Client::try_from(config).context("creating a kube client")
}

/// A DNS-1123 label `<prefix>-<pid>-<counter><time>` that no other test process produces.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut prefix: String = prefix
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    prefix = prefix.trim_matches('-').to_string();
    if prefix.is_empty() {
        prefix.push_str("test");
    }
    let suffix = format!("-{}-{n}{:x}", std::process::id(), nanos % 0xfff);
    prefix.truncate(63 - suffix.len());
    let prefix = prefix.trim_end_matches('-');
    format!("{prefix}{suffix}")
}

fn crd_files() -> Result<Vec<PathBuf>> {
    let dir = crds_dir();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .with_context(|| format!("reading {}", dir.display()))?
            .path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// kubectl to use: `REBOUND_KUBECTL`, else the one built with the control plane (same
/// version as the API server), else `kubectl` on `PATH`.
fn pick_kubectl(bin_dir: Option<&Path>) -> PathBuf {
    if let Some(k) = std::env::var_os("REBOUND_KUBECTL").filter(|k| !k.is_empty()) {
        return PathBuf::from(k);
    }
    if let Some(k) = bin_dir.map(|d| d.join("kubectl")).filter(|k| k.is_file()) {
        return k;
    }
    PathBuf::from("kubectl")
}

/// Runs a dev/ script; its stderr goes to ours (build progress), the last non-empty
/// line of its stdout (or "") is returned.
pub(crate) fn run_script<I, S>(script: &Path, args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not run {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{} failed ({}); stdout:\n{stdout}",
            script.display(),
            out.status
        );
    }
    Ok(stdout
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or_default()
        .to_string())
}
