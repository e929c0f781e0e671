//! A real node for the tests that need Pods: `dev/cluster-up.sh --node` starts
//! kube-controller-manager, kube-scheduler, containerd, a kubelet and kube-proxy beside
//! the control plane, and loads Rebound's images (`dev/build-images.sh`) and the node's
//! own (`dev/node-images.sh`: the pause image and the test worker) into its containerd.
//!
//! One node per machine, so a [`Node`] owns its state dir: dropping it runs
//! `dev/cluster-down.sh`, on failure too. [`HostSnapshot`] records what a node could
//! leave behind (processes, mounts, links, rules, cgroups) to prove that nothing is.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cluster::{Cluster, CmdOutput, repo_root, run_script};

/// The node's address (the API server listens there too); `dev/lib/controlplane.sh`.
pub const NODE_IP: &str = "10.200.0.1";
/// The node's name in the API.
pub const NODE_NAME: &str = "rebound-node";
/// The test worker's image (`dev/node/worker`).
pub const WORKER_IMAGE: &str = "rebound.dev/node-worker:dev";

/// A cluster with a real node, stopped (and its host state removed) when dropped.
pub struct Node {
    cluster: Option<Cluster>,
    state_dir: PathBuf,
}

impl Node {
    /// Builds the images if needed, starts the control plane and the node in `state_dir`
    /// and loads the images. Fails, naming the cause, if this machine cannot run a node.
    pub fn start(state_dir: &Path) -> Result<Node> {
        let mut node = Node {
            cluster: None,
            state_dir: state_dir.to_path_buf(),
        };
        let root = repo_root();
        let images = PathBuf::from(run_script(
            &root.join("dev/build-images.sh"),
            std::iter::empty::<&str>(),
        )?);
        let cluster = Cluster::start_with(state_dir, &["--node"])?;
        let mut args: Vec<std::ffi::OsString> = vec!["--import".into(), state_dir.into()];
        for entry in
            std::fs::read_dir(&images).with_context(|| format!("reading {}", images.display()))?
        {
            let path = entry?.path();
            if path.to_string_lossy().ends_with(".oci.tar") {
                args.push(path.into());
            }
        }
        node.cluster = Some(cluster);
        run_script(&root.join("dev/node-images.sh"), args)?;
        Ok(node)
    }

    /// The cluster's state dir.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Restarts one of the node's processes (`kubelet`, `containerd`) as a crash would:
    /// SIGKILL, then `dev/cluster-up.sh --node` starts what is missing.
    pub fn kill_and_restart(&self, process: &str) -> Result<()> {
        let pid_file = self.state_dir.join("node").join(format!("{process}.pid"));
        let pid = std::fs::read_to_string(&pid_file)
            .with_context(|| format!("reading {}", pid_file.display()))?;
        let status = Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -KILL {} ({process}) failed", pid.trim());
        }
        run_script(
            &repo_root().join("dev/cluster-up.sh"),
            [OsStr::new("--node"), self.state_dir.as_os_str()],
        )
        .map(drop)
    }

    /// Stops the node and the control plane now (what dropping does, with its error).
    pub fn stop(mut self) -> Result<()> {
        self.cluster = None;
        run_script(
            &repo_root().join("dev/cluster-down.sh"),
            [self.state_dir.as_os_str()],
        )
        .map(drop)
    }

    /// The host PID of a running container (`containerID` of a Pod's status, without
    /// `containerd://`), from the node's containerd.
    pub fn container_pid(&self, id: &str) -> Result<u32> {
        let socket = self.state_dir.join("node/containerd/containerd.sock");
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&socket)
            .args(["--namespace", "k8s.io", "tasks", "ls"])
            .output()
            .context("running ctr")?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(id)).then(|| f.next()?.parse().ok())?
            })
            .with_context(|| format!("container {id} has no running task"))
    }

    /// `kubectl get ARGS -o json`, parsed.
    pub fn get_json<I, S>(&self, args: I) -> Result<Value>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut all: Vec<std::ffi::OsString> = vec!["get".into()];
        all.extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        all.extend(["-o".into(), "json".into()]);
        let out = self.kubectl(&all)?.ok()?;
        serde_json::from_str(&out.stdout).context("parsing kubectl's JSON")
    }

    /// The JSON lines a container printed (`kubectl logs`); other lines are skipped.
    pub fn json_logs(&self, namespace: &str, pod: &str, container: &str) -> Result<Vec<Value>> {
        let out = self
            .kubectl(["logs", "-n", namespace, pod, "-c", container])?
            .ok()?;
        Ok(json_lines(&out.stdout))
    }

    /// Creates a namespace where Pod Security `restricted` is enforced.
    pub fn restricted_namespace(&self, prefix: &str) -> Result<String> {
        let name = crate::unique_name(prefix);
        let manifest = serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest",
                "rebound.dev/test": "true",
            }},
        });
        self.kubectl_stdin(["create", "-f", "-"], &manifest.to_string())?
            .ok()?;
        Ok(name)
    }

    /// `kubectl apply -f -` of JSON objects in `namespace`.
    pub fn apply(&self, namespace: &str, objects: &[Value]) -> Result<CmdOutput> {
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
        self.kubectl_stdin(["apply", "-n", namespace, "-f", "-"], &list.to_string())?
            .ok()
    }
}

