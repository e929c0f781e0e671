//! The sidecar's answers are `rebound_policy::decide`'s answers: the same inputs through a
//! real gRPC client and straight into the function give the same decision, for a generated
//! table covering every strategy, jitter kind, terminal action and give-up reason.

mod common;

use std::time::{Duration, Instant};

use rebound_policy::{
    Context, Decision, Disposition, GiveUpReason, PolicyTable, decide, decide::mix64,
};
use rebound_sidecar::{
    answer::resolved_to_wire,
    pb::v1::{self as pb, decide_result},
    testkit,
};

const NOW_MS: u64 = 1_800_000_000_000;

/// What `decide` says, in wire terms; `None` when no policy governs the queue.
fn expected(table: &PolicyTable, req: &pb::DecideRequest) -> Option<pb::DecideResponse> {
    let entry = table.lookup(&req.queue)?;
    let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    let (job_id, error_class) = (non_empty(&req.job_id), non_empty(&req.error_class));
    let ctx = Context {
        job_id: job_id.as_deref(),
        error_class: error_class.as_deref(),
        first_failure_ms: (req.first_failure_unix_ms != 0).then_some(req.first_failure_unix_ms),
        now_ms: Some(NOW_MS),
        retry_after_ms: (req.retry_after_ms != 0).then_some(req.retry_after_ms),
    };
    let mut r = pb::DecideResponse {
        policy: Some(pb::PolicyRef {
            name: entry.name().to_owned(),
            namespace: entry.namespace().to_owned(),
            generation: entry.generation,
            config_hash: table.hash().to_owned(),
        }),
        ..Default::default()
    };
    match decide(entry, req.attempt, &ctx) {
        Decision::Retry { delay_ms } => {
            r.set_decision(pb::Decision::Retry);
            r.delay_ms = delay_ms;
        }
        Decision::GiveUp {
            disposition,
            reason,
        } => {
            r.set_decision(pb::Decision::GiveUp);
            r.reason_message = reason.to_string();
            r.set_reason(match reason {
                GiveUpReason::MaxAttempts { .. } => pb::GiveUpReason::MaxAttempts,
                GiveUpReason::Deadline { .. } => pb::GiveUpReason::Deadline,
                GiveUpReason::NonRetryable { .. } => pb::GiveUpReason::NonRetryable,
            });
            match disposition {
                Disposition::Drop => r.set_disposition(pb::Disposition::Drop),
                Disposition::DeadLetter { dead_letter_queue } => {
                    r.set_disposition(pb::Disposition::DeadLetter);
                    r.dead_letter_queue = dead_letter_queue;
                }
            }
        }
    }
    Some(r)
}

/// A deterministic spread of requests: known queues, glob matches, unknown queues,
/// attempts past every limit, non-retryable classes, deadlines and pushbacks.
fn requests(policies: usize, n: usize) -> Vec<pb::DecideRequest> {
    (0..n as u64)
        .map(|k| {
            let r = mix64(k);
            let i = (r % (policies as u64 + 5)) as usize;
            let queue = match (r >> 8) % 4 {
                0 | 1 => format!("q{i}"),
                2 => format!("g{i}.sub{}", r % 7),
                _ => format!("unknown-{i}"),
            };
            pb::DecideRequest {
                queue,
                attempt: 1 + ((r >> 16) % 20) as u32,
                job_id: format!("job-{}", (r >> 24) % 1000),
                error_class: ["", "Timeout", "Fatal", "http.404", "http.500"]
                    [((r >> 32) % 5) as usize]
                    .to_owned(),
                first_failure_unix_ms: match (r >> 40) % 3 {
                    0 => 0,
                    1 => NOW_MS - 60_000,
                    _ => NOW_MS - 29 * 60_000,
                },
                retry_after_ms: if (r >> 48).is_multiple_of(5) {
                    90_000
                } else {
                    0
                },
            }
        })
        .collect()
}

