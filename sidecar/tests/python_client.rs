//! A client in another language: Python `grpcio`, with stubs generated from the proto at
//! test time, calls every RPC (and health and reflection) of the real binary, over TCP and
//! over the Unix socket. Skipped with a message when grpcio is missing, unless CI is set.

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use common::{SERVING, eventually};
use rebound_sidecar::client;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const POLICIES: &str = r#"apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata:
  name: webhooks
spec:
  queues: ["webhooks"]
  backoff:
    base: 2s
    cap: 1m
  maxAttempts: 5
  nonRetryableErrors: ["InvalidSignature"]
  terminal:
    action: deadLetter
    deadLetterQueue: webhooks-dead
---
apiVersion: rebound.dev/v1alpha1
kind: RetryPolicy
metadata:
  name: reports
spec:
  queues: ["reports.*"]
"#;

fn python_has_grpc() -> bool {
    Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_tools, grpc_health.v1, grpc_reflection.v1alpha",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_python(target: &str) {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = here.join("tests/python/client_test.py");
    let proto_root: PathBuf = here.join("../proto");
    let status = Command::new("python3")
        .arg(&script)
        .args(["--target", target])
        .arg("--proto-root")
        .arg(&proto_root)
        .status()
        .expect("run python3");
    assert!(
        status.success(),
        "python client against {target}: {status:?}"
    );
}

#[tokio::test]
async fn python_grpcio_client_calls_every_rpc() {
    if !python_has_grpc() {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        assert!(
            !ci,
            "CI is set but python3 cannot import grpcio: pip install -r sidecar/tests/python/requirements.txt"
        );
        eprintln!(
            "SKIPPED python_grpcio_client_calls_every_rpc: python3 cannot import grpcio \
             (pip install -r sidecar/tests/python/requirements.txt)"
        );
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let policies = tmp.path().join("policies.yaml");
    std::fs::write(&policies, POLICIES).expect("write");
    let socket = tmp.path().join("rebound.sock");
    let grpc = rebound_test_support::free_port().expect("a free port");
    let _sidecar = Sidecar(
        Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
            .arg("--policies-file")
            .arg(&policies)
            .args([
                "--namespace",
                "demo",
                "--listen",
                &grpc.to_string(),
                "--no-admin",
            ])
            .arg("--uds")
            .arg(&socket)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn rebound-sidecar"),
    );
    eventually(
        "the sidecar to report SERVING",
        Duration::from_secs(20),
        || async move {
            let Ok(channel) = client::tcp_channel(grpc).await else {
                return false;
            };
            HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .is_ok_and(|r| r.into_inner().status == SERVING)
        },
    )
    .await;

    run_python(&grpc.to_string());
    run_python(&format!("unix:{}", socket.display()));
}
