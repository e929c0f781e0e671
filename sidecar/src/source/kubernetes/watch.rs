//! The watch of one ConfigMap, written out rather than kube's `watcher` so that each
//! control-plane fault is handled the way client-go's reflector handles it:
//!
//! - the object is listed once, then watched from the list's `resourceVersion`; a watch
//!   that ends (the server's timeout, an API server restart) is resumed from the last
//!   `resourceVersion` seen (bookmarks keep it current), with no new list;
//! - `410 Gone` (the version fell out of the server's window) relists at once, once; the
//!   last good configuration keeps answering in between, so nothing is ever unserved;
//! - a failure waits for [`WatchBackoff`]: full jitter under a short cap, reset as soon as
//!   a list or watch is accepted again, and never shorter than a `Retry-After` the server
//!   sent in its `Status`;
//! - the [`crate::source_link::SourceLink`] says whether changes are seen.

use std::{sync::Arc, time::Duration, time::Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::core::Status;
use kube::{Api, Client, ResourceExt};
use rebound_runtime::watch_backoff::{SIDECAR_CAP, WatchBackoff};

use super::{Change, ConfigMapSource, document};
use crate::store::{self, LoadError, Store};
use crate::system_now_ms;

/// The server ends each watch after this long (client-go picks 5-10 minutes at random);
/// it is then resumed from its last version at once.
const WATCH_TIMEOUT_S: u32 = 290;

/// Why a list or watch stopped.
enum Stop {
    /// The server closed the watch normally: resume at once.
    Ended,
    /// The version is too old: list again at once.
    Gone,
    /// A failure: back off (at least `retry_after`), then resume.
    Failed {
        error: kube::Error,
        retry_after: Option<Duration>,
    },
}

/// The watch's state between requests.
struct Watch<'a> {
    api: Api<ConfigMap>,
    source: &'a ConfigMapSource,
    origin: String,
    store: Arc<Store>,
    selector: String,
    /// Where to resume from; `None` lists first.
    version: Option<String>,
    last_error: Option<String>,
}

