//! Flux as a GitOps engine for tests: source-controller and kustomize-controller (built by
//! `dev/build-flux.sh`) run as host processes against a test cluster, syncing one
//! namespace from a Git repository that `githttp` serves on 127.0.0.1. Everything a
//! [`GitServer`] or [`Flux`] starts is killed on drop, on failure too; logs stay in the
//! directory the test names.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use rebound_test_support::free_port;

use crate::Cluster;
use crate::process::Running;

/// The script that builds the binaries and CRDs; named in every "not built" error.
pub const BUILD_SCRIPT: &str = "dev/build-flux.sh";

/// The directory holding `source-controller`, `kustomize-controller`, `githttp` and
/// `crds/`.
#[derive(Debug)]
pub struct FluxTools {
    bin_dir: PathBuf,
}

static TOOLS: OnceLock<std::result::Result<FluxTools, String>> = OnceLock::new();

impl FluxTools {
    /// `REBOUND_FLUX_BIN_DIR` if set, else the cache dir `dev/build-flux.sh --print-bin-dir`
    /// names. Never builds (a cold build takes minutes): an absent binary is an error
    /// naming the script, so the test fails rather than skips.
    pub fn get() -> Result<&'static FluxTools> {
        TOOLS
            .get_or_init(|| FluxTools::find().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("Flux is not available: {e}"))
    }

    fn find() -> Result<FluxTools> {
        let bin_dir = match std::env::var_os("REBOUND_FLUX_BIN_DIR").filter(|p| !p.is_empty()) {
            Some(p) => PathBuf::from(p),
            None => print_bin_dir()?,
        };
        wait_for_build_in_progress(&bin_dir)?;
        for binary in ["source-controller", "kustomize-controller", "githttp"] {
            let path = bin_dir.join(binary);
            ensure!(
                path.is_file(),
                "{} does not exist: run {BUILD_SCRIPT} (dev/test.sh and .ci/run do)",
                path.display()
            );
        }
        let tools = FluxTools { bin_dir };
        ensure!(
            !tools.crd_files()?.is_empty(),
            "no CRDs in {}: run {BUILD_SCRIPT}",
            tools.bin_dir.join("crds").display()
        );
        Ok(tools)
    }

    /// A binary of the bin dir.
    pub fn binary(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    /// The Flux CRD files (`crds/*.yaml`), sorted.
    pub fn crd_files(&self) -> Result<Vec<PathBuf>> {
        let dir = self.bin_dir.join("crds");
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}: run {BUILD_SCRIPT}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
        files.sort();
        Ok(files)
    }

    /// Applies every Flux CRD to `cluster` (server-side, idempotent) and waits until each
    /// is Established.
    pub fn install_crds(&self, cluster: &Cluster) -> Result<()> {
        for file in self.crd_files()? {
            for crd in crate::yaml_documents(&file)? {
                cluster.apply_crd(&crd)?;
            }
        }
        Ok(())
    }
}

