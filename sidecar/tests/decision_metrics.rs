//! `decisions_total{policy, outcome, disposition, reason}` and `delay_seconds` from the real
//! binary, asked over gRPC and scraped from its admin port: one sample per kind of answer
//! (retry, Retry-After, budget-stretched, dead-letter, drop, non-retryable, deadline), and
//! reloads that swap policies keep the series to those of the policies loaded.

use std::{
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use rebound_sidecar::pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient};
use rebound_test_support::{eventually, free_port, http_get, metrics::Samples};
use tonic::transport::Channel;

const DECISIONS: &str = "rebound_sidecar_decisions_total";
const WAIT: Duration = Duration::from_secs(20);

/// Dead-letters, gives up past one minute and on `Fatal*` errors; retries after 2 s.
const PLAIN: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: plain}\nspec:\n  queues: [plain]\n  backoff: {strategy: constant, base: 2s, jitter: {kind: none}}\n  maxAttempts: 3\n  maxRetryDuration: 1m\n  nonRetryableErrors: [\"Fatal*\"]\n  terminal: {action: deadLetter, deadLetterQueue: plain-dead}\n";
/// Drops; one retry a second.
const BUDGETED: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: budgeted}\nspec:\n  queues: [budgeted]\n  backoff: {strategy: constant, base: 1s, jitter: {kind: none}}\n  maxAttempts: 5\n  retryBudget: {ratePerSecond: 1, burst: 1}\n";

struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(policies: &Path, grpc: SocketAddr, admin: SocketAddr) -> Sidecar {
    let child = Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
        .arg("--policies-file")
        .arg(policies)
        .args(["--namespace", "demo", "--listen", &grpc.to_string()])
        .args(["--admin-listen", &admin.to_string()])
        .args(["--poll-interval", "100ms"])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn rebound-sidecar");
    Sidecar(child)
}

/// Replaces the file in one rename, as an editor or a deploy would.
fn publish(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write policies");
    std::fs::rename(&tmp, path).expect("rename policies");
}

fn scrape(admin: SocketAddr) -> Samples {
    let r = http_get(admin, "/metrics").expect("GET /metrics");
    assert_eq!(r.status, 200, "{r:?}");
    Samples::parse(&r.body).expect("an exposition")
}

fn loaded_hash(admin: SocketAddr) -> Option<String> {
    let r = http_get(admin, "/metrics").ok()?;
    let samples = Samples::parse(&r.body).ok()?;
    let info = samples
        .matching("rebound_sidecar_config_info", &[])
        .next()?;
    info.labels.get("config_hash").cloned()
}

async fn wait_for_hash(admin: SocketAddr, not: Option<&str>) -> String {
    eventually("a configuration loaded", WAIT, || async move {
        Ok(loaded_hash(admin).filter(|h| Some(h.as_str()) != not))
    })
    .await
    .expect("loaded")
}

