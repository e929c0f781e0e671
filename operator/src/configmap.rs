//! The per-namespace ConfigMap: what it should hold and which write gets it there.
//!
//! Ownership is the `app.kubernetes.io/managed-by: rebound-operator` label. A ConfigMap of
//! the same name without it belongs to someone else and is never touched. Creation uses a
//! plain create (fails if one appeared meanwhile); updates use server-side apply with the
//! resourceVersion we compared against as a precondition. So a foreign ConfigMap is never
//! adopted, even in a race. The operator never deletes the ConfigMap.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use rebound_policy::compiled::{CONFIGMAP_KEY, MAX_DOCUMENT_BYTES, MAX_INFLATED_DOCUMENT_BYTES};

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
    /// The JSON gzip'd, when it is too large for `data`: then it goes to `binaryData`
    /// under the same key (and `data` loses the key).
    pub compressed: Option<Arc<[u8]>>,
}

/// Which size limit a namespace's document passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// The JSON is over [`MAX_INFLATED_DOCUMENT_BYTES`], what a sidecar inflates.
    Json,
    /// The gzip'd JSON is over [`MAX_DOCUMENT_BYTES`], what a ConfigMap holds.
    Compressed,
}

impl Limit {
    /// The word the status message names the limit by.
    pub fn name(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Compressed => "compressed",
        }
    }

    /// The limit in bytes.
    pub fn bytes(self) -> usize {
        match self {
            Self::Json => MAX_INFLATED_DOCUMENT_BYTES,
            Self::Compressed => MAX_DOCUMENT_BYTES,
        }
    }
}

/// A document that does not fit: the limit it passed and its size in that limit's terms
/// (JSON bytes for [`Limit::Json`], gzip'd bytes for [`Limit::Compressed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overflow {
    pub limit: Limit,
    pub bytes: usize,
}

/// The last document compressed, by hash: a namespace's reconciles compress only when
/// the document changes.
pub type Compressed = Option<(String, Arc<[u8]>)>;

impl Desired {
    /// The document as it will be stored: plain up to [`MAX_DOCUMENT_BYTES`], else gzip'd
    /// if that fits and its JSON stays within [`MAX_INFLATED_DOCUMENT_BYTES`] (what a
    /// sidecar inflates). `Err` names the limit passed and the size that passed it.
    pub fn new(
        json: String,
        hash: String,
        has_policies: bool,
        last: &mut Compressed,
    ) -> Result<Self, Overflow> {
        let mut desired = Self {
            json,
            hash,
            has_policies,
            compressed: None,
        };
        if desired.json.len() <= MAX_DOCUMENT_BYTES {
            return Ok(desired);
        }
        if desired.json.len() > MAX_INFLATED_DOCUMENT_BYTES {
            return Err(Overflow {
                limit: Limit::Json,
                bytes: desired.json.len(),
            });
        }
        let gz = match last {
            Some((hash, gz)) if *hash == desired.hash => gz.clone(),
            _ => gzip(desired.json.as_bytes()),
        };
        if gz.len() > MAX_DOCUMENT_BYTES {
            return Err(Overflow {
                limit: Limit::Compressed,
                bytes: gz.len(),
            });
        }
        *last = Some((desired.hash.clone(), gz.clone()));
        desired.compressed = Some(gz);
        Ok(desired)
    }

    /// What the ConfigMap holds under the document keys once this is written.
    pub fn content(&self) -> Content {
        match &self.compressed {
            Some(gz) => Content::of(None, Some(gz)),
            None => Content::of(Some(&self.json), None),
        }
    }
}

/// Why the live document could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Unreadable {
    #[error("inflating binaryData {CONFIGMAP_KEY}: {0}")]
    Inflate(#[from] std::io::Error),
    #[error("the inflated document passes {MAX_INFLATED_DOCUMENT_BYTES} bytes")]
    TooLarge,
    #[error("parsing {CONFIGMAP_KEY}: {0}")]
    Json(#[from] serde_json::Error),
}

/// The policies a ConfigMap's document serves, uid → generation (no document: none).
pub fn served(cm: &ConfigMap) -> Result<HashMap<String, i64>, Unreadable> {
    #[derive(serde::Deserialize)]
    struct Document {
        #[serde(default)]
        policies: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        #[serde(default)]
        uid: String,
        #[serde(default)]
        generation: i64,
    }
    let plain = cm.data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY));
    let gz = cm.binary_data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY));
    let document: Document = match (plain, gz) {
        (Some(json), _) => serde_json::from_str(json)?,
        (None, Some(gz)) => {
            let limit = MAX_INFLATED_DOCUMENT_BYTES as u64 + 1;
            let mut json = Vec::new();
            std::io::Read::read_to_end(
                &mut std::io::Read::take(flate2::read::GzDecoder::new(&gz.0[..]), limit),
                &mut json,
            )?;
            if json.len() as u64 >= limit {
                return Err(Unreadable::TooLarge);
            }
            serde_json::from_slice(&json)?
        }
        (None, None) => return Ok(HashMap::new()),
    };
    Ok(document
        .policies
        .into_iter()
        .map(|e| (e.uid, e.generation))
        .collect())
}