fn print_bin_dir() -> Result<PathBuf> {
    let script = crate::repo_root().join(BUILD_SCRIPT);
    let out = Command::new("bash")
        .arg(&script)
        .arg("--print-bin-dir")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not run {}", script.display()))?;
    ensure!(
        out.status.success(),
        "{BUILD_SCRIPT} --print-bin-dir failed ({})",
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    Ok(PathBuf::from(last.trim()))
}

/// One Git repository (`policies.git`, branch `main`) served over smart HTTP by `githttp`
/// on 127.0.0.1, and the work tree its commits are made from.
pub struct GitServer {
    // Field order is drop order: the server stops before its directory goes.
    _server: Running,
    addr: String,
    git_dir: PathBuf,
    work_tree: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl GitServer {
    /// An empty repository and a server on a port the server itself chose (port 0); its
    /// log goes to `log_dir`.
    pub fn start(log_dir: &Path) -> Result<GitServer> {
        let tools = FluxTools::get()?;
        let dir = tempfile::Builder::new().prefix("rebound-git-").tempdir()?;
        let root = dir.path().join("repos");
        let git_dir = root.join("policies.git");
        let work_tree = dir.path().join("work");
        std::fs::create_dir_all(&work_tree)?;
        git(&[
            "init",
            "--quiet",
            "--bare",
            "--initial-branch=main",
            &git_dir.to_string_lossy(),
        ])?;
        let addr_file = dir.path().join("addr");
        let log = log_dir.join(format!("{}.log", crate::unique_name("githttp")));
        let mut child = Command::new(tools.binary("githttp"))
            .arg("-root")
            .arg(&root)
            .arg("-listen")
            .arg("127.0.0.1:0")
            .arg("-addr-file")
            .arg(&addr_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting githttp (log {})", log.display()))?;
        let start = Instant::now();
        let addr = loop {
            if let Ok(text) = std::fs::read_to_string(&addr_file) {
                break text.trim().to_owned();
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "githttp exited ({status}) before listening:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                bail!("githttp not listening after 10 s (log {})", log.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ok(GitServer {
            _server: Running(child),
            addr,
            git_dir,
            work_tree,
            log,
            _dir: dir,
        })
    }

    /// The clone URL (`http://127.0.0.1:PORT/policies.git`).
    pub fn url(&self) -> String {
        format!("http://{}/policies.git", self.addr)
    }

    /// The server's log.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Writes `files` (path relative to the repository root, content) into the work tree
    /// and commits the tree to `main`; returns the commit's SHA-1.
    pub fn commit(&self, files: &[(&str, &str)], message: &str) -> Result<String> {
        for (path, content) in files {
            let path = self.work_tree.join(path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&path, content)?;
        }
        let git_dir = format!("--git-dir={}", self.git_dir.display());
        let work_tree = format!("--work-tree={}", self.work_tree.display());
        git(&[&git_dir, &work_tree, "add", "--all"])?;
        git(&[
            &git_dir,
            &work_tree,
            "-c",
            "user.name=Rebound tests",
            "-c",
            "user.email=tests@rebound.dev",
            "commit",
            "--quiet",
            "--message",
            message,
        ])?;
        Ok(git(&[&git_dir, "rev-parse", "HEAD"])?.trim().to_owned())
    }
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .stdin(Stdio::null())
        .output()
        .context("could not run git")?;
    ensure!(
        out.status.success(),
        "git {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// source-controller and kustomize-controller watching one namespace of a cluster, as host
/// processes: no leader election, metrics and health on free 127.0.0.1 ports, artifacts
/// served from a temporary directory on 127.0.0.1 (kustomize-controller fetches them
/// there through `SOURCE_CONTROLLER_LOCALHOST`).
pub struct Flux {
    _kustomize: Running,
    _source: Running,
    logs: Vec<PathBuf>,
    _storage: tempfile::TempDir,
}

impl Flux {
    /// Installs the Flux CRDs and starts both controllers for `namespace`.
    pub fn start(cluster: &Cluster, namespace: &str, log_dir: &Path) -> Result<Flux> {
        let tools = FluxTools::get()?;
        tools.install_crds(cluster)?;
        let storage = tempfile::Builder::new()
            .prefix("rebound-flux-storage-")
            .tempdir()?;
        let storage_addr = free_port()?.to_string();
        let common = |metrics: String, health: String| {
            vec![
                format!("--metrics-addr={metrics}"),
                format!("--health-addr={health}"),
                "--enable-leader-election=false".to_owned(),
                "--watch-all-namespaces=false".to_owned(),
                "--log-level=debug".to_owned(),
            ]
        };
        let mut source_args = common(free_port()?.to_string(), free_port()?.to_string());
        source_args.extend([
            format!("--storage-path={}", storage.path().display()),
            format!("--storage-addr={storage_addr}"),
            format!("--storage-adv-addr={storage_addr}"),
        ]);
        let kustomize_args = common(free_port()?.to_string(), free_port()?.to_string());
        let kubeconfig = cluster.kubeconfig();
        let mut logs = Vec::new();
        let mut spawn = |name: &str, args: &[String], env: &[(&str, &str)]| -> Result<Running> {
            let log = log_dir.join(format!("{}.log", crate::unique_name(name)));
            let child = Command::new(tools.binary(name))
                .args(args)
                .env("KUBECONFIG", kubeconfig)
                .env("RUNTIME_NAMESPACE", namespace)
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?)
                .spawn()
                .with_context(|| format!("starting {name} (log {})", log.display()))?;
            logs.push(log);
            Ok(Running(child))
        };
        let source = spawn("source-controller", &source_args, &[])?;
        let kustomize = spawn(
            "kustomize-controller",
            &kustomize_args,
            &[("SOURCE_CONTROLLER_LOCALHOST", &storage_addr)],
        )?;
        Ok(Flux {
            _kustomize: kustomize,
            _source: source,
            logs,
            _storage: storage,
        })
    }

    /// The controllers' logs (JSON lines; they log to stderr).
    pub fn logs(&self) -> &[PathBuf] {
        &self.logs
    }
}

/// A condition of an object's `status.conditions` by type.
pub fn condition<'a>(object: &'a serde_json::Value, kind: &str) -> Option<&'a serde_json::Value> {
    object
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// Longest wait for a build in progress: a cold build at the lowest priority on a busy
/// machine.
const BUILD_WAIT: Duration = Duration::from_secs(45 * 60);

/// The test never builds, but `dev/test.sh` starts `dev/build-flux.sh` in the background
/// at the lowest priority, so that a cold build's minutes of CPU fall in the suite's idle
/// time. Waits while a build holds the version dir's lock (`dev/lib/cached-build.sh` holds
/// it while it builds), for at most [`BUILD_WAIT`]; returns at once when none does.
fn wait_for_build_in_progress(bin_dir: &Path) -> Result<()> {
    let Some(lock) = bin_dir.parent().map(|d| d.join(".lock")) else {
        return Ok(());
    };
    if !lock.is_file() {
        return Ok(());
    }
    let started = Instant::now();
    let status = Command::new("flock")
        .arg("--wait")
        .arg(BUILD_WAIT.as_secs().to_string())
        .arg(&lock)
        .arg("true")
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("waiting for the lock {} (flock)", lock.display()))?;
    ensure!(
        status.success(),
        "a Flux build still held {} after {:?}: see .state/flux-build.log",
        lock.display(),
        started.elapsed()
    );
    if started.elapsed() > Duration::from_secs(1) {
        eprintln!(
            "waited {:.0?} for the Flux build in progress",
            started.elapsed()
        );
    }
    Ok(())
}
