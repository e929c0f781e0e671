//! Hot reload through a reproduced kubelet atomic-writer swap, and last-known-good through
//! every kind of bad update: corrupt JSON, a tampered hash, a half-written file, a deleted
//! directory. Health follows: NOT_SERVING until the first good configuration, then SERVING
//! throughout, whatever the files do.

mod common;

use std::{path::Path, sync::Arc, time::Duration};

use common::{NOT_SERVING, SERVING, eventually, health_status};
use rebound_sidecar::{
    pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient},
    source::files::FileSource,
    store::Store,
    testkit::{self, AtomicWriter},
};
use tonic::transport::Channel;

const KEY: &str = "policies.json";
const WAIT: Duration = Duration::from_secs(10);

async fn served_hash(client: &mut RetryAdvisorClient<Channel>) -> Option<String> {
    let req = pb::DecideRequest {
        queue: "q1".to_owned(),
        attempt: 1,
        job_id: "j".to_owned(),
        ..Default::default()
    };
    let r = client.decide(req).await.ok()?.into_inner();
    r.policy.map(|p| p.config_hash)
}

async fn wait_for_hash(client: &mut RetryAdvisorClient<Channel>, hash: &str, what: &str) {
    let mut c = client.clone();
    eventually(what, WAIT, || {
        let mut c = c.clone();
        async move { served_hash(&mut c).await.as_deref() == Some(hash) }
    })
    .await;
    assert_eq!(served_hash(&mut c).await.as_deref(), Some(hash));
}

async fn wait_for_failures(store: &Arc<Store>, at_least: u64, what: &str) {
    let store = Arc::clone(store);
    eventually(what, WAIT, || {
        let n = store.metrics().reload_failures();
        async move { n >= at_least }
    })
    .await;
}

fn doc_bytes(salt: i64) -> (Vec<u8>, String) {
    let doc = testkit::document("team-a", 50, salt);
    (doc.to_json().into_bytes(), doc.hash)
}

