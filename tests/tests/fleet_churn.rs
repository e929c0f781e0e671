//! Sidecar Leases come and go with their Pods, on the real API server with real
//! `rebound-sidecar` processes: named uniquely per Pod and namespace and always validly
//! (a 240-character Pod name included), owned by their Pod (the garbage collector, absent
//! from the test cluster, deletes them with it: the owner reference is read), deleted by
//! the sidecar on SIGTERM; and 1,000 churned Pod names leave the Lease count and what a
//! sidecar walks to judge membership bounded.

mod fleet_support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use fleet_support::{
    LEASE_S, Sidecar, apply_lease, create_configmap, pod_kubeconfig, renewal, sidecar_leases,
    wait_for,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams};
use rebound_sidecar::fleet::membership::lease_name;
use rebound_tests::TestEnv;
use rebound_tests::lease::apply_sidecar_rbac;

const SA: &str = "rebound-worker";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_named_per_pod_owned_by_it_and_deleted_on_the_way_out() -> Result<()> {
    let env = TestEnv::new("fleet-owned").await?;
    let ns = env.namespace.as_str();
    apply_sidecar_rbac(&env)?;
    create_configmap(&env.client, ns).await?;
    // A Pod name of 240 characters: `rebound-sidecar-<name>` would be 256.
    let long = format!("w-{}", "x".repeat(238));
    let mut sidecars = Vec::new();
    let mut uids = Vec::new();
    for pod in ["w-0", long.as_str()] {
        let (kubeconfig, uid) = pod_kubeconfig(env.cluster, &env.client, ns, pod, SA).await?;
        sidecars.push(Sidecar::spawn(&kubeconfig, ns, pod, &[("POD_UID", &uid)])?);
        uids.push(uid);
    }
    for s in &sidecars {
        let c = &mut s.connect().await?;
        wait_for(c, Duration::from_secs(30), |s| s.members == 2).await?;
    }
    let api: Api<Lease> = Api::namespaced(env.client.clone(), ns);
    for (s, uid) in sidecars.iter().zip(&uids) {
        let name = lease_name(ns, &s.pod, ns);
        ensure!(name.len() <= 253, "{name}");
        let lease = api.get(&name).await.with_context(|| name.clone())?;
        let owners = lease.metadata.owner_references.unwrap_or_default();
        ensure!(owners.len() == 1, "{name}: {owners:?}");
        ensure!(
            owners[0].kind == "Pod" && owners[0].name == s.pod && &owners[0].uid == uid,
            "{name}: {owners:?}"
        );
    }
    ensure!(
        lease_name(ns, "w-0", ns) == "rebound-sidecar-w-0",
        "short names readable"
    );

    // SIGTERM: each deletes its own Lease; the other counts it out at once.
    let mut first = sidecars.remove(0);
    first.stop()?;
    let c = &mut sidecars[0].connect().await?;
    let stopped = Instant::now();
    wait_for(c, Duration::from_secs(30), |s| s.members == 1).await?;
    ensure!(
        stopped.elapsed() < Duration::from_secs(LEASE_S),
        "{:?}",
        stopped.elapsed()
    );
    sidecars[0].stop()?;
    let left = sidecar_leases(&env.client, ns).await?;
    ensure!(left.is_empty(), "Leases left behind: {left:?}");
    Ok(())
}

/// `team-a/w-0` and `team-b/w-0` serving one ConfigMap hold two Leases, not one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_the_same_name_in_two_namespaces_are_two_members() -> Result<()> {
    let env = TestEnv::new("fleet-two-ns").await?;
    let ns = env.namespace.as_str();
    create_configmap(&env.client, ns).await?;
    let kubeconfig = env.cluster.kubeconfig();
    let a = Sidecar::spawn(kubeconfig, ns, "w-0", &[("POD_NAMESPACE", ns)])?;
    let b = Sidecar::spawn(kubeconfig, ns, "w-0", &[("POD_NAMESPACE", "team-b")])?;
    let mut members = Vec::new();
    for s in [&a, &b] {
        let c = &mut s.connect().await?;
        members.push(
            wait_for(c, Duration::from_secs(30), |s| s.members == 2)
                .await?
                .member,
        );
    }
    members.sort_unstable();
    ensure!(members == [0, 1], "{members:?}");
    Ok(())
}

