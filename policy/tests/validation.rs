//! The CRD (schema bounds + CEL rules) and the Rust validator must agree: every invalid
//! policy in the fixture table is rejected by both, naming the same field, and every
//! example policy is accepted by both.

use kube::{CustomResourceExt, core::cel::Validator};
use rebound_policy::{RetryPolicy, manifest::parse_manifests};
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/invalid-policies.yaml");
const EXPECT: &str = "rebound.dev/expect-field";

fn crd_schema() -> Value {
    let crd = RetryPolicy::crd();
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("the CRD has a schema");
    serde_json::to_value(schema).expect("schema serialises")
}

/// Fields the API server would reject, as `a.b[0].c` paths, from all three of its checks:
/// CEL rules, OpenAPI bounds, and strict field validation (unknown fields).
fn api_server_rejections(schema: &Value, object: &Value) -> Vec<String> {
    let mut fields = Vec::new();
    if let Err(errors) = Validator::new().validate(schema, object, None) {
        fields.extend(errors.iter().map(|e| e.field_path.clone()));
    }
    let openapi = to_json_schema(schema.clone());
    let validator = jsonschema::draft4::new(&openapi).expect("the CRD schema compiles");
    for error in validator.iter_errors(object) {
        fields.push(pointer_to_path(
            &error.instance_path().to_string(),
            &error.to_string(),
        ));
    }
    unknown_fields(schema, object, String::new(), &mut fields);
    fields
}

/// OpenAPI v3.0 → JSON Schema draft 4: `nullable` and `x-kubernetes-*` have no meaning
/// there and are dropped; draft 4 shares `exclusiveMinimum: true` with OpenAPI 3.0.
fn to_json_schema(mut v: Value) -> Value {
    if let Value::Object(map) = &mut v {
        map.retain(|k, _| !k.starts_with("x-kubernetes") && k != "nullable" && k != "format");
        for value in map.values_mut() {
            *value = to_json_schema(value.take());
        }
    }
    v
}

fn pointer_to_path(pointer: &str, message: &str) -> String {
    let mut path = String::new();
    for segment in pointer.split('/').filter(|s| !s.is_empty()) {
        if segment.chars().all(|c| c.is_ascii_digit()) {
            path.push_str(&format!("[{segment}]"));
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(segment);
        }
    }
    let _ = message;
    path
}