fn write_raw(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_swaps_reload_and_bad_updates_keep_the_last_good_config() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("policies");
    std::fs::create_dir(&dir).expect("mkdir");
    let writer = AtomicWriter::new(&dir);

    let store = common::store();
    let source = FileSource::mounted_dir(dir.clone(), KEY, Duration::from_millis(200))
        .spawn(Arc::clone(&store))
        .expect("watch");
    let server = common::start(Arc::clone(&store), Arc::new(rebound_sidecar::system_now_ms)).await;
    let mut client = server.advisor().await;
    let mut health = server.health().await;

    // Empty mount: nothing to serve yet.
    assert_eq!(health_status(&mut health, "").await, NOT_SERVING);
    assert_eq!(
        health_status(&mut health, "rebound.v1.RetryAdvisor").await,
        NOT_SERVING
    );
    wait_for_failures(&store, 1, "the missing file to be reported").await;
    let status = client
        .decide(pb::DecideRequest {
            queue: "q1".to_owned(),
            attempt: 1,
            ..Default::default()
        })
        .await
        .expect_err("no config yet");
    assert_eq!(status.code(), tonic::Code::Unavailable);

    // First publication.
    let (a, hash_a) = doc_bytes(0);
    writer.write(&[(KEY, &a)]).expect("publish a");
    wait_for_hash(&mut client, &hash_a, "config A").await;
    assert_eq!(health_status(&mut health, "").await, SERVING);
    assert_eq!(
        health_status(&mut health, "rebound.v1.RetryAdvisor").await,
        SERVING
    );

    // A kubelet swap to a new version.
    let (b, hash_b) = doc_bytes(1);
    writer.write(&[(KEY, &b)]).expect("publish b");
    wait_for_hash(&mut client, &hash_b, "config B after the ..data swap").await;

    // Corrupt JSON: rejected, B still answers, health unchanged.
    let failures = store.metrics().reload_failures();
    writer
        .write(&[(KEY, b"{\"format\": \"rebound.dev/compiled-poli")])
        .expect("publish corrupt");
    wait_for_failures(&store, failures + 1, "corrupt JSON to be rejected").await;
    assert_eq!(
        served_hash(&mut client).await.as_deref(),
        Some(hash_b.as_str())
    );
    assert_eq!(health_status(&mut health, "").await, SERVING);

    // A document whose content does not match its hash (edited by hand): rejected.
    let failures = store.metrics().reload_failures();
    let tampered = String::from_utf8(b.clone())
        .expect("utf8")
        .replace("\"maxAttempts\":2", "\"maxAttempts\":3");
    assert_ne!(tampered.as_bytes(), b.as_slice());
    writer
        .write(&[(KEY, tampered.as_bytes())])
        .expect("publish tampered");
    wait_for_failures(&store, failures + 1, "a tampered document to be rejected").await;
    assert_eq!(
        served_hash(&mut client).await.as_deref(),
        Some(hash_b.as_str())
    );

    // Half-written in place (not the atomic writer): rejected until the write completes.
    let (c, hash_c) = doc_bytes(2);
    writer.write(&[(KEY, &b)]).expect("back to b");
    let real = writer.current_file(KEY).expect("real file");
    let failures = store.metrics().reload_failures();
    write_raw(&real, &c[..c.len() / 2]);
    wait_for_failures(&store, failures + 1, "a half-written file to be rejected").await;
    assert_eq!(
        served_hash(&mut client).await.as_deref(),
        Some(hash_b.as_str())
    );
    write_raw(&real, &c);
    wait_for_hash(&mut client, &hash_c, "config C once the write completes").await;

    // The whole directory disappears: C keeps answering, health stays SERVING.
    let failures = store.metrics().reload_failures();
    std::fs::remove_dir_all(&dir).expect("rm -r");
    wait_for_failures(&store, failures + 1, "the deleted directory to be reported").await;
    assert_eq!(
        served_hash(&mut client).await.as_deref(),
        Some(hash_c.as_str())
    );
    assert_eq!(health_status(&mut health, "").await, SERVING);

    // It comes back with a new version: the watch is re-armed and D loads.
    let (d, hash_d) = doc_bytes(3);
    let writer = AtomicWriter::new(&dir);
    writer.write(&[(KEY, &d)]).expect("publish d");
    wait_for_hash(&mut client, &hash_d, "config D in the re-created directory").await;
    let (e, hash_e) = doc_bytes(4);
    writer.write(&[(KEY, &e)]).expect("publish e");
    wait_for_hash(&mut client, &hash_e, "config E through the re-armed watch").await;

    drop(source);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_manifests_are_compiled_and_watched() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("policies.yaml");
    let manifest = |attempts: u32| {
        format!(
            "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: webhooks\nspec:\n  queues: [webhooks]\n  maxAttempts: {attempts}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ignored\n"
        )
    };
    std::fs::write(&file, manifest(3)).expect("write");
    let store = common::store();
    let _source = FileSource::manifests(
        vec![file.clone()],
        "demo".to_owned(),
        Duration::from_millis(200),
    )
    .spawn(Arc::clone(&store))
    .expect("watch");
    let server = common::start(Arc::clone(&store), Arc::new(rebound_sidecar::system_now_ms)).await;
    let mut client = server.advisor().await;
    let max_attempts = |client: &RetryAdvisorClient<Channel>| {
        let mut client = client.clone();
        async move {
            client
                .get_policy(pb::GetPolicyRequest {
                    queue: "webhooks".to_owned(),
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().resolved)
                .map(|p| p.max_attempts)
        }
    };
    eventually("the YAML policy", WAIT, || {
        let f = max_attempts(&client);
        async move { f.await == Some(3) }
    })
    .await;
    let r = client
        .get_policy(pb::GetPolicyRequest {
            queue: "webhooks".to_owned(),
        })
        .await
        .expect("policy")
        .into_inner();
    assert_eq!(r.policy.expect("ref").namespace, "demo");

    // An invalid edit is rejected whole; the valid version keeps answering.
    let failures = store.metrics().reload_failures();
    std::fs::write(&file, manifest(0)).expect("write invalid");
    wait_for_failures(&store, failures + 1, "an invalid manifest to be rejected").await;
    assert_eq!(max_attempts(&client).await, Some(3));

    // An editor-style replace (write elsewhere, rename over) is picked up.
    let tmp_file = tmp.path().join(".policies.yaml.swp");
    std::fs::write(&tmp_file, manifest(7)).expect("write tmp");
    std::fs::rename(&tmp_file, &file).expect("rename");
    eventually("the edited YAML policy", WAIT, || {
        let f = max_attempts(&client);
        async move { f.await == Some(7) }
    })
    .await;
    client
        .decide(pb::DecideRequest {
            queue: "webhooks".to_owned(),
            attempt: 1,
            ..Default::default()
        })
        .await
        .expect("decides");
    server.stop().await;
}
