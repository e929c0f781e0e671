//! `kube::Client::try_default()` accepts the kubeconfig written by dev/cluster-up.sh
//! when `KUBECONFIG` points at it, as it will for the operator and the CLI.
//!
//! This file holds a single test on purpose: it sets `KUBECONFIG` for the process.

use rebound_tests::Cluster;

#[test]
fn try_default_reads_the_kubeconfig_from_the_environment() {
    let cluster = Cluster::shared().expect("cluster");
    // SAFETY: the only test of this binary, and no other thread reads the environment
    // at this point (the tokio runtime below is created afterwards).
    unsafe { std::env::set_var("KUBECONFIG", cluster.kubeconfig()) };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(async {
        let client = kube::Client::try_default()
            .await
            .expect("Client::try_default with KUBECONFIG");
        let version = client.apiserver_version().await.expect("GET /version");
        assert!(version.git_version.starts_with("v1."), "{version:?}");
        let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client);
        namespaces
            .get("default")
            .await
            .expect("the default namespace");
    });
}
