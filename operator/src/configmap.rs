//! The per-namespace ConfigMap: what it should hold and which write gets it there.
//!
//! Ownership is the `app.kubernetes.io/managed-by: rebound-operator` label. A ConfigMap of
//! the same name without it belongs to someone else and is never touched. Creation uses a
//! plain create (fails if one appeared meanwhile); updates use server-side apply with the
//! resourceVersion we compared against as a precondition. So a foreign ConfigMap is never
//! adopted, even in a race. The operator never deletes the ConfigMap.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use rebound_policy::compiled::{CONFIGMAP_KEY, MAX_DOCUMENT_BYTES};

use crate::objects::{ConfigMapView, Content};

pub use crate::objects::{HASH_ANNOTATION, MANAGED_BY_LABEL, PART_OF_LABEL};

/// The compiled document of a namespace, ready to write.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    pub json: String,
    pub hash: String,
    /// The namespace has RetryPolicies (valid or not). Without any, a missing ConfigMap
    /// stays missing; an existing one of ours gets the empty document, so sidecars learn
    /// that the policies were removed.
    pub has_policies: bool,
}

impl Desired {
    /// What the ConfigMap holds under the document keys once this is written.
    pub fn content(&self) -> Content {
        Content::of(Some(&self.json), None)
    }
}

/// The one write (or none) that brings the ConfigMap to the desired state. There is no
/// delete: a ConfigMap of ours outlives the namespace's last policy (holding the empty
/// document), because a missing ConfigMap looks like a fault to a running sidecar.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Already holds the document (or there is none and no policy asks for one).
    UpToDate,
    Create(ConfigMap),
    /// Server-side apply; the object carries the resourceVersion precondition.
    Apply(ConfigMap),
    /// Someone else's ConfigMap has that name.
    NotOwned,
    /// The document exceeds [`MAX_DOCUMENT_BYTES`]; the ConfigMap stays as it is.
    TooLarge {
        bytes: usize,
    },
}

/// Decides the write from the ConfigMap as last seen (`None`: there is none).
pub fn plan(
    name: &str,
    namespace: &str,
    current: Option<&ConfigMapView>,
    desired: &Desired,
) -> Plan {
    match current {
        Some(cm) if !cm.managed => Plan::NotOwned,
        None if !desired.has_policies => Plan::UpToDate,
        _ if desired.json.len() > MAX_DOCUMENT_BYTES => Plan::TooLarge {
            bytes: desired.json.len(),
        },
        None => Plan::Create(build(name, namespace, desired, None)),
        Some(cm) => {
            if cm.labelled
                && cm.content == desired.content()
                && cm.hash_annotation.as_deref() == Some(desired.hash.as_str())
            {
                Plan::UpToDate
            } else {
                Plan::Apply(build(
                    name,
                    namespace,
                    desired,
                    Some(cm.resource_version.clone()),
                ))
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
            has_policies: true,
        }
    }

    fn empty() -> Desired {
        Desired {
            has_policies: false,
            ..desired("empty")
        }
    }

    fn view(managed: bool, json: Option<&str>) -> ConfigMapView {
        ConfigMapView {
            uid: "u".to_owned(),
            resource_version: "7".to_owned(),
            managed,
            labelled: managed,
            content: Content::of(json, None),
            hash_annotation: json.map(|j| format!("h-{j}")),
        }
    }

    #[test]
    fn creates_when_missing_and_skips_when_equal() {
        assert!(matches!(
            plan("cm", "ns", None, &desired("{}")),
            Plan::Create(_)
        ));
        assert_eq!(
            plan("cm", "ns", Some(&view(true, Some("{}"))), &desired("{}")),
            Plan::UpToDate
        );
    }

    #[test]
    fn applies_with_the_compared_resource_version() {
        match plan("cm", "ns", Some(&view(true, Some("old"))), &desired("new")) {
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
    fn puts_back_a_label_removed_from_ours() {
        let unlabelled = ConfigMapView {
            labelled: false,
            ..view(true, Some("{}"))
        };
        assert!(matches!(
            plan("cm", "ns", Some(&unlabelled), &desired("{}")),
            Plan::Apply(_)
        ));
    }

    #[test]
    fn never_touches_a_foreign_configmap() {
        let foreign = view(false, Some("theirs"));
        assert_eq!(
            plan("cm", "ns", Some(&foreign), &desired("x")),
            Plan::NotOwned
        );
        assert_eq!(plan("cm", "ns", Some(&foreign), &empty()), Plan::NotOwned);
    }

    #[test]
    fn keeps_ours_with_the_empty_document_when_no_policies_are_left() {
        match plan("cm", "ns", Some(&view(true, Some("x"))), &empty()) {
            Plan::Apply(cm) => {
                let data = cm.data.unwrap_or_default();
                assert_eq!(data.get(CONFIGMAP_KEY).map(String::as_str), Some("empty"));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            plan("cm", "ns", Some(&view(true, Some("empty"))), &empty()),
            Plan::UpToDate
        );
        // A namespace without policies never gets one.
        assert_eq!(plan("cm", "ns", None, &empty()), Plan::UpToDate);
    }

    #[test]
    fn refuses_oversize_documents() {
        let big = desired(&"x".repeat(MAX_DOCUMENT_BYTES + 1));
        assert!(matches!(
            plan("cm", "ns", None, &big),
            Plan::TooLarge { .. }
        ));
    }
}
