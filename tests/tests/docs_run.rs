//! Every shell block of the docs runs as pasted: the fenced `sh`/`bash` blocks of
//! `README.md`, `docs/*.md`, `dev/README.md`, `examples/*/README.md` and
//! `clients/*/README.md`, each in a fresh empty directory (from the repository root where
//! the paragraph before it says "from a checkout"), with `KUBECONFIG` set to the shared
//! test cluster and the workspace's binaries, the cluster's kubectl and `grpcurl` on
//! `PATH`. A block that needs something running (an operator, a sidecar) gets it for the
//! time of the block; where the doc shows output or names a result, it is checked.
//!
//! A block that cannot run here is marked in the Markdown right before it with
//! `<!-- not run: REASON -->`; the test prints how many blocks ran and which were skipped
//! and why. An unmarked block that fails fails the test.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use rebound_test_support::{eventually_blocking, free_port};
use rebound_tests::doc::{CommandRun, ShellBlock, run_block, shell_blocks};
use rebound_tests::{Cluster, repo_root, unique_name, yaml_documents};
use serde_json::Value;

/// Pages whose blocks another test runs in order, with what that test adds around them.
const RUN_ELSEWHERE: &[(&str, &str)] = &[(
    "docs/install.md",
    "its blocks build on each other and install the charts, the operator and worker Pods: \
     tests/tests/install_doc.rs runs them in order on a cluster of its own (playing the \
     kubelet), tests/tests/node.rs on a real node",
)];

/// What a block needs running while it runs.
#[derive(Clone, Copy, Debug)]
enum Setup {
    /// Nothing beyond the cluster and the tools on `PATH`.
    Nothing,
    /// Namespace `shop` with `examples/policies/payments.yaml`, compiled by a running operator.
    Shop,
    /// A sidecar at 127.0.0.1:7411 (the default address) on `examples/policies/webhooks.yaml`.
    Sidecar,
    /// The shared cluster's state dir is `.state/cluster` of the checkout.
    DefaultStateDir,
    /// 127.0.0.1:7411 and :7412 free: the block starts the sidecar itself.
    SidecarPortsFree,
}

type Check = fn(&[CommandRun]) -> Result<()>;

/// Blocks with a setup or checks of their own, by page and the start of their first
/// command. Every entry must find its block.
const SPECIAL: &[(&str, &str, Setup, Check)] = &[
    (
        "README.md",
        "cargo run -p rebound-cli -- validate -f examples/policies/*.yaml",
        Setup::Nothing,
        check_readme_offline,
    ),
    (
        "README.md",
        "kubectl rebound explain payments.charge -n shop",
        Setup::Shop,
        check_readme_plugin,
    ),
    (
        "docs/sidecar.md",
        "grpcurl -plaintext 127.0.0.1:7411 list",
        Setup::Sidecar,
        check_sidecar_reflection,
    ),
    (
        "docs/sidecar.md",
        "cargo run -p rebound-sidecar -- --policies-file examples/policies/webhooks.yaml --namespace demo &",
        Setup::SidecarPortsFree,
        check_sidecar_local_use,
    ),
    (
        "dev/README.md",
        "dev/mint-user-kubeconfig.sh .state/cluster",
        Setup::DefaultStateDir,
        check_minted_kubeconfig,
    ),
];

fn pages() -> Result<Vec<String>> {
    let root = repo_root();
    let mut pages = vec!["README.md".to_owned(), "dev/README.md".to_owned()];
    let glob = |dir: &str, nested: bool| -> Result<Vec<String>> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(root.join(dir)).with_context(|| format!("reading {dir}"))? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if nested {
                if path.join("README.md").is_file() {
                    found.push(format!("{dir}/{name}/README.md"));
                }
            } else if name.ends_with(".md") && path.is_file() {
                found.push(format!("{dir}/{name}"));
            }
        }
        found.sort();
        Ok(found)
    };
    pages.extend(glob("docs", false)?);
    pages.extend(glob("examples", true)?);
    pages.extend(glob("clients", true)?);
    Ok(pages)
}

fn json(run: &CommandRun) -> Result<Value> {
    serde_json::from_str(&run.stdout)
        .with_context(|| format!("`{}` did not print JSON:\n{}", run.cmd, run.stdout))
}

