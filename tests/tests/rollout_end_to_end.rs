//! A policy change rolls out on real parts: the real `rebound-operator`, three real
//! `rebound-sidecar` processes in watch mode acting as Pods (their fleet Leases carry the
//! evidence), jobs driven through real gRPC clients, changes made by `kubectl apply`, and
//! the adapters' own assignment ports (Node and Ruby) run on the exposure the operator
//! wrote. Jobs fail a fixed-seed number of times and then succeed (stop asking) or are
//! given up; each attempt of a job goes to the next sidecar.

mod fleet_support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, ensure};
use fleet_support::Sidecar;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Event};
use kube::api::{Api, ListParams};
use rebound_policy::compiled::{CONFIGMAP_KEY, CompiledPolicy, CompiledRollout};
use rebound_policy::rollout::evidence::{EVIDENCE_ANNOTATION, EvidenceReport};
use rebound_policy::spec::{AnalysisVerdict, RolloutPhase, RolloutStatus};
use rebound_policy::{CompiledDocument, RetryPolicy};
use rebound_sidecar::pb::v1::retry_advisor_client::RetryAdvisorClient;
use rebound_test_support::{eventually, free_port};
use rebound_tests::lease::apply_sidecar_rbac;
use rebound_tests::process::Running;
use rebound_tests::{TestEnv, repo_root};
use tonic::transport::Channel;

const SA: &str = "rebound-worker";
const QUEUE: &str = "jobs";
const POLICY: &str = "jobs";
/// A whole rollout: two steps of a few seconds each, maturity about 5 s, reports every 1 s.
const ROLLOUT_WAIT: Duration = Duration::from_secs(120);

/// The policy: a constant 10 ms backoff, so a job's whole life is short, and `rollout`.
fn manifest(max_attempts: u32, steps: &str, analysis: &str) -> String {
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {POLICY}}}\n\
         spec:\n  queues: [{QUEUE}]\n  maxAttempts: {max_attempts}\n  \
         backoff: {{strategy: constant, base: 10ms, jitter: {{kind: none}}}}\n  \
         rollout:\n    steps: {steps}\n    analysis: {analysis}\n"
    )
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How many times job `n` fails before it succeeds: `lo..=hi`, from a fixed-seed hash.
fn failures(n: u64, lo: u32, hi: u32) -> u32 {
    lo + (rebound_policy::decide::mix64(n) % u64::from(hi - lo + 1)) as u32
}

/// One answer a job got.
#[derive(Clone, Debug)]
struct Answer {
    job: String,
    first_failure_ms: u64,
    revision: String,
    gave_up: bool,
}

/// The operator, the sidecars and their clients.
struct Rig {
    env: TestEnv,
    _operator: Running,
    sidecars: Vec<Sidecar>,
    clients: Vec<RetryAdvisorClient<Channel>>,
    /// Each Pod's kubeconfig and UID: a sidecar restarted in its Pod reuses them.
    pods: BTreeMap<String, (std::path::PathBuf, String)>,
}

impl Rig {
    async fn start(prefix: &str, sidecars: usize) -> Result<Rig> {
        let env = TestEnv::new(prefix).await?;
        apply_sidecar_rbac(&env)?;
        let operator = Running::workspace_binary(
            "rebound-operator",
            env.cluster.kubeconfig(),
            &[
                format!("--namespaces={}", env.namespace),
                "--leader-elect=false".into(),
                // Three watch-mode sidecars load a step well within this.
                "--rollout-step-lead=2s".into(),
                format!("--metrics-addr={}", free_port()?),
            ],
            Path::new(env!("CARGO_TARGET_TMPDIR")),
        )?;
        let mut rig = Rig {
            env,
            _operator: operator,
            sidecars: Vec::new(),
            clients: Vec::new(),
            pods: BTreeMap::new(),
        };
        for i in 0..sidecars {
            let sidecar = rig.spawn_sidecar(&format!("worker-{i}")).await?;
            rig.clients.push(sidecar.connect().await?);
            rig.sidecars.push(sidecar);
        }
        Ok(rig)
    }

