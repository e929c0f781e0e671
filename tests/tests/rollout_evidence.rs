//! A rollout's evidence as the sidecars publish it, on the real API server: a real
//! `rebound-sidecar` in watch mode, acting as its Pod, serves a ConfigMap document whose
//! policy is in rollout (two started steps, a tiny backoff so jobs mature within ~5 s).
//! Decides over a fixed set of job ids through a real gRPC client; the counts in the
//! sidecar's fleet Lease (`rebound.dev/rollout-evidence`, read with
//! `EvidenceReport::parse`) equal what the test computes with `rollout::assign::arm`,
//! replayed calls add nothing, `mature` catches up after the maturity, and after a SIGKILL
//! the Lease keeps the killed process's last report while its restart reports a new epoch
//! from zero. A reload keeping the revision keeps the counts; a new revision starts empty.

mod fleet_support;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use fleet_support::Sidecar;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use rebound_policy::{
    CompiledDocument,
    compiled::CompiledRollout,
    rollout::{
        analysis::StepCounts,
        assign::{Arm, Exposure, Step, arm, revision_id},
        evidence::{EVIDENCE_ANNOTATION, EvidenceReport, maturity_ms},
    },
};
use rebound_sidecar::fleet::membership::CONFIG_HASH_ANNOTATION;
use rebound_sidecar::pb::v1::{GetPolicyRequest, retry_advisor_client::RetryAdvisorClient};
use rebound_tests::TestEnv;
use rebound_tests::lease::apply_sidecar_rbac;
use tonic::transport::Channel;

const SA: &str = "rebound-worker";
const POD: &str = "worker-0";
const QUEUE: &str = "payments";
const JOBS: usize = 600;

fn now_ms() -> u64 {
    rebound_sidecar::system_now_ms()
}

/// The policy in rollout: stable gives up at attempt 3, the canary at attempt 2; 100 ms
/// constant delays, so the maturity is the 5 s margin and a little more. Step 0 (20 %)
/// started 60 s ago, step 1 (60 %) 30 s ago.
fn document(namespace: &str, t0: u64) -> Result<(CompiledDocument, Exposure, u64)> {
    let yaml = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {QUEUE}}}\nspec:\n  queues: [{QUEUE}]\n  backoff: {{strategy: constant, base: 100ms, jitter: {{kind: none}}}}\n  maxAttempts: 3\n"
    );
    let mut doc = rebound_sidecar::store::compile_manifests(
        &[(PathBuf::from("rollout.yaml"), yaml)],
        namespace,
    )?;
    let policy = doc.policies.first_mut().context("one policy")?;
    let mut canary = policy.params.clone();
    canary.max_attempts = 2;
    let maturity = maturity_ms(&policy.params, &canary).context("a bounded maturity")?;
    let steps = vec![
        Step {
            weight: 20,
            start_unix_ms: t0 - 60_000,
        },
        Step {
            weight: 60,
            start_unix_ms: t0 - 30_000,
        },
    ];
    let exposure = Exposure::new(revision_id(&canary), steps.clone())
        .map_err(|e| anyhow::anyhow!("{}: {}", e.field, e.message))?;
    policy.rollout = Some(CompiledRollout {
        revision: revision_id(&canary),
        stable_revision: revision_id(&policy.params),
        canary,
        steps,
    });
    let doc = CompiledDocument::new(doc.namespace, doc.policies);
    Ok((doc, exposure, maturity))
}

async fn decide(
    client: &mut RetryAdvisorClient<Channel>,
    job: &str,
    attempt: u32,
    first_failure_ms: u64,
) -> Result<(bool, String)> {
    fleet_support::decide_job(client, QUEUE, job, attempt, first_failure_ms).await
}

/// One job of the fixed set: its first failure (in step 0 or step 1) and whether it runs
/// until it is given up.
struct Job {
    id: String,
    first_failure_ms: u64,
    to_the_end: bool,
}

/// What the test expects per step, by [`arm`] computed here.
fn expected(jobs: &[Job], exposure: &Exposure) -> BTreeMap<usize, StepCounts> {
    let mut want: BTreeMap<usize, StepCounts> = BTreeMap::new();
    for job in jobs {
        let t = job.first_failure_ms;
        let step = exposure
            .steps()
            .iter()
            .rposition(|s| s.start_unix_ms <= t)
            .expect("in a step");
        let c = want.entry(step).or_default();
        c.weight = exposure.steps()[step].weight;
        let canary = u64::from(arm(exposure, Some(&job.id), Some(t), t) == Arm::Canary);
        c.failed_all += 1;
        c.failed_new += canary;
        if job.to_the_end {
            c.bad_all += 1;
            c.bad_new += canary;
        }
    }
    want
}

