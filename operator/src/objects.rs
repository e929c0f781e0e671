//! What the operator reads from the API, parsed defensively.
//!
//! RetryPolicies are watched as untyped objects: one spec that the Rust types cannot even
//! deserialize (an older CRD, disabled validation) must become an `InvalidSpec` status on
//! that policy, not a watch error that stops every namespace.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::{ApiResource, DynamicObject, ObjectMeta};
use kube::{Resource, ResourceExt};
use rebound_policy::spec::{RolloutRequest, RolloutStatus};
use rebound_policy::{FieldError, RetryPolicy, RetryPolicySpec, RetryPolicyStatus};
use serde::Deserialize;

use crate::cache::Keyed;
use crate::status::StatusSeen;

pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const PART_OF_LABEL: &str = "app.kubernetes.io/part-of";
/// Copy of the document hash, so `kubectl get -o jsonpath` can check convergence.
pub const HASH_ANNOTATION: &str = "rebound.dev/hash";

/// The RetryPolicy resource, for `Api<DynamicObject>`.
pub fn policy_resource() -> ApiResource {
    ApiResource::erase::<RetryPolicy>(&())
}

/// One RetryPolicy as the reconcile needs it.
#[derive(Clone, Debug)]
pub struct PolicyView {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub generation: i64,
    pub resource_version: String,
    /// Creation time in Unix seconds; older policies win ties.
    pub created: Option<i64>,
    /// Being deleted (a finalizer of someone else holds it): no longer compiled.
    pub deleting: bool,
    pub spec: Result<RetryPolicySpec, FieldError>,
    /// `None` when absent or unreadable (then it is simply rewritten).
    pub status: Option<StatusSeen>,
    /// `status.rollout`, only for a policy that has one (boxed: others pay a pointer).
    pub rollout: Option<Box<RolloutSeen>>,
}

impl PolicyView {
    /// `None` for objects without the metadata every stored object has.
    pub fn from_dynamic(obj: &DynamicObject) -> Option<Self> {
        let meta = obj.meta();
        let spec = match obj.data.get("spec") {
            Some(spec) => parse_spec(spec),
            None => Err(FieldError {
                field: "spec".to_owned(),
                message: "is required".to_owned(),
            }),
        };
        let status = obj
            .data
            .get("status")
            .and_then(|s| RetryPolicyStatus::deserialize(s).ok());
        let rollout = status
            .as_ref()
            .and_then(|s| s.rollout.clone())
            .map(|r| Box::new(RolloutSeen::of(r)));
        let status = status.map(|s| StatusSeen::of(&s));
        Some(Self {
            name: meta.name.clone()?,
            namespace: meta.namespace.clone()?,
            uid: meta.uid.clone()?,
            generation: meta.generation.unwrap_or(0),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            created: meta.creation_timestamp.as_ref().map(|t| t.0.as_second()),
            deleting: meta.deletion_timestamp.is_some(),
            spec,
            status,
            rollout,
        })
    }

    /// The watch cache's key and view of a policy.
    pub fn keyed(obj: &DynamicObject) -> Keyed<Self> {
        Keyed {
            namespace: obj.metadata.namespace.clone().unwrap_or_default(),
            name: obj.metadata.name.clone().unwrap_or_default(),
            view: Self::from_dynamic(obj),
        }
    }

    /// What events and API calls name this policy by.
    pub fn object_ref(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(RetryPolicy::api_version(&()).into_owned()),
            kind: Some(RetryPolicy::kind(&()).into_owned()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        }
    }
}

/// What a policy shows of its rollout: the operator's fields and a person's request.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutSeen {
    /// `status.rollout` without `request`.
    pub status: RolloutStatus,
    pub request: Option<RolloutRequest>,
}

impl RolloutSeen {
    /// Splits a policy's `status.rollout`.
    pub fn of(mut status: RolloutStatus) -> Self {
        let request = status.request.take();
        Self { status, request }
    }
}

/// The part of `status` the operator's field manager owns (`null` when it owns none).
fn owned_status(
    managed: Option<&[ManagedFieldsEntry]>,
    status: &serde_json::Value,
) -> serde_json::Value {
    let wrapped = serde_json::json!({ "status": status });
    crate::owned::fields_of(managed.unwrap_or_default(), crate::FIELD_MANAGER, "status")
        .and_then(|fields| crate::owned::project(&wrapped, &fields))
        .and_then(|mut v| v.get_mut("status").map(serde_json::Value::take))
        .unwrap_or(serde_json::Value::Null)
}

