//! The operator runs a policy's rollout against a real API server: steps, promote
//! requests, rollback on evidence, restarts, and a second apply that changes nothing.
//! Sidecar evidence comes from Leases the tests write as sidecars do (the annotation
//! `rebound.dev/rollout-evidence`, an `EvidenceReport`).

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use rebound_policy::RetryPolicy;
use rebound_policy::compiled::CompiledPolicy;
use rebound_policy::rollout::analysis::StepCounts;
use rebound_policy::rollout::evidence::{
    EVIDENCE_ANNOTATION, EvidenceReport, PolicyEvidence, StepEvidence,
};
use rebound_policy::spec::{AnalysisVerdict, RolloutPhase, RolloutStatus};
use rebound_tests::TestEnv;
use rebound_tests::lease::{PREFIX, sidecar_lease};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);
/// A step takes effect a second after it is written (the test's sidecars are Leases).
const LEAD: &str = "--rollout-step-lead=1s";

/// The `payments` policy at `max_attempts` with a rollout of `steps` (YAML flow list).
fn manifest(max_attempts: u32, steps: &str, analysis: &str) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: payments}}\n\
         spec:\n  queues: [payments]\n  maxAttempts: {max_attempts}\n  \
         backoff: {{base: 1s, cap: 5m}}\n  rollout:\n    steps: {steps}\n    \
         analysis: {analysis}\n"
    )
}

fn apply(env: &TestEnv, yaml: &str) -> Result<()> {
    env.kubectl_stdin(["apply", "-f", "-"], yaml)?.ok()?;
    Ok(())
}

/// The rollout status once `check` holds for it.
async fn rollout_when(
    api: &Api<RetryPolicy>,
    what: &str,
    check: impl Fn(&RolloutStatus) -> bool,
) -> Result<RetryPolicy> {
    eventually(what, WAIT, || async {
        let p = api.get("payments").await?;
        let status = p.status.clone().unwrap_or_default();
        let hit = status.observed_generation == p.metadata.generation
            && status.rollout.as_ref().is_some_and(&check);
        Ok(hit.then_some(p))
    })
    .await
}

/// `payments` at 25 attempts until Healthy, then at `to`: the policy once its rollout is
/// in `phase`.
async fn change_from_25(
    env: &TestEnv,
    api: &Api<RetryPolicy>,
    to: u32,
    steps: &str,
    analysis: &str,
    phase: RolloutPhase,
) -> Result<RetryPolicy> {
    apply(env, &manifest(25, steps, analysis))?;
    rollout_when(api, "Healthy", |r| r.phase == RolloutPhase::Healthy).await?;
    apply(env, &manifest(to, steps, analysis))?;
    rollout_when(api, &format!("{phase:?}"), |r| r.phase == phase).await
}

fn rollout(p: &RetryPolicy) -> RolloutStatus {
    p.status
        .as_ref()
        .and_then(|s| s.rollout.clone())
        .unwrap_or_default()
}

/// The `payments` policy as the ConfigMap serves it.
async fn served(client: &kube::Client, ns: &str) -> Result<Option<CompiledPolicy>> {
    Ok(configmap_document(client, ns)
        .await?
        .and_then(|(doc, _)| doc.policies.into_iter().find(|p| p.name == "payments")))
}

/// Writes a person's request as `kubectl rebound rollout` does: a merge patch of the
/// status subresource under another field manager.
async fn request(api: &Api<RetryPolicy>, action: &str, revision: &str, id: &str) -> Result<()> {
    let patch = json!({"status": {"rollout": {"request": {
        "action": action, "revision": revision, "id": id}}}});
    let params = PatchParams {
        field_manager: Some("kubectl-rebound".to_owned()),
        ..PatchParams::default()
    };
    api.patch_status("payments", &params, &Patch::Merge(&patch))
        .await?;
    Ok(())
}

fn status_of<'a>(p: &'a RetryPolicy, type_: &str) -> Option<(&'a str, &'a str)> {
    let conditions = &p.status.as_ref()?.conditions;
    condition(conditions, type_).map(|c| (c.status.as_str(), c.reason.as_str()))
}

