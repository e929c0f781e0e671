//! Retry budgets through a real sidecar and real gRPC clients: a storm of concurrent
//! failures never puts more than `burst` retries into one slot of scheduled time, the
//! budget only ever adds to `decide`'s delay, a repeated question gets the identical
//! answer, a policy without a budget answers as before, and a reload keeps the bookings
//! unless the budget itself changed.

mod common;

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Instant};

use common::sample;
use rebound_policy::{
    CompiledDocument, Context, Decision, PolicyTable, decide, resolve::RetryBudget,
};
use rebound_sidecar::{
    pb::v1::{self as pb, decide_result, retry_advisor_client::RetryAdvisorClient},
    store::{Store, compile_manifests},
};
use tonic::transport::Channel;

const NOW_MS: u64 = 1_800_000_000_000;
const RATE: u32 = 10;
const BURST: u32 = 1;

/// `storm` (budget 10/s, burst 1) and `plain` (the same curve, no budget). `plain_cap`
/// changes the plain policy only; `rate` changes storm's budget.
fn doc(rate: u32, plain_cap: &str) -> CompiledDocument {
    doc_with(
        &format!("  retryBudget: {{ratePerSecond: {rate}}}\n"),
        plain_cap,
    )
}

fn doc_with(budget: &str, plain_cap: &str) -> CompiledDocument {
    let yaml = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: storm}}\n\
         spec:\n  queues: [storm]\n  backoff: {{base: 1s, cap: 2s}}\n{budget}\
         ---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: plain}}\n\
         spec:\n  queues: [plain]\n  backoff: {{base: 1s, cap: {plain_cap}}}\n"
    );
    compile_manifests(&[(PathBuf::from("policies.yaml"), yaml)], "ns").expect("compiles")
}

fn ask(queue: &str, job: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        queue: queue.to_owned(),
        attempt: 1,
        job_id: job.to_owned(),
        ..Default::default()
    }
}

/// What `decide` alone says for a request, in milliseconds.
fn plain_delay(table: &PolicyTable, req: &pb::DecideRequest) -> u64 {
    let entry = table.lookup(&req.queue).expect("governed");
    let ctx = Context {
        job_id: Some(&req.job_id),
        now_ms: Some(NOW_MS),
        ..Default::default()
    };
    match decide(entry, req.attempt, &ctx) {
        Decision::Retry { delay_ms } => delay_ms,
        other => panic!("decide gave up: {other:?}"),
    }
}

fn slot(delay_ms: u64) -> u64 {
    let budget = RetryBudget {
        rate_per_second: RATE,
        burst: BURST,
    };
    budget.slot_of(NOW_MS + delay_ms)
}

