//! The per-namespace ConfigMap: what it should hold and which write gets it there.
//!
//! Ownership is the `app.kubernetes.io/managed-by: rebound-operator` label. A ConfigMap of
//! the same name without it belongs to someone else and is never touched. Creation uses a
//! plain create (fails if one appeared meanwhile); updates use server-side apply with the
//! resourceVersion we compared against as a precondition; deletion preconditions on uid and
//! resourceVersion. So a foreign ConfigMap is never adopted, even in a race.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use rebound_policy::compiled::{CONFIGMAP_KEY, MAX_DOCUMENT_BYTES};

use crate::objects::ConfigMapView;

pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const PART_OF_LABEL: &str = "app.kubernetes.io/part-of";
/// Copy of the document hash, so `kubectl get -o jsonpath` can check convergence.
pub const HASH_ANNOTATION: &str = "rebound.dev/hash";

/// The compiled document of a namespace, ready to write.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    pub json: String,
    pub hash: String,
}

/// The one write (or none) that brings the ConfigMap to the desired state.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Already holds the document (or there is nothing and nothing is wanted).
    UpToDate,
    Create(ConfigMap),
    /// Server-side apply; the object carries the resourceVersion precondition.
    Apply(ConfigMap),
    Delete {
        uid: String,
        resource_version: String,
    },
    /// Someone else's ConfigMap has that name.
    NotOwned,
    /// The document exceeds [`MAX_DOCUMENT_BYTES`]; the ConfigMap stays as it is.
    TooLarge {
        bytes: usize,
    },
}

/// Decides the write. `desired` is `None` when the namespace has no RetryPolicies left.
pub fn plan(
    name: &str,
    namespace: &str,
    current: Option<&ConfigMapView>,
    desired: Option<&Desired>,
) -> Plan {
    match (current, desired) {
        (Some(cm), _) if !cm.managed => Plan::NotOwned,
        (None, None) => Plan::UpToDate,
        (Some(cm), None) => Plan::Delete {
            uid: cm.uid.clone(),
            resource_version: cm.resource_version.clone(),
        },
        (_, Some(d)) if d.json.len() > MAX_DOCUMENT_BYTES => Plan::TooLarge {
            bytes: d.json.len(),
        },
        (None, Some(d)) => Plan::Create(build(name, namespace, d, None)),
        (Some(cm), Some(d)) => {
            if cm.document.as_deref() == Some(d.json.as_str())
                && cm.hash_annotation.as_deref() == Some(d.hash.as_str())
            {
                Plan::UpToDate
            } else {
                Plan::Apply(build(name, namespace, d, Some(cm.resource_version.clone())))
            }
        }
    }
}

/// The ConfigMap as we want it; only these fields are ours under server-side apply.
pub fn build(
    name: &str,
    namespace: &str,
    desired: &Desired,
    resource_version: Option<String>,
) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            resource_version,
            labels: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.to_owned(), crate::FIELD_MANAGER.to_owned()),
                (PART_OF_LABEL.to_owned(), "rebound".to_owned()),
            ])),
            annotations: Some(BTreeMap::from([(
                HASH_ANNOTATION.to_owned(),
                desired.hash.clone(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(
            CONFIGMAP_KEY.to_owned(),
            desired.json.clone(),
        )])),
        ..ConfigMap::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desired(json: &str) -> Desired {
        Desired {
            json: json.to_owned(),
            hash: format!("h-{json}"),
        }
    }

    fn view(managed: bool, json: Option<&str>) -> ConfigMapView {
        ConfigMapView {
            uid: "u".to_owned(),
            resource_version: "7".to_owned(),
            managed,
            document: json.map(str::to_owned),
            hash_annotation: json.map(|j| format!("h-{j}")),
        }
    }

    #[test]
    fn creates_when_missing_and_skips_when_equal() {
        assert!(matches!(
            plan("cm", "ns", None, Some(&desired("{}"))),
            Plan::Create(_)
        ));
        assert_eq!(
            plan(
                "cm",
                "ns",
                Some(&view(true, Some("{}"))),
                Some(&desired("{}"))
            ),
            Plan::UpToDate
        );
    }

    #[test]
    fn applies_with_the_compared_resource_version() {
        match plan(
            "cm",
            "ns",
            Some(&view(true, Some("old"))),
            Some(&desired("new")),
        ) {
            Plan::Apply(cm) => {
                assert_eq!(cm.metadata.resource_version.as_deref(), Some("7"));
                assert_eq!(
                    cm.metadata
                        .labels
                        .unwrap_or_default()
                        .get(MANAGED_BY_LABEL)
                        .map(String::as_str),
                    Some("rebound-operator")
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn never_touches_a_foreign_configmap() {
        let foreign = view(false, Some("theirs"));
        assert_eq!(
            plan("cm", "ns", Some(&foreign), Some(&desired("x"))),
            Plan::NotOwned
        );
        assert_eq!(plan("cm", "ns", Some(&foreign), None), Plan::NotOwned);
    }

    #[test]
    fn deletes_ours_when_no_policies_are_left() {
        assert!(matches!(
            plan("cm", "ns", Some(&view(true, Some("x"))), None),
            Plan::Delete { .. }
        ));
        assert_eq!(plan("cm", "ns", None, None), Plan::UpToDate);
    }

    #[test]
    fn refuses_oversize_documents() {
        let big = desired(&"x".repeat(MAX_DOCUMENT_BYTES + 1));
        assert!(matches!(
            plan("cm", "ns", None, Some(&big)),
            Plan::TooLarge { .. }
        ));
    }
}