    /// A sidecar in Pod `pod` (created the first time).
    async fn spawn_sidecar(&mut self, pod: &str) -> Result<Sidecar> {
        let env = &self.env;
        if !self.pods.contains_key(pod) {
            let made =
                fleet_support::pod_kubeconfig(env.cluster, &env.client, &env.namespace, pod, SA)
                    .await?;
            self.pods.insert(pod.to_owned(), made);
        }
        let (kubeconfig, uid) = &self.pods[pod];
        Sidecar::spawn(kubeconfig, &env.namespace, pod, &[("POD_UID", uid)])
    }

    fn apply(&self, yaml: &str) -> Result<()> {
        self.env.kubectl_stdin(["apply", "-f", "-"], yaml)?.ok()?;
        Ok(())
    }

    fn policies(&self) -> Api<RetryPolicy> {
        Api::namespaced(self.env.client.clone(), &self.env.namespace)
    }

    /// The rollout status once the operator has observed the current generation and
    /// `check` holds.
    async fn rollout_when(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&RolloutStatus) -> bool,
    ) -> Result<RetryPolicy> {
        let api = self.policies();
        eventually(what, timeout, || async {
            let p = api.get(POLICY).await?;
            let status = p.status.clone().unwrap_or_default();
            let hit = status.observed_generation == p.metadata.generation
                && status.rollout.as_ref().is_some_and(&check);
            Ok(hit.then_some(p))
        })
        .await
    }

    /// The policy as the ConfigMap serves it.
    async fn served(&self) -> Result<Option<CompiledPolicy>> {
        let api: Api<ConfigMap> = Api::namespaced(self.env.client.clone(), &self.env.namespace);
        let Some(cm) = api.get_opt(rebound_tests::compiled::CONFIGMAP).await? else {
            return Ok(None);
        };
        let Some(json) = cm.data.and_then(|mut d| d.remove(CONFIGMAP_KEY)) else {
            return Ok(None);
        };
        let document = CompiledDocument::from_json(json.as_bytes())?;
        Ok(document.policies.into_iter().find(|p| p.name == POLICY))
    }

    /// Applies the policy's first revision and waits until it serves every job: the
    /// stable revision of the rollout that follows.
    async fn stable(&self, yaml: &str) -> Result<RolloutStatus> {
        self.apply(yaml)?;
        let first = self
            .rollout_when("the first revision to be Healthy", ROLLOUT_WAIT, |r| {
                r.phase == RolloutPhase::Healthy
            })
            .await?;
        self.sidecars_serve(str::is_empty).await?;
        first
            .status
            .and_then(|s| s.rollout)
            .context("no status.rollout")
    }

    /// Runs jobs while `yaml` is applied, until the rollout satisfies `until`; returns
    /// the policy then (or the timeout), every answer, and what the watcher saw.
    async fn change_under_load(
        &self,
        yaml: &str,
        jobs: (&str, fn(u64) -> u32),
        until: (&str, impl Fn(&RolloutStatus) -> bool),
    ) -> Result<(RetryPolicy, Vec<Answer>, Seen)> {
        let watcher = Watcher::start(self);
        let load = Load::start(&self.clients, 4, jobs.0, jobs.1);
        self.apply(yaml)?;
        let reached = self.rollout_when(until.0, ROLLOUT_WAIT, until.1).await;
        let answers = load.finish().await?;
        let seen = watcher.finish().await?;
        let reached = reached.with_context(|| format!("phases seen: {:?}", seen.0))?;
        Ok((reached, answers, seen))
    }

    /// Waits until every sidecar answers attempt 1 of `probe` with a revision that `want`
    /// accepts (each has loaded what the ConfigMap holds).
    async fn sidecars_serve(&self, want: impl Fn(&str) -> bool) -> Result<()> {
        for (i, client) in self.clients.iter().enumerate() {
            let want = &want;
            eventually(
                &format!("sidecar {i} to serve the expected revisions"),
                Duration::from_secs(30),
                || {
                    let mut client = client.clone();
                    async move {
                        let answer = ask(&mut client, "probe", now_ms(), 1).await?;
                        Ok(want(&answer.revision).then_some(()))
                    }
                },
            )
            .await?;
        }
        Ok(())
    }
}

