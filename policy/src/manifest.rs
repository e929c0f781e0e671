//! Reading RetryPolicy manifests from YAML, as `kubectl apply -f` would: multi-document
//! files, other kinds skipped, every problem reported with the field that has it.

use serde_json::Value;

use crate::{
    resolve::{FieldError, ResolvedPolicy, resolve},
    spec::RetryPolicy,
};

pub const API_VERSION: &str = "rebound.dev/v1alpha1";
pub const KIND: &str = "RetryPolicy";

/// Largest YAML text read: far above a namespace's worth of policies (the compiled
/// document of one namespace is at most 900 KiB), far below what hurts a sidecar.
pub const MAX_MANIFEST_BYTES: usize = 8 * 1024 * 1024;

/// Parser budgets sized to what policy files need: a policy is a few dozen events and
/// never needs more than a handful of anchors, so an alias bomb fails after bounded work
/// instead of expanding into memory.
fn yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_reader_input_bytes = Some(MAX_MANIFEST_BYTES);
    budget.max_events = 2_000_000;
    budget.max_aliases = 1_000;
    budget.max_anchors = 1_000;
    budget.max_recorded_anchor_events = 100_000;
    budget.max_recorded_anchor_bytes = 1024 * 1024;
    budget.max_depth = 64;
    budget.max_documents = 10_000;
    let mut aliases = serde_saphyr::options::AliasLimits::default();
    aliases.max_total_replayed_events = 100_000;
    aliases.max_replay_stack_depth = 16;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.alias_limits = aliases;
    options
}

/// A YAML file that could not be read as YAML at all.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct YamlError(String);

/// One RetryPolicy document of a file.
#[derive(Debug)]
pub struct ManifestDocument {
    /// 1-based position among the file's documents.
    pub index: usize,
    /// `metadata.name` when it could be read.
    pub name: Option<String>,
    pub result: Result<(RetryPolicy, ResolvedPolicy), Vec<FieldError>>,
}

/// Reads every RetryPolicy in a multi-document YAML text. Documents of other kinds and
/// empty documents are skipped.
pub fn parse_manifests(text: &str) -> Result<Vec<ManifestDocument>, YamlError> {
    if text.len() > MAX_MANIFEST_BYTES {
        return Err(YamlError(format!(
            "{} bytes is more than a policy file can need (at most {MAX_MANIFEST_BYTES})",
            text.len()
        )));
    }
    let values: Vec<Value> = serde_saphyr::from_multiple_with_options(text, yaml_options())
        .map_err(|e| YamlError(e.to_string()))?;
    Ok(values
        .into_iter()
        .enumerate()
        .filter(|(_, v)| is_retry_policy(v))
        .map(|(i, v)| ManifestDocument {
            index: i + 1,
            name: v
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .map(str::to_owned),
            result: check_document(v),
        })
        .collect())
}

/// RetryPolicies, and anything else claiming Rebound's API group (so a misspelt kind is
/// reported instead of silently skipped).
fn is_retry_policy(v: &Value) -> bool {
    v.get("kind").and_then(Value::as_str) == Some(KIND)
        || v.get("apiVersion")
            .and_then(Value::as_str)
            .is_some_and(|a| a.starts_with("rebound.dev/"))
}

/// Top-level and metadata fields the API server knows; anything else is refused by its
/// strict field validation (kubectl's default), so it is refused here too.
const TOP_LEVEL_FIELDS: [&str; 5] = ["apiVersion", "kind", "metadata", "spec", "status"];
const METADATA_FIELDS: [&str; 15] = [
    "name",
    "namespace",
    "labels",
    "annotations",
    "generateName",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "finalizers",
    "ownerReferences",
    "managedFields",
    "selfLink",
];

fn unknown_field(v: &Value) -> Option<String> {
    let top = v.as_object()?;
    if let Some(key) = top.keys().find(|k| !TOP_LEVEL_FIELDS.contains(&k.as_str())) {
        return Some(key.clone());
    }
    let metadata = top.get("metadata")?.as_object()?;
    metadata
        .keys()
        .find(|k| !METADATA_FIELDS.contains(&k.as_str()))
        .map(|k| format!("metadata.{k}"))
}

