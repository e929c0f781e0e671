//! `kubectl rebound rollout` against the real API server. The test writes the status the
//! operator would write (status subresource, checked against the CRD's schema) and checks
//! what the plugin reads from it and writes back: only `status.rollout.request`.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use rebound_policy::RetryPolicy;
use rebound_tests::{TestEnv, repo_root, yaml_documents};
use serde_json::{Value, json};

const NEW: &str = "sha256:1a2b3c4d5e6f1a2b3c4d5e6f1a2b3c4d5e6f1a2b3c4d5e6f1a2b3c4d5e6f1a2b";
const STABLE: &str = "sha256:9f8e7d6c5b4a9f8e7d6c5b4a9f8e7d6c5b4a9f8e7d6c5b4a9f8e7d6c5b4a9f8e";

fn manifest(name: &str, rollout: bool, max_attempts: u32) -> String {
    let mut m = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: {name}\nspec:\n  \
         queues: [{name}]\n  maxAttempts: {max_attempts}\n  backoff: {{base: 1s, cap: 5m}}\n"
    );
    if rollout {
        m.push_str("  rollout:\n    steps: [{weight: 10, pause: 10m}, {weight: 50}]\n");
    }
    m
}

/// The status rebound-operator writes for `phase` at `generation` (docs/operator.md).
fn status(phase: &str, generation: i64) -> Value {
    let condition = |kind: &str, status: &str, reason: &str| {
        json!({"type": kind, "status": status, "reason": reason, "message": format!("{kind} {reason}"),
               "observedGeneration": generation, "lastTransitionTime": "2026-01-02T03:04:05Z"})
    };
    let (step, steps, conditions) = match phase {
        "Progressing" | "Paused" => (
            json!(0),
            json!([{"weight": 10, "startUnixMs": 1_767_323_045_000_i64}]),
            json!([
                condition("Ready", "False", "RollingOut"),
                condition("Reconciling", "True", "RolloutStep"),
                condition("Progressing", "True", "RolloutStep")
            ]),
        ),
        "Degraded" => (
            Value::Null,
            Value::Null,
            json!([
                condition("Ready", "False", "RolledBack"),
                condition("Stalled", "True", "RolledBack"),
                condition("Degraded", "True", "RolledBack")
            ]),
        ),
        _ => (
            Value::Null,
            Value::Null,
            json!([
                condition("Ready", "True", "Compiled"),
                condition("Healthy", "True", "RolloutComplete")
            ]),
        ),
    };
    let stable = if phase == "Healthy" { NEW } else { STABLE };
    json!({"status": {
        "observedGeneration": generation,
        "conditions": conditions,
        "rollout": {
            "phase": phase, "revision": NEW, "stableRevision": stable, "step": step, "steps": steps,
            "message": format!("{phase} at step 1/2"),
            "analysis": {"verdict": "Continue", "eValue": 0.5, "threshold": 20.0, "failedNew": 40,
                         "failedStable": 360, "badNew": 2, "badStable": 9, "stepFailedJobs": 400,
                         "minFailedJobs": 200},
        },
    }})
}

struct Env {
    env: TestEnv,
    api: Api<RetryPolicy>,
}

impl Env {
    async fn new(prefix: &str) -> Result<Env> {
        let env = TestEnv::new(prefix).await?;
        let api = Api::namespaced(env.client.clone(), &env.namespace);
        Ok(Env { env, api })
    }

    fn apply(&self, manifest: &str) -> Result<()> {
        self.env
            .kubectl_stdin(["apply", "-f", "-"], manifest)?
            .ok()?;
        Ok(())
    }

    /// Writes the status as the operator would (another field manager than the plugin's).
    async fn write_status(&self, name: &str, phase: &str, generation: i64) -> Result<()> {
        let params = PatchParams {
            field_manager: Some("rebound-operator".to_owned()),
            ..Default::default()
        };
        self.api
            .patch_status(name, &params, &Patch::Merge(status(phase, generation)))
            .await?;
        Ok(())
    }

    /// The object as the API server returns it, as JSON.
    async fn read(&self, name: &str) -> Result<Value> {
        Ok(serde_json::to_value(self.api.get(name).await?)?)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kubectl-rebound"));
        c.args(args)
            .args(["-n", &self.env.namespace])
            .env("KUBECONFIG", self.env.cluster.kubeconfig())
            .stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Result<Output> {
        Ok(self.command(args).output()?)
    }

    fn run_as(&self, kubeconfig: &std::path::Path, args: &[&str]) -> Result<Output> {
        Ok(self.command(args).env("KUBECONFIG", kubeconfig).output()?)
    }
}

fn code(out: &Output) -> Option<i32> {
    out.status.code()
}

fn is_hex16(id: &str) -> bool {
    id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit())
}

