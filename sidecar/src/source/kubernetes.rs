//! Configuration from a watch of one ConfigMap, for sub-second propagation.
//!
//! The watch lists and watches with `fieldSelector=metadata.name=<name>`, so RBAC can be
//! narrowed to that one object: `get`, `list` and `watch` on `configmaps` with
//! `resourceNames: [<name>]`. The client comes from `KUBECONFIG` (or `~/.kube/config`) or the
//! in-cluster service account.

use std::{str::FromStr, sync::Arc, time::Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};
use rebound_policy::compiled::CONFIGMAP_KEY;

use crate::store::{self, LoadError, Store};

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

/// The watch could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot create a Kubernetes client (KUBECONFIG or in-cluster): {0}")]
pub struct ClientError(#[from] kube::Error);

/// What one watch event means for the configuration.
#[derive(Debug, PartialEq)]
pub enum Change<'a> {
    /// A new version of the document's bytes.
    Document(&'a [u8]),
    /// The object or its key is gone; keep the last good configuration.
    Unusable(String),
    /// Nothing to do (a restart marker).
    Nothing,
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

/// Interprets one watch event. `seen` tracks whether the object exists, so that the end of
/// an initial listing without it is reported.
pub fn interpret<'a>(
    event: &'a watcher::Event<ConfigMap>,
    key: &str,
    origin: &ConfigMapRef,
    seen: &mut bool,
) -> Change<'a> {
    match event {
        watcher::Event::Init => {
            *seen = false;
            Change::Nothing
        }
        watcher::Event::InitApply(cm) | watcher::Event::Apply(cm) => {
            *seen = true;
            document(cm, key, origin)
        }
        watcher::Event::Delete(_) => {
            *seen = false;
            Change::Unusable(format!("{origin} was deleted"))
        }
        watcher::Event::InitDone if !*seen => Change::Unusable(format!("{origin} does not exist")),
        watcher::Event::InitDone => Change::Nothing,
    }
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

    /// Connects with the default client configuration.
    pub async fn client() -> Result<Client, ClientError> {
        Ok(Client::try_default().await?)
    }

    /// Runs until the stream ends (it retries with backoff, so in practice until the task
    /// is dropped). Parsing runs on the blocking pool so requests never wait for it.
    pub async fn run(self, client: Client, store: Arc<Store>) {
        let api: Api<ConfigMap> = Api::namespaced(client, &self.target.namespace);
        let selector = format!("metadata.name={}", self.target.name);
        let mut events = watcher(api, watcher::Config::default().fields(&selector))
            .default_backoff()
            .boxed();
        let origin = self.target.to_string();
        let mut seen = false;
        let mut last_error: Option<String> = None;
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(error) => {
                    let error = LoadError::Source {
                        origin: origin.clone(),
                        message: error.to_string(),
                    };
                    report(&store, &mut last_error, &error);
                    continue;
                }
            };
            let started = Instant::now();
            match interpret(&event, &self.key, &self.target, &mut seen) {
                Change::Nothing => {}
                Change::Unusable(message) => {
                    let error = LoadError::Source {
                        origin: origin.clone(),
                        message,
                    };
                    report(&store, &mut last_error, &error);
                }
                Change::Document(bytes) => {
                    let bytes = bytes.to_vec();
                    let (store2, origin2) = (Arc::clone(&store), origin.clone());
                    let parsed = tokio::task::spawn_blocking(move || {
                        let result = super::inflate(&bytes, &origin2)
                            .and_then(|json| store::parse_compiled(&json, &origin2))
                            .map(|doc| store2.install(doc, &origin2, started));
                        drop(bytes);
                        store::release_freed_memory();
                        result
                    })
                    .await;
                    match parsed {
                        Ok(Ok(_)) => last_error = None,
                        Ok(Err(error)) => report(&store, &mut last_error, &error),
                        Err(join) => tracing::error!(%join, "configuration parse task failed"),
                    }
                }
            }
        }
    }
}

/// Counts a failure once per distinct message, so a watch that keeps failing the same way
/// does not flood the logs.
fn report(store: &Store, last_error: &mut Option<String>, error: &LoadError) {
    let message = error.to_string();
    if last_error.as_ref() != Some(&message) {
        store.reject(error);
        *last_error = Some(message);
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

    #[test]
    fn reports_deletion_and_absence_after_the_initial_list() {
        let t = target();
        let mut seen = false;
        let key = "policies.json";
        assert_eq!(
            interpret(&watcher::Event::Init, key, &t, &mut seen),
            Change::Nothing
        );
        assert!(matches!(
            interpret(&watcher::Event::InitDone, key, &t, &mut seen),
            Change::Unusable(m) if m.contains("does not exist")
        ));
        let obj = cm(Some((key, "x")));
        let applied = watcher::Event::Apply(obj.clone());
        assert_eq!(
            interpret(&applied, key, &t, &mut seen),
            Change::Document(b"x")
        );
        assert!(seen);
        let deleted = watcher::Event::Delete(obj);
        assert!(matches!(
            interpret(&deleted, key, &t, &mut seen),
            Change::Unusable(m) if m.contains("deleted")
        ));
    }
}
