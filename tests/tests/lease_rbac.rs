//! A sidecar may write only its own Lease, on the real API server: the worker RBAC of
//! examples/worker/worker-watch.yaml and the ValidatingAdmissionPolicy of
//! deploy/admission.yaml, exercised with ServiceAccount tokens bound (by TokenRequest) to
//! two Pod objects, as the kubelet would mount them.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use rebound_tests::lease::{
    PREFIX, apply_sidecar_rbac, client_with_token, create_pod, dry_run, forbidden, refusal,
    sidecar_lease, token,
};
use rebound_tests::{TestEnv, unique_name};
use serde_json::json;

const SA: &str = "rebound-worker";
const CM: &str = "rebound-policies";
const WAIT: Duration = Duration::from_secs(60);

fn renewal() -> Patch<serde_json::Value> {
    Patch::Merge(json!({"spec": {"renewTime": MicroTime(Timestamp::now())}}))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_may_write_only_its_own_lease() -> Result<()> {
    let env = TestEnv::new("lease-rbac").await?;
    let ns = env.namespace.as_str();
    apply_sidecar_rbac(&env)?;

    let (a, b) = (unique_name("worker-a"), unique_name("worker-b"));
    let pod_a = create_pod(&env.client, ns, &a, SA).await?;
    let pod_b = create_pod(&env.client, ns, &b, SA).await?;
    let as_a: Api<Lease> = Api::namespaced(
        client_with_token(
            env.cluster,
            &token(&env.client, ns, SA, Some(&pod_a)).await?,
        )
        .await?,
        ns,
    );
    let as_b: Api<Lease> = Api::namespaced(
        client_with_token(
            env.cluster,
            &token(&env.client, ns, SA, Some(&pod_b)).await?,
        )
        .await?,
        ns,
    );
    let as_admin: Api<Lease> = Api::namespaced(env.client.clone(), ns);
    let lease = |pod: &str| sidecar_lease(pod, CM, Timestamp::now(), 15);

    // Until the API server has loaded the RBAC and the policy: own allowed, other refused.
    let deadline = Instant::now() + WAIT;
    loop {
        let own = refusal(as_a.create(&dry_run(), &lease(&a)).await)?;
        let other = refusal(as_a.create(&dry_run(), &lease(&b)).await)?;
        if own.is_none() && other == forbidden() {
            break;
        }
        if Instant::now() > deadline {
            bail!("after {WAIT:?}: own Lease {own:?}, the other Pod's {other:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Its own Lease: create, update, patch (a renewal).
    let created = as_a
        .create(&PostParams::default(), &lease(&a))
        .await
        .context("Pod a creating its own Lease")?;
    let mut updated = created.clone();
    if let Some(spec) = updated.spec.as_mut() {
        spec.renew_time = Some(MicroTime(Timestamp::now()));
    }
    as_a.replace(&format!("{PREFIX}{a}"), &PostParams::default(), &updated)
        .await
        .context("Pod a updating its own Lease")?;
    as_a.patch(&format!("{PREFIX}{a}"), &PatchParams::default(), &renewal())
        .await
        .context("Pod a renewing its own Lease")?;

    // The other Pod's Lease: create refused, then (once b holds it) update, patch, delete.
    ensure!(refusal(as_a.create(&PostParams::default(), &lease(&b)).await)? == forbidden());
    let theirs = as_b
        .create(&PostParams::default(), &lease(&b))
        .await
        .context("Pod b creating its own Lease")?;
    let name_b = format!("{PREFIX}{b}");
    ensure!(
        refusal(as_a.replace(&name_b, &PostParams::default(), &theirs).await)? == forbidden(),
        "Pod a updated Pod b's Lease"
    );
    ensure!(
        refusal(
            as_a.patch(&name_b, &PatchParams::default(), &renewal())
                .await
        )? == forbidden(),
        "Pod a patched Pod b's Lease"
    );
    ensure!(
        refusal(as_a.delete(&name_b, &DeleteParams::default()).await)? == forbidden(),
        "Pod a deleted Pod b's Lease"
    );

    // Named or labelled like a sidecar's, under another name: refused. A token of the same
    // ServiceAccount bound to no Pod has no pod name: refused even its "own" Lease.
    let mut extra = lease(&a);
    extra.metadata.name = Some(format!("{PREFIX}{a}-2"));
    ensure!(refusal(as_a.create(&dry_run(), &extra).await)? == forbidden());
    let mut disguised = lease(&a);
    disguised.metadata.name = Some("worker-lock".to_owned());
    ensure!(refusal(as_a.create(&dry_run(), &disguised).await)? == forbidden());
    let unbound: Api<Lease> = Api::namespaced(
        client_with_token(env.cluster, &token(&env.client, ns, SA, None).await?).await?,
        ns,
    );
    ensure!(
        refusal(
            unbound
                .patch(&format!("{PREFIX}{a}"), &PatchParams::default(), &renewal())
                .await
        )? == forbidden()
    );
    // Taking the label off another sidecar's Lease is a write of a sidecar Lease too.
    let unlabel =
        Patch::Merge(json!({"metadata": {"labels": {"app.kubernetes.io/component": null}}}));
    ensure!(refusal(as_a.patch(&name_b, &PatchParams::default(), &unlabel).await)? == forbidden());

    // As designed: a Lease neither named nor labelled like a sidecar's is the worker's own
    // business (RBAC allows Leases in its namespace), and people are not affected.
    let plain = Lease {
        metadata: ObjectMeta {
            name: Some("worker-lock".to_owned()),
            ..ObjectMeta::default()
        },
        ..Lease::default()
    };
    ensure!(refusal(as_a.create(&PostParams::default(), &plain).await)?.is_none());
    ensure!(
        refusal(
            as_admin
                .patch(&name_b, &PatchParams::default(), &renewal())
                .await
        )?
        .is_none()
    );

    // The RBAC grants delete (a sidecar deletes its own Lease when it stops); the policy
    // refuses the other Pod's Lease and allows its own.
    ensure!(refusal(as_a.delete(&name_b, &DeleteParams::default()).await)? == forbidden());
    ensure!(
        refusal(
            as_a.delete(&format!("{PREFIX}{a}"), &DeleteParams::default())
                .await
        )?
        .is_none()
    );
    Ok(())
}

/// The admission policy refuses sidecar Leases whose fields are out of range (what no
/// sidecar writes and typed readers cannot hold), and confines a Pod with a name too long
/// for `rebound-sidecar-<pod>` to the hashed Lease its Pod owns.
#[tokio::test(flavor = "multi_thread")]
async fn sidecar_leases_out_of_range_or_owned_by_another_pod_are_refused() -> Result<()> {
    use k8s_openapi::jiff::SignedDuration;
    use kube::api::{ApiResource, DynamicObject};
    use rebound_sidecar::fleet::membership::lease_name;

    let env = TestEnv::new("lease-range").await?;
    let ns = env.namespace.as_str();
    apply_sidecar_rbac(&env)?;
    let a = unique_name("worker-a");
    let long = |c: char| format!("w-{}", c.to_string().repeat(238));
    let (l1, l2) = (long('x'), long('y'));
    let mut apis = Vec::new();
    let mut uids = Vec::new();
    for pod in [&a, &l1, &l2] {
        let object = create_pod(&env.client, ns, pod, SA).await?;
        uids.push(object.metadata.uid.clone().context("uid")?);
        let client = client_with_token(
            env.cluster,
            &token(&env.client, ns, SA, Some(&object)).await?,
        )
        .await?;
        apis.push(Api::<DynamicObject>::namespaced_with(
            client,
            ns,
            &ApiResource::erase::<Lease>(&()),
        ));
    }
    let lease = |pod: &str, name: &str, owner: Option<&str>, spec: serde_json::Value| {
        let owners: Vec<serde_json::Value> = owner
            .map(|uid| json!({"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}))
            .into_iter()
            .collect();
        serde_json::from_value::<DynamicObject>(json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "labels": rebound_tests::lease::labels(CM),
                         "ownerReferences": owners},
            "spec": spec,
        }))
    };
    let at = |offset_s: i64| MicroTime(Timestamp::now() + SignedDuration::from_secs(offset_s));
    let spec = |renew: serde_json::Value, seconds: i64, holder: &str| json!({"holderIdentity": holder, "leaseDurationSeconds": seconds, "renewTime": renew});
    let own = format!("{PREFIX}{a}");
    let now = serde_json::to_value(at(0))?;

    // Until the API server has loaded the RBAC and the policy: a plain own Lease allowed.
    let deadline = Instant::now() + WAIT;
    while refusal(
        apis[0]
            .create(
                &dry_run(),
                &lease(&a, &own, None, spec(now.clone(), 15, &a))?,
            )
            .await,
    )?
    .is_some()
    {
        ensure!(Instant::now() < deadline, "the own Lease was never allowed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let invalid = Some((422, "Invalid".to_owned()));
    for (what, body) in [
        (
            "renewTime 9999",
            spec(json!("9999-12-31T23:59:59.000000Z"), 15, &a),
        ),
        (
            "renewTime 2 h ahead",
            spec(serde_json::to_value(at(7200))?, 15, &a),
        ),
        ("leaseDurationSeconds 0", spec(now.clone(), 0, &a)),
        (
            "leaseDurationSeconds 100000",
            spec(now.clone(), 100_000, &a),
        ),
        ("another holder", spec(now.clone(), 15, "someone-else")),
    ] {
        let got = refusal(
            apis[0]
                .create(&dry_run(), &lease(&a, &own, None, body)?)
                .await,
        )?;
        ensure!(got == invalid, "{what}: {got:?}");
    }
    let ahead = spec(serde_json::to_value(at(1800))?, 15, &a);
    ensure!(
        refusal(
            apis[0]
                .create(&dry_run(), &lease(&a, &own, None, ahead)?)
                .await
        )?
        .is_none()
    );

    // Long names: the hashed Lease owned by its Pod; not by another Pod's token, nor
    // claimed by one with its own UID.
    let name1 = lease_name(ns, &l1, ns);
    let owned = lease(&l1, &name1, Some(&uids[1]), spec(now.clone(), 15, &l1))?;
    let created = apis[1]
        .create(&PostParams::default(), &owned)
        .await
        .context("the long-named Pod creating its hashed Lease")?;
    ensure!(
        refusal(
            apis[1]
                .create(
                    &dry_run(),
                    &lease(&l1, &name1, None, spec(now.clone(), 15, &l1))?
                )
                .await
        )? == forbidden()
    );
    ensure!(refusal(apis[2].delete(&name1, &DeleteParams::default()).await)? == forbidden());
    let mut claimed = lease(&l2, &name1, Some(&uids[2]), spec(now.clone(), 15, &l2))?;
    claimed.metadata.resource_version = created.metadata.resource_version.clone();
    let got = refusal(
        apis[2]
            .replace(&name1, &PostParams::default(), &claimed)
            .await,
    )?;
    ensure!(
        got == forbidden(),
        "another Pod claiming the Lease: {got:?}"
    );
    ensure!(refusal(apis[1].delete(&name1, &DeleteParams::default()).await)?.is_none());
    Ok(())
}
