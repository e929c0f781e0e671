//! The namespace's compiled ConfigMap, written as the operator writes it, for tests and
//! examples that stand in for the operator, and read back as a sidecar reads it.

use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use rebound_policy::CompiledDocument;
use rebound_policy::compiled::CONFIGMAP_KEY;

/// The ConfigMap's name, as the operator writes it.
pub const CONFIGMAP: &str = "rebound-policies";

/// The ConfigMap [`CONFIGMAP`] holding `document` in plain JSON.
pub fn configmap(document: &CompiledDocument) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(CONFIGMAP.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(
            CONFIGMAP_KEY.to_owned(),
            document.to_json(),
        )])),
        ..ConfigMap::default()
    }
}

/// Creates [`CONFIGMAP`] with `document` in `api`'s namespace, or replaces the one there.
pub async fn put(api: &Api<ConfigMap>, document: &CompiledDocument) -> Result<()> {
    let mut cm = configmap(document);
    match api.get_opt(CONFIGMAP).await? {
        Some(current) => {
            cm.metadata.resource_version = current.metadata.resource_version;
            api.replace(CONFIGMAP, &PostParams::default(), &cm).await?;
        }
        None => {
            api.create(&PostParams::default(), &cm).await?;
        }
    }
    Ok(())
}

/// The hash of the document in `api`'s [`CONFIGMAP`], if there is one a sidecar can read
/// (plain JSON; the compressed form is the operator tests' concern).
pub async fn hash(api: &Api<ConfigMap>) -> Option<String> {
    let cm = api.get_opt(CONFIGMAP).await.ok()??;
    let json = cm.data?.remove(CONFIGMAP_KEY)?;
    Some(CompiledDocument::from_json(json.as_bytes()).ok()?.hash)
}
