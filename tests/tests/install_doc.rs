//! docs/install.md, run: every `sh` block, in order, against a control plane of its own.
//! Nothing runs Pods there, so the test plays the kubelet for the two Pods the page
//! creates: it starts the real binaries with the arguments and environment of their Pod
//! templates as read back from the API server, as their service accounts (client
//! certificates for those identities, so only the RBAC the page installed applies).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use rebound_test_support::{eventually, free_port, http_get};
use rebound_tests::doc::{run_shell, shell_blocks, shell_env};
use rebound_tests::helm::Helm;
use rebound_tests::kubelet::{Running, move_flags, resolve, start_as};
use rebound_tests::{Cluster, DedicatedCluster, repo_root, unique_name, yaml_documents};

/// How long the test waits for a process it started to answer.
const WAIT: Duration = Duration::from_secs(60);

/// Starts `binary` as the Pod of `deployment` would run its `container`, as the Pod's
/// service account; `listen` moves a flag's address (or path) elsewhere on this machine.
async fn play_kubelet(
    cluster: &Cluster,
    namespace: &str,
    deployment: &str,
    binary: &str,
    listen: &BTreeMap<&str, String>,
    extra: &[String],
) -> Result<Running> {
    let client = cluster.client().await?;
    let api: kube::Api<Deployment> = kube::Api::namespaced(client, namespace);
    let dep = api.get(deployment).await?;
    let spec = dep
        .spec
        .template
        .spec
        .context("the Deployment has no pod spec")?;
    let sa = spec
        .service_account_name
        .unwrap_or_else(|| "default".to_owned());
    let container = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .find(|c| c.image.as_deref().is_some_and(|i| i.contains(binary)))
        .with_context(|| format!("no {binary} container in {deployment}"))?;
    let pod = format!("{deployment}-0");
    let (args, env) = resolve(container, &pod, namespace)?;
    let args = move_flags(args, listen, extra);
    start_as(cluster, binary, namespace, &sa, &args, &env)
}

fn label_value<'a>(line: &'a str, name: &str, label: &str) -> Option<(&'a str, f64)> {
    let rest = line.strip_prefix(name)?.strip_prefix('{')?;
    let (labels, value) = rest.split_once("} ")?;
    let v = labels
        .split(',')
        .find_map(|kv| kv.strip_prefix(&format!("{label}=\"")))?;
    Some((v.strip_suffix('"')?, value.trim().parse().ok()?))
}

/// The body of every fenced block of `lang` in a Markdown page.
fn fenced(page: &str, lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (&mut current, line.trim()) {
            (Some(body), "```") => {
                blocks.push(std::mem::take(body));
                current = None;
            }
            (Some(body), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, fence) if fence.strip_prefix("```") == Some(lang) => {
                current = Some(String::new());
            }
            (None, _) => {}
        }
    }
    blocks
}

