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
    store.install(testkit::document("ns", 3, 0), "test", Instant::now());
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
    store.install(with_catch_all(), "test", Instant::now());
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

/// `DecideRequest` as a client in another language may send it: text fields as raw bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawDecideRequest {
    #[prost(bytes = "vec", tag = "1")]
    queue: Vec<u8>,
    #[prost(uint32, tag = "2")]
    attempt: u32,
    #[prost(bytes = "vec", tag = "3")]
    job_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "4")]
    error_class: Vec<u8>,
    #[prost(uint64, tag = "5")]
    first_failure_unix_ms: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDecideBatchRequest {
    #[prost(message, repeated, tag = "1")]
    requests: Vec<RawDecideRequest>,
}

async fn raw_batch(
    addr: std::net::SocketAddr,
    batch: RawDecideBatchRequest,
) -> Result<pb::DecideBatchResponse, tonic::Status> {
    let channel = rebound_sidecar::client::tcp_channel(addr)
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec =
        tonic_prost::ProstCodec::<RawDecideBatchRequest, pb::DecideBatchResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/rebound.v1.RetryAdvisor/DecideBatch",
    );
    grpc.unary(tonic::Request::new(batch), path, codec)
        .await
        .map(tonic::Response::into_inner)
}

fn item_code(result: &pb::DecideResult) -> Option<u32> {
    match &result.result {
        Some(pb::decide_result::Result::Error(e)) => Some(e.code),
        Some(pb::decide_result::Result::Decision(_)) => Some(0),
        None => None,
    }
}

#[tokio::test]
async fn invalid_utf8_and_implausible_times_are_per_item_invalid_argument() {
    const NOW: u64 = 1_800_000_000_000;
    let store = common::store();
    store.install(testkit::document("ns", 3, 0), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(NOW)).await;
    let good = RawDecideRequest {
        queue: b"q0".to_vec(),
        attempt: 1,
        ..Default::default()
    };
    let bad_utf8 = b"q\xff0".to_vec();
    let items = [
        (good.clone(), None),
        (
            RawDecideRequest {
                queue: bad_utf8.clone(),
                ..good.clone()
            },
            Some("queue"),
        ),
        (
            RawDecideRequest {
                job_id: bad_utf8.clone(),
                ..good.clone()
            },
            Some("job_id"),
        ),
        (
            RawDecideRequest {
                error_class: bad_utf8.clone(),
                ..good.clone()
            },
            Some("error_class"),
        ),
        (
            RawDecideRequest {
                first_failure_unix_ms: NOW / 1000,
                ..good.clone()
            },
            Some("first_failure_unix_ms"),
        ),
        (
            RawDecideRequest {
                first_failure_unix_ms: NOW + 3_600_000,
                ..good.clone()
            },
            Some("first_failure_unix_ms"),
        ),
        (
            RawDecideRequest {
                first_failure_unix_ms: NOW + 1_000,
                ..good.clone()
            },
            None,
        ),
        (good.clone(), None),
    ];
    let response = raw_batch(
        server.addr,
        RawDecideBatchRequest {
            requests: items.iter().map(|(r, _)| r.clone()).collect(),
        },
    )
    .await
    .expect("the batch is answered item by item");
    assert_eq!(response.results.len(), items.len());
    for ((_, field), result) in items.iter().zip(&response.results) {
        match field {
            None => assert_eq!(item_code(result), Some(0), "{result:?}"),
            Some(field) => {
                assert_eq!(
                    item_code(result),
                    Some(Code::InvalidArgument as u32),
                    "{field}: {result:?}"
                );
                let Some(pb::decide_result::Result::Error(e)) = &result.result else {
                    unreachable!()
                };
                assert_eq!(e.message.split_once(' ').map(|(f, _)| f), Some(*field));
            }
        }
    }

    // Unary: the same check, the same code.
    let mut client = server.advisor().await;
    let status = client
        .decide(pb::DecideRequest {
            first_failure_unix_ms: NOW / 1000,
            ..req("q0", 1)
        })
        .await
        .expect_err("seconds, not ms");
    assert_eq!(status.code(), Code::InvalidArgument);
    server.stop().await;
}

