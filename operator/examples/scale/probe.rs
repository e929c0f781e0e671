//! What the benchmark measures from outside: the API server's request counters, the
//! operator process (RSS, CPU, metrics endpoint).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rebound_tests::DedicatedCluster;

/// Write requests (POST, PUT, PATCH, APPLY, DELETE) the API server counted, per resource.
pub fn apiserver_writes(cluster: &DedicatedCluster) -> Result<HashMap<String, f64>> {
    let text = cluster.kubectl(["get", "--raw", "/metrics"])?.ok()?.stdout;
    let mut out: HashMap<String, f64> = HashMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let label = |key: &str| {
            line.split(&format!("{key}=\""))
                .nth(1)
                .and_then(|r| r.split('"').next())
        };
        let (Some(verb), Some(resource)) = (label("verb"), label("resource")) else {
            continue;
        };
        if !matches!(verb, "POST" | "PUT" | "PATCH" | "APPLY" | "DELETE") {
            continue;
        }
        if !matches!(
            resource,
            "configmaps" | "retrypolicies" | "events" | "leases"
        ) {
            continue;
        }
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(resource.to_owned()).or_default() += value;
    }
    for r in ["configmaps", "retrypolicies", "events", "leases"] {
        out.entry(r.to_owned()).or_default();
    }
    Ok(out)
}

pub struct Operator(Child);

impl Operator {
    pub fn start(bin: &Path, kubeconfig: &Path, metrics: SocketAddr, log: &Path) -> Result<Self> {
        let file = std::fs::File::create(log)?;
        let child = Command::new(bin)
            .env("KUBECONFIG", kubeconfig)
            .arg(format!("--metrics-addr={metrics}"))
            .arg("--lease-namespace=default")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()?;
        eprintln!("operator pid {} log {}", child.id(), log.display());
        Ok(Self(child))
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (VmHWM, VmRSS) in KiB.
pub fn rss_kib(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmHWM:"), field("VmRSS:")))
}

/// User + system CPU seconds of a process.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) start at ") ".
    let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of /proc/PID/stat (11 and 12 after the name).
    Ok((ticks(11) + ticks(12)) / 100.0)
}

pub use rebound_test_support::free_port;

pub fn scrape(addr: SocketAddr, name: &str) -> Result<f64> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

pub async fn wait_until(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().unwrap_or(false) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("timed out waiting for {what}")
}
