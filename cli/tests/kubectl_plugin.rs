//! `kubectl rebound …` against the real control plane, through kubectl's own plugin
//! mechanism: kubectl finds `kubectl-rebound` on PATH and runs it with the kubeconfig.
//! The compiled ConfigMap is written the way the operator writes it: the policy crate's
//! compilation of the namespace's RetryPolicies as the API server returns them.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{ListParams, ObjectMeta, PostParams},
};
use rebound_policy::{
    Context, Decision, PolicySource, PolicyTable, RetryPolicy, compile,
    compiled::{CONFIGMAP_KEY, CompiledDocument},
    decide,
};
use rebound_tests::TestEnv;
use serde_json::Value;

const CM: &str = "rebound-policies";

fn manifest(name: &str, queues: &[&str]) -> String {
    let queues: Vec<String> = queues.iter().map(|q| format!("{q:?}")).collect();
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: {name}\nspec:\n  \
         queues: [{}]\n  maxAttempts: 5\n  backoff:\n    base: 2s\n    cap: 10m\n---\n",
        queues.join(", ")
    )
}

/// A directory holding only `kubectl-rebound`, the way a user installs the plugin.
struct Plugin {
    _dir: tempfile::TempDir,
    path: String,
    kubeconfig: PathBuf,
    kubectl: PathBuf,
}

impl Plugin {
    fn install(env: &TestEnv) -> Result<Plugin> {
        let dir = tempfile::tempdir()?;
        std::os::unix::fs::symlink(
            env!("CARGO_BIN_EXE_kubectl-rebound"),
            dir.path().join("kubectl-rebound"),
        )?;
        let kubectl_dir = env
            .cluster
            .kubectl_path()
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let path =
            std::env::join_paths([dir.path().to_path_buf(), kubectl_dir].into_iter().chain(
                std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
            ))?
            .to_string_lossy()
            .into_owned();
        Ok(Plugin {
            _dir: dir,
            path,
            kubeconfig: env.cluster.kubeconfig().to_path_buf(),
            kubectl: env.cluster.kubectl_path().to_path_buf(),
        })
    }

    /// `kubectl rebound ARGS` with `KUBECONFIG` set, as a user's shell would run it.
    fn run(&self, args: &[&str], kubeconfig: Option<&Path>) -> Result<Output> {
        Command::new(&self.kubectl)
            .arg("rebound")
            .args(args)
            .env("PATH", &self.path)
            .env("KUBECONFIG", kubeconfig.unwrap_or(&self.kubeconfig))
            .output()
            .context("running kubectl rebound")
    }

    fn json(&self, args: &[&str]) -> Result<Value> {
        let out = self.run(args, None)?;
        ensure!(
            out.status.success(),
            "kubectl rebound {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }
}

/// Compiles the namespace as the operator does and writes the ConfigMap it would write.
async fn write_configmap(env: &TestEnv) -> Result<CompiledDocument> {
    let ns = env.namespace.as_str();
    let policies: Api<RetryPolicy> = Api::namespaced(env.client.clone(), ns);
    let sources = policies
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|p| PolicySource::from_object(p, ns))
        .collect();
    let doc = compile(ns, sources).document;
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(CM.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                "rebound-operator".to_owned(),
            )])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(CONFIGMAP_KEY.to_owned(), doc.to_json())])),
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(env.client.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await?;
    Ok(doc)
}

fn outcomes(explained: &Value) -> BTreeMap<(String, String), (String, Value)> {
    explained["candidates"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                (
                    c["policy"].as_str().unwrap_or_default().to_owned(),
                    c["pattern"].as_str().unwrap_or_default().to_owned(),
                ),
                (
                    c["outcome"].as_str().unwrap_or_default().to_owned(),
                    c["beatenBy"].clone(),
                ),
            )
        })
        .collect()
}

fn key(policy: &str, pattern: &str) -> (String, String) {
    (policy.to_owned(), pattern.to_owned())
}