fn gzip(bytes: &[u8]) -> Arc<[u8]> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = encoder.write_all(bytes);
    encoder.finish().unwrap_or_default().into()
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
    /// The document changes form (plain ↔ compressed): a JSON merge patch that sets the
    /// new key and removes the old one in one write, with the resourceVersion precondition.
    /// (Server-side apply would leave the old key where the first write, a create, owns it,
    /// and a key in both `data` and `binaryData` is invalid.)
    Switch(serde_json::Value),
    /// Someone else's ConfigMap has that name.
    NotOwned,
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
        None => Plan::Create(build(name, namespace, desired, None)),
        Some(cm) => {
            if cm.labelled
                && cm.content == desired.content()
                && cm.hash_annotation.as_deref() == Some(desired.hash.as_str())
            {
                Plan::UpToDate
            } else if (desired.compressed.is_some() && cm.content.plain)
                || (desired.compressed.is_none() && cm.content.compressed)
            {
                Plan::Switch(switch(desired, &cm.resource_version))
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
        data: desired
            .compressed
            .is_none()
            .then(|| BTreeMap::from([(CONFIGMAP_KEY.to_owned(), desired.json.clone())])),
        binary_data: desired
            .compressed
            .as_ref()
            .map(|gz| BTreeMap::from([(CONFIGMAP_KEY.to_owned(), ByteString(gz.to_vec()))])),
        ..ConfigMap::default()
    }
}

/// The merge patch of [`Plan::Switch`].
fn switch(desired: &Desired, resource_version: &str) -> serde_json::Value {
    let (plain, compressed) = match &desired.compressed {
        // ByteString serializes as base64, as the API wants binaryData.
        Some(gz) => (
            serde_json::Value::Null,
            serde_json::to_value(ByteString(gz.to_vec())).unwrap_or_default(),
        ),
        None => (
            serde_json::Value::String(desired.json.clone()),
            serde_json::Value::Null,
        ),
    };
    serde_json::json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {
                MANAGED_BY_LABEL: crate::FIELD_MANAGER,
                PART_OF_LABEL: "rebound",
            },
            "annotations": { HASH_ANNOTATION: desired.hash },
        },
        "data": { CONFIGMAP_KEY: plain },
        "binaryData": { CONFIGMAP_KEY: compressed },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desired(json: &str) -> Desired {
        Desired {
            json: json.to_owned(),
            hash: format!("h-{json}"),
            has_policies: true,
            compressed: None,
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
    fn a_large_document_goes_compressed_into_binary_data() {
        let json = format!("{{\"x\":\"{}\"}}", "ab".repeat(MAX_DOCUMENT_BYTES));
        let mut last = None;
        let big = Desired::new(json.clone(), "h".to_owned(), true, &mut last).expect("fits");
        let gz = big.compressed.clone().expect("compressed");
        assert!(gz.len() <= MAX_DOCUMENT_BYTES);
        let mut inflated = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut inflated)
            .expect("gzip");
        assert_eq!(inflated, json.as_bytes());
        let Plan::Create(cm) = plan("cm", "ns", None, &big) else {
            panic!("expected a create");
        };
        assert!(cm.data.is_none());
        let stored = cm.binary_data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY));
        assert_eq!(stored.map(|b| &b.0[..]), Some(&gz[..]));
        assert_eq!(Content::of_configmap(&cm), big.content());
        // Written: the same document is up to date, from the cache of the last gzip.
        let written = ConfigMapView {
            content: big.content(),
            hash_annotation: Some("h".to_owned()),
            ..view(true, None)
        };
        let again = Desired::new(json, "h".to_owned(), true, &mut last).expect("fits");
        assert_eq!(plan("cm", "ns", Some(&written), &again), Plan::UpToDate);
        // Written plain before: one write that swaps the forms.
        let plain = ConfigMapView {
            content: Content::of(Some("{}"), None),
            ..view(true, Some("{}"))
        };
        let Plan::Switch(patch) = plan("cm", "ns", Some(&plain), &big) else {
            panic!("expected a switch");
        };
        assert_eq!(patch["data"][CONFIGMAP_KEY], serde_json::Value::Null);
        assert!(patch["binaryData"][CONFIGMAP_KEY].is_string());
        assert_eq!(patch["metadata"]["resourceVersion"], "7");
        // A small one stays plain.
        let small = Desired::new("{}".to_owned(), "h".to_owned(), true, &mut last);
        assert_eq!(small.map(|d| d.compressed), Ok(None));
    }

    #[test]
    fn refuses_what_does_not_fit_even_compressed() {
        // Pseudo-random text does not compress below the limit.
        let mut x: u64 = 1;
        let noise: String = (0..MAX_DOCUMENT_BYTES * 2)
            .map(|_| {
                x = rebound_policy::decide::mix64(x);
                char::from(b'a' + (x % 26) as u8)
            })
            .collect();
        let json = format!("{{\"x\":\"{noise}\"}}");
        let over = Desired::new(json, "h".to_owned(), true, &mut None).expect_err("too large");
        assert_eq!(over.limit, Limit::Compressed);
        assert!(over.bytes > MAX_DOCUMENT_BYTES && over.bytes < MAX_DOCUMENT_BYTES * 2);
        // Over the JSON limit: the JSON's length, against the JSON limit (it would compress
        // to a few KiB, far under the compressed limit).
        let huge = "x".repeat(MAX_INFLATED_DOCUMENT_BYTES + 1);
        assert_eq!(
            Desired::new(huge, "h".to_owned(), true, &mut None),
            Err(Overflow {
                limit: Limit::Json,
                bytes: MAX_INFLATED_DOCUMENT_BYTES + 1
            })
        );
    }
}