/// A sidecar Lease carrying a report of `counts` for step 0 of `revision`.
fn evidence_lease(pod: &str, epoch: &str, revision: &str, counts: StepCounts) -> Result<Lease> {
    let report = EvidenceReport {
        epoch: epoch.to_owned(),
        policies: vec![PolicyEvidence {
            policy: "payments".to_owned(),
            revision: revision.to_owned(),
            steps: vec![StepEvidence {
                step: 0,
                mature: counts,
                seen: counts,
            }],
        }],
    };
    let mut lease = sidecar_lease(pod, CM, Timestamp::now(), 3600);
    lease.metadata.annotations = Some(
        [(
            EVIDENCE_ANNOTATION.to_owned(),
            serde_json::to_string(&report)?,
        )]
        .into(),
    );
    Ok(lease)
}

async fn put_lease(leases: &Api<Lease>, lease: Lease) -> Result<()> {
    let name = lease.metadata.name.clone().unwrap_or_default();
    let params = PatchParams::apply("rebound-sidecar").force();
    leases.patch(&name, &params, &Patch::Apply(&lease)).await?;
    Ok(())
}

fn counts(weight: u32, failed_all: u64, bad_new: u64, bad_all: u64) -> StepCounts {
    StepCounts {
        weight,
        failed_new: failed_all * u64::from(weight) / 100,
        failed_all,
        bad_new,
        bad_all,
    }
}

async fn resource_versions(client: &kube::Client, ns: &str) -> Result<(String, String)> {
    let policies: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let p = policies.get("payments").await?.metadata.resource_version;
    let c = cms.get(CM).await?.metadata.resource_version;
    Ok((p.unwrap_or_default(), c.unwrap_or_default()))
}

/// (a) + (d): two manual steps passed by promote requests; a second apply of the same
/// manifest during and after the rollout writes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn manual_steps_pass_on_promote_and_a_reapply_changes_nothing() -> Result<()> {
    let env = TestEnv::new("op-rollout-manual").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h", LEAD]))?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let steps = "[{weight: 10}, {weight: 50}]";
    apply(&env, &manifest(25, steps, "{}"))?;
    let first = rollout_when(&api, "first sight: Healthy", |r| {
        r.phase == RolloutPhase::Healthy
    })
    .await?;
    let stable = rollout(&first).revision;

    let v2 = manifest(5, steps, "{}");
    apply(&env, &v2)?;
    let paused = rollout_when(&api, "step 0 paused", |r| {
        r.phase == RolloutPhase::Paused && r.revision != stable
    })
    .await?;
    let r = rollout(&paused);
    ensure!(r.stable_revision == stable && r.step == Some(0), "{r:?}");
    ensure!(status_of(&paused, "Progressing") == Some(("True", "RolloutPaused")));
    ensure!(status_of(&paused, "Ready") == Some(("False", "RollingOut")));
    ensure!(status_of(&paused, "Reconciling") == Some(("True", "RollingOut")));
    ensure!(status_of(&paused, "Healthy").is_some_and(|(s, _)| s == "False"));
    let doc = eventually("the document carries both revisions", WAIT, || async {
        Ok(served(client, ns).await?.filter(|p| p.rollout.is_some()))
    })
    .await?;
    let canary = doc.rollout.clone().expect("rollout");
    ensure!(
        doc.params.max_attempts == 25,
        "params are the stable revision's"
    );
    ensure!(canary.canary.max_attempts == 5 && canary.revision == r.revision);
    ensure!(canary.steps.len() == 1 && canary.steps[0].weight == 10);

    // (d) during: the same manifest again writes nothing.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = resource_versions(client, ns).await?;
    apply(&env, &v2)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        resource_versions(client, ns).await? == before,
        "re-apply during"
    );

    request(&api, "Promote", &r.revision, "promote-1").await?;
    let second = rollout_when(&api, "step 1", |r| r.step == Some(1)).await?;
    let r2 = rollout(&second);
    ensure!(r2.steps[0] == r.steps[0], "step 0 keeps its start: {r2:?}");
    ensure!(r2.steps[1].weight == 50);
    ensure!(r2.handled_request.as_deref() == Some("promote-1"));
    request(&api, "Promote", &r.revision, "promote-2").await?;
    let done = rollout_when(&api, "promoted", |r| r.phase == RolloutPhase::Healthy).await?;
    let r3 = rollout(&done);
    ensure!(r3.stable_revision == r.revision && r3.revision == r.revision);
    ensure!(r3.handled_request.as_deref() == Some("promote-2"));
    ensure!(status_of(&done, "Ready") == Some(("True", "Compiled")));
    ensure!(status_of(&done, "Healthy") == Some(("True", "RolloutComplete")));
    ensure!(status_of(&done, "Progressing") == Some(("False", "RolloutComplete")));
    eventually(
        "the document serves the new revision alone",
        WAIT,
        || async {
            Ok(served(client, ns)
                .await?
                .filter(|p| p.rollout.is_none() && p.params.max_attempts == 5))
        },
    )
    .await?;

    // (d) after.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = resource_versions(client, ns).await?;
    apply(&env, &v2)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        resource_versions(client, ns).await? == before,
        "re-apply after"
    );
    Ok(())
}

