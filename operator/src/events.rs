//! Kubernetes Events (events.k8s.io/v1), published off the reconcile path by one background
//! task so a burst of status changes never slows the ConfigMap write. Events are best
//! effort: a full queue or a failed publish is logged, not retried.
//!
//! Repeats of one (type, reason, object) within [`FOLD_FOR`] fold into one Event with a
//! series count, as kube-runtime's `Recorder` does. Unlike it, the Event's name always
//! fits: `{object name}.{nanoseconds in hex}` with the object name cut short where the whole
//! would pass the 253-character limit (a valid policy name can be 253 characters itself).

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::error::status_code;
use crate::metrics::Metrics;
use crate::status::EventNote;

/// Events waiting to be published; beyond this they are dropped.
const QUEUE: usize = 4_096;
/// Repeats within this long become a series on one Event (kube-runtime uses the same).
const FOLD_FOR: SignedDuration = SignedDuration::from_mins(6);
/// Longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;
/// Longest `reportingInstance` the API accepts.
const MAX_INSTANCE: usize = 128;

/// Sends events to the publishing task.
#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<(EventNote, ObjectReference)>,
}

impl Events {
    /// Starts the publishing task; it ends when every `Events` handle is dropped.
    pub fn start(client: kube::Client, instance: String, metrics: Arc<Metrics>) -> Self {
        let (tx, mut rx) = mpsc::channel::<(EventNote, ObjectReference)>(QUEUE);
        let mut publisher = Publisher {
            client,
            instance: truncate(&instance, MAX_INSTANCE).to_owned(),
            recent: Recents::default(),
        };
        tokio::spawn(async move {
            while let Some((note, reference)) = rx.recv().await {
                metrics.wrote("event");
                if let Err(e) = publisher.publish(&note, &reference).await {
                    let code = status_code(&e);
                    warn!(error = %e, code, reason = note.reason, object = ?reference.name, "could not publish event");
                }
            }
            debug!("event publisher stopped");
        });
        Self { tx }
    }

    /// Queues an event about `regarding`.
    pub fn emit(&self, note: EventNote, regarding: ObjectReference) {
        if self.tx.try_send((note, regarding)).is_err() {
            warn!("event queue full or closed; dropping an event");
        }
    }
}

/// What an Event is folded by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    warning: bool,
    reason: &'static str,
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
}

/// An Event published recently: its name and how often it occurred.
struct Recent {
    name: String,
    count: i32,
    last: Timestamp,
}

struct Publisher {
    client: kube::Client,
    instance: String,
    recent: Recents,
}

/// Most Events remembered for folding. Past it, new Events are still published, only not
/// folded with a repeat: a burst of 100,000 new policies then costs no more memory than
/// this, and a publish never scans more than it.
const MAX_RECENT: usize = QUEUE;

/// The Events published within [`FOLD_FOR`], by what they fold by.
#[derive(Default)]
struct Recents {
    by_key: HashMap<Key, Recent>,
    /// When expired entries were last dropped (a scan of all, so at most once a second).
    swept: Option<Timestamp>,
}

impl Recents {
    /// The Event a new one with `key` folds into at `now`, if any.
    fn get_mut(&mut self, key: &Key, now: Timestamp) -> Option<&mut Recent> {
        self.sweep(now);
        self.by_key.get_mut(key).filter(|r| r.last + FOLD_FOR > now)
    }

    /// Remembers a published Event, unless [`MAX_RECENT`] are remembered already.
    fn remember(&mut self, key: Key, recent: Recent) {
        if self.by_key.len() < MAX_RECENT || self.by_key.contains_key(&key) {
            self.by_key.insert(key, recent);
        }
    }

    fn sweep(&mut self, now: Timestamp) {
        if self
            .swept
            .is_some_and(|t| t + SignedDuration::from_secs(1) > now)
        {
            return;
        }
        self.by_key.retain(|_, r| r.last + FOLD_FOR > now);
        self.swept = Some(now);
    }
}