fn lost(outcome: &str, by: &str) -> (String, Value) {
    (outcome.to_owned(), Value::from(by))
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_rebound_explains_asks_and_simulates_from_the_cluster() -> Result<()> {
    let env = TestEnv::new("cli-plugin").await?;
    let ns = env.namespace.clone();
    // `charge` is created first, so it keeps "payments.charge" against `zlate`; `dup`
    // writes one pattern twice (`payments.ch*`, `payments.ch**`), which admission and the
    // policy crate both accept.
    env.kubectl_stdin(
        ["apply", "-f", "-"],
        &manifest("charge", &["payments.charge"]),
    )?
    .ok()?;
    let rest = [
        manifest("zlate", &["payments.charge", "other"]),
        manifest("payments", &["payments.*"]),
        manifest("broad", &["pay*"]),
        manifest("catchall", &["*"]),
        manifest("dup", &["payments.ch*", "payments.ch**"]),
    ]
    .concat();
    env.kubectl_stdin(["apply", "-f", "-"], &rest)?.ok()?;
    let plugin = Plugin::install(&env)?;

    // No ConfigMap yet: explain says so, ask cannot answer (exit 2).
    let v = plugin.json(&["explain", "payments.charge", "-n", &ns, "-o", "json"])?;
    assert_eq!(v["configMap"]["found"], false);
    let out = plugin.run(
        &[
            "ask",
            "--queue",
            "payments.charge",
            "--attempt",
            "1",
            "-n",
            &ns,
        ],
        None,
    )?;
    assert_eq!(out.status.code(), Some(2));

    let doc = write_configmap(&env).await?;

    let v = plugin.json(&[
        "explain",
        "payments.charge",
        "-n",
        &ns,
        "-o",
        "json",
        "--samples",
        "500",
    ])?;
    assert_eq!(v["namespace"], ns.as_str());
    assert_eq!(v["servedBy"]["policy"], "charge");
    assert_eq!(v["servedBy"]["match"], "exact");
    let want = BTreeMap::from([
        (
            key("charge", "payments.charge"),
            ("serving".to_owned(), Value::Null),
        ),
        (key("zlate", "payments.charge"), lost("conflict", "charge")),
        (
            key("payments", "payments.*"),
            lost("exactMatchWins", "charge"),
        ),
        (key("broad", "pay*"), lost("exactMatchWins", "charge")),
        (key("catchall", "*"), lost("exactMatchWins", "charge")),
        (key("dup", "payments.ch*"), lost("exactMatchWins", "charge")),
        (
            key("dup", "payments.ch**"),
            lost("exactMatchWins", "charge"),
        ),
    ]);
    assert_eq!(outcomes(&v), want);
    assert_eq!(v["configMap"]["found"], true);
    assert_eq!(v["configMap"]["inSync"], true);
    assert_eq!(v["configMap"]["hash"], doc.hash.as_str());
    assert_eq!(v["configMap"]["servedBy"], "charge");
    assert_eq!(v["schedule"]["name"], "charge");
    assert_eq!(v["schedule"]["maxAttempts"], 5);

    let v = plugin.json(&[
        "explain",
        "payments.refund",
        "-n",
        &ns,
        "-o",
        "json",
        "--samples",
        "200",
    ])?;
    assert_eq!(v["servedBy"]["policy"], "payments");
    assert_eq!(v["servedBy"]["match"], "glob");
    let got = outcomes(&v);
    assert_eq!(
        got[&key("broad", "pay*")],
        lost("moreSpecificGlobWins", "payments")
    );
    assert_eq!(
        got[&key("catchall", "*")],
        lost("moreSpecificGlobWins", "payments")
    );
    assert!(!got.contains_key(&key("charge", "payments.charge")));

    // ask answers from the ConfigMap exactly as the policy crate decides on that document.
    let read_back = Api::<ConfigMap>::namespaced(env.client.clone(), &ns)
        .get(CM)
        .await?;
    let served =
        CompiledDocument::from_json(read_back.data.unwrap_or_default()[CONFIGMAP_KEY].as_bytes())?;
    let table = PolicyTable::new(&served);
    for (queue, attempt) in [
        ("payments.refund", 2u32),
        ("payments.charge", 3),
        ("video", 5),
    ] {
        let a = attempt.to_string();
        let got = plugin.json(&[
            "ask",
            "--queue",
            queue,
            "--attempt",
            &a,
            "--job-id",
            "job-1",
            "-n",
            &ns,
            "-o",
            "json",
        ])?;
        let entry = table.lookup(queue).context("governed")?;
        let ctx = Context {
            job_id: Some("job-1"),
            ..Context::default()
        };
        assert_eq!(got["source"], "configMap");
        assert_eq!(got["policy"]["name"], entry.name());
        assert_eq!(got["policy"]["configHash"], served.hash.as_str());
        match decide(entry, attempt, &ctx) {
            Decision::Retry { delay_ms } => {
                assert_eq!(got["decision"], "Retry");
                assert_eq!(got["delayMs"], delay_ms);
            }
            Decision::GiveUp { reason, .. } => {
                assert_eq!(got["decision"], "GiveUp");
                assert_eq!(got["reason"], reason.code());
            }
        }
    }

    // simulate from the cluster = simulate of the same manifest in the same namespace.
    let from_cluster = plugin.json(&[
        "simulate",
        "--policy",
        "payments",
        "-n",
        &ns,
        "-o",
        "json",
        "--samples",
        "400",
    ])?;
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), manifest("payments", &["payments.*"]))?;
    let offline = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(["simulate", "-f"])
        .arg(file.path())
        .args(["-n", &ns, "-o", "json", "--samples", "400"])
        .output()?;
    assert_eq!(offline.status.code(), Some(0));
    assert_eq!(
        from_cluster,
        serde_json::from_slice::<Value>(&offline.stdout)?
    );
    // One pattern written twice is a valid policy: simulated, no finding.
    let out = plugin.run(&["simulate", "--policy", "dup", "-n", &ns], None)?;
    assert_eq!(out.status.code(), Some(0));

    // The context's namespace is used when -n is not given.
    let kubeconfig = tempfile::NamedTempFile::new()?;
    std::fs::copy(env.cluster.kubeconfig(), kubeconfig.path())?;
    let set = Command::new(env.cluster.kubectl_path())
        .args([
            "config",
            "set-context",
            "--current",
            "--namespace",
            &ns,
            "--kubeconfig",
        ])
        .arg(kubeconfig.path())
        .output()?;
    ensure!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let out = plugin.run(
        &["explain", "payments.charge", "-o", "json"],
        Some(kubeconfig.path()),
    )?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["namespace"], ns.as_str());
    assert_eq!(v["servedBy"]["policy"], "charge");

    // A policy added after the ConfigMap was written: explain says the ConfigMap is stale
    // and which policy the sidecars still answer with.
    env.kubectl_stdin(
        ["apply", "-f", "-"],
        &manifest("refunds", &["payments.refund"]),
    )?
    .ok()?;
    let v = plugin.json(&[
        "explain",
        "payments.refund",
        "-n",
        &ns,
        "-o",
        "json",
        "--samples",
        "100",
    ])?;
    assert_eq!(v["servedBy"]["policy"], "refunds");
    assert_eq!(v["configMap"]["inSync"], false);
    assert_eq!(v["configMap"]["servedBy"], "payments");
    Ok(())
}

