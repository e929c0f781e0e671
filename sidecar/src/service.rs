//! The `rebound.v1.RetryAdvisor` gRPC service: a thin adapter from tonic to [`crate::answer`].

use std::{sync::Arc, time::Instant};

use tonic::{Request, Response, Status};

use crate::{
    answer::Snapshot,
    answer::{self},
    pb::{
        server::{self as wire, retry_advisor_server::RetryAdvisor},
        v1 as pb,
    },
    store::Store,
};

/// Where "now" comes from when enforcing maxRetryDuration; tests pin it.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The advisor service over a [`Store`].
#[derive(Clone)]
pub struct Advisor {
    store: Arc<Store>,
    clock: Clock,
}

impl Advisor {
    pub fn new(store: Arc<Store>, clock: Clock) -> Self {
        Self { store, clock }
    }

    fn with_config<T>(&self, f: impl FnOnce(&Snapshot) -> Result<T, Status>) -> Result<T, Status> {
        let guard = self.store.snapshot();
        match guard.as_deref() {
            Some(cfg) => f(&cfg.snapshot),
            None => {
                self.store.metrics().count_unavailable();
                Err(Status::unavailable(
                    "no valid policy configuration is loaded yet; use the local fallback policy",
                ))
            }
        }
    }
}

#[tonic::async_trait]
impl RetryAdvisor for Advisor {
    async fn decide(
        &self,
        request: Request<wire::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        let metrics = self.store.metrics();
        let now = (self.clock)();
        self.with_config(|cfg| {
            let started = Instant::now();
            let evidence = Some(&**metrics.evidence());
            let answered = answer::decide_counted(cfg, request.get_ref(), now, evidence);
            metrics.decided(started.elapsed());
            match answered {
                Ok((response, _)) => Ok(Response::new(response)),
                Err(e) => {
                    metrics.count_rejected(e.rejection());
                    Err(e.into())
                }
            }
        })
    }

    async fn decide_batch(
        &self,
        request: Request<wire::DecideBatchRequest>,
    ) -> Result<Response<pb::DecideBatchResponse>, Status> {
        let metrics = self.store.metrics();
        let now = (self.clock)();
        self.with_config(|cfg| {
            let started = Instant::now();
            let evidence = Some(&**metrics.evidence());
            let answered =
                answer::decide_batch_counted(cfg, request.get_ref(), now, evidence, |r| {
                    metrics.count_rejected(r)
                });
            metrics.decided_batch(started.elapsed());
            answered.map(Response::new).map_err(|e| {
                metrics.count_rejected(e.rejection());
                e.into()
            })
        })
    }

    async fn get_policy(
        &self,
        request: Request<wire::GetPolicyRequest>,
    ) -> Result<Response<pb::GetPolicyResponse>, Status> {
        let link = self.store.metrics().source_link().status();
        self.with_config(|cfg| {
            let mut answer = answer::get_policy(cfg, request.get_ref()).map_err(Status::from)?;
            answer.config_source = Some(pb::ConfigSource {
                connected: link.connected,
                disconnected_since_unix_ms: link.disconnected_since_ms.unwrap_or(0),
                served_hash: answer
                    .policy
                    .as_ref()
                    .map(|p| p.config_hash.clone())
                    .unwrap_or_default(),
            });
            Ok(Response::new(answer))
        })
    }
}
