//! An operator at rest stays at rest, and a change near the ConfigMap limit takes down
//! only itself. One test, one operator over two namespaces, and one shared at-rest window
//! at the end: with `--resync=2s` every namespace is reconciled in full about ten times in
//! it, and each of those reconciles would write if a comparison were wrong (the loop this
//! guards against wrote every 2 s). The 60 s version is in `docs/operator.md`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use rebound_policy::compiled::MAX_DOCUMENT_BYTES;
use rebound_policy::{PolicySource, RetryPolicy, RetryPolicySpec, compile};
use rebound_tests::{TestEnv, retry_policy_resource};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const RESYNC: Duration = Duration::from_secs(2);
/// Ten resync periods.
fn window() -> Duration {
    std::env::var("REBOUND_AT_REST_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(RESYNC * 10, Duration::from_secs)
}

#[tokio::test(flavor = "multi_thread")]
async fn at_rest_nothing_is_written_and_a_growing_policy_leaves_only_itself_out() -> Result<()> {
    let env = TestEnv::new("op-rest").await?;
    let client = &env.client;
    let foreign = env.namespace.clone();
    let big = env.cluster.create_namespace(client, "op-rest-big").await?;
    let op = Operator::start(
        env.cluster.kubeconfig(),
        vec![
            format!("--namespaces={foreign},{big}"),
            format!("--lease-namespace={foreign}"),
            format!("--resync={}s", RESYNC.as_secs()),
        ],
    )?;

    // 1. Another field manager adds a condition type and a status field of its own.
    let mut manifests = policy("p0", &["a"], 3);
    manifests.push_str(&policy("p1", &["b"], 3));
    env.kubectl_stdin(["apply", "-f", "-"], &manifests)?.ok()?;
    converged(client, &foreign, WAIT).await?;
    other_tool_status(
        &env,
        "p0",
        json!({"conditions": [{"type": "Healthy", "status": "True", "reason": "Probed",
            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
    )?;
    other_tool_status(
        &env,
        "p1",
        json!({"summary": {"retryBudget": "set by other-tool"}}),
    )?;
    // Any edit in the namespace reconciles it (a status write alone triggers nothing).
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p2", &["c"], 3))?
        .ok()?;
    converged(client, &foreign, WAIT).await?;

    // 2. Near the limit, the oldest policy grows past it.
    let shape = Shape::new(&big)?;
    let policies: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &big, &retry_policy_resource());
    apply(&policies, &shape.manifest(0, SMALL)).await?;
    for i in 1..shape.count {
        apply(&policies, &shape.manifest(i, shape.queues(i))).await?;
    }
    let before = converged(client, &big, WAIT).await?;
    ensure!(before.policies.len() == shape.count, "all fit at first");
    apply(&policies, &shape.manifest(0, FULL)).await?;
    let grown = wait_for_reason(client, &big, &name(0), "DocumentTooLarge", WAIT).await?;
    let message = ready_condition(&grown.status.clone().unwrap_or_default().conditions)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    let parsed = TooLarge::parse(&message)?;
    ensure!(
        parsed.limit == "compressed"
            && parsed.max == MAX_DOCUMENT_BYTES
            && parsed.bytes > MAX_DOCUMENT_BYTES
            && parsed.served == shape.count - 1,
        "{parsed:?}"
    );
    // Every other policy is still Ready and served at its generation.
    let typed: Api<RetryPolicy> = Api::namespaced(client.clone(), &big);
    let others = eventually("the others to stay Ready", WAIT, || async {
        let list = typed.list(&ListParams::default()).await?.items;
        let others: Vec<RetryPolicy> = list
            .into_iter()
            .filter(|p| p.metadata.name.as_deref() != Some(name(0).as_str()))
            .collect();
        let ready = others.iter().all(|p| {
            let status = p.status.clone().unwrap_or_default();
            ready_condition(&status.conditions).is_some_and(|c| {
                c.status == "True" && c.observed_generation == p.metadata.generation
            })
        });
        Ok(ready.then_some(others))
    })
    .await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &big);
    let (json, _) = stored_document(&cms.get(CM).await?)?;
    let served = rebound_policy::compiled::CompiledDocument::from_json(&json)?;
    let served: BTreeMap<String, i64> = served
        .policies
        .iter()
        .map(|p| (p.name.clone(), p.generation))
        .collect();
    let wanted: BTreeMap<String, i64> = others
        .iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap_or_default(),
                p.metadata.generation.unwrap_or_default(),
            )
        })
        .collect();
    ensure!(served == wanted, "served {served:?}");
    let event = events(client, &big)
        .await?
        .into_iter()
        .find(|e| e.regarding == name(0) && e.reason == "DocumentTooLarge")
        .context("a DocumentTooLarge event")?;
    ensure!(TooLarge::parse(&event.note)? == parsed);

    // 3. At rest: no write, no object changes, while reconciles keep running.
    tokio::time::sleep(RESYNC * 2).await;
    let start = Snapshot::take(&op, client, &[&foreign, &big]).await?;
    tokio::time::sleep(window()).await;
    let end = Snapshot::take(&op, client, &[&foreign, &big]).await?;
    eprintln!(
        "at rest for {:?}: {} writes, {} reconciles, {} objects of which {} changed",
        window(),
        end.writes - start.writes,
        end.reconciles - start.reconciles,
        end.versions.len(),
        end.versions
            .iter()
            .filter(|(k, v)| start.versions.get(*k) != Some(*v))
            .count()
    );
    ensure!(
        end.writes == start.writes,
        "{} writes at rest",
        end.writes - start.writes
    );
    ensure!(end.versions == start.versions, "objects changed at rest");
    // The window did see reconciles (each namespace about every 2 s).
    ensure!(
        end.reconciles - start.reconciles >= 5.0,
        "only {} reconciles in the window",
        end.reconciles - start.reconciles
    );
    // The other tool's condition and field are left where they are.
    let p0 = status_json(client, &foreign, "p0").await?;
    let types: Vec<&str> = p0["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["type"].as_str())
        .collect();
    ensure!(
        types.contains(&"Healthy") && types.contains(&"Ready"),
        "{types:?}"
    );
    let p1 = status_json(client, &foreign, "p1").await?;
    ensure!(p1["summary"]["retryBudget"] == "set by other-tool");
    Ok(())
}

/// `kubectl apply --server-side --subresource=status --field-manager=other-tool`.
fn other_tool_status(env: &TestEnv, name: &str, status: Value) -> Result<()> {
    let manifest = json!({
        "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
        "metadata": {"name": name}, "status": status,
    });
    env.kubectl_stdin(
        [
            "apply",
            "--server-side",
            "--subresource=status",
            "--field-manager=other-tool",
            "-f",
            "-",
        ],
        &manifest.to_string(),
    )?
    .ok()?;
    Ok(())
}

async fn status_json(client: &kube::Client, ns: &str, name: &str) -> Result<Value> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &retry_policy_resource());
    Ok(api.get(name).await?.data["status"].clone())
}

