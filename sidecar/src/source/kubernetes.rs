//! Configuration from a watch of one ConfigMap, for sub-second propagation.
//!
//! The watch lists and watches with `fieldSelector=metadata.name=<name>`, so RBAC can be
//! narrowed to that one object: `get`, `list` and `watch` on `configmaps` with
//! `resourceNames: [<name>]`. The client comes from `KUBECONFIG` (or `~/.kube/config`) or the
//! in-cluster service account.

use std::{str::FromStr, sync::Arc};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use rebound_policy::compiled::CONFIGMAP_KEY;

use crate::store::{LoadError, Store};

/// `namespace/name` of the ConfigMap to watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigMapRef {
    pub namespace: String,
    pub name: String,
}

impl FromStr for ConfigMapRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((namespace, name))
                if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
            {
                Ok(Self {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => Err(format!("expected NAMESPACE/NAME, got {s:?}")),
        }
    }
}

impl std::fmt::Display for ConfigMapRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "configmap/{}/{}", self.namespace, self.name)
    }
}

mod watch;

/// The watch could not start.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct ClientError(#[from] rebound_runtime::api_client::ApiClientError);

/// What one watch event means for the configuration.
#[derive(Debug, PartialEq)]
pub enum Change<'a> {
    /// A new version of the document's bytes.
    Document(&'a [u8]),
    /// The object or its key is gone; keep the last good configuration.
    Unusable(String),
}

/// The document in a ConfigMap: `data[key]`, or `binaryData[key]`.
pub fn document<'a>(cm: &'a ConfigMap, key: &str, origin: &ConfigMapRef) -> Change<'a> {
    if let Some(text) = cm.data.as_ref().and_then(|d| d.get(key)) {
        return Change::Document(text.as_bytes());
    }
    if let Some(bytes) = cm.binary_data.as_ref().and_then(|d| d.get(key)) {
        return Change::Document(&bytes.0);
    }
    Change::Unusable(
        LoadError::MissingKey {
            origin: origin.to_string(),
            key: key.to_owned(),
        }
        .to_string(),
    )
}

/// Watches one ConfigMap and installs each new document.
pub struct ConfigMapSource {
    pub target: ConfigMapRef,
    pub key: String,
}

impl ConfigMapSource {
    pub fn new(target: ConfigMapRef, key: Option<String>) -> Self {
        Self {
            target,
            key: key.unwrap_or_else(|| CONFIGMAP_KEY.to_owned()),
        }
    }

    /// Connects with the default client configuration, through the API client the
    /// binaries share (HTTP/2 keepalive, connect timeout, bounded in-client retries).
    pub async fn client() -> Result<Client, ClientError> {
        Ok(rebound_runtime::api_client::infer().await?)
    }

    /// Runs until the task is dropped; see [`watch`] for how faults are handled.
    pub async fn run(self, client: Client, store: Arc<Store>) {
        watch::run(&self, client, store).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;

    use super::*;

    fn cm(data: Option<(&str, &str)>) -> ConfigMap {
        ConfigMap {
            data: data.map(|(k, v)| BTreeMap::from([(k.to_owned(), v.to_owned())])),
            ..Default::default()
        }
    }

    fn target() -> ConfigMapRef {
        "ns/rebound-policies".parse().expect("valid")
    }

    #[test]
    fn parses_namespace_slash_name() {
        assert_eq!(
            target(),
            ConfigMapRef {
                namespace: "ns".to_owned(),
                name: "rebound-policies".to_owned()
            }
        );
        for bad in ["", "ns", "/x", "ns/", "a/b/c"] {
            assert!(bad.parse::<ConfigMapRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn reads_the_key_from_data_or_binary_data() {
        let t = target();
        let with = cm(Some(("policies.json", "{}")));
        assert_eq!(
            document(&with, "policies.json", &t),
            Change::Document(b"{}")
        );
        let other = cm(Some(("other", "{}")));
        assert!(
            matches!(document(&other, "policies.json", &t), Change::Unusable(m) if m.contains("policies.json"))
        );
        let binary = ConfigMap {
            binary_data: Some(BTreeMap::from([(
                "policies.json".to_owned(),
                ByteString(b"[]".to_vec()),
            )])),
            ..Default::default()
        };
        assert_eq!(
            document(&binary, "policies.json", &t),
            Change::Document(b"[]")
        );
    }
}
