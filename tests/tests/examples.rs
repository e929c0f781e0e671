//! Every example under `examples/policies/` is accepted by a real API server with
//! `kubectl apply`, reads back unchanged, and `kubectl get retrypolicies` shows the
//! CRD's printer columns for it.

use kube::Api;
use kube::api::DynamicObject;
use rebound_tests::{
    TestEnv, example_policy_files, json_contains, retry_policy_crd_file, retry_policy_resource,
    yaml_documents,
};

/// The printer column headers plain `kubectl get` shows for RetryPolicy (priority 0; the
/// others are for `-o wide`), from the CRD file.
fn column_headers() -> Vec<String> {
    let docs = yaml_documents(&retry_policy_crd_file()).expect("CRD file parses");
    docs[0]["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .expect("the CRD has printer columns")
        .iter()
        .filter(|c| c["priority"].as_i64().unwrap_or(0) == 0)
        .map(|c| {
            c["name"]
                .as_str()
                .expect("column name")
                .to_ascii_uppercase()
        })
        .collect()
}

/// (file, name, document) for every RetryPolicy in the examples.
fn example_policies() -> Vec<(String, String, serde_json::Value)> {
    let files = example_policy_files().expect("examples/policies is readable");
    assert!(!files.is_empty(), "examples/policies/ has no *.yaml files");
    let mut policies = Vec::new();
    for file in files {
        let label = file
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        for doc in yaml_documents(&file).expect("example parses as YAML") {
            assert_eq!(doc["kind"], "RetryPolicy", "{label}: unexpected kind");
            assert_eq!(doc["apiVersion"], "rebound.dev/v1alpha1", "{label}");
            let name = doc["metadata"]["name"]
                .as_str()
                .unwrap_or_else(|| panic!("{label}: a policy without metadata.name"))
                .to_string();
            policies.push((label.clone(), name, doc));
        }
    }
    policies
}

async fn assert_reads_back(env: &TestEnv, policies: &[(String, String, serde_json::Value)]) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.namespace, &retry_policy_resource());
    for (file, name, doc) in policies {
        let got = api
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{file}: reading back {name}: {e}"));
        let spec = &got.data["spec"];
        assert!(
            json_contains(spec, &doc["spec"]),
            "{file}: {name} reads back differently\n file:   {}\n server: {spec}",
            doc["spec"]
        );
    }
}

fn assert_listed_with_columns(
    env: &TestEnv,
    resource: &str,
    policies: &[(String, String, serde_json::Value)],
) {
    let out = env
        .kubectl(["get", resource])
        .expect("run kubectl get")
        .ok()
        .expect("kubectl get");
    let mut lines = out.stdout.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let mut wanted = vec!["NAME".to_string()];
    wanted.extend(column_headers());
    assert_eq!(
        header, wanted,
        "columns of `kubectl get {resource}`:\n{}",
        out.stdout
    );
    let rows: Vec<&str> = lines.collect();
    // No operator runs here, so the status columns (the queues served, the summary, Ready)
    // are empty; the operator's tests check what they show.
    for (file, name, _) in policies {
        assert!(
            rows.iter()
                .any(|r| r.split_whitespace().next() == Some(name.as_str())),
            "{file}: {name} not listed:\n{}",
            out.stdout
        );
    }
}

#[tokio::test]
async fn every_example_is_accepted_by_kubectl_apply_and_reads_back() {
    let policies = example_policies();
    let env = TestEnv::new("examples-apply").await.expect("test env");

    for file in example_policy_files().expect("examples") {
        let out = env
            .kubectl(["apply", "-f", file.to_str().expect("utf-8 path")])
            .expect("run kubectl apply");
        assert!(
            out.success(),
            "{} was rejected:\n{}{}",
            file.display(),
            out.stdout,
            out.stderr
        );
        assert!(
            out.stdout.lines().all(|l| l.ends_with(" created")),
            "{}: {}",
            file.display(),
            out.stdout
        );
    }
    assert_reads_back(&env, &policies).await;
    assert_listed_with_columns(&env, "retrypolicies", &policies);
    assert_listed_with_columns(&env, "rp", &policies);

    // Applying the same files again changes nothing.
    for file in example_policy_files().expect("examples") {
        let out = env
            .kubectl(["apply", "-f", file.to_str().expect("utf-8 path")])
            .expect("run kubectl apply")
            .ok()
            .expect("re-apply");
        assert!(
            out.stdout.lines().all(|l| l.ends_with(" unchanged")),
            "{}: re-apply changed something: {}",
            file.display(),
            out.stdout
        );
    }
}

#[tokio::test]
async fn every_example_is_accepted_by_server_side_apply() {
    let policies = example_policies();
    let env = TestEnv::new("examples-ssa").await.expect("test env");
    let dir = rebound_tests::repo_root().join("examples/policies");
    let out = env
        .kubectl([
            "apply",
            "--server-side",
            "--field-manager=gitops",
            "-f",
            dir.to_str().expect("utf-8 path"),
        ])
        .expect("run kubectl apply");
    assert!(out.success(), "rejected:\n{}{}", out.stdout, out.stderr);
    assert_reads_back(&env, &policies).await;

    let diff = env
        .kubectl([
            "diff",
            "--server-side",
            "--field-manager=gitops",
            "-f",
            dir.to_str().expect("utf-8 path"),
        ])
        .expect("run kubectl diff");
    assert_eq!(
        diff.status.code(),
        Some(0),
        "kubectl diff after apply:\n{}{}",
        diff.stdout,
        diff.stderr
    );
}