/// (b): a report where the canary's bad-job ratio is far higher rolls back: Degraded with
/// the evidence, the ConfigMap serves stable alone, a Warning Event. Prints the time from
/// the report to the rollback.
#[tokio::test(flavor = "multi_thread")]
async fn bad_evidence_rolls_back() -> Result<()> {
    let env = TestEnv::new("op-rollout-bad").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h", LEAD]))?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let steps = "[{weight: 10, pause: 1h}]";
    let analysis = "{minFailedJobs: 100}";
    let p = change_from_25(&env, &api, 2, steps, analysis, RolloutPhase::Progressing).await?;
    let revision = rollout(&p).revision;
    eventually("the canary served", WAIT, || async {
        Ok(served(client, ns).await?.filter(|p| p.rollout.is_some()))
    })
    .await?;

    // Real reports come long after the change: not within the burst of the apply.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 1000 failed jobs, 100 on the canary; 60 of its 100 gave up against 40 of 900.
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let bad = counts(10, 1000, 60, 100);
    put_lease(
        &leases,
        evidence_lease("a", "00000000000000aa", &revision, bad)?,
    )
    .await?;
    let reported = Instant::now();
    eventually("the document serves stable alone", WAIT, || async {
        Ok(served(client, ns)
            .await?
            .filter(|p| p.rollout.is_none() && p.params.max_attempts == 25))
    })
    .await?;
    let took = reported.elapsed();
    eprintln!(
        "rollback: {} ms from the evidence report to the ConfigMap without the canary",
        took.as_millis()
    );
    let p = rollout_when(&api, "Degraded", |r| r.phase == RolloutPhase::Degraded).await?;
    let r = rollout(&p);
    let analysis = r.analysis.expect("analysis");
    ensure!(analysis.verdict == AnalysisVerdict::Harm, "{analysis:?}");
    ensure!(
        (analysis.bad_new, analysis.bad_stable) == (60, 40),
        "{analysis:?}"
    );
    ensure!((analysis.failed_new, analysis.failed_stable) == (100, 900));
    ensure!(status_of(&p, "Degraded") == Some(("True", "RolledBack")));
    ensure!(status_of(&p, "Stalled") == Some(("True", "RolledBack")));
    ensure!(status_of(&p, "Ready").is_some_and(|(s, _)| s == "False"));
    eventually("a RolledBack Event", WAIT, || async {
        let seen = events(client, ns).await?;
        Ok(seen
            .iter()
            .any(|e| e.reason == "RolledBack" && e.regarding == "payments")
            .then_some(()))
    })
    .await?;
    Ok(())
}

/// (c): a restart keeps the step, its start and the evidence; a report of an epoch seen
/// replaces its last one; a sidecar gone leaves its counts in.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_resumes_with_the_same_step_and_evidence() -> Result<()> {
    let env = TestEnv::new("op-rollout-restart").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let mut op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h", LEAD]))?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let steps = "[{weight: 50}]";
    let p = change_from_25(&env, &api, 6, steps, "{}", RolloutPhase::Paused).await?;
    let before = rollout(&p);
    let failed = |r: &RolloutStatus| r.analysis.map(|a| a.failed_new + a.failed_stable);

    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let epoch = "00000000000000c1";
    put_lease(
        &leases,
        evidence_lease("a", epoch, &before.revision, counts(50, 100, 2, 4))?,
    )
    .await?;
    rollout_when(&api, "100 jobs", |r| failed(r) == Some(100)).await?;
    // The same epoch again, grown: replaces, never adds.
    put_lease(
        &leases,
        evidence_lease("a", epoch, &before.revision, counts(50, 120, 2, 4))?,
    )
    .await?;
    rollout_when(&api, "120 jobs", |r| failed(r) == Some(120)).await?;

    op.kill();
    // The sidecar goes while no operator runs: its last report stays in status.
    leases
        .delete(&format!("{PREFIX}a"), &DeleteParams::default())
        .await?;
    let _op = op.restart()?;
    put_lease(
        &leases,
        evidence_lease(
            "b",
            "00000000000000c2",
            &before.revision,
            counts(50, 30, 0, 1),
        )?,
    )
    .await?;
    let p = rollout_when(&api, "150 jobs after the restart", |r| {
        failed(r) == Some(150)
    })
    .await?;
    let after = rollout(&p);
    ensure!(
        after.steps == before.steps,
        "{:?} != {:?}",
        after.steps,
        before.steps
    );
    ensure!(after.step == before.step && after.phase == RolloutPhase::Paused);
    ensure!(after.evidence.len() == 2, "{:?}", after.evidence);
    // Reports move the rollout's figures, not Ready: one `Compiled` Event (first sight),
    // however many reports came.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let compiled: i32 = events(client, ns)
        .await?
        .iter()
        .filter(|e| e.reason == "Compiled" && e.regarding == "payments")
        .map(|e| e.count)
        .sum();
    ensure!(compiled == 1, "{compiled} Compiled Events");
    Ok(())
}

