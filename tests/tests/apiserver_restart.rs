//! A client survives an API server restart: stop only kube-apiserver, start it again on
//! the same port with the same certificates, and the same client and kubeconfig work,
//! with the data (kept in etcd) still there.
//!
//! Runs on a cluster of its own so that the shared cluster of the other tests is never
//! disrupted.

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use rebound_tests::{DedicatedCluster, repo_root, unique_name};

#[tokio::test]
async fn client_works_again_after_the_api_server_restarts() {
    let state_dir = repo_root().join(".state").join(unique_name("restart"));
    let cluster = tokio::task::spawn_blocking({
        let state_dir = state_dir.clone();
        move || DedicatedCluster::start(&state_dir)
    })
    .await
    .expect("join")
    .expect("a dedicated cluster");

    let client = cluster.client().await.expect("client");
    let ns = cluster
        .create_namespace(&client, "restart")
        .await
        .expect("namespace");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("before-restart".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create");

    cluster.stop_apiserver().expect("stop the API server");
    let down = tokio::time::timeout(Duration::from_secs(10), cms.get("before-restart")).await;
    assert!(
        matches!(down, Ok(Err(_)) | Err(_)),
        "the API server still answers after it was stopped: {down:?}"
    );

    cluster
        .start_apiserver()
        .expect("start the API server again");
    let got = cms.get("before-restart").await.expect("read after restart");
    assert_eq!(got.metadata.name.as_deref(), Some("before-restart"));

    // The same once more, through the one-step restart.
    cluster.restart_apiserver().expect("restart");
    cms.get("before-restart").await.expect("read after restart");
    let out = cluster
        .kubectl(["get", "rp", "-n", &ns])
        .expect("run kubectl")
        .ok()
        .expect("the CRD is still served");
    assert!(out.stdout.is_empty() || out.stdout.contains("NAME"));
}