/// A batch as raw items, to send far more (empty) items than any valid batch.
#[derive(Clone, PartialEq, prost::Message)]
struct RawItems {
    #[prost(bytes = "vec", repeated, tag = "1")]
    requests: Vec<Vec<u8>>,
}

async fn raw_call<M: prost::Message + Send + Sync + 'static>(
    addr: std::net::SocketAddr,
    method: &'static str,
    message: M,
) -> tonic::Status {
    let channel = rebound_sidecar::client::tcp_channel(addr)
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec = tonic_prost::ProstCodec::<M, pb::DecideBatchResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(method);
    grpc.unary(tonic::Request::new(message), path, codec)
        .await
        .expect_err("refused")
}

#[tokio::test]
async fn each_rpc_has_its_own_message_bound_and_batches_are_counted_before_decoding() {
    let store = common::store();
    store.install(testkit::document("ns", 3, 0), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(0)).await;
    let mut client = server.advisor().await;

    // A Decide or GetPolicy needs about 1 KiB: 3 KB is refused before decoding.
    let status = client
        .decide(pb::DecideRequest {
            error_class: "x".repeat(3000),
            ..req("q0", 1)
        })
        .await
        .expect_err("over the Decide bound");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let status = client
        .get_policy(pb::GetPolicyRequest {
            queue: "x".repeat(3000),
        })
        .await
        .expect_err("over the GetPolicy bound");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");

    // 200,000 empty items (400 KB, under the batch message bound): refused by count.
    let status = raw_call(
        server.addr,
        "/rebound.v1.RetryAdvisor/DecideBatch",
        RawItems {
            requests: vec![Vec::new(); 200_000],
        },
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // The largest valid batch still fits.
    let full = pb::DecideBatchRequest {
        requests: vec![
            pb::DecideRequest {
                job_id: "j".repeat(MAX_JOB_ID_LEN),
                error_class: "e".repeat(253),
                ..req(&"q".repeat(MAX_QUEUE_LEN), 1)
            };
            MAX_BATCH
        ],
    };
    let answered = client.decide_batch(full).await.expect("valid").into_inner();
    assert_eq!(answered.results.len(), MAX_BATCH);
    client.decide(req("q0", 1)).await.expect("still answering");
    server.stop().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_and_served_again_once_others_leave() {
    use rebound_sidecar::server::MAX_CONNECTIONS;
    let store = common::store();
    store.install(testkit::document("ns", 3, 0), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(0)).await;
    let mut idle = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        idle.push(
            tokio::net::TcpStream::connect(server.addr)
                .await
                .expect("connect"),
        );
    }
    let addr = server.addr;
    common::eventually(
        "a connection past the cap to be closed",
        std::time::Duration::from_secs(10),
        || async move {
            use tokio::io::AsyncReadExt;
            let Ok(mut extra) = tokio::net::TcpStream::connect(addr).await else {
                return false;
            };
            let mut buf = [0u8; 64];
            // Closed at once: EOF (or a reset) instead of the server's HTTP/2 SETTINGS.
            matches!(
                tokio::time::timeout(std::time::Duration::from_secs(2), extra.read(&mut buf)).await,
                Ok(Ok(0) | Err(_))
            )
        },
    )
    .await;
    drop(idle);
    common::eventually(
        "answers once the idle connections are gone",
        std::time::Duration::from_secs(10),
        || async move {
            let Ok(channel) = rebound_sidecar::client::tcp_channel(addr).await else {
                return false;
            };
            pb::retry_advisor_client::RetryAdvisorClient::new(channel)
                .decide(req("q0", 1))
                .await
                .is_ok()
        },
    )
    .await;
    server.stop().await;
}