/// `kubectl __complete rebound …` (what kubectl's shell completion runs) reaches
/// `kubectl_complete-rebound` on PATH; answers are cobra's: candidates, then `:directive`.
#[tokio::test(flavor = "multi_thread")]
async fn kubectl_completes_the_plugin() -> Result<()> {
    let env = TestEnv::new("cli-complete").await?;
    let dir = tempfile::tempdir()?;
    // kubectl completes a plugin it finds, with the completion executable beside it.
    for (bin, name) in [
        (env!("CARGO_BIN_EXE_kubectl-rebound"), "kubectl-rebound"),
        (
            env!("CARGO_BIN_EXE_kubectl_complete-rebound"),
            "kubectl_complete-rebound",
        ),
    ] {
        std::os::unix::fs::symlink(bin, dir.path().join(name))?;
    }
    let path = std::env::join_paths(std::iter::once(dir.path().to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))?;
    let complete = |words: &[&str]| -> Result<(Vec<String>, u32)> {
        let out = Command::new(env.cluster.kubectl_path())
            .args(["__complete", "rebound"])
            .args(words)
            .env("PATH", &path)
            .env("KUBECONFIG", env.cluster.kubeconfig())
            .output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout)?;
        let mut lines: Vec<&str> = text.lines().collect();
        let directive = lines
            .pop()
            .and_then(|l| l.strip_prefix(':'))
            .context("a :directive line")?
            .parse()?;
        let values = lines
            .iter()
            .map(|l| l.split('\t').next().unwrap_or_default().to_owned())
            .collect();
        Ok((values, directive))
    };
    let (subs, directive) = complete(&[""])?;
    assert_eq!(
        subs,
        [
            "validate",
            "simulate",
            "explain",
            "storm",
            "plot",
            "diff",
            "crd",
            "ask",
            "completion",
            "check",
            "inject",
            "rollout"
        ]
    );
    assert_eq!(directive, 4, "no file names for a subcommand");
    assert_eq!(complete(&["ex"])?, (vec!["explain".to_owned()], 4));
    let (formats, _) = complete(&["ask", "-o", ""])?;
    assert_eq!(formats, ["text", "json", "yaml"]);
    assert_eq!(complete(&["completion", "z"])?, (vec!["zsh".to_owned()], 4));
    let (_, directive) = complete(&["validate", "-f", ""])?;
    assert_eq!(directive, 0, "-f completes file names");
    let (flags, _) = complete(&["explain", "q", "--na"])?;
    assert_eq!(flags, ["--namespace"]);
    let (actions, _) = complete(&["rollout", ""])?;
    assert_eq!(actions, ["status", "promote", "abort", "retry"]);
    let (flags, _) = complete(&["rollout", "status", "p", "--w"])?;
    assert_eq!(flags, ["--watch"]);
    Ok(())
}