async fn apply(api: &Api<DynamicObject>, manifest: &Value) -> Result<()> {
    let name = manifest["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let object: DynamicObject = serde_json::from_value(manifest.clone())?;
    api.patch(
        &name,
        &PatchParams::apply("at-rest-test").force(),
        &Patch::Apply(&object),
    )
    .await
    .with_context(|| format!("applying {name}"))?;
    Ok(())
}

/// What changes if anything is written: the operator's write counter and every object's
/// resourceVersion.
struct Snapshot {
    writes: f64,
    reconciles: f64,
    versions: BTreeMap<String, String>,
}

impl Snapshot {
    async fn take(op: &Operator, client: &kube::Client, namespaces: &[&str]) -> Result<Self> {
        let mut versions = BTreeMap::new();
        for ns in namespaces {
            let policies: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), ns, &retry_policy_resource());
            for p in policies.list_metadata(&ListParams::default()).await?.items {
                versions.insert(
                    format!("{ns}/rp/{}", p.metadata.name.unwrap_or_default()),
                    p.metadata.resource_version.unwrap_or_default(),
                );
            }
            let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
            for cm in cms.list_metadata(&ListParams::default()).await?.items {
                versions.insert(
                    format!("{ns}/cm/{}", cm.metadata.name.unwrap_or_default()),
                    cm.metadata.resource_version.unwrap_or_default(),
                );
            }
        }
        Ok(Self {
            writes: op.writes()?,
            reconciles: op.metric("rebound_operator_reconciles_total")?,
            versions,
        })
    }
}