/// The documents of a stream of several JSON values (grpcurl prints one per answer).
fn json_stream(run: &CommandRun) -> Result<Vec<Value>> {
    serde_json::Deserializer::from_str(&run.stdout)
        .into_iter::<Value>()
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("`{}` did not print JSON:\n{}", run.cmd, run.stdout))
}

fn run_of<'a>(runs: &'a [CommandRun], prefix: &str) -> Result<&'a CommandRun> {
    runs.iter()
        .find(|r| r.cmd.starts_with(prefix))
        .with_context(|| format!("no command `{prefix}…` ran"))
}

fn example_policy_count() -> Result<usize> {
    let mut n = 0;
    for file in rebound_tests::example_policy_files()? {
        n += yaml_documents(&file)?.len();
    }
    Ok(n)
}

fn check_readme_offline(runs: &[CommandRun]) -> Result<()> {
    let sim = json(run_of(
        runs,
        "cargo run -p rebound-cli -- simulate -f examples/policies/webhooks.yaml -o json",
    )?)?;
    let names: Vec<&str> = sim["policies"]
        .as_array()
        .context("simulate: no policies")?
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    ensure!(
        names == ["webhooks"],
        "simulate webhooks.yaml: policies {names:?}"
    );
    // Concatenated, the files are one stream of every example policy, all valid.
    let report = json(run_of(runs, "cat examples/policies/*.yaml |")?)?;
    let n = example_policy_count()?;
    ensure!(
        report["valid"] == n && report["invalid"] == 0 && report["unreadable"] == 0,
        "validate of the concatenated examples: {report}"
    );
    Ok(())
}

fn check_readme_plugin(runs: &[CommandRun]) -> Result<()> {
    let ask = json(run_of(runs, "kubectl rebound ask")?)?;
    ensure!(
        ask["source"] == "configMap"
            && ask["decision"] == "Retry"
            && ask["attempt"] == 3
            && ask["policy"]["name"] == "payments"
            && ask["policy"]["namespace"] == "shop",
        "kubectl rebound ask: {ask}"
    );
    Ok(())
}

fn check_decide(answer: &Value) -> Result<()> {
    ensure!(
        answer["decision"] == "DECISION_RETRY"
            && answer["policy"]["name"] == "webhooks"
            && answer["policy"]["namespace"] == "demo",
        "Decide answered {answer}"
    );
    Ok(())
}

fn check_sidecar_reflection(runs: &[CommandRun]) -> Result<()> {
    let list = run_of(runs, "grpcurl -plaintext 127.0.0.1:7411 list")?;
    let services: BTreeSet<&str> = list.stdout.lines().map(str::trim).collect();
    for s in ["rebound.v1.RetryAdvisor", "grpc.health.v1.Health"] {
        ensure!(
            services.contains(s),
            "`list` does not name {s}: {services:?}"
        );
    }
    let decide = json_stream(run_of(
        runs,
        "grpcurl -plaintext -d '{\"queue\":\"webhooks\",\"attempt\":3",
    )?)?;
    ensure!(decide.len() == 1, "Decide printed {decide:?}");
    check_decide(&decide[0])?;
    let policy = json_stream(run_of(
        runs,
        "grpcurl -plaintext -d '{\"queue\":\"webhooks\"}'",
    )?)?;
    ensure!(policy.len() == 1, "GetPolicy printed {policy:?}");
    ensure!(
        policy[0]["policy"]["name"] == "webhooks",
        "GetPolicy answered {}",
        policy[0]
    );
    Ok(())
}

fn check_sidecar_local_use(runs: &[CommandRun]) -> Result<()> {
    let decide = json_stream(run_of(runs, "grpcurl -plaintext -d")?)?;
    ensure!(decide.len() == 1, "Decide printed {decide:?}");
    check_decide(&decide[0])?;
    let metrics = run_of(runs, "curl -s 127.0.0.1:7412/metrics")?;
    let active = metrics.stdout.lines().any(|l| {
        l.split_once(' ').is_some_and(|(k, v)| {
            k == "rebound_sidecar_config_state{state=\"active\"}" && v.trim() == "1"
        })
    });
    ensure!(
        active,
        "/metrics has no active configuration:\n{}",
        metrics.stdout
    );
    Ok(())
}