/// Fires `jobs` concurrently, each on its own clone of the channel.
async fn storm(
    client: &RetryAdvisorClient<Channel>,
    jobs: impl Iterator<Item = String>,
) -> Vec<(pb::DecideRequest, pb::DecideResponse)> {
    // One call that books nothing first: until the server's SETTINGS have arrived, the
    // client may open more streams than the server allows at once (32), and the extra
    // ones are refused (REFUSED_STREAM).
    client
        .clone()
        .get_policy(pb::GetPolicyRequest {
            queue: "storm".into(),
        })
        .await
        .expect("get_policy");
    let tasks: Vec<_> = jobs
        .map(|job| {
            let mut c = client.clone();
            tokio::spawn(async move {
                let req = ask("storm", &job);
                let r = c.decide(req.clone()).await.expect("decide").into_inner();
                (req, r)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

fn metric(store: &Store, name: &str) -> f64 {
    series(store, name).unwrap_or(0.0)
}

fn series(store: &Store, name: &str) -> Option<f64> {
    sample(
        &store.render_metrics(),
        &format!("rebound_sidecar_{name}{{policy=\"ns/storm\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_never_overfills_a_slot_and_repeats_and_reloads_keep_answers() {
    let store = common::store();
    let first = doc(RATE, "2s");
    store.install(first.clone(), "test", Instant::now());
    let table = PolicyTable::new(&first);
    let server = common::start(Arc::clone(&store), common::fixed_clock(NOW_MS)).await;
    let client = server.advisor().await;

    // 200 distinct jobs failing at the same instant, all at once.
    let answers = storm(&client, (0..200).map(|i| format!("job-{i}"))).await;
    let mut per_slot: HashMap<u64, u32> = HashMap::new();
    let mut stretched = 0;
    for (req, r) in &answers {
        assert_eq!(r.decision(), pb::Decision::Retry, "{r:?}");
        // The budget only adds to decide's delay, and says by how much.
        assert_eq!(r.delay_ms - r.budget_delay_ms, plain_delay(&table, req));
        assert_eq!(r.budget_stretched, r.budget_delay_ms > 0);
        stretched += u32::from(r.budget_stretched);
        *per_slot.entry(slot(r.delay_ms)).or_default() += 1;
    }
    assert!(per_slot.values().all(|&n| n <= BURST), "{per_slot:?}");
    assert_eq!(per_slot.len(), 200, "every retry scheduled, none dropped");
    assert!(
        stretched >= 200 - 20,
        "at most 20 slots lie within decide's 2s"
    );

    // A batch books slots too, and shares the book with the unary calls.
    let mut c = client.clone();
    let batch = pb::DecideBatchRequest {
        requests: (0..50)
            .map(|i| ask("storm", &format!("batch-{i}")))
            .collect(),
    };
    let results = c
        .decide_batch(batch)
        .await
        .expect("batch")
        .into_inner()
        .results;
    for result in results {
        let Some(decide_result::Result::Decision(r)) = result.result else {
            panic!("batch item failed: {result:?}");
        };
        assert!(r.budget_stretched);
        *per_slot.entry(slot(r.delay_ms)).or_default() += 1;
    }
    assert!(per_slot.values().all(|&n| n <= BURST), "{per_slot:?}");
    assert_eq!(metric(&store, "retry_budget_admitted_total"), 250.0);

    // The same question again: the identical answer, and no new slot taken.
    let by_job: HashMap<String, pb::DecideResponse> = answers
        .iter()
        .map(|(req, r)| (req.job_id.clone(), r.clone()))
        .collect();
    let again = storm(&client, (0..50).map(|i| format!("job-{i}"))).await;
    for (req, r) in &again {
        assert_eq!(Some(r), by_job.get(&req.job_id));
    }
    assert_eq!(metric(&store, "retry_budget_repeats_total"), 50.0);
    assert_eq!(metric(&store, "retry_budget_admitted_total"), 250.0);

    // A policy without a budget answers exactly what decide says.
    let mut c = client.clone();
    for i in 0..20 {
        let req = ask("plain", &format!("job-{i}"));
        let r = c.decide(req.clone()).await.expect("decide").into_inner();
        assert_eq!(r.delay_ms, plain_delay(&table, &req));
        assert_eq!((r.budget_stretched, r.budget_delay_ms), (false, 0));
    }

    // A reload that leaves storm's budget alone keeps its bookings and memo.
    let before = store.current().expect("loaded");
    let second = doc(RATE, "3s");
    assert!(store.install(second.clone(), "test", Instant::now()));
    let after = store.current().expect("loaded");
    assert_ne!(before.hash(), after.hash());
    assert!(
        after
            .snapshot
            .budgets
            .shares_with(&before.snapshot.budgets, "ns/storm")
    );
    let last_booked = per_slot.keys().copied().max().expect("booked");
    let late = storm(&client, std::iter::once("late".to_owned())).await;
    assert_eq!(slot(late[0].1.delay_ms), last_booked + 1);
    let repeat = storm(&client, std::iter::once("job-7".to_owned())).await;
    assert_eq!(
        Some(&repeat[0].1.delay_ms),
        by_job.get("job-7").map(|r| &r.delay_ms)
    );

    // A changed budget starts an empty book: the first retry fits as decided.
    assert!(store.install(doc(2 * RATE, "3s"), "test", Instant::now()));
    let fresh = storm(&client, std::iter::once("fresh".to_owned())).await;
    let (req, r) = &fresh[0];
    assert_eq!(
        (r.delay_ms, r.budget_stretched),
        (plain_delay(&table, req), false)
    );
    assert!(metric(&store, "retry_budget_stretched_total") >= 200.0);

    // Without its budget the policy answers as decide does, and its series are gone.
    assert!(store.install(doc_with("", "3s"), "test", Instant::now()));
    let plain = storm(&client, std::iter::once("late".to_owned())).await;
    let (req, r) = &plain[0];
    assert_eq!(
        (r.delay_ms, r.budget_stretched, r.budget_delay_ms),
        (plain_delay(&table, req), false, 0)
    );
    assert_eq!(series(&store, "retry_budget_admitted_total"), None);
    server.stop().await;
}
