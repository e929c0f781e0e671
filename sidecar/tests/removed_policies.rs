//! The namespace's last RetryPolicy is deleted: the operator keeps the ConfigMap with an
//! empty, hash-stamped document. The sidecar loads it, answers NOT_FOUND for every queue,
//! stays SERVING, and its metrics tell "no policies" (`empty`) from "the input is broken,
//! last good kept" (`stale`).

mod common;

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use common::{SERVING, eventually, health_status};
use rebound_policy::CompiledDocument;
use rebound_sidecar::{
    pb::v1 as pb,
    source::files::FileSource,
    testkit::{self, AtomicWriter},
};
use tonic::Code;

const KEY: &str = "policies.json";
const WAIT: Duration = Duration::from_secs(10);

/// `metric{labels}` → value, from the Prometheus text of the admin port.
async fn scrape(admin: SocketAddr) -> BTreeMap<String, f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(admin).await.expect("admin");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("send");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("read");
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn state(admin: SocketAddr) -> Option<String> {
    let m = scrape(admin).await;
    let states: Vec<_> = ["none", "active", "empty", "stale"]
        .into_iter()
        .filter(|s| m.get(&format!("rebound_sidecar_config_state{{state=\"{s}\"}}")) == Some(&1.0))
        .collect();
    match states.as_slice() {
        [one] => Some((*one).to_owned()),
        _ => None,
    }
}

async fn wait_state(admin: SocketAddr, want: &str) {
    eventually(&format!("state {want}"), WAIT, || async move {
        state(admin).await.as_deref() == Some(want)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_document_means_no_policies_and_a_broken_one_keeps_the_last_good() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("policies");
    let writer = AtomicWriter::new(&dir);
    let full = testkit::document("team-a", 3, 0);
    writer
        .write(&[(KEY, full.to_json().as_bytes())])
        .expect("publish");
    let store = common::store();
    let _source = FileSource::mounted_dir(dir.clone(), KEY, Duration::from_millis(100))
        .spawn(Arc::clone(&store))
        .expect("watch");
    let server = common::start(Arc::clone(&store), common::fixed_clock(0)).await;
    let mut client = server.advisor().await;
    let mut health = server.health().await;
    wait_state(server.admin, "active").await;
    let ask = pb::DecideRequest {
        queue: "q0".to_owned(),
        attempt: 1,
        ..Default::default()
    };
    client.decide(ask.clone()).await.expect("q0 is governed");

    // The last policy is deleted: an empty, hash-stamped document.
    let empty = CompiledDocument::new("team-a", Vec::new());
    writer
        .write(&[(KEY, empty.to_json().as_bytes())])
        .expect("publish empty");
    wait_state(server.admin, "empty").await;
    let m = scrape(server.admin).await;
    assert_eq!(m.get("rebound_sidecar_config_policies"), Some(&0.0));
    let info = format!(
        "rebound_sidecar_config_info{{config_hash=\"{}\",origin=\"{}\"}}",
        empty.hash,
        dir.join(KEY).display()
    );
    assert_eq!(m.get(&info), Some(&1.0), "{m:?}");
    for queue in ["q0", "q1", "anything"] {
        let status = client
            .decide(pb::DecideRequest {
                queue: queue.to_owned(),
                ..ask.clone()
            })
            .await
            .expect_err("no policy governs it");
        assert_eq!(status.code(), Code::NotFound, "{queue}");
    }
    assert_eq!(health_status(&mut health, "").await, SERVING);
    assert_eq!(
        health_status(&mut health, "rebound.v1.RetryAdvisor").await,
        SERVING
    );

    // A broken document: stale, the empty one keeps answering.
    writer
        .write(&[(KEY, b"{\"format\":")])
        .expect("publish bad");
    wait_state(server.admin, "stale").await;
    let status = client.decide(ask.clone()).await.expect_err("still empty");
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(health_status(&mut health, "").await, SERVING);

    // Policies come back.
    writer
        .write(&[(KEY, testkit::document("team-a", 3, 1).to_json().as_bytes())])
        .expect("publish again");
    wait_state(server.admin, "active").await;
    client.decide(ask).await.expect("governed again");
    server.stop().await;
}
