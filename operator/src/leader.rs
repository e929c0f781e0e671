//! Leader election on a Lease (kube-lease-manager): every replica campaigns, only the
//! holder runs the controller. Losing the Lease stops the controller at once (its caches
//! and memory are dropped; the next term starts fresh); shutdown releases the Lease so a
//! standby takes over without waiting for it to expire.
//!
//! The lease manager keeps saying "leader" while it cannot reach the API server, so a
//! leader cut off for longer than the Lease (an API server outage, a hung connection)
//! would still be writing when a standby takes the expired Lease over. As client-go's
//! `RenewDeadline`, the term also stops once the Lease has not been seen renewed by this
//! replica for [`renew_deadline`] (below the duration): the old leader stops writing
//! before anyone else can hold the Lease, and leads again only once it is seen renewing.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
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
    let (mut leading, task) = campaign(manager);
    let deadline = renew_deadline(flags.lease_duration, flags.lease_grace);
    let (confirmed_tx, mut confirmed) = watch::channel(false);
    let confirming = tokio::spawn(confirm(
        read_lease(
            Api::namespaced(client.clone(), &namespace),
            flags.lease_name.clone(),
            identity.clone(),
        ),
        CONFIRM_EVERY,
        deadline,
        confirmed_tx,
    ));

    let result = loop {
        metrics.set_leader(false);
        // A standby is healthy: it is ready to take over.
        metrics.set_ready(true);
        // Leads only while the manager holds the Lease and it is seen renewed in time.
        let ended = loop {
            if *leading.borrow_and_update() && *confirmed.borrow_and_update() {
                break None;
            }
            tokio::select! {
                changed = leading.changed() => if changed.is_err() {
                    break Some(Err(ElectionError("the Lease task ended".to_owned())));
                },
                _ = confirmed.changed() => {}
                _ = shutdown.wait_for(|s| *s) => break Some(Ok(())),
            }
        };
        if let Some(ended) = ended {
            break ended;
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
            _ = confirmed.wait_for(|c| !*c) => {
                metrics.clear_namespaces();
                warn!(
                    %identity,
                    renew_deadline_s = deadline.as_secs_f64(),
                    "the Lease was not seen renewed within the renew deadline; controller stopped before it can expire"
                );
            }
        }
    };
    confirming.abort();
    metrics.set_leader(false);
    // Dropping the receiver makes the Lease task release the Lease and end.
    drop(leading);
    match tokio::time::timeout(Duration::from_secs(5), task).await {
        Ok(Ok(Ok(()))) => info!("released the Lease"),
        Ok(Ok(Err(e))) => warn!(error = %e, "could not release the Lease"),
        Ok(Err(e)) => warn!(error = %e, "the Lease task failed"),
        Err(_) => warn!("timed out releasing the Lease"),
    }
    result
}

/// Renews (or campaigns for) the Lease, like the manager's own `watch()` but retrying a
/// failed renewal after the shared watch backoff (at most 1 s) instead of the manager's
/// growing one (up to 30 s), so a leader is back within seconds of the API server's
/// return. Dropping the receiver releases the Lease and ends the task. One log line per
/// failing streak.
fn campaign(
    manager: kube_lease_manager::LeaseManager,
) -> (
    watch::Receiver<bool>,
    tokio::task::JoinHandle<Result<(), kube_lease_manager::LeaseManagerError>>,
) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut backoff = crate::backoff::watch_backoff("lease");
        let mut failing = false;
        loop {
            tokio::select! {
                biased;
                _ = tx.closed() => return manager.release().await,
                changed = manager.changed() => match changed {
                    Ok(leading) => {
                        backoff.reset();
                        if std::mem::take(&mut failing) {
                            info!("the Lease is reachable again");
                        }
                        tx.send_replace(leading);
                    }
                    Err(error) => {
                        if !std::mem::replace(&mut failing, true) {
                            warn!(%error, "cannot renew or read the Lease; retrying");
                        }
                        let delay = backoff.next().unwrap_or(Duration::from_secs(1));
                        tokio::select! {
                            _ = tx.closed() => return manager.release().await,
                            _ = tokio::time::sleep(delay) => {}
                        }
                    }
                },
            }
        }
    });
    (rx, task)
}

/// How long after its last renewal a leader keeps writing: halfway between the renewal
/// (`grace` before expiry) and the expiry, so at least `grace / 2` before anyone else can
/// take the Lease.
pub fn renew_deadline(duration_s: u64, grace_s: u64) -> Duration {
    Duration::from_secs(duration_s).saturating_sub(Duration::from_secs(grace_s) / 2)
}

/// How often the Lease is read to confirm the leadership.
const CONFIRM_EVERY: Duration = Duration::from_millis(500);

