//! Reading sidecar Leases the API server accepts but no typed client can hold, so one odd
//! Lease never fails the operator's Lease watch.

use std::collections::HashSet;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::ResourceExt;
use kube::runtime::watcher::Event;

/// A sidecar Lease as the watch reads it: the API server stores Leases no typed client can
/// hold (a `renewTime` or a `managedFields` time in year 9999), and one such Lease must not
/// fail the list. So the metadata counting needs is taken field by field, the spec kept
/// untyped for [`Lenient`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RawLease {
    pub metadata: kube::api::ObjectMeta,
    pub spec: serde_json::Value,
}

impl<'de> serde::Deserialize<'de> for RawLease {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Raw {
            #[serde(default)]
            metadata: serde_json::Value,
            #[serde(default)]
            spec: serde_json::Value,
        }
        let raw = Raw::deserialize(deserializer)?;
        let text = |field: &str| raw.metadata.get(field)?.as_str().map(str::to_owned);
        let labels = raw
            .metadata
            .get("labels")
            .and_then(|l| serde_json::from_value(l.clone()).ok());
        // Of the annotations only the rollout evidence report is read (bounded and parsed
        // later); the others, up to 256 KiB, are never copied.
        let annotations = raw
            .metadata
            .get("annotations")
            .and_then(|a| a.get(rebound_policy::rollout::evidence::EVIDENCE_ANNOTATION))
            .and_then(|v| v.as_str())
            .map(|text| {
                let limit = rebound_policy::rollout::evidence::MAX_EVIDENCE_BYTES;
                let text = if text.len() > limit {
                    format!("{{\"oversized\":{}}}", text.len())
                } else {
                    text.to_owned()
                };
                [(
                    rebound_policy::rollout::evidence::EVIDENCE_ANNOTATION.to_owned(),
                    text,
                )]
                .into()
            });
        Ok(RawLease {
            metadata: kube::api::ObjectMeta {
                name: text("name"),
                namespace: text("namespace"),
                resource_version: text("resourceVersion"),
                uid: text("uid"),
                labels,
                annotations,
                ..kube::api::ObjectMeta::default()
            },
            spec: raw.spec,
        })
    }
}

impl kube::Resource for RawLease {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Lease".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "coordination.k8s.io".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "leases".into()
    }
    fn meta(&self) -> &kube::api::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut kube::api::ObjectMeta {
        &mut self.metadata
    }
}

/// Turns the untyped Lease watch into typed events. A Lease that does not deserialize
/// keeps its metadata and the spec fields that do; a field that does not is dropped (a
/// Lease without `renewTime` counts as no member) with one warning per Lease, naming it.
#[derive(Default)]
pub struct Lenient {
    warned: HashSet<(String, String)>,
}

impl Lenient {
    pub fn typed(&mut self, event: Event<RawLease>) -> Event<Lease> {
        match event {
            Event::Init => Event::Init,
            Event::InitDone => Event::InitDone,
            Event::InitApply(o) => Event::InitApply(self.lease(o)),
            Event::Apply(o) => Event::Apply(self.lease(o)),
            Event::Delete(o) => {
                let key = (o.namespace().unwrap_or_default(), o.name_any());
                self.warned.remove(&key);
                Event::Delete(self.lease(o))
            }
        }
    }

    fn lease(&mut self, mut object: RawLease) -> Lease {
        let spec = std::mem::take(&mut object.spec);
        let parsed = serde_json::from_value::<LeaseSpec>(spec.clone());
        let spec = match parsed {
            Ok(spec) => spec,
            Err(error) => {
                let key = (object.namespace().unwrap_or_default(), object.name_any());
                if self.warned.insert(key.clone()) {
                    tracing::warn!(
                        namespace = %key.0,
                        lease = %key.1,
                        %error,
                        "skipping the fields of a sidecar Lease that cannot be read"
                    );
                }
                lenient_spec(&spec)
            }
        };
        Lease {
            metadata: object.metadata,
            spec: Some(spec),
        }
    }
}

/// The fields of `spec` that deserialize one by one.
fn lenient_spec(spec: &serde_json::Value) -> LeaseSpec {
    let field = |name: &str| -> serde_json::Value {
        let mut one = serde_json::Map::new();
        if let Some(v) = spec.get(name) {
            one.insert(name.to_owned(), v.clone());
        }
        serde_json::Value::Object(one)
    };
    let part = |name: &str| serde_json::from_value::<LeaseSpec>(field(name)).unwrap_or_default();
    LeaseSpec {
        holder_identity: part("holderIdentity").holder_identity,
        lease_duration_seconds: part("leaseDurationSeconds").lease_duration_seconds,
        renew_time: part("renewTime").renew_time,
        acquire_time: part("acquireTime").acquire_time,
        ..LeaseSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{CONFIGMAP_LABEL, record};

    #[test]
    fn a_lease_no_type_can_hold_is_read_without_its_bad_fields() {
        let object: RawLease = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "rebound-sidecar-x", "namespace": "a",
                         "labels": {CONFIGMAP_LABEL: "cm"},
                         "managedFields": [{"manager": "m", "time": "9999-12-31T23:59:59Z"}]},
            "spec": {"holderIdentity": "x", "leaseDurationSeconds": 15,
                     "renewTime": "9999-12-31T23:59:59.000000Z"},
        }))
        .expect("object");
        let mut lenient = Lenient::default();
        let Event::Apply(lease) = lenient.typed(Event::Apply(object.clone())) else {
            panic!("not an Apply");
        };
        let spec = lease.spec.clone().expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("x"));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.renew_time, None);
        let record = record(&lease, "cm").expect("record");
        assert!(!record.holds(), "never renewed as far as can be read");
        // Warned once per Lease.
        lenient.typed(Event::Apply(object));
        assert_eq!(lenient.warned.len(), 1);
    }
}
