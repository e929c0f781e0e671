//! The metrics/probe server under half-sent requests: probes are still answered, every
//! half-sent connection is closed by the server after its header timeout, and connections
//! beyond the cap are closed unserved (and counted).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::*;
use rebound_test_support::HttpResponse;
use rebound_tests::TestEnv;

const WAIT: Duration = Duration::from_secs(60);
/// The operator's cap (`http::MAX_CONNECTIONS`).
const CAP: usize = 256;

/// Connections that send the start of a request and then nothing.
fn half_sent(addr: SocketAddr, n: usize) -> Result<Vec<TcpStream>> {
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(addr)?;
            s.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n")?;
            Ok(s)
        })
        .collect()
}

/// How many of `streams` the server closes (EOF or reset) within `timeout` of the call.
fn closed_by_server(streams: Vec<TcpStream>, timeout: Duration) -> Result<usize> {
    let deadline = Instant::now() + timeout;
    let mut closed = 0;
    for mut s in streams {
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let mut sink = Vec::new();
        match s.read_to_end(&mut sink) {
            Ok(_) => closed += 1,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => closed += 1,
            Err(_) => {}
        }
    }
    Ok(closed)
}

#[tokio::test(flavor = "multi_thread")]
async fn half_sent_requests_are_dropped_and_probes_still_answer() -> Result<()> {
    let env = TestEnv::new("op-http").await?;
    let op = Operator::start(env.cluster.kubeconfig(), scoped(&env.namespace, &[]))?;
    let addr = op.metrics;
    // Leading comes after /livez (the Lease is acquired, then seen renewed).
    eventually("leading", WAIT, || async {
        let scrape = http_get(addr, "/metrics").and_then(HttpResponse::ok).ok();
        Ok(scrape.filter(|s| metric_sum(s, "rebound_operator_leader") == 1.0))
    })
    .await?;

    let hanging = half_sent(addr, 200)?;
    // While they hang, probes and scrapes are answered.
    ensure!(http_get(addr, "/livez")?.ok()? == "ok\n");
    let scrape = http_get(addr, "/metrics")?.ok()?;
    ensure!(
        metric_sum(&scrape, "rebound_operator_leader") == 1.0,
        "{scrape}"
    );
    // The server closes every one of them (its header timeout is 5 s).
    let closed =
        tokio::task::spawn_blocking(move || closed_by_server(hanging, Duration::from_secs(30)))
            .await??;
    ensure!(
        closed == 200,
        "{closed} of 200 half-sent connections closed"
    );

    // Past the cap: the extra connections are closed unserved and counted.
    let over = 20;
    let flood = half_sent(addr, CAP + over)?;
    let closed =
        tokio::task::spawn_blocking(move || closed_by_server(flood, Duration::from_secs(30)))
            .await??;
    ensure!(closed == CAP + over, "{closed} of {} closed", CAP + over);
    let refused = op.metric("rebound_operator_http_connections_refused_total")?;
    ensure!(refused >= over as f64, "{refused} refused");
    ensure!(http_get(addr, "/livez")?.ok()? == "ok\n");
    Ok(())
}
