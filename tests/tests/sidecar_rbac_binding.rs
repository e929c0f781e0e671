//! The sidecars' RBAC appears without YAML, on the real API server: the operator, running
//! as its ServiceAccount with the RBAC of deploy/rbac.yaml, binds the sidecar ClusterRole
//! in a namespace with an injected Pod and in one with a RetryPolicy (not in one with
//! neither, nor in its own); a Pod-bound token there reads only its namespace's compiled ConfigMap and
//! writes only its own Lease; and the operator's ServiceAccount can bind nothing else.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding, RoleRef, Subject};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use rebound_test_support::{free_port, workspace_binary};
use rebound_tests::lease::{
    client_with_token, create_labelled_pod, dry_run, forbidden, refusal, sidecar_lease, token,
};
use rebound_tests::process::Running;
use rebound_tests::{TestEnv, repo_root, unique_name};
use serde_json::Value;

const OPERATOR_NS: &str = "rebound-system";
const OPERATOR_SA: &str = "rebound-operator";
const ROLE: &str = "rebound-sidecar";
const CM: &str = "rebound-policies";
const WAIT: Duration = Duration::from_secs(60);
/// The label injection leaves on a Pod.
const INJECTED: &[(&str, &str)] = &[("rebound.dev/injected", "true")];

/// The shared cluster's kubeconfig with its user replaced by the bearer `token`.
fn token_kubeconfig(env: &TestEnv, token: &str) -> Result<PathBuf> {
    let text = std::fs::read_to_string(env.cluster.kubeconfig())?;
    let mut config: Value = serde_saphyr::from_str(&text).context("parsing the kubeconfig")?;
    let user = config["users"][0]
        .as_object_mut()
        .context("the kubeconfig has no user")?;
    user.insert("user".to_owned(), serde_json::json!({ "token": token }));
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.kubeconfig", unique_name("operator-sa")));
    std::fs::write(&path, serde_json::to_string(&config)?)?;
    Ok(path)
}

