//! Health transitions and graceful shutdown, in process and for the real binary: SIGTERM
//! flips health to NOT_SERVING, an in-flight call still gets its answers, the process exits
//! 0 and removes its socket. Also the admin port's /metrics and the Unix socket.

mod common;

use std::{
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{NOT_SERVING, SERVING, eventually, health_status};
use rebound_sidecar::{
    client,
    pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient},
    testkit,
};
use rebound_test_support::{free_port, http_get, metrics::Samples};
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[tokio::test]
async fn shutdown_flips_health_and_lets_in_flight_calls_finish() {
    let store = common::store();
    let mut server = common::start(store.clone(), common::fixed_clock(0)).await;
    let mut health = server.health().await;
    assert_eq!(health_status(&mut health, "").await, NOT_SERVING);

    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("watch")
        .into_inner();
    let first = watch.message().await.expect("stream").expect("status");
    assert_eq!(first.status, NOT_SERVING);

    store.install(testkit::document("ns", 10, 0), "test", Instant::now());
    let next = watch.message().await.expect("stream").expect("status");
    assert_eq!(
        next.status, SERVING,
        "SERVING once a configuration is loaded"
    );

    // The Watch stream is an in-flight call: after shutdown begins it still receives the
    // NOT_SERVING update instead of being cut off.
    server.begin_stop();
    let last = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("update in time")
        .expect("stream still open")
        .expect("status");
    assert_eq!(last.status, NOT_SERVING);
    drop(watch);
    tokio::time::timeout(Duration::from_secs(5), server.join())
        .await
        .expect("drains once the last call ends");
}

struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_binary(policies: &Path, grpc: SocketAddr, admin: SocketAddr, uds: &Path) -> Sidecar {
    let child = Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
        .arg("--policies-file")
        .arg(policies)
        .args(["--namespace", "demo", "--listen", &grpc.to_string()])
        .args(["--admin-listen", &admin.to_string()])
        .arg("--uds")
        .arg(uds)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn rebound-sidecar");
    Sidecar(child)
}

const POLICY: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: webhooks\nspec:\n  queues: [webhooks]\n  maxAttempts: 4\n  terminal:\n    action: deadLetter\n    deadLetterQueue: webhooks-dead\n";

#[tokio::test]
async fn the_binary_serves_tcp_uds_and_metrics_and_stops_on_sigterm() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let policies = tmp.path().join("policies.yaml");
    std::fs::write(&policies, POLICY).expect("write");
    let socket = tmp.path().join("rebound.sock");
    let (grpc, admin) = (
        free_port().expect("a free port"),
        free_port().expect("a free port"),
    );
    let mut sidecar = spawn_binary(&policies, grpc, admin, &socket);

    // kubelet's probe: gRPC health on the admin port.
    let started = Instant::now();
    eventually(
        "the binary to report SERVING",
        Duration::from_secs(20),
        || async move {
            let Ok(channel) = client::tcp_channel(admin).await else {
                return false;
            };
            let mut c = HealthClient::new(channel);
            c.check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .is_ok_and(|r| r.into_inner().status == SERVING)
        },
    )
    .await;
    eprintln!("SERVING after {:?} (debug build)", started.elapsed());

    let ask = pb::DecideRequest {
        queue: "webhooks".to_owned(),
        attempt: 4,
        job_id: "job-1".to_owned(),
        ..Default::default()
    };
    let mut tcp = RetryAdvisorClient::new(client::tcp_channel(grpc).await.expect("tcp"));
    let over_tcp = tcp
        .decide(ask.clone())
        .await
        .expect("tcp decide")
        .into_inner();
    assert_eq!(over_tcp.decision(), pb::Decision::GiveUp);
    assert_eq!(over_tcp.dead_letter_queue, "webhooks-dead");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o660, "socket mode {mode:o}");
    let mut uds = RetryAdvisorClient::new(client::uds_channel(socket.clone()).await.expect("uds"));
    let over_uds = uds.decide(ask).await.expect("uds decide").into_inner();
    assert_eq!(over_uds, over_tcp);

    let metrics = http_get(admin, "/metrics").expect("GET /metrics");
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert_eq!(
        metrics.header("content-type"),
        Some(rebound_sidecar::metrics::CONTENT_TYPE)
    );
    let body = metrics.body.as_str();
    assert_eq!(
        common::sample(body, "rebound_sidecar_config_state{state=\"active\"}"),
        Some(1.0),
        "{body}"
    );
    let samples = Samples::parse(body).expect("an exposition");
    assert_eq!(
        samples.value(
            "rebound_sidecar_decisions_total",
            &[
                ("policy", "demo/webhooks"),
                ("outcome", "give_up"),
                ("disposition", "dead_letter"),
                ("reason", "max_attempts"),
            ]
        ),
        Some(2.0),
        "{body}"
    );
    let info: Vec<_> = samples
        .matching("rebound_sidecar_config_info", &[])
        .collect();
    assert_eq!(info.len(), 1, "{body}");
    assert!(
        info[0]
            .labels
            .get("config_hash")
            .is_some_and(|h| h.starts_with("sha256:"))
            && !info[0].labels.contains_key("namespace"),
        "the hash as the operator reports it, no namespace label: {info:?}"
    );

    // SIGTERM: exit 0, socket removed.
    let pid = i32::try_from(sidecar.0.id()).expect("pid");
    // SAFETY: sending a signal to a child process this test spawned.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = sidecar.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists(), "socket file removed on exit");
}

