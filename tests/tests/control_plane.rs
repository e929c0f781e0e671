//! The test control plane itself: kube-rs talks to it, RBAC is enforced for users with
//! minted client certificates, and the version is the one the binaries were built for.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ListParams, PostParams};
use rebound_tests::{TestEnv, client_from_kubeconfig, retry_policy_resource};

#[tokio::test]
async fn kube_client_reaches_the_api_server() {
    let env = TestEnv::new("cp-client").await.expect("test env");
    let version = env.client.apiserver_version().await.expect("GET /version");
    assert_eq!(version.major, "1");
    assert!(
        version.git_version.starts_with("v1."),
        "unstamped version: {version:?}"
    );

    // A namespaced write and read through the client.
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let cm = ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some("probe".into()),
            ..Default::default()
        },
        data: Some([("k".to_string(), "v".to_string())].into()),
        ..Default::default()
    };
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create a ConfigMap");
    let got = cms.get("probe").await.expect("read the ConfigMap");
    assert_eq!(
        got.data.and_then(|d| d.get("k").cloned()).as_deref(),
        Some("v")
    );
}

#[tokio::test]
async fn kubectl_and_kube_rs_report_the_same_server_version() {
    let env = TestEnv::new("cp-version").await.expect("test env");
    let out = env
        .cluster
        .kubectl(["version", "-o", "json"])
        .expect("run kubectl")
        .ok()
        .expect("kubectl version");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("kubectl version json");
    let from_rs = env.client.apiserver_version().await.expect("version");
    assert_eq!(v["serverVersion"]["gitVersion"], from_rs.git_version);
}

#[tokio::test]
async fn minted_service_account_user_is_subject_to_rbac() {
    let env = TestEnv::new("cp-rbac").await.expect("test env");
    if env.cluster.state_dir().is_none() {
        eprintln!("skipped: REBOUND_KUBECONFIG is set, the CA key is not available");
        return;
    }
    let ns = env.namespace.as_str();
    let user = format!("system:serviceaccount:{ns}:reader");
    let groups = [
        "system:serviceaccounts".to_string(),
        format!("system:serviceaccounts:{ns}"),
    ];
    let group_refs: Vec<&str> = groups.iter().map(String::as_str).collect();
    let kubeconfig = env
        .cluster
        .mint_user_kubeconfig(&user, &group_refs)
        .expect("mint a kubeconfig");
    let client = client_from_kubeconfig(&kubeconfig)
        .await
        .expect("client for the minted user");
    let api: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client, ns, &retry_policy_resource());

    let err = api
        .list(&ListParams::default())
        .await
        .expect_err("listing without a RoleBinding must be forbidden");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "expected 403, got {err:?}"
    );

    let rbac = format!(
        r#"{{"apiVersion":"v1","kind":"List","items":[
  {{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"Role","metadata":{{"name":"rp-reader"}},
    "rules":[{{"apiGroups":["rebound.dev"],"resources":["retrypolicies"],"verbs":["get","list","watch"]}}]}},
  {{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding","metadata":{{"name":"rp-reader"}},
    "roleRef":{{"apiGroup":"rbac.authorization.k8s.io","kind":"Role","name":"rp-reader"}},
    "subjects":[{{"kind":"ServiceAccount","name":"reader","namespace":"{ns}"}}]}}]}}"#
    );
    env.kubectl_stdin(["apply", "-f", "-"], &rbac)
        .expect("run kubectl")
        .ok()
        .expect("apply the Role and RoleBinding");

    // RBAC changes reach the authorizer's cache within a moment.
    let mut last = None;
    for _ in 0..50 {
        match api.list(&ListParams::default()).await {
            Ok(_) => {
                last = None;
                break;
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(last.is_none(), "still not allowed: {last:?}");

    let can_i = env
        .cluster
        .kubectl([
            "auth",
            "can-i",
            "delete",
            "retrypolicies",
            "-n",
            ns,
            "--as",
            &user,
        ])
        .expect("run kubectl auth can-i");
    assert_eq!(can_i.stdout.trim(), "no");
}
