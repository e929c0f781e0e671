//! Support for the injection tests: the admission policies of `rebound inject
//! --admission-policy` installed for a test (removed on drop), the CLI run on a manifest,
//! Pods created (or dry-run) as the API server admits them, and JSON compared field by
//! field.

use std::{io::Write as _, path::PathBuf, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api,
    api::{ApiResource, DynamicObject, PostParams},
};
use serde_json::{Value, json};

use crate::Cluster;

/// The CLI binary of this workspace (`cargo build -p rebound-cli` first).
pub fn rebound() -> Result<PathBuf> {
    rebound_test_support::workspace_binary("rebound")
}

/// The parameter ConfigMap the chart would write, for Rebound installed in `namespace`.
pub fn params(namespace: &str, image: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "rebound-injection", "namespace": namespace},
        "data": {
            "image": image,
            "configMapName": "rebound-policies",
            "mode": "watch",
            "logLevel": "info",
            "cpuRequest": "10m",
            "memoryRequest": "16Mi",
            "memoryLimit": "64Mi",
            "metrics": "false",
        }
    })
}

/// The injection policies and their parameters, installed in a cluster for one test;
/// deleted on drop (they are cluster-wide).
pub struct Installed<'a> {
    cluster: &'a Cluster,
    /// Rebound's own namespace, where the parameters live.
    namespace: String,
    manifests: String,
    pub params_file: tempfile::NamedTempFile,
}

impl<'a> Installed<'a> {
    /// Applies the policies for Rebound in `namespace` (which must exist) and the
    /// parameters there.
    pub fn apply(cluster: &'a Cluster, namespace: &str, image: &str) -> Result<Installed<'a>> {
        let out = Command::new(rebound()?)
            .args([
                "inject",
                "--admission-policy",
                "--policy-namespace",
                namespace,
            ])
            .output()?;
        ensure!(
            out.status.success(),
            "rebound inject --admission-policy: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let manifests = String::from_utf8(out.stdout)?;
        let params = serde_json::to_string(&params(namespace, image))?;
        let mut params_file = tempfile::NamedTempFile::new()?;
        params_file.write_all(params.as_bytes())?;
        let installed = Installed {
            cluster,
            namespace: namespace.to_owned(),
            manifests,
            params_file,
        };
        cluster
            .kubectl_stdin(
                ["apply", "--server-side", "--force-conflicts", "-f", "-"],
                &installed.manifests,
            )?
            .ok()?;
        installed.apply_params(&params)?;
        Ok(installed)
    }

    /// Changes one parameter, in the cluster and in the file the CLI reads.
    pub fn set_param(&mut self, image: &str, key: &str, value: &str) -> Result<()> {
        let mut params = params(&self.namespace, image);
        params["data"][key] = json!(value);
        let text = serde_json::to_string(&params)?;
        let mut file = tempfile::NamedTempFile::new()?;
        file.write_all(text.as_bytes())?;
        self.params_file = file;
        self.apply_params(&text)
    }

    pub fn apply_params(&self, params: &str) -> Result<()> {
        self.cluster
            .kubectl_stdin(["apply", "--server-side", "-f", "-"], params)?
            .ok()?;
        Ok(())
    }

    pub fn delete_params(&self, namespace: &str) -> Result<()> {
        self.cluster
            .kubectl(["-n", namespace, "delete", "configmap", "rebound-injection"])?
            .ok()?;
        Ok(())
    }
}

impl Drop for Installed<'_> {
    fn drop(&mut self) {
        let _ = self.cluster.kubectl_stdin(
            ["delete", "--ignore-not-found", "--wait=false", "-f", "-"],
            &self.manifests,
        );
    }
}

/// `rebound inject` on one object, with the parameters file; `extra` args such as
/// `--enable`. The single object it writes back.
pub fn cli_inject(object: &Value, params_file: &std::path::Path, extra: &[&str]) -> Result<Value> {
    let mut child = Command::new(rebound()?)
        .args(["inject", "-f", "-", "--params"])
        .arg(params_file)
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("no stdin")?
        .write_all(serde_json::to_string(object)?.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "rebound inject: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let docs: Vec<Value> = serde_saphyr::from_multiple(&String::from_utf8(out.stdout)?)?;
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    ensure!(
        docs.len() == 1,
        "rebound inject wrote {} documents",
        docs.len()
    );
    Ok(docs.into_iter().next().unwrap_or_default())
}

/// Creates (or dry-runs) a Pod as JSON, keeping every field the server returns.
pub async fn create_pod(
    client: &kube::Client,
    namespace: &str,
    pod: &Value,
    dry_run: bool,
) -> kube::Result<Value> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::erase::<Pod>(&()));
    let object: DynamicObject =
        serde_json::from_value(pod.clone()).map_err(kube::Error::SerdeError)?;
    let params = PostParams {
        dry_run,
        ..PostParams::default()
    };
    let created = api.create(&params, &object).await?;
    serde_json::to_value(created).map_err(kube::Error::SerdeError)
}

/// The object without what the server makes up per request (uid, times, versions).
pub fn comparable(mut pod: Value) -> Value {
    if let Some(meta) = pod.get_mut("metadata").and_then(Value::as_object_mut) {
        for key in [
            "uid",
            "creationTimestamp",
            "resourceVersion",
            "managedFields",
            "generation",
        ] {
            meta.remove(key);
        }
    }
    pod
}

/// Every path where two JSON values differ (empty when equal).
pub fn differences(a: &Value, b: &Value) -> Vec<String> {
    fn walk(a: &Value, b: &Value, path: String, out: &mut Vec<String>) {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    walk(
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                        format!("{path}/{k}"),
                        out,
                    );
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    walk(p, q, format!("{path}/{i}"), out);
                }
            }
            _ if a == b => {}
            _ => out.push(format!("{path}: {a} != {b}")),
        }
    }
    let mut out = Vec::new();
    walk(a, b, String::new(), &mut out);
    out
}

impl Installed<'_> {
    /// Waits until this install is the one the API server applies: a probe Pod in
    /// `namespace` is injected and a malformed one refused, and an annotated probe in
    /// Rebound's own namespace is admitted as sent. The policies load asynchronously,
    /// each on its own, and share their names with any earlier install: only this
    /// install's bindings exclude this install's namespace.
    pub async fn wait_until_in_effect(&self, client: &kube::Client, namespace: &str) -> Result<()> {
        let probe = |value: &str| {
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "probe", "annotations": {"rebound.dev/inject": value}},
                "spec": {"serviceAccountName": "default", "containers": [{"name": "c", "image": "busybox"}]}
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let injected = match create_pod(client, namespace, &probe("true"), true).await {
                Ok(pod) => pod
                    .pointer("/metadata/labels/rebound.dev~1injected")
                    .is_some(),
                Err(_) => false,
            };
            let refused = create_pod(client, namespace, &probe("maybe"), true)
                .await
                .is_err();
            let asked = probe("true");
            let own_excluded = match create_pod(client, &self.namespace, &asked, true).await {
                Ok(pod) => {
                    crate::json_contains(&pod, &asked)
                        && pod
                            .pointer("/metadata/labels/rebound.dev~1injected")
                            .is_none()
                }
                Err(_) => false,
            };
            if injected && refused && own_excluded {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "the injection policies did not take effect within 60s (injecting: {injected}, refusing: {refused}, own namespace excluded: {own_excluded})"
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
