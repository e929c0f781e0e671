//! A policy in rollout served by three real sidecar processes (file mode, the compiled
//! document in a mounted directory), asked over gRPC: every job gets the revision the
//! committed assignment vectors say, the same answer from every sidecar, a request without
//! a job id gets the stable revision, and `GetPolicy` returns the rollout a fallback needs.
//!
//! The vectors' times lie around 2027-01-15; the sidecars use their own clock, so each
//! rollout is shifted to end a day before now. Shifting the steps and the first failures
//! alike keeps every arm: it depends on their order and on the ids only.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use rebound_policy::{
    CompiledDocument, CompiledPolicy, ResolvedPolicy,
    compiled::CompiledRollout,
    resolve,
    rollout::assign::Step,
    spec::RetryPolicySpec,
    vectors::assign::{self, AssignCase, WireArm, WireStep},
};
use rebound_sidecar::pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient};
use rebound_test_support::{eventually, free_port};
use tonic::transport::Channel;

const VECTORS: &str = include_str!("../../policy/testdata/assign-vectors.json");
const WAIT: Duration = Duration::from_secs(30);
const DAY_MS: u64 = 24 * 3_600_000;

struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(dir: &Path, grpc: SocketAddr, admin: SocketAddr) -> Sidecar {
    let child = Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
        .arg("--policies-dir")
        .arg(dir)
        .args(["--listen", &grpc.to_string()])
        .args(["--admin-listen", &admin.to_string()])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn rebound-sidecar");
    Sidecar(child)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Jittered, so every job id gets its own delays; the canary gives up after attempt 2.
fn params(max_attempts: u32) -> ResolvedPolicy {
    let spec: RetryPolicySpec = serde_json::from_value(serde_json::json!({
        "queues": ["q"], "maxAttempts": max_attempts,
        "backoff": {"base": "1s", "cap": "10m", "jitter": {"kind": "full"}}
    }))
    .expect("spec");
    resolve(&spec).expect("valid")
}

const STABLE_REVISION: &str =
    "sha256:0000000000000000000000000000000000000000000000000000000000000001";

/// A queue `v<N>` per (revision, steps) of the cases.
fn rollouts(cases: &[AssignCase]) -> BTreeMap<(String, Vec<WireStep>), String> {
    let mut queues = BTreeMap::new();
    for c in cases {
        let n = queues.len();
        queues
            .entry((c.revision.clone(), c.steps.clone()))
            .or_insert_with(|| format!("v{n}"));
    }
    queues
}

/// A policy in rollout per queue, its steps shifted by `shift`.
fn document(queues: &BTreeMap<(String, Vec<WireStep>), String>, shift: u64) -> CompiledDocument {
    let policies = queues
        .iter()
        .map(|((revision, steps), queue)| CompiledPolicy {
            name: queue.clone(),
            namespace: "shop".into(),
            uid: String::new(),
            generation: 1,
            queues: vec![queue.clone()],
            params: params(25),
            rollout: Some(CompiledRollout {
                revision: revision.clone(),
                stable_revision: STABLE_REVISION.into(),
                canary: params(2),
                steps: steps
                    .iter()
                    .map(|s| Step {
                        weight: s.weight,
                        start_unix_ms: s.start_unix_ms - shift,
                    })
                    .collect(),
            }),
        })
        .collect();
    CompiledDocument::new("shop", policies)
}

async fn connect(grpc: SocketAddr, hash: &str) -> RetryAdvisorClient<Channel> {
    let url = format!("http://{grpc}");
    eventually("a sidecar serving the rollout", WAIT, || {
        let url = url.clone();
        async move {
            let Ok(mut client) = RetryAdvisorClient::connect(url).await else {
                return Ok(None);
            };
            let served = client
                .decide(pb::DecideRequest {
                    queue: "v0".into(),
                    attempt: 1,
                    ..Default::default()
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().policy)
                .map(|p| p.config_hash);
            Ok((served.as_deref() == Some(hash)).then_some(client))
        }
    })
    .await
    .expect("sidecar up")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_answer_every_job_from_the_revision_the_vectors_name() {
    let file = assign::AssignFile::from_json(VECTORS).expect("vectors");
    let cases: Vec<AssignCase> = file
        .cases
        .into_iter()
        .filter(|c| c.first_failure_unix_ms.is_some() && !c.steps.is_empty())
        .collect();
    assert!(cases.len() > 200, "{} cases", cases.len());
    // The latest time in the file lands a day before now.
    let latest = cases
        .iter()
        .filter_map(|c| c.first_failure_unix_ms)
        .max()
        .expect("cases");
    let shift = latest - (now_ms() - DAY_MS);
    let queues = rollouts(&cases);
    let doc = document(&queues, shift);

    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::write(tmp.path().join("policies.json"), doc.to_json()).expect("write");
    let mut sidecars = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..3 {
        let (grpc, admin) = (free_port().expect("port"), free_port().expect("port"));
        sidecars.push(spawn(tmp.path(), grpc, admin));
        clients.push(connect(grpc, &doc.hash).await);
    }

    let (mut canary, mut stable) = (0, 0);
    for c in &cases {
        let queue = &queues[&(c.revision.clone(), c.steps.clone())];
        for attempt in [1, 2] {
            let request = pb::DecideRequest {
                queue: queue.clone(),
                attempt,
                job_id: c.job_id.clone().unwrap_or_default(),
                first_failure_unix_ms: c.first_failure_unix_ms.map_or(0, |t| t - shift),
                ..Default::default()
            };
            let mut answers = Vec::new();
            for client in &mut clients {
                let r = client.decide(request.clone()).await.expect("decided");
                answers.push(r.into_inner());
            }
            // Without a job id the jitter is random by design: the revision still agrees.
            let same = |a: &pb::DecideResponse| match request.job_id.is_empty() {
                false => *a == answers[0],
                true => {
                    (a.revision.as_str(), a.decision) == (&answers[0].revision, answers[0].decision)
                }
            };
            assert!(
                answers.iter().all(same),
                "{}: the sidecars disagree: {answers:?}",
                c.name
            );
            let a = &answers[0];
            match c.expected.arm {
                WireArm::Canary => {
                    assert_eq!(a.revision, c.revision, "{}", c.name);
                    // The canary's maxAttempts 2 answers attempt 2.
                    let give_up = attempt == 2;
                    assert_eq!(a.decision() == pb::Decision::GiveUp, give_up, "{}", c.name);
                    canary += 1;
                }
                WireArm::Stable => {
                    assert_eq!(a.revision, STABLE_REVISION, "{}", c.name);
                    assert_eq!(a.decision(), pb::Decision::Retry, "{}", c.name);
                    stable += 1;
                }
            }
        }
    }
    assert!(
        canary > 50 && stable > 50,
        "{canary} canary, {stable} stable"
    );

    // GetPolicy: the stable revision as `resolved`, the rollout with its shifted steps.
    let ((revision, steps), queue) = queues.iter().next().expect("a rollout");
    let got = clients[0]
        .get_policy(pb::GetPolicyRequest {
            queue: queue.clone(),
        })
        .await
        .expect("policy")
        .into_inner();
    let rollout = got.rollout.expect("the rollout");
    assert_eq!(rollout.revision, *revision);
    assert_eq!(rollout.stable_revision, STABLE_REVISION);
    assert_eq!(rollout.canary.map(|p| p.max_attempts), Some(2));
    assert_eq!(got.resolved.map(|p| p.max_attempts), Some(25));
    assert_eq!(
        rollout
            .steps
            .iter()
            .map(|s| (s.weight, s.start_unix_ms + shift))
            .collect::<Vec<_>>(),
        steps
            .iter()
            .map(|s| (s.weight, s.start_unix_ms))
            .collect::<Vec<_>>()
    );
    drop(sidecars);
}
