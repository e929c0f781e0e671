//! The RetryPolicy CRD against a real API server: it installs cleanly with server-side
//! apply, re-applying it changes nothing, and the served names and columns are the ones
//! in the file.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use rebound_tests::{
    Cluster, FIELD_MANAGER, RETRY_POLICY_CRD, TestEnv, retry_policy_crd_file, yaml_documents,
};

async fn get_crd(env: &TestEnv) -> CustomResourceDefinition {
    Api::<CustomResourceDefinition>::all(env.client.clone())
        .get(RETRY_POLICY_CRD)
        .await
        .expect("the RetryPolicy CRD is installed")
}

fn crd_file() -> std::path::PathBuf {
    let file = retry_policy_crd_file();
    assert!(
        file.is_file(),
        "{} is missing: the tests need the generated CRD",
        file.display()
    );
    file
}

#[tokio::test]
async fn crd_is_installed_and_established() {
    crd_file();
    let env = TestEnv::new("crd-established").await.expect("test env");
    assert!(
        env.cluster
            .installed_crds()
            .iter()
            .any(|n| n.ends_with(&format!("/{RETRY_POLICY_CRD}"))),
        "the harness did not install {RETRY_POLICY_CRD}: {:?}",
        env.cluster.installed_crds()
    );
    let crd = get_crd(&env).await;
    let conditions = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .expect("CRD status has conditions");
    for wanted in ["Established", "NamesAccepted"] {
        assert!(
            conditions
                .iter()
                .any(|c| c.type_ == wanted && c.status == "True"),
            "condition {wanted} is not True: {conditions:?}"
        );
    }
    assert_eq!(crd.spec.group, "rebound.dev");
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.kind, "RetryPolicy");
    assert_eq!(crd.spec.names.plural, "retrypolicies");
    assert_eq!(crd.spec.names.short_names, Some(vec!["rp".to_string()]));
    let served: Vec<_> = crd
        .spec
        .versions
        .iter()
        .filter(|v| v.served)
        .map(|v| v.name.as_str())
        .collect();
    assert!(served.contains(&"v1alpha1"), "served versions: {served:?}");

    // The API server knows the resource under its short name.
    let out = env
        .cluster
        .kubectl(["api-resources", "--api-group=rebound.dev", "--no-headers"])
        .expect("run kubectl")
        .ok()
        .expect("kubectl api-resources");
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("retrypolicies "))
        .unwrap_or_else(|| panic!("retrypolicies not discovered:\n{}", out.stdout));
    let fields: Vec<_> = line.split_whitespace().collect();
    assert_eq!(
        fields,
        [
            "retrypolicies",
            "rp",
            "rebound.dev/v1alpha1",
            "true",
            "RetryPolicy"
        ],
        "api-resources line: {line}"
    );
}

#[tokio::test]
async fn reapplying_the_crd_server_side_is_a_no_op() {
    let file = crd_file();
    let env = TestEnv::new("crd-reapply").await.expect("test env");
    let before = get_crd(&env).await;

    // The same field manager as the harness: nothing new to own, nothing to change.
    let out = env
        .cluster
        .kubectl([
            "apply",
            "--server-side",
            "--field-manager",
            FIELD_MANAGER,
            "-f",
            file.to_str().expect("utf-8 path"),
        ])
        .expect("run kubectl");
    assert!(out.success(), "re-apply failed: {}", out.stderr);
    assert!(
        out.stdout.contains("serverside-applied"),
        "unexpected output: {}",
        out.stdout
    );

    let after = get_crd(&env).await;
    assert_eq!(
        before.metadata.resource_version, after.metadata.resource_version,
        "re-applying the same CRD wrote a new resourceVersion"
    );
    assert_eq!(before.metadata.generation, after.metadata.generation);

    // And kubectl sees no difference between the file and the cluster.
    let diff = env
        .cluster
        .kubectl([
            "diff",
            "--server-side",
            "--field-manager",
            FIELD_MANAGER,
            "-f",
            file.to_str().expect("utf-8 path"),
        ])
        .expect("run kubectl diff");
    assert_eq!(
        diff.status.code(),
        Some(0),
        "kubectl diff found differences:\n{}\n{}",
        diff.stdout,
        diff.stderr
    );
}

#[tokio::test]
async fn crd_in_the_cluster_has_the_printer_columns_of_the_file() {
    let file = crd_file();
    let env = TestEnv::new("crd-columns").await.expect("test env");
    let docs = yaml_documents(&file).expect("CRD file parses");
    let version = docs[0]["spec"]["versions"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == "v1alpha1"))
        .expect("the file defines v1alpha1");
    let wanted: Vec<String> = version["additionalPrinterColumns"]
        .as_array()
        .expect("printer columns in the file")
        .iter()
        .map(|c| c["name"].as_str().expect("column name").to_string())
        .collect();

    let crd = get_crd(&env).await;
    let served: Vec<String> = crd
        .spec
        .versions
        .iter()
        .find(|v| v.name == "v1alpha1")
        .and_then(|v| v.additional_printer_columns.as_ref())
        .map(|cols| cols.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    assert_eq!(served, wanted);
}

#[test]
fn shared_cluster_is_reused_within_the_process() {
    let a = Cluster::shared().expect("cluster");
    let b = Cluster::shared().expect("cluster");
    assert!(std::ptr::eq(a, b));
    assert!(a.kubeconfig().is_file());
}
