//! Fleet membership survives what real clusters do, on the real API server with real
//! `rebound-sidecar` processes in watch mode (docs/sidecar.md, "Fleet-wide retry budgets"):
//! Leases written by hand where other nodes would write them, with clocks 60 s off, with a
//! `renewTime` no typed client can read, and an API server restart (on a cluster of its
//! own). Names, owners and churn are in fleet_churn.rs.

mod fleet_support;

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use fleet_support::{
    LEASE_S, Sidecar, apply_lease, create_configmap, json_logs, renewal, scope, wait_for,
};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use rebound_tests::{DedicatedCluster, TestEnv, repo_root, unique_name};

/// Hand-written peers 60 s behind and 60 s ahead, renewed every second by the test, are
/// counted steadily; the one ahead is counted out within the lease duration of its last
/// renewal, not 60 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_sixty_seconds_off_are_counted_exactly_while_they_renew() -> Result<()> {
    let env = TestEnv::new("fleet-skew").await?;
    create_configmap(&env.client, &env.namespace).await?;
    let skews = [("behind", -60), ("ahead", 60)];
    let (admin, namespace) = (env.client.clone(), env.namespace.clone());
    let renew = move |which: &'static str, skew: i64| {
        let (client, ns) = (admin.clone(), namespace.clone());
        async move {
            let at = Timestamp::now() + SignedDuration::from_secs(skew);
            apply_lease(&client, &ns, which, renewal(which, at, LEASE_S)).await
        }
    };
    for (which, skew) in skews {
        renew(which, skew).await?;
    }
    let sidecar = Sidecar::spawn(env.cluster.kubeconfig(), &env.namespace, "self", &[])?;
    let client = &mut sidecar.connect().await?;
    let ahead = Arc::new(AtomicBool::new(true));
    let renewer = {
        let ahead = Arc::clone(&ahead);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                renew("behind", -60).await?;
                if ahead.load(Ordering::Relaxed) {
                    renew("ahead", 60).await?;
                }
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        })
    };
    wait_for(client, Duration::from_secs(30), |s| s.members == 3).await?;
    let changes_before = sidecar.metric("rebound_sidecar_fleet_membership_changes")?;
    // Steady for 3 lease durations: every sample a current fleet of 3.
    let start = Instant::now();
    let mut samples = 0;
    while start.elapsed() < Duration::from_secs(3 * LEASE_S) {
        let s = scope(client).await?;
        ensure!(s.members == 3 && !s.stale, "sample {samples}: {s:?}");
        samples += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(sidecar.metric("rebound_sidecar_fleet_membership_changes")? == changes_before);

    // The writer ahead stops renewing: out within the lease duration (plus a tick and the
    // polling slack), where a timestamp rule would keep it 60 s longer.
    ahead.store(false, Ordering::Relaxed);
    let stopped = Instant::now();
    wait_for(client, Duration::from_secs(30), |s| s.members == 2).await?;
    let out = stopped.elapsed();
    eprintln!("skew ±60 s: {samples} samples of 3 members; the writer ahead out after {out:?}");
    ensure!(out <= Duration::from_secs(LEASE_S + 2), "out after {out:?}");
    renewer.abort();
    Ok(())
}

/// A Lease whose `renewTime` no typed client can hold (year 9999, accepted by the API
/// server) is skipped with one warning naming it, as is one with an absurd duration; one
/// whose metadata no typed client can hold is read without it; the fleet of the others
/// forms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_no_type_can_hold_is_skipped_alone_with_one_warning() -> Result<()> {
    let env = TestEnv::new("fleet-hostile").await?;
    create_configmap(&env.client, &env.namespace).await?;
    let mut hostile = renewal("hostile", Timestamp::now(), LEASE_S);
    hostile["spec"]["renewTime"] = "9999-12-31T23:59:59.000000Z".into();
    apply_lease(&env.client, &env.namespace, "hostile", hostile.clone()).await?;
    let mut huge = renewal("huge", Timestamp::now(), LEASE_S);
    huge["spec"]["leaseDurationSeconds"] = 2_147_483_647.into();
    apply_lease(&env.client, &env.namespace, "huge", huge).await?;

    // Metadata too: a client may set managedFields, times included.
    let mut meta = renewal("meta", Timestamp::now(), LEASE_S);
    meta["metadata"]["managedFields"] = serde_json::json!([{
        "manager": "someone", "operation": "Update", "apiVersion": "coordination.k8s.io/v1",
        "time": "9999-12-31T23:59:59Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}},
    }]);
    // (kubectl: the typed metadata of a Rust client cannot read the answer either)
    env.kubectl_stdin(
        ["create", "-n", &env.namespace, "-f", "-"],
        &meta.to_string(),
    )?
    .ok()?;

    let mut a = Sidecar::spawn(env.cluster.kubeconfig(), &env.namespace, "a", &[])?;
    let mut b = Sidecar::spawn(env.cluster.kubeconfig(), &env.namespace, "b", &[])?;
    let (ca, cb) = (&mut a.connect().await?, &mut b.connect().await?);
    // The hostile one renews with another extreme time: still one warning.
    hostile["spec"]["renewTime"] = "9999-12-31T23:59:58.000000Z".into();
    apply_lease(&env.client, &env.namespace, "hostile", hostile).await?;
    for c in [ca, cb] {
        wait_for(c, Duration::from_secs(30), |s| s.members == 2).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for s in [&mut a, &mut b] {
        s.stop()?;
        let warned = |lease: &str| {
            json_logs(&s.log).map(|logs| {
                logs.iter()
                    .filter(|l| l["level"] == "WARN" && l["fields"]["lease"] == lease)
                    .count()
            })
        };
        ensure!(
            warned("rebound-sidecar-hostile")? == 1,
            "{}",
            s.log.display()
        );
        ensure!(warned("rebound-sidecar-huge")? == 1, "{}", s.log.display());
    }
    Ok(())
}

