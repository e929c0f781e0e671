//! Half-sent calls cannot make the sidecar hold more request bytes than its budget: calls
//! past it are refused with RESOURCE_EXHAUSTED, and the sidecar keeps answering.

mod common;

use std::time::{Duration, Instant};

use rebound_sidecar::{
    answer::MAX_REQUEST_BYTES,
    pb::v1 as pb,
    server::{GRPC_REQUEST_BYTES_IN_FLIGHT, MAX_CONCURRENT_STREAMS},
    testkit::{
        self,
        flood::{Outcome, half_sent_calls},
    },
};

const RESOURCE_EXHAUSTED: i32 = 8;

#[tokio::test]
async fn half_sent_batches_past_the_budget_are_refused_and_decide_still_answers() {
    let store = common::store();
    store.install(testkit::document("ns", 3, 0), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(0)).await;

    // 4 connections × 32 calls, each announcing an almost full batch and sending 60,000
    // bytes of it: 7.7 MB in all, nearly twice the budget.
    let (connections, streams, sent) = (4, MAX_CONCURRENT_STREAMS as usize, 60_000);
    let announced = u32::try_from(MAX_REQUEST_BYTES - 64).expect("fits");
    let mut flood = half_sent_calls(
        server.addr,
        "/rebound.v1.RetryAdvisor/DecideBatch",
        connections,
        streams,
        announced,
        sent,
    )
    .await
    .expect("open the calls");

    // A call is only held whole if all its bytes fit: at most budget / sent of them.
    let calls = connections * streams;
    let held_at_most = GRPC_REQUEST_BYTES_IN_FLIGHT / sent;
    let refused_at_least = calls - held_at_most;
    let mut refused = 0;
    let mut other = Vec::new();
    let waited = tokio::time::timeout(Duration::from_secs(8), async {
        while refused < refused_at_least {
            match flood.next_outcome().await {
                Some(Outcome::Status(RESOURCE_EXHAUSTED)) => refused += 1,
                Some(outcome) => other.push(outcome),
                None => break,
            }
        }
    })
    .await;
    assert!(
        waited.is_ok() && refused >= refused_at_least,
        "{refused} of {calls} half-sent calls refused (expected at least {refused_at_least}); other outcomes: {other:?}"
    );
    assert!(other.is_empty(), "calls ended otherwise: {other:?}");

    // The flood is still open; an ordinary worker call is answered.
    let answer = server
        .advisor()
        .await
        .decide(pb::DecideRequest {
            queue: "q0".into(),
            attempt: 1,
            ..Default::default()
        })
        .await
        .expect("Decide answered during the flood")
        .into_inner();
    assert!(
        answer.policy.is_some(),
        "answered from a policy: {answer:?}"
    );
    drop(flood);
    server.stop().await;
}
