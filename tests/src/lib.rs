//! Integration-test support for Rebound.
//!
//! Tests run against a real kube-apiserver + etcd started from `dev/` (see
//! `dev/README.md`). A test gets the shared cluster, a client and a fresh namespace
//! with [`TestEnv::new`]:
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! let env = rebound_tests::TestEnv::new("my-test").await?;
//! let out = env.kubectl(["get", "retrypolicies"])?.ok()?;
//! println!("{}", out.stdout);
//! # Ok(())
//! # }
//! ```

pub mod client_modules;
pub mod cluster;
pub mod compiled;
pub mod doc;
pub mod flux;
pub mod helm;
pub mod injection;
pub mod kubelet;
pub mod lease;
pub mod module_graph;
pub mod node;
pub mod process;
pub mod prometheus;
pub mod proxy;
pub mod scrape;

pub use cluster::{
    Cluster, CmdOutput, DedicatedCluster, FIELD_MANAGER, TestEnv, client_from_kubeconfig, crds_dir,
    repo_root, unique_name,
};

use kube::core::{ApiResource, GroupVersionKind};

/// API group of Rebound's custom resources.
pub const GROUP: &str = "rebound.dev";
/// API version of Rebound's custom resources.
pub const VERSION: &str = "v1alpha1";
/// Name of the RetryPolicy CRD.
pub const RETRY_POLICY_CRD: &str = "retrypolicies.rebound.dev";

/// The RetryPolicy resource, for `kube::Api<DynamicObject>`.
pub fn retry_policy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, "RetryPolicy"),
        "retrypolicies",
    )
}

/// The file that defines the RetryPolicy CRD.
pub fn retry_policy_crd_file() -> std::path::PathBuf {
    crds_dir().join(format!("{RETRY_POLICY_CRD}.yaml"))
}

/// Every `examples/policies/*.yaml`, sorted.
pub fn example_policy_files() -> anyhow::Result<Vec<std::path::PathBuf>> {
    let dir = repo_root().join("examples/policies");
    let mut files = Vec::new();
    for entry in
        std::fs::read_dir(&dir).map_err(|e| anyhow::anyhow!("reading {}: {e}", dir.display()))?
    {
        let path = entry
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", dir.display()))?
            .path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The YAML documents of a file as JSON values (empty documents are skipped).
pub fn yaml_documents(path: &std::path::Path) -> anyhow::Result<Vec<serde_json::Value>> {
    use anyhow::Context;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
        .with_context(|| format!("parsing {} as YAML", path.display()))?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// True if every field set in `expected` has the same value in `actual` (numbers are
/// compared as numbers, so `3` equals `3.0`; `actual` may have more fields).
pub fn json_contains(actual: &serde_json::Value, expected: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (actual, expected) {
        (Value::Object(a), Value::Object(e)) => e
            .iter()
            .all(|(k, ev)| a.get(k).is_some_and(|av| json_contains(av, ev))),
        (Value::Array(a), Value::Array(e)) => {
            a.len() == e.len() && a.iter().zip(e).all(|(av, ev)| json_contains(av, ev))
        }
        (Value::Number(a), Value::Number(e)) => a.as_f64() == e.as_f64(),
        (a, e) => a == e,
    }
}