/// Deserializes a spec, naming the offending field the way the API server would.
fn parse_spec(value: &serde_json::Value) -> Result<RetryPolicySpec, FieldError> {
    serde_path_to_error::deserialize::<_, RetryPolicySpec>(value).map_err(|e| {
        let path = e.path().to_string();
        FieldError {
            field: if path == "." || path.is_empty() {
                "spec".to_owned()
            } else {
                format!("spec.{path}")
            },
            message: e.into_inner().to_string(),
        }
    })
}

/// Keeps of a RetryPolicy what a reconcile reads (identity, generation, spec, and of the
/// status only the fields the operator's field manager owns) before it enters the watch
/// cache. Labels, annotations (up to 256 KiB per object), managed fields and owner
/// references are never read. Conditions and fields other tools add to the status are
/// dropped here, so they never make the operator's status differ from what it wants.
pub fn slim_policy(obj: &mut DynamicObject) {
    if let Some(status) = obj.data.get_mut("status") {
        // A person's rollout request is written by another field manager, and read.
        let request = status
            .pointer_mut("/rollout/request")
            .map(serde_json::Value::take);
        *status = owned_status(obj.metadata.managed_fields.as_deref(), status);
        if let Some(request) = request {
            if !status.is_object() {
                *status = serde_json::json!({});
            }
            if !status["rollout"].is_object() {
                status["rollout"] = serde_json::json!({});
            }
            status["rollout"]["request"] = request;
        }
    }
    let meta = &mut obj.metadata;
    meta.managed_fields = None;
    meta.annotations = None;
    meta.labels = None;
    meta.owner_references = None;
    if let Some(fields) = obj.data.as_object_mut() {
        fields.retain(|k, _| k == "spec" || k == "status");
    }
}

/// Keeps of a ConfigMap what a reconcile reads before it enters the watch cache. Of
/// someone else's ConfigMap (of our name) only its identity stays: its data can be
/// 1 MiB. Of ours: the document, the hash annotation, our labels, and of `managedFields`
/// an empty entry for our field manager, which tells a ConfigMap we wrote whose label
/// someone removed (drift, to be repaired) from someone else's.
pub fn slim_configmap(cm: &mut ConfigMap) {
    let view = ConfigMapView::from_configmap(cm);
    let meta = &mut cm.metadata;
    meta.owner_references = None;
    cm.binary_data = None;
    if !view.managed {
        meta.managed_fields = None;
        meta.annotations = None;
        meta.labels = None;
        cm.data = None;
        return;
    }
    meta.managed_fields = written_by_us(meta).then(|| {
        vec![ManagedFieldsEntry {
            manager: Some(crate::FIELD_MANAGER.to_owned()),
            ..ManagedFieldsEntry::default()
        }]
    });
    let keep = |map: &mut Option<std::collections::BTreeMap<String, String>>, keys: &[&str]| {
        if let Some(m) = map.as_mut() {
            m.retain(|k, _| keys.contains(&k.as_str()));
        }
    };
    keep(&mut meta.annotations, &[HASH_ANNOTATION]);
    keep(&mut meta.labels, &[MANAGED_BY_LABEL, PART_OF_LABEL]);
    keep(&mut cm.data, &[rebound_policy::compiled::CONFIGMAP_KEY]);
}

/// The object has fields owned by the operator's field manager: the operator wrote it.
fn written_by_us(meta: &ObjectMeta) -> bool {
    meta.managed_fields
        .iter()
        .flatten()
        .any(|e| e.manager.as_deref() == Some(crate::FIELD_MANAGER))
}

/// The part of a ConfigMap the operator compares and preconditions on.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigMapView {
    pub uid: String,
    pub resource_version: String,
    /// Ours: carries `app.kubernetes.io/managed-by: rebound-operator`, or was written by
    /// the operator's field manager (then a missing label is drift).
    pub managed: bool,
    /// Carries both of our labels with our values.
    pub labelled: bool,
    /// What the document keys hold, as a fingerprint (the document itself is not kept).
    pub content: Content,
    pub hash_annotation: Option<String>,
}