/// The request written and who wrote it; `spec` and `generation` as before.
async fn check_request(
    e: &Env,
    name: &str,
    before: &Value,
    action: &str,
    out: &Output,
) -> Result<String> {
    ensure!(
        out.status.success(),
        "{action}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_json::from_slice(&out.stdout)?;
    let after = e.read(name).await?;
    let request = &after["status"]["rollout"]["request"];
    assert_eq!(request["action"], action);
    assert_eq!(request["revision"], NEW, "the revision read");
    assert_eq!(
        request["step"], before["status"]["rollout"]["step"],
        "the step read"
    );
    let id = request["id"].as_str().context("an id")?.to_owned();
    assert!(is_hex16(&id), "{id}");
    assert_eq!(printed["id"], id.as_str());
    assert_eq!(printed["action"], action);
    assert_eq!(after["spec"], before["spec"], "spec untouched");
    assert_eq!(
        after["metadata"]["generation"],
        before["metadata"]["generation"]
    );
    assert_eq!(
        after["metadata"]["annotations"],
        before["metadata"]["annotations"]
    );
    // The operator's fields are as it wrote them.
    assert_eq!(
        after["status"]["rollout"]["phase"],
        before["status"]["rollout"]["phase"]
    );
    assert_eq!(
        after["status"]["conditions"],
        before["status"]["conditions"]
    );
    let manager = after["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["manager"] == "kubectl-rebound")
        .context("a managedFields entry of kubectl-rebound")?;
    assert_eq!(manager["subresource"], "status");
    assert_eq!(
        manager["fieldsV1"]["f:status"]["f:rollout"]["f:request"]["f:id"],
        json!({}),
        "kubectl-rebound owns status.rollout.request: {manager}"
    );
    assert!(
        manager["fieldsV1"].get("f:spec").is_none()
            && manager["fieldsV1"]["f:status"]
                .get("f:conditions")
                .is_none()
            && manager["fieldsV1"]["f:status"]["f:rollout"]
                .get("f:phase")
                .is_none(),
        "kubectl-rebound owns nothing else: {manager}"
    );
    Ok(id)
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_write_only_status_rollout_request() -> Result<()> {
    let e = Env::new("cli-rollout-req").await?;
    e.apply(&manifest("pay", true, 5))?;
    e.apply(&manifest("plain", false, 5))?;
    let promote = ["rollout", "promote", "pay", "-o", "json"];

    // Refused, nothing written: no status yet, a policy without rollout, Healthy, and a
    // retry of a rollout that is not rolled back.
    let refused = |args: &[&str], why: &str| -> Result<()> {
        let out = e.run(args)?;
        assert_eq!(
            code(&out),
            Some(1),
            "{why}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{why}: printed {:?}", out.stdout);
        Ok(())
    };
    let unchanged = |before: &Value, after: &Value, why: &str| {
        assert_eq!(
            before["metadata"]["resourceVersion"], after["metadata"]["resourceVersion"],
            "{why}: nothing written"
        );
    };
    let before = e.read("pay").await?;
    refused(&promote, "no status.rollout")?;
    unchanged(&before, &e.read("pay").await?, "no status.rollout");
    let plain = e.read("plain").await?;
    refused(&["rollout", "abort", "plain"], "no spec.rollout")?;
    unchanged(&plain, &e.read("plain").await?, "no spec.rollout");

    e.write_status("pay", "Healthy", 1).await?;
    let before = e.read("pay").await?;
    for action in ["promote", "abort", "retry"] {
        refused(
            &["rollout", action, "pay"],
            &format!("{action} when Healthy"),
        )?;
    }
    unchanged(&before, &e.read("pay").await?, "Healthy");

    // Status for an older generation: the plugin waits for the operator to see the new one.
    e.write_status("pay", "Progressing", 1).await?;
    e.apply(&manifest("pay", true, 6))?;
    let before = e.read("pay").await?;
    assert_eq!(before["metadata"]["generation"], 2);
    refused(&promote, "generation not observed")?;
    unchanged(&before, &e.read("pay").await?, "generation not observed");

    e.write_status("pay", "Progressing", 2).await?;
    let before = e.read("pay").await?;
    refused(&["rollout", "retry", "pay"], "retry when Progressing")?;
    unchanged(&before, &e.read("pay").await?, "retry when Progressing");

    let first = check_request(&e, "pay", &before, "Promote", &e.run(&promote)?).await?;
    // `status` shows the request until the operator records it as handled.
    let look = || -> Result<Value> {
        let out = e.run(&["rollout", "status", "pay", "--watch=false", "-o", "json"])?;
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let pending = &look()?["pendingRequest"];
    assert_eq!(
        (pending["action"].as_str(), pending["id"].as_str()),
        (Some("Promote"), Some(first.as_str()))
    );
    let handled = json!({"status": {"rollout": {"handledRequest": first}}});
    e.api
        .patch_status("pay", &PatchParams::default(), &Patch::Merge(handled))
        .await?;
    assert_eq!(look()?.get("pendingRequest"), None);
    let out = e.run(&["rollout", "promote", "--full", "pay", "-o", "json"])?;
    let second = check_request(&e, "pay", &before, "PromoteFull", &out).await?;
    assert_ne!(first, second, "each request has its own id");
    e.write_status("pay", "Paused", 2).await?;
    let before = e.read("pay").await?;
    let out = e.run(&["rollout", "abort", "pay", "-o", "json"])?;
    check_request(&e, "pay", &before, "Abort", &out).await?;

    e.write_status("pay", "Degraded", 2).await?;
    let before = e.read("pay").await?;
    for action in ["promote", "abort"] {
        refused(
            &["rollout", action, "pay"],
            &format!("{action} when Degraded"),
        )?;
    }
    let out = e.run(&["rollout", "retry", "pay", "-o", "json"])?;
    check_request(&e, "pay", &before, "Retry", &out).await?;

    // A missing policy is an error, not a refusal.
    let out = e.run(&["rollout", "promote", "nosuch"])?;
    assert_eq!(code(&out), Some(2));
    Ok(())
}

/// `rollout status` running in the background, its JSON lines as they come.
struct Watch {
    child: Child,
    lines: mpsc::Receiver<Value>,
}

impl Watch {
    fn start(e: &Env, args: &[&str]) -> Result<Watch> {
        let mut child = e
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().context("stdout")?;
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let value = serde_json::from_str(&line).unwrap_or(Value::String(line));
                if send.send(value).is_err() {
                    break;
                }
            }
        });
        Ok(Watch { child, lines })
    }

    fn next(&self) -> Result<Value> {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .context("a status line within 60 s")
    }

    /// The exit code, waiting up to 60 s.
    fn exit(&mut self) -> Result<Option<i32>> {
        for _ in 0..600 {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.code());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        anyhow::bail!("rollout status did not exit within 60 s")
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn status_watches_until_healthy_or_degraded() -> Result<()> {
    let e = Env::new("cli-rollout-status").await?;
    e.apply(&manifest("pay", true, 5))?;
    e.write_status("pay", "Progressing", 1).await?;

    // One look: the fields, exit 3 (not finished).
    let out = e.run(&["rollout", "status", "pay", "--watch=false", "-o", "json"])?;
    assert_eq!(
        code(&out),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["state"], "Progressing");
    assert_eq!(v["phase"], "Progressing");
    assert_eq!(v["revision"], NEW);
    assert_eq!(v["stableRevision"], STABLE);
    assert_eq!(
        (
            v["step"].clone(),
            v["stepCount"].clone(),
            v["weight"].clone()
        ),
        (json!(0), json!(2), json!(10))
    );
    assert_eq!(v["analysis"]["badRatioNew"], 0.05);
    assert_eq!(v["analysis"]["badRatioStable"], 0.025);
    assert_eq!(v["analysis"]["eValue"], 0.5);
    assert_eq!(v["analysis"]["threshold"], 20.0);
    assert_eq!(v["analysis"]["stepFailedJobs"], 400);
    assert_eq!(v["analysis"]["minFailedJobs"], 200);
    assert_eq!(v["observedGeneration"], 1);
    // Text for people works on the same state.
    let out = e.run(&["rollout", "status", "pay", "--watch=false"])?;
    assert_eq!(code(&out), Some(3));
    assert!(!out.stdout.is_empty());

    // Timeout: exit 3.
    let out = e.run(&["rollout", "status", "pay", "--timeout", "2s", "-o", "json"])?;
    assert_eq!(
        code(&out),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Healthy for an old generation does not end the watch; for the current one it does.
    let mut watch = Watch::start(
        &e,
        &["rollout", "status", "pay", "-o", "json", "--timeout", "90s"],
    )?;
    assert_eq!(watch.next()?["state"], "Progressing");
    e.apply(&manifest("pay", true, 6))?;
    let line = watch.next()?;
    assert_eq!(
        (line["state"].clone(), line["generation"].clone()),
        (json!("Waiting"), json!(2))
    );
    e.write_status("pay", "Healthy", 1).await?;
    let line = watch.next()?;
    assert_eq!(
        (line["state"].clone(), line["phase"].clone()),
        (json!("Waiting"), json!("Healthy"))
    );
    assert!(
        watch.child.try_wait()?.is_none(),
        "a stale Healthy ended the watch"
    );
    e.write_status("pay", "Healthy", 2).await?;
    let line = watch.next()?;
    assert_eq!(
        (line["state"].clone(), line["weight"].clone()),
        (json!("Healthy"), json!(100))
    );
    assert_eq!(watch.exit()?, Some(0));

    // Degraded: its own exit code.
    e.write_status("pay", "Progressing", 2).await?;
    let mut watch = Watch::start(
        &e,
        &["rollout", "status", "pay", "-o", "json", "--timeout", "90s"],
    )?;
    assert_eq!(watch.next()?["state"], "Progressing");
    e.write_status("pay", "Degraded", 2).await?;
    assert_eq!(watch.next()?["state"], "Degraded");
    assert_eq!(watch.exit()?, Some(1));

    // A policy without spec.rollout: its conditions decide, so one command gates any policy.
    e.apply(&manifest("plain", false, 5))?;
    let plain = |phase: &str| -> Result<Value> {
        let mut s = status(phase, 1);
        s["status"]["rollout"] = Value::Null;
        Ok(s)
    };
    let params = PatchParams::default();
    e.api
        .patch_status("plain", &params, &Patch::Merge(plain("Degraded")?))
        .await?;
    let out = e.run(&["rollout", "status", "plain", "-o", "json"])?;
    assert_eq!(code(&out), Some(1), "Stalled=True");
    e.api
        .patch_status("plain", &params, &Patch::Merge(plain("Healthy")?))
        .await?;
    let out = e.run(&["rollout", "status", "plain", "-o", "json"])?;
    assert_eq!(code(&out), Some(0), "Ready=True");
    let v: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        (v["state"].clone(), v["phase"].clone()),
        (json!("Healthy"), Value::Null)
    );
    Ok(())
}

/// A cluster-scoped object this test created, deleted when it ends.
struct ClusterObject<'a>(&'a TestEnv, &'a str);

impl Drop for ClusterObject<'_> {
    fn drop(&mut self) {
        let _ = self.0.kubectl(["delete", self.1, "--ignore-not-found"]);
    }
}

/// The ClusterRole of deploy/rbac.yaml (the chart's, aggregated into `edit`) is all a
/// person needs; without it the request is refused by the API server, with the role named.
#[tokio::test(flavor = "multi_thread")]
async fn the_rollout_cluster_role_is_what_requests_need() -> Result<()> {
    let e = Env::new("cli-rollout-rbac").await?;
    let ns = e.env.namespace.clone();
    e.apply(&manifest("pay", true, 5))?;
    e.write_status("pay", "Progressing", 1).await?;
    let mut role = yaml_documents(&repo_root().join("deploy/rbac.yaml"))?
        .into_iter()
        .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "rebound-rollout")
        .context("deploy/rbac.yaml has the ClusterRole rebound-rollout")?;
    let name = format!("rebound-rollout-{ns}");
    role["metadata"] = json!({"name": name});
    e.env
        .kubectl_stdin(["apply", "-f", "-"], &role.to_string())?
        .ok()?;
    let object = format!("clusterrole/{name}");
    let _role = ClusterObject(&e.env, &object);
    e.env
        .kubectl([
            "-n",
            &ns,
            "create",
            "rolebinding",
            "rollout",
            "--clusterrole",
            &name,
            "--user",
            "rollout-alice",
        ])?
        .ok()?;
    let alice = e.env.cluster.mint_user_kubeconfig("rollout-alice", &[])?;
    let bob = e.env.cluster.mint_user_kubeconfig("rollout-bob", &[])?;

    let before = e.read("pay").await?;
    let out = e.run_as(&bob, &["rollout", "promote", "pay"])?;
    assert_eq!(
        code(&out),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        e.read("pay").await?["metadata"]["resourceVersion"],
        before["metadata"]["resourceVersion"]
    );
    let out = e.run_as(
        &alice,
        &["rollout", "status", "pay", "--watch=false", "-o", "json"],
    )?;
    assert_eq!(
        code(&out),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = e.run_as(&alice, &["rollout", "promote", "pay", "-o", "json"])?;
    check_request(&e, "pay", &before, "Promote", &out).await?;
    Ok(())
}