/// What one read of the Lease says: `Some(Some(t))` held by this replica, last renewed at
/// `t`; `Some(None)` not held by it; `None` the read failed.
type Seen = Option<Option<Timestamp>>;

/// Reads the Lease `name` as [`Seen`] by `identity`.
fn read_lease(
    api: Api<Lease>,
    name: String,
    identity: String,
) -> impl Fn() -> BoxFuture<'static, Seen> + Send {
    move || {
        let (api, name, identity) = (api.clone(), name.clone(), identity.clone());
        Box::pin(async move {
            let spec = api.get_opt(&name).await.ok()?.and_then(|l| l.spec);
            let holder = spec.as_ref().and_then(|s| s.holder_identity.as_deref());
            Some(match holder {
                Some(h) if h == identity => spec.and_then(|s| s.renew_time).map(|t| t.0),
                _ => None,
            })
        })
    }
}

/// Keeps `confirmed` true while `read` shows a renewal by this replica less than
/// `deadline` old. The age is checked every `every` while a read is under way: a read
/// may take as long as the API server needs under a burst of writes (seconds; cut short
/// at `deadline`) without the term ending while renewals go on, and a read that fails or
/// hangs confirms nothing new, so the last renewal seen ages until the deadline passes.
async fn confirm(
    read: impl Fn() -> BoxFuture<'static, Seen> + Send,
    every: Duration,
    deadline: Duration,
    confirmed: watch::Sender<bool>,
) {
    let mut renewed: Option<Timestamp> = None;
    let mut reading: Option<BoxFuture<'static, Result<Seen, tokio::time::error::Elapsed>>> = None;
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                if reading.is_none() {
                    reading = Some(Box::pin(tokio::time::timeout(deadline, read())));
                }
            }
            answer = async {
                match reading.as_mut() {
                    Some(r) => r.await,
                    None => std::future::pending().await,
                }
            } => {
                reading = None;
                if let Ok(Some(seen)) = answer {
                    renewed = seen;
                }
            }
        }
        let held = renewed.is_some_and(|t| held_within(t, Timestamp::now(), deadline));
        confirmed.send_if_modified(|c| std::mem::replace(c, held) != held);
    }
}

/// The renewal at `renewed` is younger than `deadline` at `now`.
fn held_within(renewed: Timestamp, now: Timestamp, deadline: Duration) -> bool {
    let age_ms = now
        .as_millisecond()
        .saturating_sub(renewed.as_millisecond());
    age_ms < i64::try_from(deadline.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_falls_between_renewal_and_expiry() {
        let d = renew_deadline(15, 5);
        assert_eq!(d, Duration::from_millis(12_500));
        assert!(d > Duration::from_secs(15 - 5) && d < Duration::from_secs(15));
        let t = Timestamp::from_second(1_000).unwrap_or(Timestamp::UNIX_EPOCH);
        let later = |ms: i64| Timestamp::from_millisecond(t.as_millisecond() + ms).unwrap_or(t);
        assert!(held_within(t, later(12_499), d));
        assert!(!held_within(t, later(12_500), d));
    }

    /// Waits (at most 30 s) until `confirmed` is `value`.
    async fn until(confirmed: &mut watch::Receiver<bool>, value: bool) -> bool {
        let wait = confirmed.wait_for(|c| *c == value);
        matches!(
            tokio::time::timeout(Duration::from_secs(30), wait).await,
            Ok(Ok(_))
        )
    }

    #[tokio::test]
    async fn a_renewal_read_slowly_still_confirms_the_leader() {
        // Each read answers five periods late (an API server busy with a burst of
        // writes), showing the renewal made when it was sent.
        let every = Duration::from_millis(10);
        let read = move || -> BoxFuture<'static, Seen> {
            let renewed = Timestamp::now();
            Box::pin(async move {
                tokio::time::sleep(every * 5).await;
                Some(Some(renewed))
            })
        };
        let (tx, mut rx) = watch::channel(false);
        let task = tokio::spawn(confirm(read, every, Duration::from_secs(5), tx));
        let confirmed = until(&mut rx, true).await;
        task.abort();
        assert!(confirmed);
    }

    #[tokio::test]
    async fn a_read_that_hangs_ends_the_term_at_the_deadline() {
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&reads);
        let read = move || -> BoxFuture<'static, Seen> {
            let first = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
            let renewed = Timestamp::now();
            Box::pin(async move {
                if !first {
                    std::future::pending::<()>().await;
                }
                Some(Some(renewed))
            })
        };
        let (tx, mut rx) = watch::channel(false);
        let every = Duration::from_millis(10);
        let task = tokio::spawn(confirm(read, every, Duration::from_millis(300), tx));
        let led = until(&mut rx, true).await;
        let stopped = until(&mut rx, false).await;
        task.abort();
        assert!(led && stopped);
    }
}
