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

pub mod cluster;

pub use cluster::{
    Cluster, CmdOutput, FIELD_MANAGER, TestEnv, client_from_kubeconfig, crds_dir, repo_root,
    unique_name,
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
