//! Kubernetes Events, published off the reconcile path by one background task so a burst
//! of status changes never slows the ConfigMap write. Events are best effort: a full
//! queue or a failed publish is logged, not retried.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::metrics::Metrics;
use crate::status::EventNote;

/// Events waiting to be published; beyond this they are dropped.
const QUEUE: usize = 4_096;

/// Sends events to the publishing task.
#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<(EventNote, ObjectReference)>,
}

impl Events {
    /// Starts the publishing task; it ends when every `Events` handle is dropped.
    pub fn start(client: kube::Client, instance: String, metrics: Arc<Metrics>) -> Self {
        let (tx, mut rx) = mpsc::channel::<(EventNote, ObjectReference)>(QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: crate::FIELD_MANAGER.to_owned(),
                instance: Some(instance),
            },
        );
        tokio::spawn(async move {
            while let Some((note, reference)) = rx.recv().await {
                let event = Event {
                    type_: if note.warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: note.reason.to_owned(),
                    note: Some(note.note),
                    action: "Reconcile".to_owned(),
                    secondary: None,
                };
                metrics.wrote("event");
                if let Err(e) = recorder.publish(&event, &reference).await {
                    let code = crate::error::status_code(&e);
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