async fn lease_report(client: &kube::Client, ns: &str) -> Result<Option<EvidenceReport>> {
    Ok(lease_state(client, ns).await?.1)
}

/// The configuration hash the Lease names and its report, from one read.
async fn lease_state(
    client: &kube::Client,
    ns: &str,
) -> Result<(Option<String>, Option<EvidenceReport>)> {
    let lease = Api::<Lease>::namespaced(client.clone(), ns)
        .get_opt(&format!("rebound-sidecar-{POD}"))
        .await?;
    let mut annotations = lease
        .and_then(|l| l.metadata.annotations)
        .unwrap_or_default();
    let report = annotations
        .remove(EVIDENCE_ANNOTATION)
        .map(|t| EvidenceReport::parse(&t).context("the report"))
        .transpose()?;
    Ok((annotations.remove(CONFIG_HASH_ANNOTATION), report))
}

/// Polls the Lease until `done` holds for its report (renewals every second).
async fn wait_report(
    env: &TestEnv,
    timeout: Duration,
    done: impl Fn(&EvidenceReport) -> bool,
) -> Result<EvidenceReport> {
    wait_lease(env, timeout, |_, r| done(r)).await
}

/// Polls the Lease until `done(config hash, report)` holds.
async fn wait_lease(
    env: &TestEnv,
    timeout: Duration,
    done: impl Fn(Option<&str>, &EvidenceReport) -> bool,
) -> Result<EvidenceReport> {
    let start = Instant::now();
    loop {
        let (hash, report) = lease_state(&env.client, &env.namespace).await?;
        if let Some(r) = &report
            && done(hash.as_deref(), r)
        {
            return Ok(report.unwrap_or_default());
        }
        if start.elapsed() > timeout {
            bail!("after {timeout:?} the Lease reports {report:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The per-step `seen` (or `mature`) counts of the one policy in a report.
fn counts(report: &EvidenceReport, mature: bool) -> BTreeMap<usize, StepCounts> {
    report
        .policies
        .iter()
        .flat_map(|p| &p.steps)
        .map(|s| (s.step as usize, if mature { s.mature } else { s.seen }))
        .collect()
}

/// The sidecar as Pod [`POD`] (a Pod-bound token), once the document is loaded.
async fn spawn(
    env: &TestEnv,
    kubeconfig: &Path,
    uid: &str,
) -> Result<(Sidecar, RetryAdvisorClient<Channel>)> {
    let sidecar = Sidecar::spawn(kubeconfig, &env.namespace, POD, &[("POD_UID", uid)])?;
    let mut client = sidecar.connect().await?;
    // Until the document is loaded the sidecar answers Unavailable.
    let start = Instant::now();
    while client
        .get_policy(GetPolicyRequest {
            queue: QUEUE.to_owned(),
        })
        .await
        .map(|r| r.into_inner().rollout.is_none())
        .unwrap_or(true)
    {
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "no rollout loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((sidecar, client))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_publish_exact_per_job_rollout_counts_in_their_lease() -> Result<()> {
    let env = TestEnv::new("rollout-evidence").await?;
    apply_sidecar_rbac(&env)?;
    let t0 = now_ms();
    let (doc, exposure, maturity) = document(&env.namespace, t0)?;
    let cm = Api::namespaced(env.client.clone(), &env.namespace);
    rebound_tests::compiled::put(&cm, &doc).await?;
    let (kubeconfig, uid) =
        fleet_support::pod_kubeconfig(env.cluster, &env.client, &env.namespace, POD, SA).await?;
    let (mut sidecar, mut client) = spawn(&env, &kubeconfig, &uid).await?;

    // A policy in rollout with nothing counted: the report names it, from zero.
    let first = wait_report(&env, Duration::from_secs(10), |r| r.policies.len() == 1).await?;
    assert_eq!(first.policies[0].policy, QUEUE);
    assert_eq!(first.policies[0].revision, exposure.revision());
    assert!(first.policies[0].steps.is_empty());

    // Half the jobs first failed in step 0 (long mature), half now in step 1; a third of
    // them run until given up. Every answer comes from the revision `arm` says.
    let now = now_ms();
    let jobs: Vec<Job> = (0..JOBS)
        .map(|i| Job {
            id: format!("job-{i:04}"),
            first_failure_ms: if i % 2 == 0 { t0 - 45_000 } else { now },
            to_the_end: i % 3 == 0,
        })
        .collect();
    for job in &jobs {
        let (_, revision) = decide(&mut client, &job.id, 1, job.first_failure_ms).await?;
        let t = job.first_failure_ms;
        let want = match arm(&exposure, Some(&job.id), Some(t), t) {
            Arm::Canary => exposure.revision().to_owned(),
            Arm::Stable => doc.policies[0]
                .rollout
                .as_ref()
                .map(|r| r.stable_revision.clone())
                .unwrap_or_default(),
        };
        assert_eq!(revision, want, "{}", job.id);
        if job.to_the_end {
            let mut attempt = 2;
            while !decide(&mut client, &job.id, attempt, job.first_failure_ms)
                .await?
                .0
            {
                attempt += 1;
                ensure!(attempt <= 3, "{} never given up", job.id);
            }
        }
    }
    // Replays of the same hook calls: attempt 1 of every job, the give-ups again.
    for job in &jobs {
        decide(&mut client, &job.id, 1, job.first_failure_ms).await?;
        if job.to_the_end {
            decide(&mut client, &job.id, 3, job.first_failure_ms).await?;
        }
    }
    let want = expected(&jobs, &exposure);
    ensure!(
        want[&0].failed_new > 0 && want[&1].bad_new > 0,
        "both arms in both steps"
    );

    let report = wait_report(&env, Duration::from_secs(10), |r| counts(r, false) == want).await?;
    assert_eq!(counts(&report, false), want);
    // Step 0's jobs failed long ago: mature at once. Step 1's mature only later.
    assert_eq!(counts(&report, true)[&0], want[&0]);
    if now_ms() - now < maturity / 2 {
        assert_eq!(counts(&report, true)[&1].failed_all, 0);
    }
    let within = Duration::from_millis(maturity) + Duration::from_secs(10);
    let mature = wait_report(&env, within, |r| counts(r, true) == want).await?;
    // Never before the maturity since the step-1 jobs' first failure.
    let matured_after = now_ms() - now;
    assert!(
        matured_after >= maturity,
        "matured after {matured_after} ms, maturity {maturity} ms"
    );
    let epoch = mature.epoch.clone();
    let canary_failed: u64 = want.values().map(|c| c.failed_new).sum();
    assert_eq!(
        sidecar.metric_with(
            "rebound_sidecar_rollout_jobs_total",
            &[("arm", "canary"), ("kind", "failed")]
        )?,
        canary_failed as f64
    );

    // A reload that keeps the revision (another policy added) keeps the counts.
    let mut more = doc.clone();
    let mut other = more.policies[0].clone();
    other.name = "other".to_owned();
    other.queues = vec!["other".to_owned()];
    other.rollout = None;
    more.policies.push(other);
    let more = CompiledDocument::new(more.namespace, more.policies);
    rebound_tests::compiled::put(&cm, &more).await?;
    let kept = wait_lease(&env, Duration::from_secs(10), |hash, _| {
        hash == Some(more.hash.as_str())
    })
    .await?;
    assert_eq!(kept, mature);

    // SIGKILL: the Lease keeps the last report of the killed epoch, as it was.
    sidecar.child.kill()?;
    sidecar.child.wait()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kept = lease_report(&env.client, &env.namespace)
        .await?
        .context("the killed sidecar's report")?;
    assert_eq!(kept, mature);
    drop(sidecar);

    // Its restart is a new epoch counting from zero: replays of old jobs and new ones.
    let (_restarted, mut client) = spawn(&env, &kubeconfig, &uid).await?;
    let fresh = wait_report(&env, Duration::from_secs(10), |r| r.epoch != epoch).await?;
    assert!(fresh.policies[0].steps.is_empty(), "{fresh:?}");
    let again = &jobs[..10];
    for job in again {
        decide(&mut client, &job.id, 1, job.first_failure_ms).await?;
    }
    let want_again = expected(again, &exposure)
        .into_iter()
        .map(|(k, mut c)| {
            (c.bad_all, c.bad_new) = (0, 0);
            (k, c)
        })
        .collect::<BTreeMap<_, _>>();
    let counted = wait_report(&env, Duration::from_secs(10), |r| {
        r.epoch != epoch && counts(r, false) == want_again
    })
    .await?;
    assert_eq!(counts(&counted, false), want_again);

    // A new revision is new evidence: the old one's counts are gone from the report.
    let mut changed = more.clone();
    let rollout = changed.policies[0].rollout.as_mut().context("in rollout")?;
    rollout.canary.max_attempts = 4;
    rollout.revision = revision_id(&rollout.canary);
    let new_revision = rollout.revision.clone();
    let changed = CompiledDocument::new(changed.namespace, changed.policies);
    rebound_tests::compiled::put(&cm, &changed).await?;
    let renewed = wait_lease(&env, Duration::from_secs(10), |hash, _| {
        hash == Some(changed.hash.as_str())
    })
    .await?;
    assert_eq!(renewed.policies.len(), 1);
    assert_eq!(renewed.policies[0].revision, new_revision);
    assert!(renewed.policies[0].steps.is_empty(), "{renewed:?}");
    Ok(())
}