impl std::ops::Deref for Node {
    type Target = Cluster;

    fn deref(&self) -> &Cluster {
        self.cluster
            .as_ref()
            .expect("a started Node always has its cluster")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.cluster.take().is_none() {
            return;
        }
        if let Err(e) = run_script(
            &repo_root().join("dev/cluster-down.sh"),
            [self.state_dir.as_os_str()],
        ) {
            eprintln!("rebound-tests: stopping the node failed: {e:#}");
        }
    }
}

/// The JSON objects among the lines of `text`.
pub fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .filter(Value::is_object)
        .collect()
}

/// Polls `check` every 200 ms until it returns `Some`, for at most `timeout`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let started = Instant::now();
    let mut last_err = None;
    loop {
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if started.elapsed() > timeout {
            match last_err {
                Some(e) => {
                    bail!("timed out after {timeout:?} waiting for {what}; last error: {e:#}")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What a node can leave on the host, compared before `up` and after `down`.
#[derive(Debug, PartialEq, Eq)]
pub struct HostSnapshot {
    /// Processes of the node: those whose command line names its state dir (the control
    /// plane, the kubelet, containerd and its shims) and those in the node's cgroup (the
    /// containers), as "pid name".
    pub processes: BTreeSet<String>,
    /// Mount points.
    pub mounts: BTreeSet<String>,
    /// Network interfaces.
    pub links: BTreeSet<String>,
    /// nftables tables and iptables rules (counters removed).
    pub rules: BTreeSet<String>,
    /// cgroups named after the node, in every hierarchy.
    pub cgroups: BTreeSet<String>,
}

impl HostSnapshot {
    /// Reads the host's state now, for the node of `state_dir`.
    pub fn take(state_dir: &Path) -> Result<HostSnapshot> {
        let state = state_dir.display().to_string();
        let mut processes = BTreeSet::new();
        for entry in std::fs::read_dir("/proc").context("reading /proc")? {
            let entry = entry?;
            let Some(pid) = entry.file_name().to_str().map(String::from) else {
                continue;
            };
            if !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            // Zombies have an empty cmdline: they run nothing.
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let Some(arg0) = cmdline.split(|&b| b == 0).next().filter(|a| !a.is_empty()) else {
                continue;
            };
            let name = Path::new(OsStr::new(&*String::from_utf8_lossy(arg0)))
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
            let names_state = String::from_utf8_lossy(&cmdline).contains(state.as_str());
            if names_state || cgroup.contains("/rebound-node") {
                processes.insert(format!("{pid} {name}"));
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .context("reading mountinfo")?
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(String::from))
            .collect();
        let links = command_lines("ip", &["-o", "link", "show"])?
            .iter()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .collect();
        let mut rules: BTreeSet<String> = command_lines("nft", &["list", "tables"])?
            .into_iter()
            .collect();
        for cmd in ["iptables-save", "ip6tables-save"] {
            for line in command_lines(cmd, &[])? {
                if !line.starts_with('#') {
                    // ":CHAIN POLICY [packets:bytes]": the counters change all the time.
                    let line = match line.rfind(" [") {
                        Some(i) if line.starts_with(':') => line[..i].to_string(),
                        _ => line,
                    };
                    rules.insert(format!("{cmd}: {line}"));
                }
            }
        }
        let mut cgroups = BTreeSet::new();
        if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
            for entry in entries.flatten() {
                let dir = entry.path().join("rebound-node");
                if dir.exists() {
                    cgroups.insert(dir.display().to_string());
                }
            }
        }
        Ok(HostSnapshot {
            processes,
            mounts,
            links,
            rules,
            cgroups,
        })
    }

    /// What `self` (after) has that `before` had not, per kind; empty when nothing is left.
    pub fn left_over(&self, before: &HostSnapshot) -> Vec<String> {
        let mut left = Vec::new();
        for (kind, after, before) in [
            ("process", &self.processes, &before.processes),
            ("mount", &self.mounts, &before.mounts),
            ("link", &self.links, &before.links),
            ("rule", &self.rules, &before.rules),
            ("cgroup", &self.cgroups, &before.cgroups),
        ] {
            left.extend(after.difference(before).map(|x| format!("{kind}: {x}")));
        }
        left
    }
}

fn command_lines(program: &str, args: &[&str]) -> Result<Vec<String>> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

/// The charts on the node, as a platform team installs them.
impl Node {
    /// `helm args` against this node; its standard output.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let mut all = vec![
            "--kubeconfig".to_owned(),
            self.kubeconfig().display().to_string(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        Ok(crate::helm::Helm::get()?.run(&all)?.ok()?.stdout)
    }

    /// Installs or upgrades both charts: `rebound-crds`, taking over the CRD the harness
    /// applied (as after a manual apply in a real cluster), then `rebound` in `namespace`
    /// with the images loaded on the node, waiting until its Pods are ready.
    pub fn install_charts(&self, namespace: &str) -> Result<()> {
        let crds = crate::helm::chart_dir("rebound-crds").display().to_string();
        let chart = crate::helm::chart_dir("rebound").display().to_string();
        let take_over = ["upgrade", "--install", "rebound-crds", &crds];
        self.helm(&[&take_over[..], &["--take-ownership", "--wait"]].concat())?;
        self.helm(&[
            "upgrade",
            "--install",
            "rebound",
            &chart,
            "--namespace",
            namespace,
            "--create-namespace",
            "--set",
            "image.pullPolicy=Never",
            "--wait",
            "--timeout",
            "180s",
        ])?;
        Ok(())
    }
}

/// Runs `steps` on a node of its own (`.state/node`, or `REBOUND_NODE_STATE_DIR`: one per
/// machine), stops it whatever they return, and fails if the node left a process, mount or
/// network device on the host. Prints how long each phase took.
pub fn on_a_node(test: &str, steps: impl FnOnce(&Node) -> Result<()>) -> Result<()> {
    let state = repo_root()
        .join(std::env::var("REBOUND_NODE_STATE_DIR").unwrap_or_else(|_| ".state/node".to_owned()));
    let before = HostSnapshot::take(&state)?;
    let started = Instant::now();
    let node = Node::start(&state).context("starting the node")?;
    let up = started.elapsed();
    let ran = steps(&node);
    let stepped = started.elapsed() - up;
    let stopped = node.stop().context("dev/cluster-down.sh");
    ran?;
    stopped?;
    eprintln!(
        "{test}: node up (images included) {:.0}s, steps {:.0}s, down {:.0}s",
        up.as_secs_f64(),
        stepped.as_secs_f64(),
        (started.elapsed() - up - stepped).as_secs_f64()
    );
    let left = HostSnapshot::take(&state)?.left_over(&before);
    anyhow::ensure!(
        left.is_empty(),
        "the node left these on the host: {left:#?}"
    );
    Ok(())
}