/// (e): with a pause, the step passes by itself once the pause is over and the evidence
/// has its minimum sample: here the only step, so the new revision is promoted.
#[tokio::test(flavor = "multi_thread")]
async fn a_step_with_a_pause_passes_by_itself() -> Result<()> {
    let env = TestEnv::new("op-rollout-pause").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h", LEAD]))?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let steps = "[{weight: 20, pause: 3s}]";
    let analysis = "{minFailedJobs: 50}";
    let p = change_from_25(&env, &api, 9, steps, analysis, RolloutPhase::Progressing).await?;
    let revision = rollout(&p).revision;
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases
        .create(
            &PostParams::default(),
            &evidence_lease("a", "00000000000000e1", &revision, counts(20, 100, 2, 10))?,
        )
        .await?;
    let done = rollout_when(&api, "promoted after the pause", |r| {
        r.phase == RolloutPhase::Healthy && r.stable_revision == revision
    })
    .await?;
    let started = rollout(&p).steps[0].start_unix_ms;
    let now = Timestamp::now().as_millisecond();
    ensure!(now - started >= 3000, "passed before its pause was over");
    ensure!(status_of(&done, "Ready") == Some(("True", "Compiled")));
    eventually("the new revision serves every job", WAIT, || async {
        Ok(served(client, ns)
            .await?
            .filter(|p| p.rollout.is_none() && p.params.max_attempts == 9))
    })
    .await?;
    Ok(())
}

/// A leader change mid-rollout: the standby that takes over continues the same step with
/// the same start time and the evidence the old leader kept in status.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_leader_resumes_the_rollout() -> Result<()> {
    let env = TestEnv::new("op-rollout-leader").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let args = |id: &str| {
        let mut a = scoped(
            ns,
            &["--resync=1h", "--lease-duration=6", "--lease-grace=2", LEAD],
        );
        a.push(format!("--identity={id}"));
        a
    };
    let mut first = Operator::start(env.cluster.kubeconfig(), args("replica-a"))?;
    eventually("replica-a to lead", WAIT, || async {
        Ok(first.is_leader().then_some(()))
    })
    .await?;
    let second = Operator::start(env.cluster.kubeconfig(), args("replica-b"))?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let steps = "[{weight: 50}]";
    let p = change_from_25(&env, &api, 4, steps, "{}", RolloutPhase::Paused).await?;
    let before = rollout(&p);
    let failed = |r: &RolloutStatus| r.analysis.map(|a| a.failed_new + a.failed_stable);
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let lease =
        |epoch: &str, n: u64| evidence_lease("a", epoch, &before.revision, counts(50, n, 1, 2));
    put_lease(&leases, lease("00000000000000d1", 100)?).await?;
    rollout_when(&api, "100 jobs", |r| failed(r) == Some(100)).await?;
    ensure!(second.writes()? == 0.0, "the standby wrote");

    first.kill();
    eventually(
        "replica-b to take over",
        Duration::from_secs(60),
        || async { Ok(second.is_leader().then_some(())) },
    )
    .await?;
    // The same sidecar restarted meanwhile: a new epoch, added to the old one's last report.
    put_lease(&leases, lease("00000000000000d2", 30)?).await?;
    let p = rollout_when(&api, "130 jobs under the new leader", |r| {
        failed(r) == Some(130)
    })
    .await?;
    let after = rollout(&p);
    ensure!(
        after.steps == before.steps && after.step == before.step,
        "{after:?}"
    );
    ensure!(second.writes()? > 0.0);
    Ok(())
}