/// A fingerprint of what a ConfigMap holds under the document's keys, and its size: enough
/// to tell whether a write would change it, without keeping the document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Content {
    pub fingerprint: u64,
    /// Bytes under the document keys, both forms.
    pub bytes: usize,
    /// `data` holds the key (the plain form).
    pub plain: bool,
    /// `binaryData` holds the key (the compressed form).
    pub compressed: bool,
}

impl Content {
    /// Of the plain document (`data`) and the compressed one (`binaryData`), either
    /// possibly absent.
    pub fn of(plain: Option<&str>, compressed: Option<&[u8]>) -> Self {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        plain.hash(&mut hasher);
        compressed.hash(&mut hasher);
        Self {
            fingerprint: hasher.finish(),
            bytes: plain.map_or(0, str::len) + compressed.map_or(0, <[u8]>::len),
            plain: plain.is_some(),
            compressed: compressed.is_some(),
        }
    }

    /// What a ConfigMap holds under the document keys.
    pub fn of_configmap(cm: &ConfigMap) -> Self {
        let plain = cm
            .data
            .as_ref()
            .and_then(|d| d.get(rebound_policy::compiled::CONFIGMAP_KEY))
            .map(String::as_str);
        let compressed = cm
            .binary_data
            .as_ref()
            .and_then(|d| d.get(rebound_policy::compiled::CONFIGMAP_KEY))
            .map(|b| b.0.as_slice());
        Self::of(plain, compressed)
    }
}

impl ConfigMapView {
    /// The watch cache's key and view of a ConfigMap.
    pub fn keyed(cm: &ConfigMap) -> Keyed<Self> {
        Keyed {
            namespace: cm.metadata.namespace.clone().unwrap_or_default(),
            name: cm.metadata.name.clone().unwrap_or_default(),
            view: Some(Self::from_configmap(cm)),
        }
    }