#[tokio::test]
async fn the_socket_mode_is_configurable() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    let socket = tmp.path().join("rebound.sock");
    let listen = rebound_sidecar::server::ListenConfig {
        uds: Some(socket.clone()),
        uds_mode: 0o600,
        ..Default::default()
    };
    let _listeners = rebound_sidecar::server::Listeners::bind(&listen)
        .await
        .expect("bind");
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
}

#[tokio::test]
async fn the_binary_refuses_non_loopback_without_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
        .args([
            "--policies-file",
            "/nonexistent.yaml",
            "--listen",
            "0.0.0.0:0",
            "--no-admin",
        ])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a loopback address"), "{stderr}");
}

/// The content type of the answer to `GET /metrics` on an admin port bound to every address (as on the
/// Pod IP), with or without the opt-in; health answers either way.
async fn metrics_status_beyond_loopback(opt_in: bool) -> (String, i32) {
    use rebound_sidecar::server::{ListenConfig, Listeners};
    let listen = ListenConfig {
        admin: Some(([0, 0, 0, 0], 0).into()),
        tcp: Some(([127, 0, 0, 1], 0).into()),
        allow_non_loopback: true,
        metrics_beyond_loopback: opt_in,
        ..ListenConfig::default()
    };
    let listeners = Listeners::bind(&listen).await.expect("bind");
    let admin = listeners.admin_addr().expect("admin");
    let admin: SocketAddr = ([127, 0, 0, 1], admin.port()).into();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(rebound_sidecar::server::serve(
        common::store(),
        common::fixed_clock(0),
        listeners,
        async {
            let _ = stopped.await;
        },
        Duration::from_secs(5),
    ));
    let response = tokio::task::spawn_blocking(move || http_get(admin, "/metrics"))
        .await
        .expect("get")
        .expect("GET /metrics");
    // Without the route the gRPC router answers (HTTP 200, `application/grpc`,
    // grpc-status UNIMPLEMENTED); the metrics route answers OpenMetrics text.
    let status = response
        .header("content-type")
        .unwrap_or_default()
        .to_owned();
    let mut health = HealthClient::new(client::tcp_channel(admin).await.expect("health"));
    let serving = health_status(&mut health, "").await;
    let _ = stop.send(());
    task.await.expect("task").expect("stopped");
    (status, serving)
}

#[tokio::test]
async fn an_admin_port_beyond_loopback_serves_only_health_unless_metrics_are_opted_in() {
    assert_eq!(
        metrics_status_beyond_loopback(false).await,
        ("application/grpc".to_owned(), NOT_SERVING)
    );
    assert_eq!(
        metrics_status_beyond_loopback(true).await,
        (
            rebound_sidecar::metrics::CONTENT_TYPE.to_owned(),
            NOT_SERVING
        )
    );
}

/// Every flag also reads a `REBOUND_*` variable, and the namespace defaults to the Pod's
/// (`POD_NAMESPACE`, set from the downward API).
#[tokio::test]
async fn settings_come_from_rebound_variables_and_the_namespace_from_the_pod() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let policies = tmp.path().join("policies.yaml");
    std::fs::write(&policies, POLICY).expect("write");
    let (grpc, admin) = (
        free_port().expect("a free port"),
        free_port().expect("a free port"),
    );
    let child = Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
        .env("REBOUND_POLICIES_FILE", &policies)
        .env("REBOUND_LISTEN", grpc.to_string())
        .env("REBOUND_ADMIN_LISTEN", admin.to_string())
        .env("POD_NAMESPACE", "team-a")
        .env_remove("REBOUND_NAMESPACE")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn rebound-sidecar");
    let _sidecar = Sidecar(child);
    let mut loaded = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if TcpStream::connect(admin).is_err() {
            continue; // still starting
        }
        let response = tokio::task::spawn_blocking(move || http_get(admin, "/metrics"))
            .await
            .expect("get")
            .expect("GET /metrics");
        let samples = Samples::parse(&response.body).expect("an exposition");
        loaded = samples.value("rebound_sidecar_config_state", &[("state", "active")]) == Some(1.0);
        if loaded {
            break;
        }
    }
    assert!(loaded, "the manifests were loaded");
    let answer = RetryAdvisorClient::new(client::tcp_channel(grpc).await.expect("tcp"))
        .decide(pb::DecideRequest {
            queue: "webhooks".into(),
            attempt: 1,
            ..Default::default()
        })
        .await
        .expect("decide")
        .into_inner();
    // The policy label is `namespace/name`: the manifests were compiled for it.
    let response = tokio::task::spawn_blocking(move || http_get(admin, "/metrics"))
        .await
        .expect("get")
        .expect("GET /metrics");
    let policies: Vec<_> = Samples::parse(&response.body)
        .expect("an exposition")
        .matching("rebound_sidecar_decisions_total", &[])
        .filter_map(|s| s.labels.get("policy").cloned())
        .collect();
    assert_eq!(policies, ["team-a/webhooks"]);
    assert_eq!(
        answer.policy.map(|p| p.namespace),
        Some("team-a".to_owned())
    );
}
