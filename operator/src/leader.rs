//! Leader election on a Lease (kube-lease-manager): every replica campaigns, only the
//! holder runs the controller. Losing the Lease stops the controller at once (its caches
//! and memory are dropped; the next term starts fresh); shutdown releases the Lease so a
//! standby takes over without waiting for it to expire.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::Flags;
use crate::metrics::Metrics;

/// Starts the controller for one leadership term; the future ends after `stop` fires.
pub type Lead = Box<dyn Fn(BoxFuture<'static, ()>) -> BoxFuture<'static, ()> + Send + Sync>;

/// Why leader election ended other than by shutdown.
#[derive(Debug, thiserror::Error)]
#[error("leader election stopped unexpectedly: {0}")]
pub struct ElectionError(String);

/// Runs `lead` whenever this replica holds the Lease, until `shutdown` turns true.
pub async fn run(
    client: kube::Client,
    flags: Arc<Flags>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
    lead: Lead,
) -> Result<(), ElectionError> {
    let stop = {
        let shutdown = shutdown.clone();
        move || -> BoxFuture<'static, ()> {
            let mut shutdown = shutdown.clone();
            Box::pin(async move {
                let _ = shutdown.wait_for(|s| *s).await;
            })
        }
    };
    if !flags.leader_elect {
        metrics.set_leader(true);
        lead(stop()).await;
        return Ok(());
    }

    let identity = flags.identity();
    let namespace = flags.lease_namespace();
    let mut delay = Duration::from_millis(500);
    let manager = loop {
        let built = LeaseManagerBuilder::new(client.clone(), flags.lease_name.clone())
            .with_namespace(namespace.clone())
            .with_identity(identity.clone())
            .with_duration(flags.lease_duration)
            .with_grace(flags.lease_grace)
            .with_field_manager(format!("{}-{identity}", crate::FIELD_MANAGER))
            .build()
            .await;
        match built {
            Ok(m) => break m,
            Err(e) => {
                warn!(error = %e, lease = %flags.lease_name, %namespace, "cannot set up the Lease; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|s| *s) => return Ok(()),
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    info!(%identity, lease = %flags.lease_name, %namespace, "campaigning for leadership");
    let (mut leading, task) = manager.watch().await;

    let result = loop {
        metrics.set_leader(false);
        // A standby is healthy: it is ready to take over.
        metrics.set_ready(true);
        tokio::select! {
            changed = leading.wait_for(|l| *l) => {
                if changed.is_err() {
                    break Err(ElectionError("the Lease task ended".to_owned()));
                }
            }
            _ = shutdown.wait_for(|s| *s) => break Ok(()),
        }
        info!(%identity, "became leader");
        metrics.set_leader(true);
        metrics.set_ready(false);
        let term = lead(stop());
        tokio::select! {
            _ = term => break Ok(()),
            lost = leading.wait_for(|l| !*l) => {
                metrics.clear_namespaces();
                if lost.is_err() {
                    break Err(ElectionError("the Lease task ended".to_owned()));
                }
                warn!(%identity, "lost leadership; controller stopped");
            }
        }
    };
    metrics.set_leader(false);
    // Dropping the receiver makes the Lease task release the Lease and end.
    drop(leading);
    match tokio::time::timeout(Duration::from_secs(5), task).await {
        Ok(Ok(Ok(_))) => info!("released the Lease"),
        Ok(Ok(Err(e))) => warn!(error = %e, "could not release the Lease"),
        Ok(Err(e)) => warn!(error = %e, "the Lease task failed"),
        Err(_) => warn!("timed out releasing the Lease"),
    }
    result
}