/// Runs until the task is dropped.
pub async fn run(source: &ConfigMapSource, client: Client, store: Arc<Store>) {
    let origin = source.target.to_string();
    let link = Arc::clone(store.metrics().source_link());
    link.starting(system_now_ms());
    let mut backoff = WatchBackoff::new(&format!("sidecar/{origin}"), SIDECAR_CAP);
    let mut watch = Watch {
        api: Api::namespaced(client, &source.target.namespace),
        source,
        selector: format!("metadata.name={}", source.target.name),
        origin,
        store,
        version: None,
        last_error: None,
    };
    loop {
        let stop = match watch.version.clone() {
            None => watch.list(&mut backoff).await,
            Some(version) => watch.watch(&version, &mut backoff).await,
        };
        match stop {
            Stop::Ended => {}
            Stop::Gone => {
                tracing::info!(origin = %watch.origin, "watch version expired (410); listing again");
                watch.version = None;
            }
            Stop::Failed { error, retry_after } => {
                let serving = watch.store.current();
                link.disconnected(
                    &watch.origin,
                    system_now_ms(),
                    &error,
                    serving.as_deref().map(store::Loaded::hash),
                    watch.store.state().as_str(),
                );
                if let Some(wait) = retry_after {
                    backoff.retry_after(wait);
                }
                let delay = backoff.next().unwrap_or(SIDECAR_CAP);
                tracing::debug!(
                    origin = %watch.origin,
                    %error,
                    failures = backoff.failures(),
                    delay_ms = delay.as_millis() as u64,
                    "configuration watch failed; retrying"
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}

impl Watch<'_> {
    /// The API server answered: changes are seen again.
    fn reached(&self, backoff: &mut WatchBackoff) {
        backoff.reset();
        let serving = self.store.current();
        self.store.metrics().source_link().connected(
            &self.origin,
            system_now_ms(),
            serving.as_deref().map(store::Loaded::hash),
        );
    }

    async fn list(&mut self, backoff: &mut WatchBackoff) -> Stop {
        let params = ListParams::default().fields(&self.selector);
        let list = match self.api.list(&params).await {
            Ok(list) => list,
            Err(error) => return failed(error),
        };
        self.reached(backoff);
        let started = Instant::now();
        match list.items.first() {
            Some(cm) => self.apply(cm, started).await,
            None => self.unusable(format!("{} does not exist", self.origin)),
        }
        match list.metadata.resource_version.filter(|v| !v.is_empty()) {
            Some(version) => {
                self.version = Some(version);
                Stop::Ended
            }
            None => failed(kube::Error::Api(
                Status::failure("the list has no resourceVersion", "NoResourceVersion").boxed(),
            )),
        }
    }

    async fn watch(&mut self, version: &str, backoff: &mut WatchBackoff) -> Stop {
        let params = WatchParams::default()
            .fields(&self.selector)
            .timeout(WATCH_TIMEOUT_S);
        let events = match self.api.watch(&params, version).await {
            Ok(events) => events,
            Err(kube::Error::Api(status)) if status.code == 410 => return Stop::Gone,
            Err(error) => return failed(error),
        };
        self.reached(backoff);
        let mut events = events.boxed();
        loop {
            let event = match events.try_next().await {
                Ok(Some(event)) => event,
                Ok(None) => return Stop::Ended,
                Err(error) => return failed(error),
            };
            let started = Instant::now();
            match event {
                WatchEvent::Added(cm) | WatchEvent::Modified(cm) => {
                    self.advance(cm.resource_version());
                    self.apply(&cm, started).await;
                }
                WatchEvent::Deleted(cm) => {
                    self.advance(cm.resource_version());
                    self.unusable(format!("{} was deleted", self.origin));
                }
                WatchEvent::Bookmark(mark) => {
                    self.advance(Some(mark.metadata.resource_version));
                }
                WatchEvent::Error(status) if status.code == 410 => return Stop::Gone,
                WatchEvent::Error(status) => return failed(kube::Error::Api(status.boxed())),
            }
        }
    }

    fn advance(&mut self, version: Option<String>) {
        if let Some(version) = version.filter(|v| !v.is_empty()) {
            self.version = Some(version);
        }
    }

    /// Parses and installs the document on the blocking pool, so requests never wait.
    async fn apply(&mut self, cm: &ConfigMap, started: Instant) {
        let bytes = match document(cm, &self.source.key, &self.source.target) {
            Change::Document(bytes) => bytes.to_vec(),
            Change::Unusable(message) => return self.unusable(message),
        };
        let (store, origin) = (Arc::clone(&self.store), self.origin.clone());
        let parsed = tokio::task::spawn_blocking(move || {
            let result = super::super::inflate(&bytes, &origin)
                .and_then(|json| store::parse_compiled(&json, &origin))
                .map(|table| store.install(table, &origin, started));
            drop(bytes);
            store::release_freed_memory();
            result
        })
        .await;
        match parsed {
            Ok(Ok(_)) => self.last_error = None,
            Ok(Err(error)) => self.report(&error),
            Err(join) => tracing::error!(%join, "configuration parse task failed"),
        }
    }

    fn unusable(&mut self, message: String) {
        let error = LoadError::Source {
            origin: self.origin.clone(),
            message,
        };
        self.report(&error);
    }

    /// Counts a rejected input once per distinct message, so an object that stays unusable
    /// does not flood the logs.
    fn report(&mut self, error: &LoadError) {
        let message = error.to_string();
        if self.last_error.as_ref() != Some(&message) {
            self.store.reject(error);
            self.last_error = Some(message);
        }
    }
}

/// A failure, with the wait the server asked for in its `Status` (`retryAfterSeconds`).
fn failed(error: kube::Error) -> Stop {
    let retry_after = match &error {
        kube::Error::Api(status) => status
            .details
            .as_ref()
            .map(|d| d.retry_after_seconds)
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(u64::from(s))),
        _ => None,
    };
    Stop::Failed { error, retry_after }
}
