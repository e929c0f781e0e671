//! Shared helpers: an in-process sidecar on ephemeral loopback ports and its clients.
#![allow(dead_code)]

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use rebound_sidecar::{
    metrics::Metrics,
    pb::v1::retry_advisor_client::RetryAdvisorClient,
    server::{self, ListenConfig, Listeners, ServeError},
    service::Clock,
    store::Store,
};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

pub fn store() -> Arc<Store> {
    Store::new(Arc::new(Metrics::default()))
}

pub fn fixed_clock(now_ms: u64) -> Clock {
    Arc::new(move || now_ms)
}

/// A sidecar served by this process on 127.0.0.1 ports chosen by the OS.
pub struct Running {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub store: Arc<Store>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

pub async fn start(store: Arc<Store>, clock: Clock) -> Running {
    let listen = ListenConfig {
        tcp: Some(([127, 0, 0, 1], 0).into()),
        admin: Some(([127, 0, 0, 1], 0).into()),
        ..ListenConfig::default()
    };
    let listeners = Listeners::bind(&listen).await.expect("bind loopback");
    let addr = listeners.tcp_addr().expect("tcp address");
    let admin = listeners.admin_addr().expect("admin address");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server::serve(
        Arc::clone(&store),
        clock,
        listeners,
        async {
            let _ = stopped.await;
        },
        Duration::from_secs(5),
    ));
    Running {
        addr,
        admin,
        store,
        stop: Some(stop),
        task,
    }
}

impl Running {
    pub async fn advisor(&self) -> RetryAdvisorClient<Channel> {
        RetryAdvisorClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect advisor")
    }

    pub async fn health(&self) -> HealthClient<Channel> {
        HealthClient::new(
            rebound_sidecar::client::tcp_channel(self.addr)
                .await
                .expect("connect health"),
        )
    }

    /// Starts a graceful shutdown and waits for it.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task
            .await
            .expect("server task")
            .expect("server stopped cleanly");
    }

    pub fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub async fn join(self) {
        self.task
            .await
            .expect("server task")
            .expect("server stopped cleanly");
    }
}

/// The health status of `service` ("" = the whole server) as the wire reports it.
pub async fn health_status(client: &mut HealthClient<Channel>, service: &str) -> i32 {
    client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .expect("health check")
        .into_inner()
        .status
}

pub const SERVING: i32 = 1;
pub const NOT_SERVING: i32 = 2;

/// [`rebound_test_support::eventually`] for a condition: fails the test after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let polled = rebound_test_support::eventually(what, timeout, || {
        let holds = check();
        async move { Ok(holds.await.then_some(())) }
    });
    if let Err(e) = polled.await {
        panic!("{e:#}");
    }
}

/// The value of one series (`name` or `name{labels}`, labels as the sidecar writes them)
/// in a Prometheus exposition.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}
