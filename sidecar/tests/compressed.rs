//! A namespace's document stored compressed, as the operator stores one past 900 KiB:
//! gzip'd in the ConfigMap's `binaryData` under the same key. File mode reads it as the
//! mounted key's file (a kubelet atomic-writer swap), watch mode from the ConfigMap on a
//! real API server; both serve it, switch between the forms, and keep the last good
//! document through a broken stream.

mod common;

use std::{collections::BTreeMap, io::Write, sync::Arc, time::Duration};

use common::eventually;
use k8s_openapi::{ByteString, api::core::v1::ConfigMap};
use kube::api::{Api, ObjectMeta, PostParams};
use rebound_sidecar::{
    pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient},
    source::{files::FileSource, kubernetes::ConfigMapSource},
    store::Store,
    testkit::{self, AtomicWriter},
};
use tonic::transport::Channel;

const KEY: &str = "policies.json";
const WAIT: Duration = Duration::from_secs(20);
/// Policies in the large document: its JSON passes the 900 KiB a ConfigMap's `data` may take.
const LARGE: usize = 10_000;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("in memory");
    encoder.finish().expect("in memory")
}

/// (JSON, gzip'd JSON, hash) of a generated document of `n` policies.
fn document(n: usize, salt: i64) -> (Vec<u8>, Vec<u8>, String) {
    let doc = testkit::document("team-a", n, salt);
    let json = doc.to_json().into_bytes();
    let gz = gzip(&json);
    (json, gz, doc.hash)
}

/// The hash of the document that answers a question about queue `q1`, over gRPC.
async fn served_hash(client: &RetryAdvisorClient<Channel>) -> Option<String> {
    let req = pb::DecideRequest {
        queue: "q1".to_owned(),
        attempt: 1,
        job_id: "j".to_owned(),
        ..Default::default()
    };
    let r = client.clone().decide(req).await.ok()?.into_inner();
    r.policy.map(|p| p.config_hash)
}

async fn wait_for_hash(client: &RetryAdvisorClient<Channel>, hash: &str, what: &str) {
    eventually(what, WAIT, || async {
        served_hash(client).await.as_deref() == Some(hash)
    })
    .await;
}

async fn wait_for_failures(store: &Arc<Store>, at_least: u64, what: &str) {
    eventually(what, WAIT, || {
        let n = store.metrics().reload_failures();
        async move { n >= at_least }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mode_serves_a_compressed_key() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("policies");
    std::fs::create_dir(&dir).expect("mkdir");
    let writer = AtomicWriter::new(&dir);
    let store = common::store();
    let _source = FileSource::mounted_dir(dir.clone(), KEY, Duration::from_millis(200))
        .spawn(Arc::clone(&store))
        .expect("watch");
    let server = common::start(Arc::clone(&store), Arc::new(rebound_sidecar::system_now_ms)).await;
    let client = server.advisor().await;

    let (json, gz, hash) = document(LARGE, 0);
    assert!(json.len() > rebound_policy::compiled::MAX_DOCUMENT_BYTES);
    assert!(gz.len() <= rebound_policy::compiled::MAX_DOCUMENT_BYTES);
    writer.write(&[(KEY, &gz)]).expect("publish compressed");
    wait_for_hash(&client, &hash, "the compressed document").await;
    assert_eq!(
        store.current().map(|l| l.hash().to_owned()),
        Some(hash.clone())
    );

    // Plain again (the namespace shrank), then compressed again.
    let (small, _, small_hash) = document(50, 1);
    writer.write(&[(KEY, &small)]).expect("publish plain");
    wait_for_hash(&client, &small_hash, "the plain document").await;
    let (_, gz2, hash2) = document(LARGE, 2);
    writer.write(&[(KEY, &gz2)]).expect("publish compressed");
    wait_for_hash(&client, &hash2, "the second compressed document").await;

    // A cut-off stream: refused, the last good document keeps answering.
    let failures = store.metrics().reload_failures();
    writer
        .write(&[(KEY, &gz[..gz.len() / 2])])
        .expect("publish broken");
    wait_for_failures(&store, failures + 1, "the broken stream to be refused").await;
    assert_eq!(served_hash(&client).await, Some(hash2));
    server.stop().await;
}

fn configmap(name: &str, plain: Option<&[u8]>, gz: Option<&[u8]>) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: plain.map(|j| BTreeMap::from([(KEY.to_owned(), String::from_utf8_lossy(j).into())])),
        binary_data: gz.map(|b| BTreeMap::from([(KEY.to_owned(), ByteString(b.to_vec()))])),
        ..ConfigMap::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_mode_serves_binary_data() {
    let env = rebound_tests::TestEnv::new("sc-compressed")
        .await
        .expect("cluster");
    let ns = env.namespace.clone();
    let api: Api<ConfigMap> = Api::namespaced(env.client.clone(), &ns);
    let (_, gz, hash) = document(LARGE, 0);
    api.create(
        &PostParams::default(),
        &configmap("rebound-policies", None, Some(&gz)),
    )
    .await
    .expect("create the ConfigMap");

    let store = common::store();
    let target = format!("{ns}/rebound-policies").parse().expect("target");
    let watch = tokio::spawn(
        ConfigMapSource::new(target, None).run(env.client.clone(), Arc::clone(&store)),
    );
    let server = common::start(Arc::clone(&store), Arc::new(rebound_sidecar::system_now_ms)).await;
    let client = server.advisor().await;
    wait_for_hash(&client, &hash, "the compressed document from the watch").await;

    // The operator's switch to plain text: binaryData gone, data back.
    let (small, _, small_hash) = document(50, 1);
    let mut cm = api.get("rebound-policies").await.expect("get");
    cm.data = configmap("x", Some(&small), None).data;
    cm.binary_data = None;
    api.replace("rebound-policies", &PostParams::default(), &cm)
        .await
        .expect("replace with plain");
    wait_for_hash(&client, &small_hash, "the plain document from the watch").await;

    // A broken stream is refused; the plain document keeps answering.
    let failures = store.metrics().reload_failures();
    let mut cm = api.get("rebound-policies").await.expect("get");
    cm.data = None;
    cm.binary_data = configmap("x", None, Some(&gz[..gz.len() / 2])).binary_data;
    api.replace("rebound-policies", &PostParams::default(), &cm)
        .await
        .expect("replace with a broken stream");
    wait_for_failures(&store, failures + 1, "the broken stream to be refused").await;
    assert_eq!(served_hash(&client).await, Some(small_hash));
    watch.abort();
    server.stop().await;
}