/// One Decide for `job`'s `attempt`.
async fn ask(
    client: &mut RetryAdvisorClient<Channel>,
    job: &str,
    first_failure_ms: u64,
    attempt: u32,
) -> Result<Answer> {
    let (gave_up, revision) =
        fleet_support::decide_job(client, QUEUE, job, attempt, first_failure_ms).await?;
    Ok(Answer {
        job: job.to_owned(),
        first_failure_ms,
        revision,
        gave_up,
    })
}

/// Workers running jobs until stopped: job `n` fails `failures(n)` times, each attempt on
/// the next sidecar, waiting the answered delay between attempts.
struct Load {
    stop: Arc<AtomicBool>,
    answers: Arc<Mutex<Vec<Answer>>>,
    tasks: Vec<tokio::task::JoinHandle<Result<()>>>,
}

impl Load {
    fn start(
        clients: &[RetryAdvisorClient<Channel>],
        workers: u64,
        prefix: &str,
        fails: fn(u64) -> u32,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicU64::new(0));
        let tasks = (0..workers)
            .map(|_| {
                let (stop, answers, next) = (stop.clone(), answers.clone(), next.clone());
                let mut clients = clients.to_vec();
                let prefix = prefix.to_owned();
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let job = format!("{prefix}-{n}");
                        let first = now_ms();
                        for attempt in 1..=fails(n) {
                            let sidecar = (n as usize + attempt as usize) % clients.len();
                            let answer = ask(&mut clients[sidecar], &job, first, attempt).await?;
                            let gave_up = answer.gave_up;
                            answers
                                .lock()
                                .map_err(|_| anyhow::anyhow!("poisoned"))?
                                .push(answer);
                            if gave_up {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        // The workers' pace: about 40 jobs a second each.
                        tokio::time::sleep(Duration::from_millis(25)).await;
                    }
                    Ok(())
                })
            })
            .collect();
        Load {
            stop,
            answers,
            tasks,
        }
    }

    async fn finish(self) -> Result<Vec<Answer>> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await??;
        }
        let answers = self
            .answers
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok(answers.clone())
    }
}

/// Per job, the revisions its answers named, `""` (no rollout) left out.
fn revisions_per_job(answers: &[Answer]) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut per_job: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for a in answers {
        let entry = per_job.entry(a.job.as_str()).or_default();
        if !a.revision.is_empty() {
            entry.insert(a.revision.as_str());
        }
    }
    per_job
}