fn unknown_fields(schema: &Value, object: &Value, at: String, out: &mut Vec<String>) {
    match object {
        Value::Object(map) => {
            let Some(props) = schema.get("properties").and_then(Value::as_object) else {
                return;
            };
            for (key, value) in map {
                let path = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                match props.get(key) {
                    Some(sub) => unknown_fields(sub, value, path, out),
                    None if at.is_empty()
                        && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") => {}
                    None => out.push(path),
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    unknown_fields(item_schema, item, format!("{at}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

fn documents(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .expect("fixture is YAML")
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

#[test]
fn fixture_covers_every_rule() {
    assert!(documents(FIXTURE).len() >= 20);
}

#[test]
fn rust_rejects_each_invalid_policy_naming_the_field() {
    let docs = parse_manifests(FIXTURE).expect("fixture parses");
    let values = documents(FIXTURE);
    assert_eq!(docs.len(), values.len());
    for (doc, value) in docs.iter().zip(&values) {
        let expected = value["metadata"]["annotations"][EXPECT]
            .as_str()
            .expect("annotated");
        let errors = doc
            .result
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("{:?} was accepted by the Rust validator", doc.name));
        assert!(
            errors.iter().any(|e| e.field == expected),
            "{:?}: expected an error on {expected}, got {errors:?}",
            doc.name
        );
    }
}

#[test]
fn crd_rejects_each_invalid_policy_naming_the_field() {
    let schema = crd_schema();
    for value in documents(FIXTURE) {
        let name = value["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let expected = value["metadata"]["annotations"][EXPECT]
            .as_str()
            .expect("annotated");
        let fields = api_server_rejections(&schema, &value);
        assert!(
            fields
                .iter()
                .any(|f| f == expected || f.starts_with(&format!("{expected}["))),
            "{name}: the CRD should reject {expected}, it reported {fields:?}"
        );
    }
}

#[test]
fn examples_pass_both_validators() {
    let schema = crd_schema();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).expect("examples exist") {
        let path = entry.expect("dir entry").path();
        let text = std::fs::read_to_string(&path).expect("readable");
        for doc in parse_manifests(&text).expect("YAML") {
            assert!(
                doc.result.is_ok(),
                "{}: {:?}",
                path.display(),
                doc.result.err()
            );
        }
        for value in documents(&text) {
            let fields = api_server_rejections(&schema, &value);
            assert!(
                fields.is_empty(),
                "{}: CRD rejects {fields:?}",
                path.display()
            );
            seen += 1;
        }
    }
    assert!(seen >= 4, "expected the example policies, found {seen}");
}

#[test]
fn policies_at_the_edges_of_every_bound_pass_both_validators() {
    let text = include_str!("fixtures/edge-valid-policies.yaml");
    let schema = crd_schema();
    let docs = parse_manifests(text).expect("YAML");
    assert_eq!(docs.len(), 7);
    for doc in docs {
        assert!(doc.result.is_ok(), "{:?}: {:?}", doc.name, doc.result.err());
    }
    for value in documents(text) {
        let fields = api_server_rejections(&schema, &value);
        assert!(
            fields.is_empty(),
            "{}: CRD rejects {fields:?}",
            value["metadata"]["name"]
        );
    }
}

#[test]
fn three_line_policy_is_valid_with_documented_defaults() {
    let text = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: minimal}\nspec: {queues: [jobs]}\n";
    let docs = parse_manifests(text).expect("YAML");
    let (_, resolved) = docs[0].result.as_ref().expect("valid");
    assert_eq!(resolved.base_ms, 1_000);
    assert_eq!(resolved.multiplier, 2.0);
    assert_eq!(resolved.cap_ms, 600_000);
    assert_eq!(resolved.max_attempts, 10);
    assert_eq!(resolved.jitter, rebound_policy::spec::JitterKind::Full);
    assert_eq!(resolved.terminal, rebound_policy::Disposition::Drop);
}

/// A schedule's resolved base is its first delay (what the compiled document and
/// `rebound explain` show), not the default base; other strategies keep their base.
#[test]
fn a_schedule_resolves_its_base_to_its_first_delay() {
    let text = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: s}\nspec:\n  queues: [jobs]\n  backoff: {strategy: schedule, schedule: [2s, 5s]}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: c}\nspec:\n  queues: [other]\n  backoff: {strategy: constant, base: 3s}\n";
    let docs = parse_manifests(text).expect("YAML");
    let base = |i: usize| docs[i].result.as_ref().expect("valid").1.base_ms;
    assert_eq!((base(0), base(1)), (2_000, 3_000));
}

#[test]
fn other_kinds_and_empty_documents_are_skipped() {
    let text = "---\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: ok}\nspec: {queues: [a]}\n";
    let docs = parse_manifests(text).expect("YAML");
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0].name.as_deref(), Some("ok"));
}

#[test]
fn wrong_api_version_and_bad_name_are_reported() {
    let text = "apiVersion: rebound.dev/v1\nkind: RetryPolicy\nmetadata: {name: a}\nspec: {queues: [a]}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: Bad_Name}\nspec: {queues: [a]}\n";
    let docs = parse_manifests(text).expect("YAML");
    assert_eq!(
        docs[0].result.as_ref().err().map(|e| e[0].field.as_str()),
        Some("apiVersion")
    );
    assert_eq!(
        docs[1].result.as_ref().err().map(|e| e[0].field.as_str()),
        Some("metadata.name")
    );
}

#[test]
fn crd_yaml_matches_committed_file() {
    let committed = include_str!("../../crds/retrypolicies.rebound.dev.yaml");
    assert!(
        committed == rebound_policy::crd_yaml(),
        "crds/retrypolicies.rebound.dev.yaml is stale: run `cargo run -p rebound-cli -- crd > crds/retrypolicies.rebound.dev.yaml`"
    );
}

#[test]
fn misspelt_kinds_and_unknown_top_level_fields_are_reported() {
    let text = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicies\nmetadata: {name: a}\nspec: {queues: [a]}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: b}\nspek: {}\nspec: {queues: [a]}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: c, labelz: {}}\nspec: {queues: [a]}\n";
    let docs = parse_manifests(text).expect("YAML");
    let fields: Vec<_> = docs
        .iter()
        .map(|d| d.result.as_ref().err().map(|e| e[0].field.clone()))
        .collect();
    assert_eq!(
        fields,
        [
            Some("kind".into()),
            Some("spek".into()),
            Some("metadata.labelz".into())
        ]
    );
}