#[tokio::test]
async fn unary_and_batch_answers_equal_decide() {
    let doc = testkit::document("team-a", 120, 0);
    let table = PolicyTable::new(&doc);
    let store = common::store();
    store.install(doc.clone(), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(NOW_MS)).await;
    let mut client = server.advisor().await;

    let reqs = requests(doc.policies.len(), 3000);
    let (mut answered, mut not_found, mut give_ups) = (0, 0, 0);
    for req in &reqs {
        let got = client.decide(req.clone()).await;
        match expected(&table, req) {
            Some(want) => {
                let got = got.expect("decision").into_inner();
                if got.decision() == pb::Decision::GiveUp {
                    give_ups += 1;
                }
                assert_eq!(got, want, "request {req:?}");
                answered += 1;
            }
            None => {
                let status = got.expect_err("unknown queue");
                assert_eq!(status.code(), tonic::Code::NotFound);
                assert!(status.message().contains(&format!("{:?}", req.queue)));
                not_found += 1;
            }
        }
    }
    assert!(
        answered > 1500 && not_found > 300 && give_ups > 300,
        "{answered} {not_found} {give_ups}"
    );

    for chunk in reqs.chunks(rebound_sidecar::answer::MAX_BATCH) {
        let batch = pb::DecideBatchRequest {
            requests: chunk.to_vec(),
        };
        let got = client
            .decide_batch(batch)
            .await
            .expect("batch")
            .into_inner();
        assert_eq!(got.results.len(), chunk.len());
        for (req, result) in chunk.iter().zip(got.results) {
            match (expected(&table, req), result.result) {
                (Some(want), Some(decide_result::Result::Decision(got))) => {
                    assert_eq!(got, want, "batch request {req:?}")
                }
                (None, Some(decide_result::Result::Error(e))) => {
                    assert_eq!(e.code, tonic::Code::NotFound as u32)
                }
                (want, got) => panic!("{req:?}: expected {want:?}, got {got:?}"),
            }
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn get_policy_returns_the_resolved_parameters() {
    let doc = testkit::document("team-a", 40, 0);
    let table = PolicyTable::new(&doc);
    let store = common::store();
    store.install(doc.clone(), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(NOW_MS)).await;
    let mut client = server.advisor().await;
    for queue in (0..40).flat_map(|i| [format!("q{i}"), format!("g{i}.x")]) {
        let entry = table.lookup(&queue).expect("known queue");
        let got = client
            .get_policy(pb::GetPolicyRequest {
                queue: queue.clone(),
            })
            .await
            .expect("policy")
            .into_inner();
        assert_eq!(got.resolved, Some(resolved_to_wire(&entry.resolved())));
        let policy = got.policy.expect("policy ref");
        assert_eq!(
            (policy.name.as_str(), policy.config_hash.as_str()),
            (entry.name(), doc.hash.as_str())
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn same_job_same_answer_without_job_id_still_within_cap() {
    let doc = testkit::document("team-a", 5, 0);
    let store = common::store();
    store.install(doc.clone(), "test", Instant::now());
    let server = common::start(store, common::fixed_clock(NOW_MS)).await;
    let mut client = server.advisor().await;
    let req = |job: &str| pb::DecideRequest {
        queue: "q0".to_owned(),
        attempt: 2,
        job_id: job.to_owned(),
        ..Default::default()
    };
    let a = client.decide(req("j1")).await.expect("a").into_inner();
    let b = client.decide(req("j1")).await.expect("b").into_inner();
    assert_eq!(a, b, "deterministic jitter per job id");
    let cap = doc.policies[0].params.cap_ms;
    for _ in 0..50 {
        let r = client.decide(req("")).await.expect("random").into_inner();
        assert!(r.delay_ms <= cap);
    }
    tokio::time::timeout(Duration::from_secs(10), server.stop())
        .await
        .expect("stops");
}