/// The `DocumentTooLarge` message, parsed by the grammar of `docs/operator.md`:
/// `<limit> limit exceeded: <bytes> > <max> bytes; serving <served> policies in ConfigMap
/// <name> without this one`.
#[derive(Debug, PartialEq)]
struct TooLarge {
    limit: String,
    bytes: usize,
    max: usize,
    served: usize,
}

impl TooLarge {
    fn parse(message: &str) -> Result<Self> {
        let words: Vec<&str> = message.split_whitespace().collect();
        match words.as_slice() {
            [
                limit,
                "limit",
                "exceeded:",
                bytes,
                ">",
                max,
                "bytes;",
                "serving",
                served,
                "policies",
                "in",
                "ConfigMap",
                _,
                "without",
                "this",
                "one",
            ] => Ok(Self {
                limit: (*limit).to_owned(),
                bytes: bytes.parse()?,
                max: max.parse()?,
                served: served.parse()?,
            }),
            _ => bail!("not the DocumentTooLarge grammar: {message:?}"),
        }
    }
}

const SMALL: usize = 1;
const FULL: usize = 64;

fn name(i: usize) -> String {
    format!("p{i:02}")
}

/// A namespace whose policies' queues and error classes are pseudo-random text (fixed
/// seed; gzip cannot shrink them much), sized so that all fit in the ConfigMap compressed
/// while `p00` is small, and not once `p00` has grown to full size: `p01`.. are full, the
/// last one is a filler of as many queues as that takes.
struct Shape {
    namespace: String,
    count: usize,
    filler: usize,
}

impl Shape {
    fn new(namespace: &str) -> Result<Self> {
        let mut shape = Self {
            namespace: namespace.to_owned(),
            count: 2,
            filler: FULL,
        };
        let full = shape.compressed(&[0, 1])? - shape.compressed(&[0])?;
        let target = MAX_DOCUMENT_BYTES - 9 * 1024;
        let base = shape.compressed(&[0])?;
        // p00, the full ones, and the filler; the estimate adds up policies as if gzip
        // compressed each alone, which it does not quite.
        shape.count = 2 + (target - base) / full;
        shape.filler = 1;
        while shape.total(SMALL)? > target {
            shape.count -= 1;
        }
        // Then the filler's queues, by bisection, to land just under the target.
        let (mut lo, mut hi) = (1, FULL);
        while lo < hi {
            shape.filler = (lo + hi).div_ceil(2);
            if shape.total(SMALL)? <= target {
                lo = shape.filler;
            } else {
                hi = shape.filler - 1;
            }
        }
        shape.filler = lo;
        let (small, grown) = (shape.total(SMALL)?, shape.total(FULL)?);
        ensure!(
            small + 3 * 1024 <= MAX_DOCUMENT_BYTES && grown >= MAX_DOCUMENT_BYTES + 3 * 1024,
            "the shape does not straddle the limit: {small} / {grown} bytes"
        );
        eprintln!(
            "{} policies, {small} bytes compressed; {grown} with p00 grown",
            shape.count
        );
        Ok(shape)
    }

    fn queues(&self, i: usize) -> usize {
        if i + 1 == self.count {
            self.filler
        } else {
            FULL
        }
    }

    fn total(&self, first: usize) -> Result<usize> {
        let sources: Vec<PolicySource> = (0..self.count)
            .map(|i| self.source(i, if i == 0 { first } else { self.queues(i) }))
            .collect::<Result<_>>()?;
        gz_len(&self.namespace, sources)
    }

    fn compressed(&self, which: &[usize]) -> Result<usize> {
        let sources = which
            .iter()
            .map(|&i| self.source(i, if i == 0 { SMALL } else { FULL }))
            .collect::<Result<_>>()?;
        gz_len(&self.namespace, sources)
    }