/// The CRD's OpenAPI schema of `spec`, the same one the API server's strict field
/// validation uses.
fn spec_schema() -> std::sync::Arc<Value> {
    static SCHEMA: std::sync::OnceLock<std::sync::Arc<Value>> = std::sync::OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            use kube::CustomResourceExt;
            let crd = serde_json::to_value(RetryPolicy::crd()).unwrap_or_default();
            let spec = crd
                .pointer("/spec/versions/0/schema/openAPIV3Schema/properties/spec")
                .cloned()
                .unwrap_or_default();
            std::sync::Arc::new(spec)
        })
        .clone()
}

/// Fields the schema does not declare, as API-server paths (`spec.backoff.jiter`). The
/// Rust types ignore unknown fields so an operator reading a newer CRD keeps working;
/// people are told here, as `kubectl apply` would tell them.
fn unknown_schema_fields(schema: &Value, value: &Value, at: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            let Some(props) = schema.get("properties").and_then(Value::as_object) else {
                return;
            };
            for (key, item) in map {
                let path = format!("{at}.{key}");
                match props.get(key) {
                    Some(sub) => unknown_schema_fields(sub, item, &path, out),
                    None => out.push(path),
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    unknown_schema_fields(item_schema, item, &format!("{at}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// Required fields the value lacks, as API-server paths (`spec.retryBudget.ratePerSecond`),
/// from the same schema: a missing field is reported where the API server reports it,
/// not at the object that lacks it.
fn missing_schema_fields(schema: &Value, value: &Value, at: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            let required = schema.get("required").and_then(Value::as_array);
            for key in required.into_iter().flatten().filter_map(Value::as_str) {
                if !map.contains_key(key) {
                    out.push(format!("{at}.{key}"));
                }
            }
            let Some(props) = schema.get("properties").and_then(Value::as_object) else {
                return;
            };
            for (key, item) in map {
                if let Some(sub) = props.get(key) {
                    missing_schema_fields(sub, item, &format!("{at}.{key}"), out);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    missing_schema_fields(item_schema, item, &format!("{at}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

fn field_error(field: impl Into<String>, message: impl Into<String>) -> Vec<FieldError> {
    vec![FieldError {
        field: field.into(),
        message: message.into(),
    }]
}

fn check_document(v: Value) -> Result<(RetryPolicy, ResolvedPolicy), Vec<FieldError>> {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
    if kind != KIND {
        return Err(field_error("kind", format!("must be {KIND}, got {kind:?}")));
    }
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if api_version != API_VERSION {
        return Err(field_error(
            "apiVersion",
            format!("must be {API_VERSION}, got {api_version:?}"),
        ));
    }
    if let Some(field) = unknown_field(&v) {
        return Err(field_error(field, "unknown field"));
    }
    if let Some(spec) = v.get("spec") {
        let mut unknown = Vec::new();
        unknown_schema_fields(&spec_schema(), spec, "spec", &mut unknown);
        if !unknown.is_empty() {
            return Err(unknown
                .into_iter()
                .map(|field| FieldError {
                    field,
                    message: "unknown field".to_owned(),
                })
                .collect());
        }
        let mut missing = Vec::new();
        missing_schema_fields(&spec_schema(), spec, "spec", &mut missing);
        if !missing.is_empty() {
            return Err(missing
                .into_iter()
                .map(|field| FieldError {
                    field,
                    message: "required".to_owned(),
                })
                .collect());
        }
    }
    let policy: RetryPolicy = serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { String::new() } else { path };
        field_error(field, e.into_inner().to_string())
    })?;
    let resolved = validate(&policy)?;
    Ok((policy, resolved))
}

/// Validates a whole object: its name and its spec.
pub fn validate(policy: &RetryPolicy) -> Result<ResolvedPolicy, Vec<FieldError>> {
    let name = policy.metadata.name.as_deref().unwrap_or("");
    let mut errors = Vec::new();
    if !is_dns_subdomain(name) {
        errors.extend(field_error(
            "metadata.name",
            format!("must be a lowercase DNS subdomain of at most 253 characters, got {name:?}"),
        ));
    }
    match resolve(&policy.spec) {
        Ok(resolved) if errors.is_empty() => Ok(resolved),
        Ok(_) => Err(errors),
        Err(spec_errors) => {
            errors.extend(spec_errors);
            Err(errors)
        }
    }
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        // The API server checks custom resource names as DNS-1123 subdomains: 253
        // characters in all, no per-label limit.
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}
