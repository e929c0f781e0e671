//! A sidecar may write only its own Lease, on the real API server: the worker RBAC of
//! examples/worker/worker-watch.yaml and the ValidatingAdmissionPolicy of
//! deploy/admission.yaml, exercised with ServiceAccount tokens bound (by TokenRequest) to
//! two Pod objects, as the kubelet would mount them.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use rebound_tests::lease::{
    PREFIX, apply_sidecar_rbac, client_with_token, create_pod, sidecar_lease, token,
};
use rebound_tests::{TestEnv, unique_name};
use serde_json::json;

const SA: &str = "rebound-worker";
const CM: &str = "rebound-policies";
const WAIT: Duration = Duration::from_secs(60);

/// The API's refusal as (HTTP code, Status reason), `None` when the request succeeded.
fn refusal<T>(result: kube::Result<T>) -> Result<Option<(u16, String)>> {
    match result {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(status)) => Ok(Some((status.code, status.reason.clone()))),
        Err(e) => Err(e.into()),
    }
}

fn forbidden() -> Option<(u16, String)> {
    Some((403, "Forbidden".to_owned()))
}

fn dry() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

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
        let own = refusal(as_a.create(&dry(), &lease(&a)).await)?;
        let other = refusal(as_a.create(&dry(), &lease(&b)).await)?;
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
    ensure!(refusal(as_a.create(&dry(), &extra).await)? == forbidden());
    let mut disguised = lease(&a);
    disguised.metadata.name = Some("worker-lock".to_owned());
    ensure!(refusal(as_a.create(&dry(), &disguised).await)? == forbidden());
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

    // The RBAC grants no delete. Granted it anyway (say, a broader Role), the policy still
    // refuses the other Pod's Lease and allows its own.
    let deleter = "lease-deleter";
    Api::<Role>::namespaced(env.client.clone(), ns)
        .create(
            &PostParams::default(),
            &Role {
                metadata: ObjectMeta {
                    name: Some(deleter.to_owned()),
                    ..ObjectMeta::default()
                },
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec!["coordination.k8s.io".to_owned()]),
                    resources: Some(vec!["leases".to_owned()]),
                    verbs: vec!["delete".to_owned()],
                    ..PolicyRule::default()
                }]),
            },
        )
        .await?;
    Api::<RoleBinding>::namespaced(env.client.clone(), ns)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: ObjectMeta {
                    name: Some(deleter.to_owned()),
                    ..ObjectMeta::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".to_owned()),
                    kind: "Role".to_owned(),
                    name: deleter.to_owned(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".to_owned(),
                    name: SA.to_owned(),
                    namespace: Some(ns.to_owned()),
                    ..Subject::default()
                }]),
            },
        )
        .await?;
    let dry_delete = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    let deadline = Instant::now() + WAIT;
    while refusal(as_a.delete("worker-lock", &dry_delete).await)?.is_some() {
        if Instant::now() > deadline {
            bail!("the delete RoleBinding never took effect");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
