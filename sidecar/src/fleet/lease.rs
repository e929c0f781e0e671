//! A Lease as the fleet reads it: the API server stores Leases no typed client can hold (a
//! `renewTime` or a `managedFields` time in year 9999 both pass its validation), and a
//! list fails as a whole on one of them. So the watch reads this type instead: the
//! metadata fields membership needs, each taken only if it reads, and the spec untyped
//! (read field by field by [`super::membership::record`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// A sidecar Lease, leniently read.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SeenLease {
    pub metadata: ObjectMeta,
    pub spec: Value,
}

impl<'de> Deserialize<'de> for SeenLease {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Raw {
            #[serde(default)]
            metadata: Value,
            #[serde(default)]
            spec: Value,
        }
        let raw = Raw::deserialize(deserializer)?;
        let text = |field: &str| raw.metadata.get(field)?.as_str().map(str::to_owned);
        let labels = raw
            .metadata
            .get("labels")
            .and_then(|l| serde_json::from_value::<BTreeMap<String, String>>(l.clone()).ok());
        Ok(SeenLease {
            metadata: ObjectMeta {
                name: text("name"),
                namespace: text("namespace"),
                resource_version: text("resourceVersion"),
                uid: text("uid"),
                labels,
                ..ObjectMeta::default()
            },
            spec: raw.spec,
        })
    }
}

impl kube::Resource for SeenLease {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Lease".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "coordination.k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "leases".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_no_type_can_hold_is_left_out_not_fatal() {
        let lease: SeenLease = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "rebound-sidecar-x", "resourceVersion": "7",
                "labels": {"rebound.dev/configmap": "cm"},
                "creationTimestamp": "9999-12-31T23:59:59Z",
                "managedFields": [{"manager": "m", "time": "9999-12-31T23:59:59Z"}],
            },
            "spec": {"renewTime": "9999-12-31T23:59:59.000000Z"},
        }))
        .unwrap();
        assert_eq!(lease.metadata.name.as_deref(), Some("rebound-sidecar-x"));
        assert_eq!(lease.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(
            lease.metadata.labels.unwrap()["rebound.dev/configmap"],
            "cm"
        );
        assert_eq!(lease.spec["renewTime"], "9999-12-31T23:59:59.000000Z");
    }
}