fn ask(queue: &str, attempt: u32, job: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        queue: queue.to_owned(),
        attempt,
        job_id: job.to_owned(),
        ..Default::default()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The decision series of `policy`: (outcome, disposition, reason) → value.
fn series_of(samples: &Samples, policy: &str) -> Vec<(String, String, String, f64)> {
    let mut out: Vec<_> = samples
        .matching(DECISIONS, &[("policy", policy)])
        .map(|s| {
            let l = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
            (l("outcome"), l("disposition"), l("reason"), s.value)
        })
        .collect();
    out.sort_by(|a, b| (&a.0, &a.1, &a.2).cmp(&(&b.0, &b.1, &b.2)));
    out
}

fn row(
    outcome: &str,
    disposition: &str,
    reason: &str,
    value: f64,
) -> (String, String, String, f64) {
    (outcome.into(), disposition.into(), reason.into(), value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_of_answer_is_counted_under_its_policy_and_reloads_drop_removed_ones() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let policies = tmp.path().join("policies.yaml");
    publish(&policies, &format!("{PLAIN}---\n{BUDGETED}"));
    let (grpc, admin) = (free_port().expect("port"), free_port().expect("port"));
    let _sidecar = spawn(&policies, grpc, admin);
    let first = wait_for_hash(admin, None).await;
    let client: RetryAdvisorClient<Channel> = RetryAdvisorClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");

    // Loaded, nothing asked: a series appears with its first decision.
    assert_eq!(scrape(admin).count(DECISIONS), 0);

    let decide = |req: pb::DecideRequest| {
        let mut c = client.clone();
        async move { c.decide(req).await.expect("decided").into_inner() }
    };
    let plain = decide(ask("plain", 1, "a")).await;
    assert_eq!(
        (plain.decision(), plain.delay_ms),
        (pb::Decision::Retry, 2_000)
    );
    let pushed = decide(pb::DecideRequest {
        retry_after_ms: 30_000,
        ..ask("plain", 1, "b")
    })
    .await;
    assert_eq!(pushed.delay_ms, 30_000);
    let dead = decide(ask("plain", 3, "c")).await;
    assert_eq!(dead.disposition(), pb::Disposition::DeadLetter);
    let fatal = decide(pb::DecideRequest {
        error_class: "FatalError".to_owned(),
        ..ask("plain", 1, "d")
    })
    .await;
    assert_eq!(fatal.reason(), pb::GiveUpReason::NonRetryable);
    let late = decide(pb::DecideRequest {
        first_failure_unix_ms: now_ms() - 59_000,
        ..ask("plain", 1, "e")
    })
    .await;
    assert_eq!(late.reason(), pb::GiveUpReason::Deadline);
    let dropped = decide(ask("budgeted", 5, "f")).await;
    assert_eq!(dropped.disposition(), pb::Disposition::Drop);
    // One retry a second: three asked at once take three slots, two of them stretched. A
    // batch answers them at one instant and counts each item once.
    let batch = client
        .clone()
        .decide_batch(pb::DecideBatchRequest {
            requests: ["g", "h", "i"].map(|j| ask("budgeted", 1, j)).to_vec(),
        })
        .await
        .expect("batch")
        .into_inner();
    let stretched = batch
        .results
        .iter()
        .filter(|r| {
            matches!(&r.result, Some(pb::decide_result::Result::Decision(d)) if d.budget_stretched)
        })
        .count();
    assert_eq!(stretched, 2);

    let after = scrape(admin);
    assert_eq!(
        series_of(&after, "demo/plain"),
        [
            row("give_up", "dead_letter", "deadline", 1.0),
            row("give_up", "dead_letter", "max_attempts", 1.0),
            row("give_up", "dead_letter", "non_retryable", 1.0),
            row("retry", "none", "backoff", 1.0),
            row("retry", "none", "retry_after", 1.0),
        ]
    );
    assert_eq!(
        series_of(&after, "demo/budgeted"),
        [
            row("give_up", "drop", "max_attempts", 1.0),
            row("retry", "none", "backoff", 1.0),
            row("retry", "none", "budget_stretched", 2.0),
        ]
    );
    // Five retries answered: 2 s, 30 s and the budget's three within 1-3 s.
    let delay = |le: &str| after.value("rebound_sidecar_delay_seconds_bucket", &[("le", le)]);
    assert_eq!(
        after.value("rebound_sidecar_delay_seconds_count", &[]),
        Some(5.0)
    );
    assert_eq!(delay("10"), Some(4.0));
    assert_eq!(delay("30"), Some(5.0));
    assert_eq!(delay("+Inf"), Some(5.0));
    assert_eq!(after.count("rebound_sidecar_delay_seconds_bucket"), 16);

    // Reloads that each bring a new policy for the queue instead of the last, which then
    // answers: the series follow the policies loaded, those kept keep counting, none of
    // the removed ones stay.
    let mut hash = first;
    for round in 0..5 {
        let other = PLAIN.replace("name: plain", &format!("name: round-{round}"));
        publish(&policies, &format!("{other}---\n{BUDGETED}"));
        hash = wait_for_hash(admin, Some(&hash)).await;
        let answer = decide(ask("plain", 3, "j")).await;
        assert_eq!(
            answer.policy.map(|p| p.name),
            Some(format!("round-{round}"))
        );
    }
    // The replaced configuration's series go once no request answers from it.
    let reloaded = eventually("only the loaded policies' series", WAIT, || async move {
        let samples = scrape(admin);
        let policies_seen: std::collections::BTreeSet<_> = samples
            .matching(DECISIONS, &[])
            .filter_map(|s| s.labels.get("policy").cloned())
            .collect();
        Ok(
            (policies_seen.into_iter().collect::<Vec<_>>() == ["demo/budgeted", "demo/round-4"])
                .then_some(samples),
        )
    })
    .await
    .expect("removed policies' series gone");
    assert_eq!(
        series_of(&reloaded, "demo/round-4"),
        [row("give_up", "dead_letter", "max_attempts", 1.0)]
    );
    assert_eq!(reloaded.count(DECISIONS), 4, "3 of budgeted, 1 of round-4");
    assert_eq!(
        reloaded.value(
            DECISIONS,
            &[
                ("policy", "demo/budgeted"),
                ("outcome", "retry"),
                ("disposition", "none"),
                ("reason", "budget_stretched"),
            ]
        ),
        Some(2.0),
        "a policy kept across reloads keeps its counts"
    );
}