/// The arm each adapter port gives `(job, first failure)` on `rollout`'s exposure:
/// `CANARY` or `STABLE`, one per case, from Node's `assign.js` and Ruby's `assign.rb`.
fn port_arms(
    rollout: &CompiledRollout,
    cases: &[(&str, u64)],
) -> Result<Vec<(String, Vec<String>)>> {
    let input = serde_json::json!({
        "revision": rollout.revision,
        "steps": rollout.steps.iter().map(|s| serde_json::json!({
            "weight": s.weight, "startUnixMs": s.start_unix_ms.to_string()})).collect::<Vec<_>>(),
        "cases": cases.iter().map(|(job, first)| serde_json::json!([job, first.to_string()])).collect::<Vec<_>>(),
    })
    .to_string();
    let root = repo_root();
    let node = format!(
        "const {{ arm }} = require({:?}); const i = JSON.parse(require('fs').readFileSync(0, 'utf8')); \
         console.log(JSON.stringify(i.cases.map(([j, t]) => arm(i.revision, i.steps, j, t, t).arm)));",
        root.join("clients/node/lib/assign.js")
    );
    let ruby = "require 'json'; require 'rebound/assign'; i = JSON.parse($stdin.read); \
                puts JSON.generate(i['cases'].map { |j, t| Rebound::Assign.arm(i['revision'], \
                i['steps'], j, t, t)['arm'] })";
    let run = |name: &str, mut cmd: Command| -> Result<(String, Vec<String>)> {
        use std::io::Write;
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(input.as_bytes())?;
        let out = child.wait_with_output()?;
        ensure!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let arms: Vec<String> =
            serde_json::from_slice(&out.stdout).with_context(|| format!("{name}'s output"))?;
        Ok((name.to_owned(), arms))
    };
    let mut node_cmd = Command::new("node");
    node_cmd.args(["-e", &node]);
    let mut ruby_cmd = Command::new("ruby");
    ruby_cmd
        .arg(format!("-I{}", root.join("clients/ruby/lib").display()))
        .args(["-e", ruby]);
    Ok(vec![run("node", node_cmd)?, run("ruby", ruby_cmd)?])
}

/// Every (phase, step) the status showed, in order, and the longest exposure the ConfigMap
/// carried.
type Seen = (Vec<(RolloutPhase, Option<u32>)>, Option<CompiledRollout>);

/// Records, until stopped, every (phase, step) the policy's status shows and the longest
/// exposure the ConfigMap carried.
struct Watcher {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Seen>>,
}

impl Watcher {
    fn start(rig: &Rig) -> Watcher {
        let stop = Arc::new(AtomicBool::new(false));
        let api = rig.policies();
        let cms: Api<ConfigMap> = Api::namespaced(rig.env.client.clone(), &rig.env.namespace);
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut phases: Vec<(RolloutPhase, Option<u32>)> = Vec::new();
            let mut longest: Option<CompiledRollout> = None;
            while !flag.load(Ordering::Relaxed) {
                let p = api.get(POLICY).await?;
                if let Some(r) = p.status.and_then(|s| s.rollout) {
                    let seen = (r.phase, r.step);
                    if phases.last() != Some(&seen) {
                        phases.push(seen);
                    }
                }
                if let Some(cm) = cms.get_opt(rebound_tests::compiled::CONFIGMAP).await?
                    && let Some(json) = cm.data.and_then(|mut d| d.remove(CONFIGMAP_KEY))
                {
                    let doc = CompiledDocument::from_json(json.as_bytes())?;
                    let rollout = doc
                        .policies
                        .into_iter()
                        .find(|p| p.name == POLICY)
                        .and_then(|p| p.rollout);
                    if let Some(r) = rollout
                        && longest
                            .as_ref()
                            .is_none_or(|l| r.steps.len() > l.steps.len())
                    {
                        longest = Some(r);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok((phases, longest))
        });
        Watcher { stop, task }
    }

    async fn finish(self) -> Result<Seen> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// Checks that every answer naming a revision is the one both ports assign the job on
/// `rollout`'s exposure. Returns (canary jobs, stable jobs).
fn check_ports(answers: &[Answer], rollout: &CompiledRollout) -> Result<(usize, usize)> {
    let mut cases: BTreeMap<&str, (u64, &str)> = BTreeMap::new();
    for a in answers.iter().filter(|a| !a.revision.is_empty()) {
        cases.insert(a.job.as_str(), (a.first_failure_ms, a.revision.as_str()));
    }
    let list: Vec<(&str, u64)> = cases.iter().map(|(j, (t, _))| (*j, *t)).collect();
    let mut canary = 0;
    for (port, arms) in port_arms(rollout, &list)? {
        ensure!(arms.len() == list.len(), "{port}: {} arms", arms.len());
        canary = 0;
        for ((job, (_, revision)), arm) in cases.iter().zip(&arms) {
            let expected = match arm.as_str() {
                "CANARY" => rollout.revision.as_str(),
                _ => rollout.stable_revision.as_str(),
            };
            ensure!(
                *revision == expected,
                "{port} assigns {job} to {arm}, the sidecars answered with {revision}"
            );
            canary += usize::from(arm == "CANARY");
        }
    }
    Ok((canary, list.len() - canary))
}

async fn events(rig: &Rig) -> Result<Vec<(String, String)>> {
    let api: Api<Event> = Api::namespaced(rig.env.client.clone(), &rig.env.namespace);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(POLICY))
        .map(|e| (e.type_.unwrap_or_default(), e.reason.unwrap_or_default()))
        .collect())
}

