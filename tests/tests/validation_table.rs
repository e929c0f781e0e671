//! The policy crate's table of invalid policies (one per validation rule, plus cases a
//! fraction of a millisecond past each duration bound) and its table of valid policies at
//! the edge of every bound, put through the real kube-apiserver. The same tables run
//! through the Rust validator and a client-side CEL evaluator in
//! `policy/tests/validation.rs`, so the three agree on one set of documents.

use rebound_tests::{TestEnv, repo_root};
use serde_json::Value;

const EXPECT: &str = "rebound.dev/expect-field";

fn documents(file: &str) -> Vec<Value> {
    let path = repo_root().join("policy/tests/fixtures").join(file);
    let text = std::fs::read_to_string(&path).expect("fixture readable");
    serde_saphyr::from_multiple::<Value>(&text)
        .expect("fixture is YAML")
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

#[tokio::test]
async fn the_api_server_rejects_every_invalid_policy_naming_the_field() {
    let env = TestEnv::new("table").await.expect("test environment");
    let docs = documents("invalid-policies.yaml");
    assert!(docs.len() >= 25);
    let mut wrong = Vec::new();
    for doc in docs {
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let field = doc["metadata"]["annotations"][EXPECT]
            .as_str()
            .expect("annotated")
            .to_owned();
        let out = env
            .kubectl_stdin(["apply", "--server-side", "-f", "-"], &doc.to_string())
            .expect("kubectl runs");
        if out.success() || !out.stderr.contains(&field) {
            wrong.push(format!(
                "{name}: expected a rejection naming {field}, got: {}",
                out.stderr.trim()
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[tokio::test]
async fn the_api_server_accepts_policies_at_the_edge_of_every_bound() {
    let env = TestEnv::new("edges").await.expect("test environment");
    for doc in documents("edge-valid-policies.yaml") {
        let out = env
            .kubectl_stdin(["apply", "--server-side", "-f", "-"], &doc.to_string())
            .expect("kubectl runs");
        assert!(out.success(), "{}: {}", doc["metadata"]["name"], out.stderr);
    }
}