    pub fn from_configmap(cm: &ConfigMap) -> Self {
        let label = |key: &str| cm.labels().get(key).map(String::as_str);
        let labelled = label(MANAGED_BY_LABEL) == Some(crate::FIELD_MANAGER)
            && label(PART_OF_LABEL) == Some("rebound");
        Self {
            uid: cm.uid().unwrap_or_default(),
            resource_version: cm.resource_version().unwrap_or_default(),
            managed: label(MANAGED_BY_LABEL) == Some(crate::FIELD_MANAGER)
                || written_by_us(cm.meta()),
            labelled,
            content: Content::of_configmap(cm),
            hash_annotation: cm.annotations().get(HASH_ANNOTATION).cloned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(spec: serde_json::Value) -> DynamicObject {
        let mut obj = DynamicObject::new("p", &policy_resource())
            .within("ns")
            .data(json!({ "spec": spec }));
        obj.metadata.uid = Some("u1".to_owned());
        obj.metadata.generation = Some(3);
        obj
    }

    #[test]
    fn parses_a_valid_spec() {
        let view = PolicyView::from_dynamic(&object(json!({"queues": ["a"]}))).expect("view");
        assert_eq!(view.generation, 3);
        assert!(view.spec.is_ok());
        assert!(view.status.is_none());
    }

    #[test]
    fn names_the_field_that_does_not_deserialize() {
        let view = PolicyView::from_dynamic(&object(json!({"queues": ["a"], "maxAttempts": -1})))
            .expect("view");
        let err = view.spec.expect_err("must fail");
        assert_eq!(err.field, "spec.maxAttempts");
    }

    #[test]
    fn slim_policy_keeps_spec_and_status_only() {
        let mut obj = object(json!({"queues": ["a"]}));
        obj.data["status"] = json!({"observedGeneration": 3});
        obj.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some(crate::FIELD_MANAGER.to_owned()),
            subresource: Some("status".to_owned()),
            fields_v1: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1(
                json!({"f:status": {"f:observedGeneration": {}}}),
            )),
            ..ManagedFieldsEntry::default()
        }]);
        obj.data["extra"] = json!("x".repeat(1000));
        obj.metadata.annotations = Some([("big".to_owned(), "x".repeat(256 * 1024))].into());
        obj.metadata.labels = Some([("team".to_owned(), "a".to_owned())].into());
        let before = PolicyView::from_dynamic(&obj).expect("view");
        slim_policy(&mut obj);
        assert!(obj.metadata.annotations.is_none() && obj.metadata.labels.is_none());
        assert!(obj.data.get("extra").is_none());
        let after = PolicyView::from_dynamic(&obj).expect("view");
        assert_eq!(format!("{before:?}"), format!("{after:?}"));
    }

    #[test]
    fn slim_policy_keeps_only_the_status_fields_the_operator_owns() {
        let mut obj = object(json!({"queues": ["a"]}));
        obj.data["status"] = json!({
            "observedGeneration": 3,
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "Compiled", "message": "",
                 "lastTransitionTime": "T"},
                {"type": "Healthy", "status": "True", "reason": "Probed", "message": "",
                 "lastTransitionTime": "T"},
            ],
        });
        let ours = json!({"f:status": {"f:observedGeneration": {}, "f:conditions": {
            "k:{\"type\":\"Ready\"}": {".": {}, "f:type": {}, "f:status": {}, "f:reason": {},
                "f:message": {}, "f:lastTransitionTime": {}}}}});
        obj.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some(crate::FIELD_MANAGER.to_owned()),
            subresource: Some("status".to_owned()),
            fields_v1: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1(
                ours,
            )),
            ..ManagedFieldsEntry::default()
        }]);
        let mut without = obj.clone();
        slim_policy(&mut obj);
        let conditions = obj.data["status"]["conditions"].as_array().map(Vec::len);
        assert_eq!(conditions, Some(1));
        // Without an entry of ours, nothing of the status is ours.
        without.metadata.managed_fields = None;
        slim_policy(&mut without);
        assert!(PolicyView::from_dynamic(&without).is_some_and(|v| v.status.is_none()));
    }

    fn configmap(labels: &[(&str, &str)], data: &[(&str, &str)]) -> ConfigMap {
        let map = |pairs: &[(&str, &str)]| {
            Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let mut cm = ConfigMap::default();
        cm.metadata.labels = map(labels);
        cm.metadata.annotations = map(&[
            ("rebound.dev/hash", "sha256:1"),
            ("kubectl.kubernetes.io/last-applied-configuration", "{}"),
        ]);
        cm.data = map(data);
        cm
    }

    #[test]
    fn slim_drops_the_data_of_foreign_configmaps() {
        let big = "x".repeat(1024 * 1024);
        let mut foreign = configmap(&[("app", "theirs")], &[("blob", &big)]);
        slim_configmap(&mut foreign);
        assert!(foreign.data.is_none() && foreign.metadata.annotations.is_none());
        assert!(!ConfigMapView::from_configmap(&foreign).managed);
    }

    #[test]
    fn slim_keeps_what_is_compared_of_ours() {
        let labels = [
            ("app.kubernetes.io/managed-by", "rebound-operator"),
            ("app.kubernetes.io/part-of", "rebound"),
            ("team", "a"),
        ];
        let mut ours = configmap(&labels, &[("policies.json", "{}"), ("extra", "x")]);
        let before = ConfigMapView::from_configmap(&ours);
        slim_configmap(&mut ours);
        assert_eq!(ConfigMapView::from_configmap(&ours), before);
        assert_eq!(ours.data.as_ref().map(|d| d.len()), Some(1));
        assert_eq!(ours.metadata.annotations.as_ref().map(|a| a.len()), Some(1));
        assert_eq!(ours.metadata.labels.as_ref().map(|l| l.len()), Some(2));
    }

    fn managed_by(manager: &str) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.to_owned()),
            operation: Some("Apply".to_owned()),
            ..ManagedFieldsEntry::default()
        }
    }

    #[test]
    fn a_configmap_we_wrote_stays_ours_without_its_label() {
        let mut cm = ConfigMap::default();
        cm.metadata.managed_fields = Some(vec![
            managed_by("kubectl"),
            managed_by(crate::FIELD_MANAGER),
        ]);
        slim_configmap(&mut cm);
        assert!(ConfigMapView::from_configmap(&cm).managed);
        assert_eq!(cm.metadata.managed_fields.as_ref().map(Vec::len), Some(1));

        let mut foreign = ConfigMap::default();
        foreign.metadata.managed_fields = Some(vec![managed_by("kubectl")]);
        slim_configmap(&mut foreign);
        assert!(!ConfigMapView::from_configmap(&foreign).managed);
        assert!(foreign.metadata.managed_fields.is_none());
    }
}
