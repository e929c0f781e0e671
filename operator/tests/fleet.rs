//! The status summary shows a retry budget as the fleet sees it: shared by the live
//! sidecar Leases of the namespace that serve its ConfigMap. Leases are created directly,
//! as sidecars write them; the resync is an hour, so only Lease events and the operator's
//! liveness timer can move the figure.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use rebound_policy::RetryPolicy;
use rebound_tests::TestEnv;
use rebound_tests::lease::{PREFIX, sidecar_lease};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
const BUDGET: &str = "500/s, burst 50 (100ms slots)";

const POLICIES: &str = "\
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: orders}
spec:
  queues: [orders]
  retryBudget: {ratePerSecond: 500, burst: 50}
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata: {name: emails}
spec:
  queues: [emails]
";

/// The retry budget the orders policy's summary shows now.
async fn budget_summary(api: &Api<RetryPolicy>) -> Result<Option<String>> {
    let policy = api.get("orders").await?;
    Ok(policy
        .status
        .and_then(|s| s.summary)
        .and_then(|s| s.retry_budget))
}

/// Waits until the orders policy's summary shows `budget`.
async fn budget_shown(client: &kube::Client, ns: &str, budget: &str) -> Result<()> {
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    eventually(&format!("retryBudget {budget:?}"), WAIT, || async {
        let shown = budget_summary(&api).await?;
        Ok((shown.as_deref() == Some(budget)).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_summary_counts_live_sidecar_leases() -> Result<()> {
    let env = TestEnv::new("op-fleet").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h"]))?;
    env.kubectl_stdin(["apply", "-f", "-"], POLICIES)?.ok()?;
    converged(client, ns, WAIT).await?;

    // No sidecar Leases: each sidecar enforces the budget alone (file mode).
    budget_shown(
        client,
        ns,
        &format!("{BUDGET} per sidecar (no sidecar Leases)"),
    )
    .await?;

    // Three live sidecars; beside them Leases that do not count: another ConfigMap's, a
    // released one (no holder), and a Lease that is no sidecar's.
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let create = |lease: Lease| {
        let leases = leases.clone();
        async move { leases.create(&PostParams::default(), &lease).await }
    };
    create(sidecar_lease("a", CM, Timestamp::now(), 3600)).await?;
    create(sidecar_lease("b", CM, Timestamp::now(), 3600)).await?;
    create(sidecar_lease("c", CM, Timestamp::now(), 3600)).await?;
    create(sidecar_lease("d", "other-policies", Timestamp::now(), 3600)).await?;
    let mut released = sidecar_lease("e", CM, Timestamp::now(), 3600);
    if let Some(spec) = released.spec.as_mut() {
        spec.holder_identity = None;
    }
    create(released).await?;
    let mut plain = sidecar_lease("f", CM, Timestamp::now(), 3600);
    plain.metadata.labels = None;
    create(plain).await?;
    budget_shown(client, ns, &format!("{BUDGET} for 3 sidecars")).await?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let emails = api.get("emails").await?.status.and_then(|s| s.summary);
    ensure!(
        emails.is_some_and(|s| s.retry_budget.is_none()),
        "a policy without a budget shows none"
    );

    // At rest, renewals included: no write at all (statuses, events, ConfigMaps).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = op.writes()?;
    for _ in 0..3 {
        for pod in ["a", "b", "c"] {
            let renewal = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
            leases
                .patch(
                    &format!("{PREFIX}{pod}"),
                    &PatchParams::default(),
                    &Patch::Merge(renewal),
                )
                .await?;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    ensure!(
        op.writes()? == before,
        "writes at rest: {} → {}",
        before,
        op.writes()?
    );

    // c renews once more, now with a 3 s lease, and stops. The update itself leaves it
    // live; its expiry three seconds later is no event, only the timer sees it.
    let stale =
        json!({"spec": {"renewTime": MicroTime(Timestamp::now()), "leaseDurationSeconds": 3}});
    leases
        .patch(
            &format!("{PREFIX}c"),
            &PatchParams::default(),
            &Patch::Merge(stale),
        )
        .await?;
    budget_shown(client, ns, &format!("{BUDGET} for 2 sidecars")).await?;

    // Every Lease gone: back to per sidecar.
    for pod in ["a", "b", "c", "d", "e", "f"] {
        leases
            .delete(&format!("{PREFIX}{pod}"), &DeleteParams::default())
            .await?;
    }
    budget_shown(
        client,
        ns,
        &format!("{BUDGET} per sidecar (no sidecar Leases)"),
    )
    .await?;

    // Each change (at least 0 → 3, 3 → 2, 2 → 0; the first Leases may have been seen one
    // by one) was announced on the budgeted policy, none on the other. Events are
    // published in the background: the last may trail the status.
    let seen = eventually("3 SidecarsChanged events for orders", WAIT, || async {
        let seen = events(client, ns).await?;
        let changes: i32 = seen
            .iter()
            .filter(|e| e.reason == "SidecarsChanged" && e.regarding == "orders")
            .map(|e| e.count)
            .sum();
        Ok((changes >= 3).then_some(seen))
    })
    .await?;
    ensure!(
        !seen
            .iter()
            .any(|e| e.reason == "SidecarsChanged" && e.regarding == "emails"),
        "the policy without a budget got a SidecarsChanged event"
    );
    ensure!(op.warnings()?.is_empty(), "{}", op.log_tail());
    Ok(())
}

/// Sidecar Leases the API server accepts but no typed client can hold (`renewTime`, or a
/// `managedFields` time, in year 9999) do not stop the operator counting the others.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_no_type_can_hold_does_not_stop_the_count() -> Result<()> {
    let env = TestEnv::new("op-fleet-hostile").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let hostile = format!(
        "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata:\n  name: {PREFIX}hostile\n  labels: {{app.kubernetes.io/name: rebound, app.kubernetes.io/component: sidecar, rebound.dev/configmap: {CM}}}\nspec:\n  holderIdentity: hostile\n  leaseDurationSeconds: 15\n  renewTime: \"9999-12-31T23:59:59.000000Z\"\n"
    );
    env.kubectl_stdin(["apply", "-n", ns, "-f", "-"], &hostile)?
        .ok()?;
    // Metadata too: a client may set managedFields, times included.
    let meta = format!(
        "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata:\n  name: {PREFIX}meta\n  labels: {{app.kubernetes.io/name: rebound, app.kubernetes.io/component: sidecar, rebound.dev/configmap: other}}\n  managedFields: [{{manager: someone, operation: Update, apiVersion: coordination.k8s.io/v1, time: \"9999-12-31T23:59:59Z\", fieldsType: FieldsV1, fieldsV1: {{f:spec: {{}}}}}}]\nspec: {{holderIdentity: meta, leaseDurationSeconds: 15}}\n"
    );
    env.kubectl_stdin(["create", "-n", ns, "-f", "-"], &meta)?
        .ok()?;
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h"]))?;
    env.kubectl_stdin(["apply", "-f", "-"], POLICIES)?.ok()?;
    converged(client, ns, WAIT).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    for pod in ["a", "b"] {
        let lease = sidecar_lease(pod, CM, Timestamp::now(), 3600);
        leases.create(&PostParams::default(), &lease).await?;
    }
    budget_shown(client, ns, &format!("{BUDGET} for 2 sidecars")).await
}

/// Renews the sidecar Leases `pods` every second, each stamped with the test's clock
/// shifted by its skew, until dropped.
struct Renewals(tokio::task::JoinHandle<()>);

impl Renewals {
    fn start(leases: Api<Lease>, pods: &'static [(&'static str, i64)]) -> Renewals {
        Renewals(tokio::spawn(async move {
            loop {
                for (pod, skew) in pods {
                    let Ok(at) = Timestamp::now().checked_add(SignedDuration::from_secs(*skew))
                    else {
                        return;
                    };
                    let renewal = json!({"spec": {"renewTime": MicroTime(at)}});
                    let name = format!("{PREFIX}{pod}");
                    // A failed renewal is a missed one, as for a sidecar.
                    let _ = leases
                        .patch(&name, &PatchParams::default(), &Patch::Merge(renewal))
                        .await;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }))
    }
}

impl Drop for Renewals {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sidecars on nodes whose clocks are a minute behind and a minute ahead of the
/// operator's are counted exactly while they renew: liveness is judged by when the
/// operator saw a Lease change, never by comparing its `renewTime` with the local clock.
#[tokio::test(flavor = "multi_thread")]
async fn sidecars_with_skewed_clocks_count_while_they_renew() -> Result<()> {
    const LEASE_S: i32 = 8;
    const SKEWED: &[(&str, i64)] = &[("behind", -60), ("ahead", 60)];
    let env = TestEnv::new("op-fleet-skew").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1h"]))?;
    env.kubectl_stdin(["apply", "-f", "-"], POLICIES)?.ok()?;
    converged(client, ns, WAIT).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    for (pod, skew) in SKEWED {
        let at = Timestamp::now().checked_add(SignedDuration::from_secs(*skew))?;
        let lease = sidecar_lease(pod, CM, at, LEASE_S);
        leases.create(&PostParams::default(), &lease).await?;
    }
    let renewals = Renewals::start(leases.clone(), SKEWED);

    // Both counted, and still both after renewing for twice the lease duration.
    let both = format!("{BUDGET} for 2 sidecars");
    budget_shown(client, ns, &both).await?;
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    for _ in 0..2 * LEASE_S {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let shown = budget_summary(&api).await?;
        ensure!(shown.as_deref() == Some(both.as_str()), "shown {shown:?}");
    }

    // Renewals stop: both are counted out about a lease duration later (plus the
    // operator's one-second tick and the status write), not the skew later.
    drop(renewals);
    let stopped = std::time::Instant::now();
    budget_shown(
        client,
        ns,
        &format!("{BUDGET} per sidecar (no sidecar Leases)"),
    )
    .await?;
    let took = stopped.elapsed();
    let bound = Duration::from_secs(LEASE_S as u64 + 10);
    ensure!(took < bound, "counted out {took:?} after the last renewal");
    println!("counted out {took:?} after the last renewal (lease {LEASE_S} s)");
    Ok(())
}