fn check_minted_kubeconfig(_: &[CommandRun]) -> Result<()> {
    let cluster = Cluster::shared()?;
    let path = Path::new("/tmp/operator.kubeconfig");
    let out = cluster.kubectl([
        OsString::from("--kubeconfig"),
        path.into(),
        "auth".into(),
        "whoami".into(),
        "-o".into(),
        "json".into(),
    ]);
    let _ = std::fs::remove_file(path);
    let review: Value = serde_json::from_str(&out?.ok()?.stdout)?;
    let user = &review["status"]["userInfo"];
    ensure!(
        user["username"] == "system:serviceaccount:demo:rebound-operator",
        "the minted kubeconfig is {user}"
    );
    let groups: BTreeSet<&str> = user["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for g in ["system:serviceaccounts", "system:serviceaccounts:demo"] {
        ensure!(
            groups.contains(g),
            "the minted kubeconfig lacks group {g}: {user}"
        );
    }
    Ok(())
}

/// A process started for a block; stopped (SIGTERM, then SIGKILL) when dropped.
struct Background {
    child: Child,
    log: PathBuf,
}

impl Background {
    fn start(program: &Path, args: &[String], env: &[(&str, OsString)]) -> Result<Background> {
        let log = std::env::temp_dir().join(format!("{}.log", unique_name("docs-run-bg")));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(repo_root())
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Background { child, log })
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // SIGTERM first, so the process shuts down as it would in a Pod.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// How long a set-up waits for what it started to answer.
const SETUP_WAIT: Duration = Duration::from_secs(90);

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// What a [`Setup`] started; stopped when dropped.
enum Running {
    Nothing,
    Process(Background),
}

/// Gets a block's setup ready; `Ok(None)` with the reason when this machine cannot
/// give it (a port taken by something else).
fn set_up(
    setup: Setup,
    cluster: &Cluster,
    bin: &Path,
    env: &[(&str, OsString)],
) -> Result<std::result::Result<Running, String>> {
    match setup {
        Setup::Nothing => Ok(Ok(Running::Nothing)),
        Setup::DefaultStateDir => {
            let expected = repo_root().join(".state/cluster");
            let same = cluster
                .state_dir()
                .and_then(|d| d.canonicalize().ok())
                .is_some_and(|d| Some(d) == expected.canonicalize().ok());
            Ok(if same {
                Ok(Running::Nothing)
            } else {
                Err(format!(
                    "the shared cluster is not the checkout's .state/cluster (state dir {:?})",
                    cluster.state_dir()
                ))
            })
        }
        Setup::SidecarPortsFree => Ok(if port_free(7411) && port_free(7412) {
            Ok(Running::Nothing)
        } else {
            Err("127.0.0.1:7411 or :7412 is taken by another program".to_owned())
        }),
        Setup::Sidecar => {
            if !(port_free(7411) && port_free(7412)) {
                return Ok(Err(
                    "127.0.0.1:7411 or :7412 is taken by another program".to_owned()
                ));
            }
            let sidecar = Background::start(
                &bin.join("rebound-sidecar"),
                &[
                    "--policies-file".into(),
                    "examples/policies/webhooks.yaml".into(),
                    "--namespace".into(),
                    "demo".into(),
                ],
                env,
            )?;
            let addr: SocketAddr = "127.0.0.1:7411".parse()?;
            eventually_blocking("the sidecar to serve", SETUP_WAIT, || {
                if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
                    return Ok(None);
                }
                let out = Command::new("grpcurl")
                    .args(["-plaintext", "-d", r#"{"service":""}"#, "127.0.0.1:7411"])
                    .arg("grpc.health.v1.Health/Check")
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .stdin(Stdio::null())
                    .output()?;
                let health: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
                Ok((out.status.success() && health["status"] == "SERVING").then_some(()))
            })
            .with_context(|| sidecar.log_tail())?;
            Ok(Ok(Running::Process(sidecar)))
        }
        Setup::Shop => {
            let ns = cluster.kubectl(["get", "namespace", "shop", "-o", "name"])?;
            if !ns.success() {
                cluster.kubectl(["create", "namespace", "shop"])?.ok()?;
            }
            let policy = repo_root().join("examples/policies/payments.yaml");
            cluster
                .kubectl([
                    OsString::from("-n"),
                    "shop".into(),
                    "apply".into(),
                    "-f".into(),
                    policy.into(),
                ])?
                .ok()?;
            let metrics = free_port()?;
            let operator = Background::start(
                &bin.join("rebound-operator"),
                &[
                    "--namespaces=shop".into(),
                    "--leader-elect=false".into(),
                    format!("--metrics-addr={metrics}"),
                    "--log-format=text".into(),
                ],
                env,
            )?;
            cluster
                .kubectl([
                    "-n",
                    "shop",
                    "wait",
                    "--for=condition=Ready",
                    "--timeout=90s",
                    "retrypolicy/payments",
                ])?
                .ok()
                .with_context(|| operator.log_tail())?;
            eventually_blocking("the ConfigMap rebound-policies in shop", SETUP_WAIT, || {
                Ok(cluster
                    .kubectl([
                        "-n",
                        "shop",
                        "get",
                        "configmap",
                        "rebound-policies",
                        "-o",
                        "name",
                    ])?
                    .success()
                    .then_some(()))
            })?;
            Ok(Ok(Running::Process(operator)))
        }
    }
}

/// `PATH` for the blocks: the workspace's binaries, the cluster's kubectl, grpcurl.
fn block_path(bin: &Path, cluster: &Cluster) -> Result<OsString> {
    let tools = Command::new("bash")
        .arg(repo_root().join("dev/install-tools.sh"))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(tools.status.success(), "dev/install-tools.sh failed");
    let tools = String::from_utf8_lossy(&tools.stdout);
    let tools = tools
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let mut dirs = vec![bin.to_path_buf()];
    if let Some(d) = cluster
        .kubectl_path()
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        dirs.push(d.to_path_buf());
    }
    dirs.push(PathBuf::from(tools));
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    Ok(std::env::join_paths(dirs)?)
}

/// The workspace's binaries the blocks name, built (a no-op when they are).
fn build_binaries() -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "-p",
            "rebound-cli",
            "-p",
            "rebound-operator",
            "-p",
            "rebound-sidecar",
        ])
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .status()?;
    ensure!(status.success(), "cargo build of the binaries failed");
    let bin = rebound_test_support::workspace_binary("rebound")?;
    Ok(bin.parent().context("no bin dir")?.to_path_buf())
}

