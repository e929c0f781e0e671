//! `dev/prometheus.sh` starts the Prometheus that `dev/build-prometheus.sh` builds on
//! 127.0.0.1 and stops it cleanly, and that server loads `monitoring/rules.yaml` and
//! evaluates it on what it scrapes: two exporters of fixed series stand for an operator
//! (scraped with `honor_labels`, as the chart's ServiceMonitor does) and a sidecar (with the
//! `namespace` and `pod` labels a PodMonitor adds). The sidecar serves another hash than
//! the operator's: ReboundSidecarConfigStale is pending in Prometheus's own alerts API; the
//! operator leads: ReboundOperatorNoLeader is not.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Result, ensure};
use rebound_test_support::eventually_blocking;
use rebound_tests::prometheus::{Server, encode, script};
use rebound_tests::repo_root;
use serde_json::{Value, json};

/// An HTTP server answering every request with `body` as Prometheus text; stopped on drop.
struct Exporter {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    fn start(body: &'static str) -> Result<Exporter> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((mut conn, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                let mut request = [0u8; 4096];
                let _ = conn.read(&mut request);
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes());
            }
        });
        Ok(Exporter {
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const OPERATOR: &str = "# TYPE rebound_operator_leader gauge\n\
rebound_operator_leader 1\n\
# TYPE rebound_operator_config_info gauge\n\
rebound_operator_config_info{namespace=\"team-a\",config_hash=\"bbb\"} 1\n";

const SIDECAR: &str = "# TYPE rebound_sidecar_config_info gauge\n\
rebound_sidecar_config_info{config_hash=\"aaa\",origin=\"team-a/rebound-policies\"} 1\n";

#[test]
fn a_real_prometheus_evaluates_the_rules_on_what_it_scrapes() -> Result<()> {
    let operator = Exporter::start(OPERATOR)?;
    let sidecar = Exporter::start(SIDECAR)?;
    let tmp = tempfile::tempdir()?;
    let config = json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [repo_root().join("monitoring/rules.yaml")],
        "scrape_configs": [
            {"job_name": "rebound-operator-metrics", "honor_labels": true,
             "static_configs": [{"targets": [operator.addr.to_string()],
                                 "labels": {"namespace": "rebound-system", "pod": "rebound-operator-0"}}]},
            {"job_name": "rebound-system/rebound-sidecar",
             "static_configs": [{"targets": [sidecar.addr.to_string()],
                                 "labels": {"namespace": "team-a", "pod": "worker-1"}}]},
        ],
    });
    let config_file = tmp.path().join("prometheus.yml");
    std::fs::write(&config_file, serde_json::to_string(&config)?)?;
    let state = tmp.path().join("state");
    let server = Server::up(&state, &config_file)?;
    // Idempotent: a second `up` reuses the running server.
    let again = script(&["up", &state.to_string_lossy()])?;
    ensure!(again.lines().last() == Some(format!("http://{}", server.addr()).as_str()));

    let groups = server.api("/api/v1/rules")?;
    let health: Vec<&Value> = groups["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .map(|r| &r["health"])
        .collect();
    ensure!(
        health.len() == 19 && health.iter().all(|h| *h == "ok" || *h == "unknown"),
        "rules: {groups}"
    );

    let alerts = eventually_blocking(
        "ReboundSidecarConfigStale pending",
        Duration::from_secs(60),
        || {
            let data = server.api("/api/v1/alerts")?;
            let alerts = data["alerts"].as_array().cloned().unwrap_or_default();
            Ok(alerts
                .iter()
                .any(|a| a["labels"]["alertname"] == "ReboundSidecarConfigStale")
                .then_some(alerts))
        },
    )?;
    let stale: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["labels"]["alertname"] == "ReboundSidecarConfigStale")
        .collect();
    ensure!(stale.len() == 1, "{alerts:?}");
    ensure!(stale[0]["state"] == "pending");
    ensure!(
        stale[0]["labels"]
            == json!({"alertname": "ReboundSidecarConfigStale", "severity": "warning",
                      "namespace": "team-a", "pod": "worker-1", "config_hash": "aaa",
                      "origin": "team-a/rebound-policies",
                      "job": "rebound-system/rebound-sidecar",
                      "instance": sidecar.addr.to_string()}),
        "{}",
        stale[0]["labels"]
    );
    // The description's template queried the operator's hash from this server.
    ensure!(
        stale[0]["annotations"]["description"]
            == "Sidecar team-a/worker-1 has served configuration aaa for more than 10 minutes; \
                the operator's current one for namespace team-a is bbb.",
        "{}",
        stale[0]["annotations"]
    );
    ensure!(
        alerts
            .iter()
            .all(|a| a["labels"]["alertname"] != "ReboundOperatorNoLeader"),
        "{alerts:?}"
    );
    // honor_labels kept the operator's namespace label; its process-wide series got the
    // target's.
    let info = server.api(&format!(
        "/api/v1/query?query={}",
        encode("rebound_operator_config_info")
    ))?;
    ensure!(
        info["result"][0]["metric"]["namespace"] == "team-a",
        "{info}"
    );
    let leader = server.api(&format!(
        "/api/v1/query?query={}",
        encode("rebound_operator_leader")
    ))?;
    ensure!(
        leader["result"][0]["metric"]["namespace"] == "rebound-system",
        "{leader}"
    );

    let pid = server.pid()?;
    drop(server);
    ensure!(
        !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| !c.contains("prometheus")),
        "prometheus (pid {pid}) still runs after down"
    );
    ensure!(!state.exists(), "down left {}", state.display());
    Ok(())
}
