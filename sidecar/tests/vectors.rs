//! The sidecar answers every case of the committed cross-language test vectors
//! (`policy/testdata/decide-vectors.json`) exactly, over a real gRPC client: the same file
//! adapters in other languages use to prove their local fallback.

mod common;

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use rebound_policy::{
    CompiledDocument, CompiledPolicy, ResolvedPolicy,
    vectors::{NAMESPACE, VectorFile, WireAnswer, WireDecision, WireDisposition, WireReason},
};
use rebound_sidecar::pb::v1 as pb;

const VECTORS: &str = include_str!("../../policy/testdata/decide-vectors.json");

/// Every policy of the file in one document; each serves the queue named after it.
fn document(file: &VectorFile) -> CompiledDocument {
    let mut policies: BTreeMap<String, ResolvedPolicy> = BTreeMap::new();
    for case in &file.cases {
        let resolved = case.policy.to_resolved().expect("valid policy");
        let name = case
            .identity
            .strip_prefix(&format!("{NAMESPACE}/"))
            .expect("identity in the vectors namespace")
            .to_owned();
        let known = policies.entry(name).or_insert_with(|| resolved.clone());
        assert_eq!(*known, resolved, "{}: one identity, one policy", case.name);
    }
    let policies = policies
        .into_iter()
        .map(|(name, params)| CompiledPolicy {
            queues: vec![name.clone()],
            name,
            namespace: NAMESPACE.to_owned(),
            uid: String::new(),
            generation: 1,
            params,
            rollout: None,
        })
        .collect();
    // Through the reader, as a sidecar loads any document.
    CompiledDocument::from_json(
        CompiledDocument::new(NAMESPACE, policies)
            .to_json()
            .as_bytes(),
    )
    .expect("document reads back")
}

fn wire_answer(r: &pb::DecideResponse) -> WireAnswer {
    WireAnswer {
        decision: match r.decision() {
            pb::Decision::GiveUp => WireDecision::GiveUp,
            _ => WireDecision::Retry,
        },
        delay_ms: r.delay_ms,
        disposition: match r.disposition() {
            pb::Disposition::Unspecified => WireDisposition::Unspecified,
            pb::Disposition::Drop => WireDisposition::Drop,
            pb::Disposition::DeadLetter => WireDisposition::DeadLetter,
        },
        dead_letter_queue: r.dead_letter_queue.clone(),
        reason: match r.reason() {
            pb::GiveUpReason::Unspecified => WireReason::Unspecified,
            pb::GiveUpReason::MaxAttempts => WireReason::MaxAttempts,
            pb::GiveUpReason::Deadline => WireReason::Deadline,
            pb::GiveUpReason::NonRetryable => WireReason::NonRetryable,
        },
        reason_message: r.reason_message.clone(),
    }
}

#[tokio::test]
async fn sidecar_answers_every_vector_exactly() {
    let file = VectorFile::from_json(VECTORS).expect("vector file parses");
    assert!(file.cases.len() > 500, "{} cases", file.cases.len());
    let store = common::store();
    store.install(document(&file), "vectors", Instant::now());
    let now = Arc::new(AtomicU64::new(rebound_policy::vectors::NOW_UNIX_MS));
    let clock_now = Arc::clone(&now);
    let server = common::start(store, Arc::new(move || clock_now.load(Ordering::SeqCst))).await;
    let mut client = server.advisor().await;

    let (mut answered, mut refused) = (0, 0);
    for case in &file.cases {
        let ctx = &case.context;
        assert!(
            ctx.first_failure_unix_ms.is_none() || ctx.now_unix_ms.is_some(),
            "{}: the sidecar always knows the time",
            case.name
        );
        if let Some(t) = ctx.now_unix_ms {
            now.store(t, Ordering::SeqCst);
        }
        let request = pb::DecideRequest {
            queue: case.identity[NAMESPACE.len() + 1..].to_owned(),
            attempt: case.attempt,
            job_id: ctx.job_id.clone().unwrap_or_default(),
            error_class: ctx.error_class.clone().unwrap_or_default(),
            first_failure_unix_ms: ctx.first_failure_unix_ms.unwrap_or(0),
            retry_after_ms: ctx.retry_after_ms.unwrap_or(0),
        };
        let got = client.decide(request).await;
        if case.attempt == 0 {
            let status = got.expect_err("attempt 0 is refused");
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{}", case.name);
            refused += 1;
            continue;
        }
        let got = got
            .unwrap_or_else(|s| panic!("{}: {s:?}", case.name))
            .into_inner();
        assert_eq!(wire_answer(&got), case.expected, "{}", case.name);
        answered += 1;
    }
    assert!(
        answered > 500 && refused > 0,
        "{answered} answered, {refused} refused"
    );
    server.stop().await;
}