    fn source(&self, i: usize, queues: usize) -> Result<PolicySource> {
        let spec: RetryPolicySpec =
            serde_json::from_value(self.manifest(i, queues)["spec"].clone())?;
        Ok(PolicySource {
            name: name(i),
            namespace: self.namespace.clone(),
            // As long as a real uid.
            uid: format!("{:08x}-0000-4000-8000-{:012x}", i * 7919, i * 104_729),
            generation: 1,
            created: Some(0),
            spec,
        })
    }

    fn manifest(&self, i: usize, queues: usize) -> Value {
        let mut x = i as u64 + 1;
        let mut noise = |kind: &str, j: usize| {
            let text: String = (0..230)
                .map(|_| {
                    x = rebound_policy::decide::mix64(x);
                    char::from(b'a' + (x % 26) as u8)
                })
                .collect();
            format!("{kind}-{i}-{j}-{text}")
        };
        let queues: Vec<String> = (0..queues).map(|j| noise("q", j)).collect();
        let errors: Vec<String> = (0..queues.len()).map(|j| noise("e", j)).collect();
        json!({
            "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
            "metadata": {"name": name(i), "namespace": self.namespace},
            "spec": {"queues": queues, "nonRetryableErrors": errors},
        })
    }
}

/// The gzip'd size of the namespace's document, as the operator compresses it.
fn gz_len(namespace: &str, sources: Vec<PolicySource>) -> Result<usize> {
    use std::io::Write;
    let json = compile(namespace, sources).document.to_json();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(json.as_bytes())?;
    Ok(gz.finish()?.len())
}

/// The samples of `name` with exactly `labels` (e.g. `{result="error"}`), or 0.
fn sample(op: &Operator, name: &str, labels: &str) -> Result<f64> {
    let text = http_get(op.metrics, "/metrics")?.ok()?;
    let series = format!("{name}{labels} ");
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0))
}

#[tokio::test(flavor = "multi_thread")]
async fn deleted_namespaces_are_forgotten() -> Result<()> {
    let env = TestEnv::new("op-forget").await?;
    let client = &env.client;
    let mut namespaces = vec![env.namespace.clone()];
    for _ in 0..2 {
        namespaces.push(env.cluster.create_namespace(client, "op-forget").await?);
    }
    let op = Operator::start(
        env.cluster.kubeconfig(),
        vec![
            format!("--namespaces={}", namespaces.join(",")),
            format!("--lease-namespace={}", namespaces[0]),
        ],
    )?;
    for ns in &namespaces {
        env.cluster
            .kubectl_stdin(["-n", ns, "apply", "-f", "-"], &policy("p", &["q"], 3))?
            .ok()?;
        converged(client, ns, WAIT).await?;
    }
    // (The last reconcile puts its namespace's state back right after its status write.)
    eventually("three namespaces held", WAIT, || async {
        let held = op.metric("rebound_operator_namespaces_held")?;
        let compiled = op.metric("rebound_operator_policies_compiled")?;
        Ok((held == 3.0 && compiled == 3.0).then_some(()))
    })
    .await?;

    // What deleting a namespace does to its contents (this control plane has no namespace
    // controller to do it): the policies go, then the ConfigMap, then the namespace.
    for ns in &namespaces {
        env.cluster
            .kubectl(["-n", ns, "delete", "retrypolicy", "--all"])?
            .ok()?;
        eventually("the empty document", WAIT, || async {
            let doc = configmap_document(client, ns).await?;
            Ok(doc.filter(|(d, _)| d.policies.is_empty()).map(|_| ()))
        })
        .await?;
        env.cluster
            .kubectl(["-n", ns, "delete", "configmap", CM])?
            .ok()?;
        env.cluster
            .kubectl(["delete", "namespace", ns, "--wait=false"])?
            .ok()?;
    }
    eventually("every namespace forgotten", WAIT, || async {
        let held = op.metric("rebound_operator_namespaces_held")?;
        let compiled = op.metric("rebound_operator_policies_compiled")?;
        let bytes = op.metric("rebound_operator_configmap_bytes")?;
        Ok((held == 0.0 && compiled == 0.0 && bytes == 0.0).then_some(()))
    })
    .await?;
    Ok(())
}