/// An API server restart longer than the lease duration: three sidecars keep their fleet
/// of three through the outage and the relist (stale while cut off), never a fleet of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_keeps_its_membership_across_an_api_server_restart() -> Result<()> {
    let state_dir = repo_root()
        .join(".state")
        .join(unique_name("fleet-restart"));
    let cluster = tokio::task::spawn_blocking({
        let state_dir = state_dir.clone();
        move || DedicatedCluster::start(&state_dir)
    })
    .await??;
    let client = cluster.client().await?;
    let ns = cluster.create_namespace(&client, "fleet").await?;
    create_configmap(&client, &ns).await?;
    let mut sidecars = Vec::new();
    let mut clients = Vec::new();
    for pod in ["w-0", "w-1", "w-2"] {
        let s = Sidecar::spawn(cluster.kubeconfig(), &ns, pod, &[])?;
        clients.push(s.connect().await?);
        sidecars.push(s);
    }
    for c in &mut clients {
        wait_for(c, Duration::from_secs(30), |s| s.members == 3).await?;
    }
    // Sample every sidecar through the stop, the outage (longer than a lease) and the
    // start, until all are current again and one more lease duration has passed.
    let sampler = {
        let mut clients = clients.clone();
        tokio::spawn(async move {
            let (mut fewest, mut stale_seen, mut current_since) = (3, false, None::<Instant>);
            loop {
                let mut all_current = true;
                for c in &mut clients {
                    // While the sidecar cannot reach the API it still answers from memory.
                    let s = scope(c).await?;
                    fewest = fewest.min(s.members);
                    stale_seen |= s.stale;
                    all_current &= !s.stale;
                }
                match (all_current && stale_seen, current_since) {
                    (true, None) => current_since = Some(Instant::now()),
                    (true, Some(t)) if t.elapsed() > Duration::from_secs(LEASE_S) => {
                        return anyhow::Ok((fewest, stale_seen));
                    }
                    (false, _) => current_since = None,
                    _ => {}
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let outage = Instant::now();
    tokio::task::block_in_place(|| -> Result<()> {
        cluster.stop_apiserver()?;
        std::thread::sleep(Duration::from_secs(LEASE_S + 2));
        cluster.start_apiserver()
    })?;
    eprintln!("API server back after {:?}", outage.elapsed());
    let (fewest, stale_seen) = tokio::time::timeout(Duration::from_secs(60), sampler).await???;
    eprintln!("restart: fewest members seen {fewest}, stale seen {stale_seen}");
    ensure!(stale_seen, "the outage was noticed");
    ensure!(fewest == 3, "a sidecar dropped to a fleet of {fewest}");
    drop(sidecars);
    Ok(())
}

/// A sidecar whose connection to the API server hangs silently (a proxy drops its packets,
/// no RST) cannot renew its Lease: it says its membership is stale within 10 s and keeps
/// the last one, its peer counts it out once its Lease expires, and both count two again
/// within 5 s of the traffic returning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_connection_turns_membership_stale_and_back() -> Result<()> {
    use rebound_tests::proxy::{Proxy, api_server_addr, kubeconfig_through};
    let env = TestEnv::new("fleet-hang").await?;
    create_configmap(&env.client, &env.namespace).await?;
    let proxy = Proxy::start(api_server_addr(env.cluster)?).await?;
    let tmp = tempfile::tempdir()?;
    let through = kubeconfig_through(env.cluster, proxy.addr(), tmp.path())?;
    let direct = Sidecar::spawn(env.cluster.kubeconfig(), &env.namespace, "w-direct", &[])?;
    let hung = Sidecar::spawn(&through, &env.namespace, "w-hung", &[])?;
    let (mut a, mut b) = (direct.connect().await?, hung.connect().await?);
    for c in [&mut a, &mut b] {
        wait_for(c, Duration::from_secs(30), |s| s.members == 2).await?;
    }

    let cut = Instant::now();
    proxy.blackhole(true);
    let mut noticed = None;
    let mut counted_out = None;
    while (noticed.is_none() || counted_out.is_none()) && cut.elapsed() < Duration::from_secs(20) {
        let (sa, sb) = (scope(&mut a).await?, scope(&mut b).await?);
        if noticed.is_none() && sb.stale {
            ensure!(
                sb.members == 2,
                "the stale sidecar kept its last membership: {sb:?}"
            );
            noticed = Some(cut.elapsed());
        }
        if counted_out.is_none() && !sa.stale && sa.members == 1 {
            counted_out = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("hang: stale after {noticed:?}, counted out by its peer after {counted_out:?}");
    ensure!(
        noticed.is_some_and(|t| t <= Duration::from_secs(10)),
        "the hung sidecar said stale after {noticed:?}"
    );
    ensure!(counted_out.is_some(), "its peer still counts it");

    tokio::time::sleep(Duration::from_secs(15).saturating_sub(cut.elapsed())).await;
    proxy.blackhole(false);
    let back = Instant::now();
    wait_for(&mut b, Duration::from_secs(30), |s| s.members == 2).await?;
    wait_for(&mut a, Duration::from_secs(30), |s| s.members == 2).await?;
    let took = back.elapsed();
    eprintln!("hang: both count two {took:?} after the traffic returned");
    ensure!(
        took <= Duration::from_secs(5),
        "back after {took:?} (> 5 s)"
    );
    Ok(())
}