impl Publisher {
    async fn publish(
        &mut self,
        note: &EventNote,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let key = Key {
            warning: note.warning,
            reason: note.reason,
            namespace: regarding.namespace.clone(),
            name: regarding.name.clone(),
            uid: regarding.uid.clone(),
        };
        if let Some(recent) = self.recent.get_mut(&key, now) {
            let series = EventSeries {
                count: recent.count + 1,
                last_observed_time: MicroTime(now),
            };
            let body = serde_json::json!({ "series": series });
            match api
                .patch(&recent.name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => {
                    recent.count += 1;
                    recent.last = now;
                    return Ok(());
                }
                // Gone (expired or deleted): start a new one.
                Err(e) if status_code(&e) == Some(404) => {}
                Err(e) => return Err(e),
            }
        }
        let object = regarding.name.as_deref().unwrap_or(crate::FIELD_MANAGER);
        let name = event_name(object, now.as_nanosecond());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.to_owned()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some("Reconcile".to_owned()),
            reason: Some(note.reason.to_owned()),
            note: Some(note.note.clone()),
            type_: Some(if note.warning { "Warning" } else { "Normal" }.to_owned()),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(crate::FIELD_MANAGER.to_owned()),
            reporting_instance: Some(self.instance.clone()),
            ..Event::default()
        };
        api.create(&PostParams::default(), &event).await?;
        self.recent.remember(
            key,
            Recent {
                name,
                count: 1,
                last: now,
            },
        );
        Ok(())
    }
}

/// `{object}.{nanos in hex}`, with `object` cut short so the whole is a valid name of at
/// most 253 characters (a cut never leaves a trailing `.` or `-`).
pub fn event_name(object: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let prefix = truncate(object, MAX_NAME - suffix.len()).trim_end_matches(['.', '-']);
    let prefix = if prefix.is_empty() {
        crate::FIELD_MANAGER
    } else {
        prefix
    };
    format!("{prefix}{suffix}")
}

/// The longest prefix of `text` of at most `max` bytes that ends on a char boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DNS subdomain: lowercase alphanumerics, `-` and `.`, starting and ending with an
    /// alphanumeric, at most 253 characters.
    fn is_subdomain(name: &str) -> bool {
        let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        name.len() <= MAX_NAME
            && name.starts_with(alnum)
            && name.ends_with(alnum)
            && name.chars().all(|c| alnum(c) || c == '-' || c == '.')
    }

    fn key(name: &str) -> Key {
        Key {
            warning: false,
            reason: "Compiled",
            namespace: Some("ns".to_owned()),
            name: Some(name.to_owned()),
            uid: None,
        }
    }

    fn recent(last: Timestamp) -> Recent {
        Recent {
            name: "e".to_owned(),
            count: 1,
            last,
        }
    }

    #[test]
    fn recents_fold_within_the_window_and_stay_bounded() {
        let t0 = Timestamp::from_second(1_800_000_000).expect("time");
        let mut recents = Recents::default();
        recents.remember(key("a"), recent(t0));
        assert!(
            recents
                .get_mut(&key("a"), t0 + FOLD_FOR - SignedDuration::from_secs(1))
                .is_some()
        );
        // Expired: not folded into, even before a sweep drops it.
        assert!(recents.get_mut(&key("a"), t0 + FOLD_FOR).is_none());
        for i in 0..2 * MAX_RECENT {
            recents.remember(key(&format!("p{i}")), recent(t0 + FOLD_FOR));
        }
        assert_eq!(recents.by_key.len(), MAX_RECENT);
        // A remembered one is still updated when full.
        recents.remember(
            key("p0"),
            recent(t0 + FOLD_FOR + SignedDuration::from_secs(5)),
        );
        let later = t0 + FOLD_FOR + SignedDuration::from_secs(10);
        assert!(recents.get_mut(&key("p0"), later).is_some());
        // Once all have expired, a sweep empties it.
        let much_later = later + FOLD_FOR + FOLD_FOR;
        assert!(recents.get_mut(&key("p0"), much_later).is_none());
        assert!(recents.by_key.is_empty());
    }

    #[test]
    fn short_names_keep_the_usual_form() {
        assert_eq!(
            event_name("emails", 0x178959f726d80ec),
            "emails.178959f726d80ec"
        );
    }

    #[test]
    fn every_valid_name_gives_a_valid_unique_event_name() {
        let nanos = 1_764_700_000_123_456_789_i128;
        for object in [
            "x".repeat(253),
            format!("{}.{}", "a".repeat(200), "b".repeat(52)),
            format!("{}-{}", "a".repeat(235), "b".repeat(17)),
            format!("{}.{}", "a".repeat(234), "b".repeat(18)),
        ] {
            let a = event_name(&object, nanos);
            assert!(is_subdomain(&a), "{a}");
            assert!(a.starts_with(&object[..200]));
            assert_ne!(a, event_name(&object, nanos + 1));
        }
    }
}