/// An oversized list is refused by its length alone: one error, no per-item work.
#[test]
fn oversized_lists_are_refused_before_any_per_item_work() {
    use rebound_policy::{duration::KubeDuration, resolve, spec::RetryPolicySpec};
    let spec = RetryPolicySpec {
        queues: vec!["not a queue".to_owned(); 80_000],
        backoff: Some(rebound_policy::spec::Backoff {
            strategy: Some(rebound_policy::spec::Strategy::Schedule),
            schedule: Some(vec![KubeDuration::parse("1s").expect("1s"); 50_000]),
            ..Default::default()
        }),
        max_attempts: None,
        max_retry_duration: None,
        non_retryable_errors: vec!["dup".to_owned(); 80_000],
        terminal: None,
        retry_budget: None,
        rollout: None,
    };
    let errors = resolve(&spec).expect_err("invalid");
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "spec.queues",
            "spec.nonRetryableErrors",
            "spec.backoff.schedule"
        ],
        "{errors:?}"
    );
}

/// Duplicates in a list of valid length are still each reported.
#[test]
fn duplicates_are_reported_per_entry() {
    use rebound_policy::{resolve, spec::RetryPolicySpec};
    let spec = RetryPolicySpec {
        queues: vec!["a".into(), "b".into(), "a".into(), "a".into()],
        backoff: None,
        max_attempts: None,
        max_retry_duration: None,
        non_retryable_errors: vec![],
        terminal: None,
        retry_budget: None,
        rollout: None,
    };
    let errors = resolve(&spec).expect_err("duplicates");
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["spec.queues[2]", "spec.queues[3]"]);
}

/// An alias bomb: 9 × 10⁴ aliases deep, each replaying ten values, about 900,000 scalars
/// from a few hundred bytes. Refused by the parser's budget, not expanded into memory.
#[test]
fn yaml_alias_bombs_are_refused_by_the_parser_budget() {
    let mut text =
        String::from("apiVersion: v1\nkind: ConfigMap\ndata:\n  a: &a [x,x,x,x,x,x,x,x,x,x]\n");
    for (name, prev) in [("b", "a"), ("c", "b"), ("d", "c"), ("e", "d")] {
        let refs = vec![format!("*{prev}"); if name == "e" { 9 } else { 10 }].join(",");
        text.push_str(&format!("  {name}: &{name} [{refs}]\n"));
    }
    assert!(text.len() < 1_000);
    let result = rebound_policy::manifest::parse_manifests(&text);
    assert!(result.is_err(), "alias bomb accepted");

    // Anchors and a few aliases, as people use them, still work.
    let ok = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: a}\nspec:\n  queues: &q [\"a\", \"b\"]\n  nonRetryableErrors: *q\n";
    let docs = rebound_policy::manifest::parse_manifests(ok).expect("small anchors are fine");
    assert!(docs[0].result.is_ok());
}

#[test]
fn oversized_yaml_is_refused_before_parsing() {
    let text = "#".repeat(rebound_policy::manifest::MAX_MANIFEST_BYTES + 1);
    assert!(rebound_policy::manifest::parse_manifests(&text).is_err());
}

/// Names follow the API server's rule for custom resources (a DNS-1123 subdomain: 253
/// characters, no 63-character label limit).
#[test]
fn long_names_the_api_server_accepts_are_accepted() {
    let yaml = |name: &str| {
        format!(
            "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {name}}}\nspec: {{queues: [q]}}\n"
        )
    };
    for name in [
        "a".repeat(100),
        "a".repeat(253),
        format!("{}.b", "a".repeat(200)),
    ] {
        let docs = rebound_policy::manifest::parse_manifests(&yaml(&name)).expect("yaml");
        assert!(docs[0].result.is_ok(), "{name}: {:?}", docs[0].result);
    }
    for name in [
        "a".repeat(254),
        "A".to_owned(),
        "a..b".to_owned(),
        "-a".to_owned(),
    ] {
        let docs = rebound_policy::manifest::parse_manifests(&yaml(&name)).expect("yaml");
        let fields: Vec<String> = docs[0]
            .result
            .as_ref()
            .expect_err("invalid name")
            .iter()
            .map(|e| e.field.clone())
            .collect();
        assert_eq!(fields, ["metadata.name"], "{name}");
    }
}

/// A missing required field is named where the API server names it, not at its parent.
#[test]
fn missing_required_fields_are_named_themselves() {
    let text = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: a}\nspec: {queues: [q], retryBudget: {burst: 1}, terminal: {deadLetterQueue: d}}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: b}\nspec: {maxAttempts: 3}\n";
    let docs = parse_manifests(text).expect("YAML");
    let fields: Vec<Vec<String>> = docs
        .into_iter()
        .map(|d| {
            d.result
                .err()
                .unwrap_or_default()
                .into_iter()
                .map(|e| e.field)
                .collect()
        })
        .collect();
    assert_eq!(
        fields,
        [
            vec!["spec.retryBudget.ratePerSecond", "spec.terminal.action"],
            vec!["spec.queues"]
        ]
    );
}