struct Report {
    ran: Vec<String>,
    skipped: Vec<(String, String)>,
    /// Blocks skipped: a page run elsewhere counts all of its blocks.
    skipped_blocks: usize,
    failed: Vec<(String, String)>,
}

#[test]
fn every_shell_block_of_the_docs_runs_as_pasted() -> Result<()> {
    let bin = build_binaries()?;
    let cluster = Cluster::shared()?;
    let path = block_path(&bin, cluster)?;
    let env: Vec<(&str, OsString)> =
        vec![("KUBECONFIG", cluster.kubeconfig().into()), ("PATH", path)];
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique_name("docs-run"));

    let mut report = Report {
        ran: Vec::new(),
        skipped: Vec::new(),
        skipped_blocks: 0,
        failed: Vec::new(),
    };
    let mut specials_used = BTreeSet::new();
    for page in pages()? {
        if let Some((_, why)) = RUN_ELSEWHERE.iter().find(|(p, _)| *p == page) {
            let n = shell_blocks(&std::fs::read_to_string(repo_root().join(&page))?).len();
            report
                .skipped
                .push((format!("{page}: all {n} blocks"), (*why).to_owned()));
            report.skipped_blocks += n;
            continue;
        }
        let text = std::fs::read_to_string(repo_root().join(&page))?;
        for block in shell_blocks(&text) {
            let name = format!("{page}:{} `{}`", block.line, block.first());
            let reason = match &block.not_run {
                Some(r) if r.is_empty() => {
                    report
                        .failed
                        .push((name, "a `not run` marker without a reason".to_owned()));
                    continue;
                }
                Some(r) => Some(r.clone()),
                None => None,
            };
            if let Some(reason) = reason {
                report.skipped.push((name, reason));
                report.skipped_blocks += 1;
                continue;
            }
            let special = SPECIAL
                .iter()
                .position(|(p, first, _, _)| *p == page && block.first().starts_with(first));
            let (setup, check) = match special {
                Some(i) => {
                    specials_used.insert(i);
                    (SPECIAL[i].2, Some(SPECIAL[i].3))
                }
                None => (Setup::Nothing, None),
            };
            eprintln!("docs-run: {name}");
            match run_one(&block, setup, check, cluster, &bin, &env, &scratch) {
                Ok(Ok(())) => report.ran.push(name),
                Ok(Err(why)) => {
                    report.skipped.push((name, format!("at run time: {why}")));
                    report.skipped_blocks += 1;
                }
                Err(e) => report.failed.push((name, format!("{e:#}"))),
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);

    for (i, (page, first, _, _)) in SPECIAL.iter().enumerate() {
        if !specials_used.contains(&i) {
            report.failed.push((
                format!("{page} `{first}`"),
                "this test sets it up or checks it, but the page has no such block".to_owned(),
            ));
        }
    }

    eprintln!("\ndocs-run: {} blocks ran:", report.ran.len());
    for name in &report.ran {
        eprintln!("  ran     {name}");
    }
    eprintln!("docs-run: {} blocks skipped:", report.skipped_blocks);
    for (name, why) in &report.skipped {
        eprintln!("  skipped {name}: {why}");
    }
    if !report.failed.is_empty() {
        let all: Vec<String> = report
            .failed
            .iter()
            .map(|(name, why)| format!("{name}:\n{why}"))
            .collect();
        return Err(anyhow!(
            "{} blocks failed:\n\n{}",
            report.failed.len(),
            all.join("\n\n")
        ));
    }
    ensure!(!report.ran.is_empty(), "no block ran");
    Ok(())
}

fn run_one(
    block: &ShellBlock,
    setup: Setup,
    check: Option<Check>,
    cluster: &Cluster,
    bin: &Path,
    env: &[(&str, OsString)],
    scratch: &Path,
) -> Result<std::result::Result<(), String>> {
    let running = match set_up(setup, cluster, bin, env)? {
        Ok(r) => r,
        Err(why) => return Ok(Err(why)),
    };
    let dir = if block.from_checkout {
        repo_root()
    } else {
        let dir = scratch.join(unique_name("block"));
        std::fs::create_dir_all(&dir)?;
        dir
    };
    let runs = run_block(&block.commands, &dir, env, Duration::from_secs(300));
    let result = (|| {
        let runs = runs?;
        for run in &runs {
            if run.code != Some(0) {
                bail!(
                    "`{}` exited with {:?}:\n{}{}",
                    run.cmd,
                    run.code,
                    run.stdout,
                    run.stderr
                );
            }
        }
        ensure!(
            runs.len() == block.commands.len(),
            "only {} of {} commands ran",
            runs.len(),
            block.commands.len()
        );
        if let Some(check) = check {
            check(&runs)?;
        }
        Ok(())
    })();
    let log = match &running {
        Running::Process(p) => p.log_tail(),
        Running::Nothing => String::new(),
    };
    drop(running);
    result.with_context(|| log).map(Ok)
}

#[test]
fn blocks_markers_and_checkout_notes_are_read_from_the_page() {
    let page = "# T\n\nFrom a checkout:\n\n```sh\nls \\\n  -l\n# a comment\n\npwd\n```\n\n\
                Elsewhere:\n\n<!-- not run: needs a real registry -->\n```bash\nnpm ci\n```\n\n\
                - in a list:\n\n  ```sh\n  echo hi\n  ```\n\n<!-- not run -->\n```sh\nx\n```\n\n\
                ```json\n{}\n```\n";
    let blocks = shell_blocks(page);
    let got: Vec<(usize, Vec<&str>, Option<&str>, bool)> = blocks
        .iter()
        .map(|b| {
            (
                b.line,
                b.commands.iter().map(String::as_str).collect(),
                b.not_run.as_deref(),
                b.from_checkout,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (5, vec!["ls   -l", "pwd"], None, true),
            (16, vec!["npm ci"], Some("needs a real registry"), false),
            (22, vec!["echo hi"], None, false),
            (27, vec!["x"], Some(""), false),
        ]
    );
}

/// The README's cluster install is marked as run by docs/install.md's test: it must stay
/// commands of that page.
#[test]
fn the_readme_install_is_commands_of_the_install_page() -> Result<()> {
    let read = |p: &str| std::fs::read_to_string(repo_root().join(p));
    let install: BTreeSet<String> = shell_blocks(&read("docs/install.md")?)
        .into_iter()
        .flat_map(|b| b.commands)
        .collect();
    let readme = shell_blocks(&read("README.md")?);
    let block = readme
        .iter()
        .find(|b| b.first().starts_with("helm upgrade --install rebound-crds"))
        .context("README.md has no helm install block")?;
    ensure!(
        block.not_run.is_some(),
        "the README's helm block is not marked"
    );
    for cmd in &block.commands {
        ensure!(
            install.contains(cmd),
            "README.md runs `{cmd}`, which docs/install.md does not"
        );
    }
    Ok(())
}