/// A ValidatingAdmissionPolicy refusing every ConfigMap write in one namespace; removed
/// when dropped (it is cluster-scoped: a failed test must not leave it behind).
struct Refusal<'a> {
    env: &'a TestEnv,
    name: String,
}

impl<'a> Refusal<'a> {
    fn start(env: &'a TestEnv) -> Result<Refusal<'a>> {
        let name = rebound_tests::unique_name("refuse-cm");
        let ns = &env.namespace;
        let manifest = format!(
            "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n\
             metadata: {{name: {name}}}\nspec:\n  failurePolicy: Fail\n  matchConstraints:\n    \
             resourceRules:\n    - apiGroups: [\"\"]\n      apiVersions: [v1]\n      \
             operations: [CREATE, UPDATE]\n      resources: [configmaps]\n  validations:\n  \
             - expression: \"false\"\n    message: refused for the test\n---\n\
             apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicyBinding\n\
             metadata: {{name: {name}}}\nspec:\n  policyName: {name}\n  validationActions: [Deny]\n  \
             matchResources:\n    namespaceSelector:\n      matchLabels: {{kubernetes.io/metadata.name: {ns}}}\n"
        );
        let refusal = Refusal { env, name };
        env.cluster
            .kubectl_stdin(["apply", "-f", "-"], &manifest)?
            .ok()?;
        // In force once a dry-run write is refused.
        rebound_test_support::eventually_blocking("the refusal to be in force", WAIT, || {
            let probe =
                env.kubectl(["annotate", "configmap", CM, "probe=1", "--dry-run=server"])?;
            Ok((!probe.success()).then_some(()))
        })?;
        Ok(refusal)
    }
}

impl Drop for Refusal<'_> {
    fn drop(&mut self) {
        let _ = self.env.cluster.kubectl([
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            &self.name,
            "--ignore-not-found",
        ]);
    }
}

async fn versions(client: &kube::Client, ns: &str) -> Result<BTreeMap<String, String>> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &retry_policy_resource());
    Ok(api
        .list_metadata(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.name.unwrap_or_default(),
                p.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect())
}

async fn ready_reasons(client: &kube::Client, ns: &str) -> Result<Vec<String>> {
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|p| {
            let status = p.status.unwrap_or_default();
            ready_condition(&status.conditions).map(|c| c.reason.clone())
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_configmap_write_flips_no_status_until_it_persists() -> Result<()> {
    let env = TestEnv::new("op-refused").await?;
    let (client, ns) = (&env.client, env.namespace.clone());
    let op = Operator::start(env.cluster.kubeconfig(), scoped(&ns, &[]))?;
    let manifests: String = ["p0", "p1", "p2"]
        .iter()
        .map(|p| policy(p, &[p], 3))
        .collect();
    env.kubectl_stdin(["apply", "-f", "-"], &manifests)?.ok()?;
    converged(client, &ns, WAIT).await?;
    let before = versions(client, &ns).await?;

    // A few seconds of refused writes: retried, no status moves.
    let refusal = Refusal::start(&env)?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p0", &["p0"], 4))?
        .ok()?;
    eventually("a refused write", WAIT, || async {
        let errors = sample(
            &op,
            "rebound_operator_reconciles_total",
            "{result=\"error\"}",
        )?;
        Ok((errors >= 1.0).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reasons = ready_reasons(client, &ns).await?;
    ensure!(!reasons.iter().any(|r| r == "ApplyFailed"), "{reasons:?}");
    drop(refusal);
    converged(client, &ns, WAIT).await?;
    let after = versions(client, &ns).await?;
    ensure!(
        after.get("p1") == before.get("p1") && after.get("p2") == before.get("p2"),
        "unchanged policies were written: {before:?} → {after:?}"
    );
    ensure!(
        !events(client, &ns)
            .await?
            .iter()
            .any(|e| e.reason == "ApplyFailed"),
        "an ApplyFailed event for a transient failure"
    );

    // Refused for longer: the policies say so.
    let _refusal = Refusal::start(&env)?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p0", &["p0"], 5))?
        .ok()?;
    wait_for_reason(client, &ns, "p0", "ApplyFailed", WAIT).await?;
    Ok(())
}