/// Stable: 3 attempts; the change: 5. Jobs fail 1 to 6 times: the new revision gives up
/// fewer of them, a good change.
fn good_failures(n: u64) -> u32 {
    failures(n, 1, 6)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_change_is_promoted_step_by_step_and_no_job_mixes_revisions() -> Result<()> {
    let rig = Rig::start("rollout-good", 3).await?;
    let steps = "[{weight: 30, pause: 1s}, {weight: 60, pause: 1s}]";
    let analysis = "{minFailedJobs: 60}";
    let stable = rig.stable(&manifest(3, steps, analysis)).await?;
    let (done, answers, (phases, longest)) = rig
        .change_under_load(
            &manifest(5, steps, analysis),
            ("good", good_failures),
            ("the change to be promoted", |r: &RolloutStatus| {
                r.phase == RolloutPhase::Healthy && r.revision != stable.revision
            }),
        )
        .await?;
    let promoted = done.status.and_then(|s| s.rollout).context("rollout")?;

    // Step by step: step 0, step 1, then promoted.
    let progressing: Vec<Option<u32>> = phases
        .iter()
        .filter(|(p, _)| *p == RolloutPhase::Progressing)
        .map(|(_, s)| *s)
        .collect();
    assert_eq!(progressing, [Some(0), Some(1)], "phases seen: {phases:?}");
    assert_eq!(promoted.stable_revision, promoted.revision);
    let served = rig.served().await?.context("served")?;
    assert_eq!(served.params.max_attempts, 5);
    assert!(served.rollout.is_none(), "promoted: no canary left");

    // Every job got one revision, across sidecars and steps.
    for (job, revisions) in revisions_per_job(&answers) {
        ensure!(revisions.len() <= 1, "{job} got {revisions:?}");
    }
    // ... the one each adapter's port assigns it on the exposure the operator wrote.
    let rollout = longest.context("the ConfigMap never carried the rollout")?;
    assert_eq!(rollout.steps.len(), 2);
    assert_eq!(
        (rollout.revision.as_str(), rollout.stable_revision.as_str()),
        (promoted.revision.as_str(), stable.revision.as_str())
    );
    let (canary, stable_jobs) = check_ports(&answers, &rollout)?;
    ensure!(
        canary > 20 && stable_jobs > 20,
        "both arms answered: {canary} canary, {stable_jobs} stable jobs"
    );
    let events = events(&rig).await?;
    for reason in ["RolloutStarted", "StepStarted", "Promoted"] {
        ensure!(
            events.iter().any(|(_, r)| r == reason),
            "no {reason} Event: {events:?}"
        );
    }
    Ok(())
}

/// Jobs fail 2 to 10 times, then succeed: 25 attempts save every one, 2 give every one up.
fn bad_failures(n: u64) -> u32 {
    failures(n, 2, 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_change_is_rolled_back_at_the_first_step() -> Result<()> {
    let rig = Rig::start("rollout-bad", 3).await?;
    let steps = "[{weight: 20, pause: 10m}, {weight: 50, pause: 10m}]";
    let analysis = "{minFailedJobs: 100}";
    let stable = rig.stable(&manifest(25, steps, analysis)).await?;
    let applied = std::time::Instant::now();
    let (rolled_back, answers, (phases, longest)) = rig
        .change_under_load(
            &manifest(2, steps, analysis),
            ("bad", bad_failures),
            ("the change to be rolled back", |r: &RolloutStatus| {
                r.phase == RolloutPhase::Degraded
            }),
        )
        .await?;
    let status = rolled_back.status.clone().context("status")?;
    let rollout = status.rollout.clone().context("rollout")?;

    // At the first step, on harm, with the evidence in the status.
    ensure!(
        phases
            .iter()
            .all(|(p, s)| *p != RolloutPhase::Progressing || *s == Some(0)),
        "never past step 0: {phases:?}"
    );
    let analysis = rollout.analysis.context("no analysis in the status")?;
    assert_eq!(analysis.verdict, AnalysisVerdict::Harm);
    ensure!(
        analysis.bad_new > 0 && analysis.e_value >= analysis.threshold,
        "{analysis:?}"
    );
    assert_eq!(rollout.stable_revision, stable.revision);
    let degraded = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .context("no Degraded condition")?;
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "RolledBack")
    );
    let served = rig.served().await?.context("served")?;
    assert_eq!(served.params.max_attempts, 25, "the stable revision serves");
    assert!(served.rollout.is_none(), "no job on the bad revision");
    ensure!(
        events(&rig)
            .await?
            .iter()
            .any(|(t, r)| t == "Warning" && r == "RolledBack"),
        "no RolledBack Warning"
    );

    // The jobs that saw the bad revision: those the step's weight assigns, no more.
    let exposure = longest.context("the ConfigMap never carried the rollout")?;
    assert_eq!(exposure.steps.len(), 1, "one step started");
    let (canary, stable_jobs) = check_ports(&answers, &exposure)?;
    let n = (canary + stable_jobs) as f64;
    eprintln!(
        "rollout: rolled back after {:.1}s with {canary} of {n} jobs on the bad revision; {analysis:?}",
        applied.elapsed().as_secs_f64()
    );
    let bound = 0.2 * n + 3.0 * (n * 0.2 * 0.8).sqrt();
    ensure!(
        (canary as f64) <= bound && canary > 0,
        "{canary} of {n} jobs saw the bad revision (20 % step, bound {bound:.0})"
    );
    for (job, revisions) in revisions_per_job(&answers) {
        ensure!(revisions.len() <= 1, "{job} got {revisions:?}");
    }

    // After the rollback every sidecar serves the stable revision to every job.
    rig.sidecars_serve(str::is_empty).await?;
    let mut client = rig.clients[0].clone();
    for n in 0..50 {
        let answer = ask(&mut client, &format!("after-{n}"), now_ms(), 2).await?;
        ensure!(!answer.gave_up && answer.revision.is_empty(), "{answer:?}");
    }
    Ok(())
}

/// The epochs' counts the operator holds: epoch -> failed jobs seen (both arms).
fn held_epochs(rollout: &RolloutStatus) -> BTreeMap<String, u64> {
    rollout
        .evidence
        .iter()
        .map(|e| (e.epoch.clone(), e.steps.iter().map(|s| s.seen[1]).sum()))
        .collect()
}

/// The report a sidecar's Lease carries: (epoch, failed jobs seen, both arms).
async fn lease_report(rig: &Rig, pod: &str) -> Result<Option<(String, u64)>> {
    let api: Api<Lease> = Api::namespaced(rig.env.client.clone(), &rig.env.namespace);
    let Some(lease) = api.get_opt(&format!("rebound-sidecar-{pod}")).await? else {
        return Ok(None);
    };
    let Some(text) = lease
        .metadata
        .annotations
        .and_then(|mut a| a.remove(EVIDENCE_ANNOTATION))
    else {
        return Ok(None);
    };
    let report = EvidenceReport::parse(&text)?;
    let failed = report
        .policies
        .iter()
        .filter(|p| p.policy == POLICY)
        .flat_map(|p| p.steps.iter().map(|s| s.seen.failed_all))
        .sum();
    Ok(Some((report.epoch, failed)))
}

/// Attempt 1 of `count` new jobs on one sidecar.
async fn first_failures(
    client: &RetryAdvisorClient<Channel>,
    prefix: &str,
    count: u64,
) -> Result<()> {
    let mut client = client.clone();
    for n in 0..count {
        ask(&mut client, &format!("{prefix}-{n}"), now_ms(), 1).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sidecar_loses_only_what_it_had_not_reported() -> Result<()> {
    let mut rig = Rig::start("rollout-kill", 1).await?;
    // A manual step: the rollout waits, so the evidence only accumulates.
    let steps = "[{weight: 50}]";
    rig.stable(&manifest(3, steps, "{}")).await?;
    rig.apply(&manifest(4, steps, "{}"))?;
    let paused = rig
        .rollout_when("Paused", ROLLOUT_WAIT, |r| r.phase == RolloutPhase::Paused)
        .await?;
    rig.sidecars_serve(|r| !r.is_empty()).await?;
    // Jobs are counted from the step's start on (the operator writes it ahead).
    let start = paused
        .status
        .and_then(|s| s.rollout)
        .and_then(|r| r.steps.first().map(|s| s.start_unix_ms as u64))
        .context("no started step")?;
    tokio::time::sleep(Duration::from_millis(start.saturating_sub(now_ms()) + 100)).await;
    let mut probe = rig.clients[0].clone();
    ask(&mut probe, "probe", now_ms(), 1).await?;

    // 40 jobs, reported and held by the operator.
    first_failures(&rig.clients[0], "before", 40).await?;
    let (old_epoch, reported) = eventually("40 jobs reported", Duration::from_secs(30), || async {
        Ok(lease_report(&rig, "worker-0")
            .await?
            .filter(|(_, failed)| *failed >= 41))
    })
    .await?;
    // 41: the probe of `sidecars_serve` is a job too.
    assert_eq!(reported, 41);
    // 25 more, then SIGKILL at once: whatever was not renewed yet is lost.
    first_failures(&rig.clients[0], "lost", 25).await?;
    let killed = rig.sidecars.remove(0);
    drop(killed);
    rig.clients.clear();
    let (epoch, last) = lease_report(&rig, "worker-0")
        .await?
        .context("the killed sidecar's Lease lost its report")?;
    assert_eq!(epoch, old_epoch);
    ensure!((41..=66).contains(&last), "last report {last}");

    // The same Pod again: a new epoch, counting from zero (a probe and 30 jobs).
    let again = rig.spawn_sidecar("worker-0").await?;
    rig.clients.push(again.connect().await?);
    rig.sidecars.push(again);
    // Its first answer (a probe job, counted) once it has loaded the document.
    rig.sidecars_serve(|r| !r.is_empty()).await?;
    first_failures(&rig.clients[0], "after", 30).await?;
    let policy = rig
        .rollout_when("both epochs held", ROLLOUT_WAIT, |r| {
            let held = held_epochs(r);
            held.len() == 2
                && held.get(&old_epoch) == Some(&last)
                && held.values().any(|&n| n == 31)
        })
        .await?;
    let held = held_epochs(&policy.status.and_then(|s| s.rollout).context("rollout")?);
    // Lost beyond the last report, never counted twice.
    assert_eq!(held.values().sum::<u64>(), last + 31);
    ensure!(last + 31 <= 41 + 25 + 31);
    Ok(())
}

#[test]
fn the_failure_draw_is_fixed_and_spread() {
    let counts = (0..6_000).fold([0u32; 7], |mut c, n| {
        c[failures(n, 1, 6) as usize] += 1;
        c
    });
    assert_eq!(counts[0], 0);
    for (k, &c) in counts.iter().enumerate().skip(1) {
        assert!((850..=1150).contains(&c), "{k}: {c}");
    }
}