/// The operator, watching `namespaces`, as if its Pod ran in `own`.
fn spawn_operator(kubeconfig: &PathBuf, own: &str, namespaces: &[&str]) -> Result<Running> {
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.log", unique_name("rebound-operator")));
    let child = Command::new(workspace_binary("rebound-operator")?)
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAMESPACE", own)
        .args([
            format!("--namespaces={}", namespaces.join(",")),
            "--leader-elect=false".to_owned(),
            format!("--metrics-addr={}", free_port()?),
            format!("--sidecar-cluster-role={ROLE}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("starting rebound-operator (log {})", log.display()))?;
    Ok(Running(child))
}

fn configmap(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    }
}

fn role_binding(name: &str, role: &str, subject: Subject) -> RoleBinding {
    RoleBinding {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "ClusterRole".to_owned(),
            name: role.to_owned(),
        },
        subjects: Some(vec![subject]),
    }
}

fn group(name: &str) -> Subject {
    Subject {
        api_group: Some("rbac.authorization.k8s.io".to_owned()),
        kind: "Group".to_owned(),
        name: name.to_owned(),
        ..Subject::default()
    }
}

/// Polls until `ns` has the RoleBinding; returns it.
async fn wait_for_binding(client: &kube::Client, ns: &str) -> Result<RoleBinding> {
    let api: Api<RoleBinding> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(found) = api.get_opt(ROLE).await? {
            return Ok(found);
        }
        if Instant::now() > deadline {
            bail!("no RoleBinding {ROLE} in {ns} after {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn ensure_binds_sidecars(binding: &RoleBinding, ns: &str) -> Result<()> {
    ensure!(binding.role_ref.kind == "ClusterRole" && binding.role_ref.name == ROLE);
    let subjects = binding.subjects.clone().unwrap_or_default();
    ensure!(
        subjects.len() == 1
            && subjects[0].kind == "Group"
            && subjects[0].name == format!("system:serviceaccounts:{ns}"),
        "{ns}: subjects {subjects:?}"
    );
    let managers: Vec<_> = binding
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|f| f.manager.clone())
        .collect();
    ensure!(
        managers == ["rebound-operator"],
        "{ns}: managers {managers:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_binds_the_sidecar_role_where_sidecars_live() -> Result<()> {
    let env = TestEnv::new("bind-pods").await?;
    let client = &env.client;
    let with_pod = env.namespace.clone();
    let with_policy = env.cluster.create_namespace(client, "bind-policy").await?;
    let neither = env.cluster.create_namespace(client, "bind-none").await?;
    let own = env.cluster.create_namespace(client, "bind-own").await?;
    for file in ["deploy/rbac.yaml", "deploy/admission.yaml"] {
        let path = repo_root().join(file);
        env.cluster
            .kubectl(["apply", "--server-side", "-f", &path.to_string_lossy()])?
            .ok()?;
    }

    // In the operator's own namespace, there before it starts (so in its first list, ahead
    // of every event below): never bound.
    let (a, b) = (unique_name("worker-a"), unique_name("worker-b"));
    create_labelled_pod(client, &own, &a, "worker", INJECTED).await?;

    // The operator as its ServiceAccount: what deploy/rbac.yaml grants, nothing more.
    let operator_token = token(client, OPERATOR_NS, OPERATOR_SA, None).await?;
    let kubeconfig = token_kubeconfig(&env, &operator_token)?;
    let _operator = spawn_operator(
        &kubeconfig,
        &own,
        &[&with_pod, &with_policy, &neither, &own],
    )?;

    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("worker".to_owned()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    Api::<ServiceAccount>::namespaced(client.clone(), &with_pod)
        .create(&PostParams::default(), &sa)
        .await?;
    let pod_a = create_labelled_pod(client, &with_pod, &a, "worker", INJECTED).await?;
    create_labelled_pod(client, &with_pod, &b, "worker", INJECTED).await?;
    let policy = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: orders}\nspec:\n  queues: [orders]\n  backoff: {strategy: constant, base: 1s, jitter: {kind: none}}\n  maxAttempts: 5\n";
    env.cluster
        .kubectl_stdin(["-n", &with_policy, "apply", "-f", "-"], policy)?
        .ok()?;

    ensure_binds_sidecars(&wait_for_binding(client, &with_pod).await?, &with_pod)?;
    ensure_binds_sidecars(&wait_for_binding(client, &with_policy).await?, &with_policy)?;
    for ns in [&neither, &own] {
        let none = Api::<RoleBinding>::namespaced(client.clone(), ns)
            .get_opt(ROLE)
            .await?;
        ensure!(none.is_none(), "a RoleBinding in {ns}");
    }

    // A Pod-bound token of the worker's ServiceAccount, as the injected sidecar gets it.
    for name in [CM, "app-settings"] {
        Api::<ConfigMap>::namespaced(client.clone(), &with_pod)
            .create(&PostParams::default(), &configmap(name))
            .await?;
    }
    let as_pod = client_with_token(
        env.cluster,
        &token(client, &with_pod, "worker", Some(&pod_a)).await?,
    )
    .await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(as_pod.clone(), &with_pod);
    let leases: Api<Lease> = Api::namespaced(as_pod.clone(), &with_pod);
    let lease = |pod: &str| sidecar_lease(pod, CM, Timestamp::now(), 15);
    // Until the API server has loaded the RBAC and the policies: own Lease allowed, other refused.
    let deadline = Instant::now() + WAIT;
    loop {
        let own = refusal(leases.create(&dry_run(), &lease(&a)).await)?;
        let other = refusal(leases.create(&dry_run(), &lease(&b)).await)?;
        if own.is_none() && other == forbidden() {
            break;
        }
        if Instant::now() > deadline {
            bail!("after {WAIT:?}: own Lease {own:?}, the other Pod's {other:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ensure!(refusal(configmaps.get(CM).await)?.is_none());
    ensure!(refusal(configmaps.get("app-settings").await)? == forbidden());
    let elsewhere: Api<ConfigMap> = Api::namespaced(as_pod.clone(), &with_policy);
    ensure!(refusal(elsewhere.get(CM).await)? == forbidden());
    let leases_elsewhere: Api<Lease> = Api::namespaced(as_pod.clone(), &with_policy);
    ensure!(refusal(leases_elsewhere.create(&dry_run(), &lease(&a)).await)? == forbidden());
    leases
        .create(&PostParams::default(), &lease(&a))
        .await
        .context("the Pod creating its own Lease")?;

    // The operator's ServiceAccount: the one RoleBinding, nothing else.
    let as_operator = client_with_token(env.cluster, &operator_token).await?;
    let bindings: Api<RoleBinding> = Api::namespaced(as_operator.clone(), &neither);
    let own_group = group(&format!("system:serviceaccounts:{neither}"));
    let attempts = [
        (
            "cluster-admin",
            role_binding("escalate", "cluster-admin", own_group.clone()),
        ),
        ("admin", role_binding(ROLE, "admin", own_group.clone())),
        // Permissions it holds itself: RBAC would allow it; the admission policy does not.
        (
            "its own role",
            role_binding("own", OPERATOR_SA, own_group.clone()),
        ),
        (
            "another subject",
            role_binding(ROLE, ROLE, group("system:authenticated")),
        ),
        (
            "another name",
            role_binding("sidecar-2", ROLE, own_group.clone()),
        ),
    ];
    // Until the API server has loaded the policy of deploy/rbac.yaml.
    let deadline = Instant::now() + WAIT;
    while refusal(bindings.create(&dry_run(), &attempts[2].1).await)? != forbidden() {
        if Instant::now() > deadline {
            bail!("the RoleBinding admission policy never took effect");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (what, attempt) in &attempts {
        ensure!(
            refusal(bindings.create(&dry_run(), attempt).await)? == forbidden(),
            "the operator's ServiceAccount bound {what}"
        );
    }
    let cluster_wide = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(unique_name("escalate")),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "ClusterRole".to_owned(),
            name: ROLE.to_owned(),
        },
        subjects: Some(vec![own_group.clone()]),
    };
    ensure!(
        refusal(
            Api::<ClusterRoleBinding>::all(as_operator.clone())
                .create(&dry_run(), &cluster_wide)
                .await
        )? == forbidden()
    );
    // The one it keeps is allowed (the control for the refusals above).
    let allowed = role_binding(ROLE, ROLE, own_group);
    ensure!(refusal(bindings.create(&dry_run(), &allowed).await)?.is_none());
    Ok(())
}
