//! Awkward input gets a clear status, never a panic: the table from the issue, through a
//! real client, plus oversized messages and batches, unknown queues with and without a
//! catch-all, and calls before any configuration is loaded.

mod common;

use std::time::Instant;

use rebound_policy::{CompiledDocument, PolicySource, compile, spec::RetryPolicySpec};
use rebound_sidecar::{
    answer::{MAX_BATCH, MAX_JOB_ID_LEN, MAX_QUEUE_LEN},
    pb::v1 as pb,
    testkit,
};
use tonic::Code;

fn req(queue: &str, attempt: u32) -> pb::DecideRequest {
    pb::DecideRequest {
        queue: queue.to_owned(),
        attempt,
        ..Default::default()
    }
}

fn with_catch_all() -> CompiledDocument {
    let source = |name: &str, queue: &str| PolicySource {
        name: name.to_owned(),
        namespace: "ns".to_owned(),
        uid: String::new(),
        generation: 1,
        created: None,
        spec: RetryPolicySpec {
            queues: vec![queue.to_owned()],
            ..testkit::spec(0)
        },
    };
    compile(
        "ns",
        vec![source("default", "*"), source("emails", "emails")],
    )
    .document
}

#[tokio::test]
async fn bad_requests_are_invalid_argument_with_a_clear_message() {
    let store = common::store();
    store.install(&testkit::document("ns", 3, 0), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(0)).await;
    let mut client = server.advisor().await;

    let long = |n: usize| "x".repeat(n);
    let cases: Vec<(&str, pb::DecideRequest, Code, &str)> = vec![
        (
            "empty queue",
            req("", 1),
            Code::InvalidArgument,
            "queue must not be empty",
        ),
        (
            "attempt 0",
            req("q0", 0),
            Code::InvalidArgument,
            "attempt must be at least 1",
        ),
        (
            "queue too long",
            req(&long(MAX_QUEUE_LEN + 1), 1),
            Code::InvalidArgument,
            "queue is 254 bytes long; at most 253",
        ),
        (
            "job id too long",
            pb::DecideRequest {
                job_id: long(MAX_JOB_ID_LEN + 1),
                ..req("q0", 1)
            },
            Code::InvalidArgument,
            "job_id is 513 bytes long; at most 512",
        ),
        (
            "error class too long",
            pb::DecideRequest {
                error_class: long(254),
                ..req("q0", 1)
            },
            Code::InvalidArgument,
            "error_class is 254 bytes long",
        ),
        (
            "unknown queue",
            req("nobody-owns-this", 1),
            Code::NotFound,
            "governs queue \"nobody-owns-this\"",
        ),
    ];
    for (what, request, code, message) in cases {
        let status = client.decide(request.clone()).await.expect_err(what);
        assert_eq!(status.code(), code, "{what}: {status:?}");
        assert!(
            status.message().contains(message),
            "{what}: {:?}",
            status.message()
        );
        // The batch form reports the same problem per item.
        let batch = client
            .decide_batch(pb::DecideBatchRequest {
                requests: vec![request, req("q0", 1)],
            })
            .await
            .expect("batch with bad items is still answered")
            .into_inner();
        match &batch.results[0].result {
            Some(pb::decide_result::Result::Error(e)) => {
                assert_eq!(e.code, code as u32, "{what}");
                assert!(e.message.contains(message), "{what}: {}", e.message);
            }
            other => panic!("{what}: {other:?}"),
        }
        assert!(matches!(
            batch.results[1].result,
            Some(pb::decide_result::Result::Decision(_))
        ));
    }

    let status = client
        .get_policy(pb::GetPolicyRequest {
            queue: String::new(),
        })
        .await
        .expect_err("empty queue");
    assert_eq!(status.code(), Code::InvalidArgument);

    let too_many = pb::DecideBatchRequest {
        requests: vec![req("q0", 1); MAX_BATCH + 1],
    };
    let status = client
        .decide_batch(too_many)
        .await
        .expect_err("batch bound");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("at most 256"),
        "{}",
        status.message()
    );

    // A message far above the decoding bound is refused before it is decoded.
    let huge = pb::DecideRequest {
        job_id: long(2 * 1024 * 1024),
        ..req("q0", 1)
    };
    let status = client.decide(huge).await.expect_err("oversized message");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // Attempts far past any limit and odd characters are answered, not refused.
    for queue in ["q0", "g1.ü/ä", "q0\n"] {
        let r = client.decide(req(queue, u32::MAX)).await;
        assert!(
            matches!(
                r.as_ref().map_err(|s| s.code()),
                Ok(_) | Err(Code::NotFound)
            ),
            "{r:?}"
        );
    }

    // The server is still healthy and answering after all of that.
    client.decide(req("q0", 1)).await.expect("still answering");
    server.stop().await;
}

#[tokio::test]
async fn catch_all_answers_unknown_queues() {
    let store = common::store();
    store.install(&with_catch_all(), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(0)).await;
    let mut client = server.advisor().await;
    let r = client
        .decide(req("whatever", 1))
        .await
        .expect("catch-all")
        .into_inner();
    assert_eq!(r.policy.expect("policy").name, "default");
    let r = client
        .decide(req("emails", 1))
        .await
        .expect("exact")
        .into_inner();
    assert_eq!(r.policy.expect("policy").name, "emails");
    server.stop().await;
}

#[tokio::test]
async fn before_any_configuration_calls_are_unavailable() {
    let server = common::start(common::store(), common::fixed_clock(0)).await;
    let mut client = server.advisor().await;
    let status = client.decide(req("q0", 1)).await.expect_err("no config");
    assert_eq!(status.code(), Code::Unavailable);
    let status = client
        .get_policy(pb::GetPolicyRequest {
            queue: "q0".to_owned(),
        })
        .await
        .expect_err("no config");
    assert_eq!(status.code(), Code::Unavailable);
    server.stop().await;
}