/// The Deployment the page leads with is the file its injection section applies, so the
/// two cannot drift (compared as parsed YAML: comments and layout may differ).
#[test]
fn the_page_leads_with_the_injected_example() -> Result<()> {
    let page = std::fs::read_to_string(repo_root().join("docs/install.md"))?;
    let lead = fenced(&page, "yaml")
        .into_iter()
        .next()
        .context("docs/install.md has no yaml block")?;
    let shown: Vec<serde_json::Value> = serde_saphyr::from_multiple(&lead)?;
    let file = yaml_documents(&repo_root().join("examples/worker/worker-injected.yaml"))?;
    ensure!(
        shown == file,
        "docs/install.md shows {shown:#?}, examples/worker/worker-injected.yaml is {file:#?}"
    );
    ensure!(
        file.len() == 1
            && file[0]["spec"]["template"]["metadata"]["annotations"]
                == serde_json::json!({"rebound.dev/inject": "true"}),
        "the example says more than the annotation: {file:#?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_install_page_works_as_written() -> Result<()> {
    let helm = Helm::get()?;
    let state = repo_root().join(".state").join(unique_name("install-doc"));
    let cluster = tokio::task::spawn_blocking({
        let state = state.clone();
        move || DedicatedCluster::start(&state)
    })
    .await??;
    // A new cluster has no CRD: take away the one the harness installed.
    cluster
        .kubectl(["delete", "crd", "retrypolicies.rebound.dev", "--wait=true"])?
        .ok()?;

    // Files of the test's own, outside the state dir that cluster-down.sh removes.
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique_name("install-doc"));
    std::fs::create_dir_all(&scratch)?;
    let helm_home = scratch.join("helm-home");
    let env = shell_env(
        cluster.kubeconfig(),
        &[helm.path(), cluster.kubectl_path()],
        &helm_home,
    );

    let page = std::fs::read_to_string(repo_root().join("docs/install.md"))?;
    // Without a kubelet no Pod runs: blocks that need one run on the node (tests/tests/node.rs).
    let blocks: Vec<Vec<String>> = shell_blocks(&page)
        .into_iter()
        .filter(|b| b.needs_node.is_none())
        .map(|b| b.commands)
        .collect();
    ensure!(
        blocks.len() >= 5,
        "docs/install.md has {} sh blocks",
        blocks.len()
    );
    let mut operator: Option<(Running, SocketAddr)> = None;
    let mut sidecar: Option<Running> = None;
    let mut outputs = Vec::new();
    let client = cluster.client().await?;
    let deployments: kube::Api<Deployment> =
        kube::Api::namespaced(client.clone(), "rebound-system");
    for block in &blocks {
        for cmd in block {
            let out = run_shell(cmd, &env)?;
            outputs.push((cmd.clone(), out));
        }
        if operator.is_none() && deployments.get_opt("rebound-operator").await?.is_some() {
            let metrics = free_port()?;
            let listen = BTreeMap::from([("--metrics-addr", metrics.to_string())]);
            let running = play_kubelet(
                &cluster,
                "rebound-system",
                "rebound-operator",
                "rebound-operator",
                &listen,
                &[],
            )
            .await?;
            // The readiness probe's path, answered on the metrics port.
            let dep = deployments.get("rebound-operator").await?;
            let probe_path = dep
                .spec
                .template
                .spec
                .and_then(|s| s.containers.into_iter().next())
                .and_then(|c| c.readiness_probe)
                .and_then(|p| p.http_get)
                .and_then(|h| h.path)
                .context("no readiness probe path")?;
            let probe_path = probe_path.as_str();
            eventually("the operator's readiness probe", WAIT, || async move {
                Ok(http_get(metrics, probe_path)
                    .ok()
                    .filter(|response| response.status == 200)
                    .map(drop))
            })
            .await
            .with_context(|| running.log_tail())?;
            operator = Some((running, metrics));
        }
        let watch: kube::Api<Deployment> = kube::Api::namespaced(client.clone(), "team-a");
        if sidecar.is_none() && watch.get_opt("worker-watch").await?.is_some() {
            let admin = free_port()?;
            let socket = scratch.join("rebound.sock");
            let listen = BTreeMap::from([
                ("--admin-listen", admin.to_string()),
                ("--uds", socket.to_string_lossy().into_owned()),
            ]);
            let extra = [format!("--listen={}", free_port()?)];
            let running = play_kubelet(
                &cluster,
                "team-a",
                "worker-watch",
                "rebound-sidecar",
                &listen,
                &extra,
            )
            .await?;
            // Loaded through its watch, with only the Role's rights.
            eventually("the sidecar to load the ConfigMap", WAIT, || async move {
                let response = http_get(admin, "/metrics")?;
                ensure!(response.status == 200, "GET /metrics: {}", response.status);
                Ok(response
                    .body
                    .lines()
                    .filter_map(|l| label_value(l, "rebound_sidecar_config_state", "state"))
                    .any(|(state, v)| state == "active" && v == 1.0)
                    .then_some(()))
            })
            .await
            .with_context(|| running.log_tail())?;
            sidecar = Some(running);
        }
    }
    let (op, _) = operator
        .as_ref()
        .context("the page never installed the operator")?;
    ensure!(sidecar.is_some(), "the page never created worker-watch");

    // The Lease RBAC works: the operator holds the Lease under its Pod's name.
    let leases: kube::Api<Lease> = kube::Api::namespaced(client.clone(), "rebound-system");
    let lease = leases
        .get("rebound-operator")
        .await
        .with_context(|| op.log_tail())?;
    ensure!(
        lease.spec.and_then(|s| s.holder_identity).as_deref() == Some("rebound-operator-0"),
        "the Lease is not held by the operator"
    );
    // The page's RBAC answers are what it says.
    let answers: Vec<&str> = outputs
        .iter()
        .filter(|(c, _)| c.contains("auth can-i"))
        .map(|(_, o)| o.trim())
        .collect();
    ensure!(
        answers == ["yes", "no"],
        "kubectl auth can-i said {answers:?}"
    );
    let restart = outputs
        .iter()
        .find(|(c, _)| c.contains("initContainers[0].restartPolicy"))
        .map(|(_, o)| o.trim());
    ensure!(restart == Some("Always"), "restartPolicy {restart:?}");
    Ok(())
}