/// 1,000 Pod names come and go (their Leases written, then deleted as the garbage
/// collector deletes them with their Pods, ten at a time): a sidecar watching them ends
/// with only its own Lease, having remembered at most the few alive at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_churned_pod_names_leave_leases_and_evaluation_bounded() -> Result<()> {
    const PODS: usize = 1_000;
    const AT_ONCE: usize = 10;
    let env = TestEnv::new("fleet-churn").await?;
    let ns = env.namespace.as_str();
    create_configmap(&env.client, ns).await?;
    let sidecar = Sidecar::spawn(env.cluster.kubeconfig(), ns, "stays", &[])?;
    let c = &mut sidecar.connect().await?;
    wait_for(c, Duration::from_secs(30), |s| s.members == 1).await?;
    let api: Api<Lease> = Api::namespaced(env.client.clone(), ns);
    let counted = |state| sidecar.metric_with("rebound_sidecar_fleet_leases", &[("state", state)]);
    let (mut most_seen, mut most_live) = (0.0_f64, 0.0_f64);
    let start = Instant::now();
    for batch in 0..PODS / AT_ONCE {
        let pods: Vec<String> = (0..AT_ONCE)
            .map(|i| format!("churn-{}", batch * AT_ONCE + i))
            .collect();
        let mut writes = tokio::task::JoinSet::new();
        for pod in pods.clone() {
            let (client, ns) = (env.client.clone(), ns.to_owned());
            writes.spawn(async move {
                let lease = renewal(&pod, Timestamp::now(), LEASE_S);
                apply_lease(&client, &ns, &pod, lease).await
            });
        }
        while let Some(done) = writes.join_next().await {
            done??;
        }
        let mut deletes = tokio::task::JoinSet::new();
        for pod in pods {
            let api = api.clone();
            deletes.spawn(async move {
                let name = format!("rebound-sidecar-{pod}");
                api.delete(&name, &DeleteParams::default()).await.map(drop)
            });
        }
        while let Some(done) = deletes.join_next().await {
            done??;
        }
        most_seen = most_seen.max(counted("seen")?);
        most_live = most_live.max(counted("live")?);
    }
    let churned = start.elapsed();
    // The watch catches up with the last deletes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while counted("seen")? > 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (end_seen, end_live) = (counted("seen")?, counted("live")?);
    let leases = sidecar_leases(&env.client, ns).await?.len();
    eprintln!(
        "{PODS} Pod names churned in {churned:?}: at most {most_seen} Leases remembered, \
         {most_live} walked; at the end {end_seen} / {end_live}, {leases} Lease(s) in the API"
    );
    ensure!(leases == 1, "{leases} Leases in the API");
    ensure!(
        end_seen <= 1.0 && end_live <= 1.0,
        "{end_seen} / {end_live}"
    );
    ensure!(
        most_seen <= (3 * AT_ONCE) as f64 && most_live <= (3 * AT_ONCE) as f64,
        "{most_seen} / {most_live}"
    );
    ensure!(
        wait_for(c, Duration::from_secs(10), |s| s.members == 1)
            .await
            .is_ok()
    );
    Ok(())
}

/// Where the RBAC grants no `delete` (a Role from before it did), a stopping sidecar
/// releases its Lease instead (no holder), and the others count it out just as fast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_delete_a_stopping_sidecar_releases_its_lease() -> Result<()> {
    let env = TestEnv::new("fleet-release").await?;
    let ns = env.namespace.as_str();
    apply_sidecar_rbac(&env)?;
    create_configmap(&env.client, ns).await?;
    let sa = "no-delete";
    let rbac = format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {sa}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: {sa}}}\nrules:\n\
         - {{apiGroups: [\"\"], resources: [configmaps], verbs: [get, list, watch]}}\n\
         - {{apiGroups: [coordination.k8s.io], resources: [leases], verbs: [get, list, watch, create, update, patch]}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: {sa}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: {sa}}}\n\
         subjects: [{{kind: ServiceAccount, name: {sa}, namespace: {ns}}}]\n"
    );
    env.kubectl_stdin(["apply", "-n", ns, "-f", "-"], &rbac)?
        .ok()?;
    let (kubeconfig, uid) = pod_kubeconfig(env.cluster, &env.client, ns, "w-0", sa).await?;
    let mut leaving = Sidecar::spawn(&kubeconfig, ns, "w-0", &[("POD_UID", &uid)])?;
    let staying = Sidecar::spawn(env.cluster.kubeconfig(), ns, "w-1", &[])?;
    let c = &mut staying.connect().await?;
    // Until the RBAC has reached the API server's cache, w-0 may not renew yet.
    wait_for(
        &mut leaving.connect().await?,
        Duration::from_secs(60),
        |s| s.members == 2,
    )
    .await?;
    wait_for(c, Duration::from_secs(30), |s| s.members == 2).await?;
    leaving.stop()?;
    let stopped = Instant::now();
    wait_for(c, Duration::from_secs(30), |s| s.members == 1).await?;
    ensure!(
        stopped.elapsed() < Duration::from_secs(LEASE_S),
        "{:?}",
        stopped.elapsed()
    );
    let lease = Api::<Lease>::namespaced(env.client.clone(), ns)
        .get("rebound-sidecar-w-0")
        .await
        .context("the released Lease stays (no delete)")?;
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    ensure!(holder.is_empty(), "holder {holder:?}");
    Ok(())
}
