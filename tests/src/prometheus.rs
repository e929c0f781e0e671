//! Prometheus and promtool for the monitoring tests: the binaries `dev/build-prometheus.sh`
//! builds (or those in `REBOUND_PROMETHEUS_BIN_DIR`), a server of a test's own
//! (`dev/prometheus.sh`, stopped on drop) and the queries of the dashboard.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

use crate::{CmdOutput, repo_root};

/// The directory holding `prometheus` and `promtool`.
#[derive(Debug)]
pub struct PrometheusTools {
    bin_dir: PathBuf,
}

static TOOLS: OnceLock<std::result::Result<PrometheusTools, String>> = OnceLock::new();

impl PrometheusTools {
    /// `REBOUND_PROMETHEUS_BIN_DIR` if set, else what `dev/build-prometheus.sh` prints (it
    /// builds on first use).
    pub fn get() -> Result<&'static PrometheusTools> {
        TOOLS
            .get_or_init(|| PrometheusTools::find().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("promtool is not available: {e}"))
    }

    fn find() -> Result<PrometheusTools> {
        let bin_dir = match std::env::var_os("REBOUND_PROMETHEUS_BIN_DIR").filter(|p| !p.is_empty())
        {
            Some(p) => PathBuf::from(p),
            None => crate::process::built_tool_dir("build-prometheus.sh")?,
        };
        for binary in ["prometheus", "promtool"] {
            let path = bin_dir.join(binary);
            if !path.is_file() {
                bail!("{} does not exist", path.display());
            }
        }
        Ok(PrometheusTools { bin_dir })
    }

    /// The prometheus server binary.
    pub fn prometheus(&self) -> PathBuf {
        self.bin_dir.join("prometheus")
    }

    /// Runs promtool with `args` in `dir`.
    pub fn promtool<I, S>(&self, dir: &Path, args: I) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let path = self.bin_dir.join("promtool");
        let out = Command::new(&path)
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("could not run {}", path.display()))?;
        Ok(CmdOutput {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// A server started by `dev/prometheus.sh up`; `down` on drop (on failure too).
pub struct Server {
    state: PathBuf,
    addr: SocketAddr,
}

impl Server {
    /// Starts a Prometheus with `config` whose TSDB, log and PID file live in `state`.
    pub fn up(state: &Path, config: &Path) -> Result<Server> {
        let out = script(&[
            "up",
            &state.to_string_lossy(),
            "--config",
            &config.to_string_lossy(),
        ])?;
        let url = out.lines().last().unwrap_or_default();
        let addr = url
            .strip_prefix("http://")
            .with_context(|| format!("dev/prometheus.sh up printed {url:?}"))?
            .parse()?;
        Ok(Server {
            state: state.to_owned(),
            addr,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// GET an API path; its `data` field.
    pub fn api(&self, path: &str) -> Result<Value> {
        // HTTP/1.0: Go's server answers it without chunked encoding.
        let mut conn = TcpStream::connect_timeout(&self.addr, Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr).as_bytes())?;
        let mut response = String::new();
        conn.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .with_context(|| format!("{path}: malformed response"))?;
        ensure!(head.starts_with("HTTP/1.0 200 "), "{path}: {head}: {body}");
        let answer: Value = serde_json::from_str(body)?;
        ensure!(answer["status"] == "success", "{path}: {answer}");
        Ok(answer["data"].clone())
    }

    /// The result vector of an instant query.
    pub fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)))?;
        ensure!(data["resultType"] == "vector", "{expr}: {data}");
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The pending and firing alerts (`/api/v1/alerts`).
    pub fn alerts(&self) -> Result<Vec<Value>> {
        Ok(self.api("/api/v1/alerts")?["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// The PID of the server (from its PID file).
    pub fn pid(&self) -> Result<u32> {
        Ok(std::fs::read_to_string(self.state.join("prometheus.pid"))?
            .trim()
            .parse()?)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = script(&["down", &self.state.to_string_lossy()]) {
            eprintln!("rebound-tests: stopping prometheus failed: {e:#}");
        }
    }
}

/// Runs `dev/prometheus.sh ARGS` with the built server; its stdout.
pub fn script(args: &[&str]) -> Result<String> {
    let tools = PrometheusTools::get()?;
    let out = Command::new("bash")
        .arg(repo_root().join("dev/prometheus.sh"))
        .args(args)
        .env("REBOUND_PROMETHEUS", tools.prometheus())
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        out.status.success(),
        "dev/prometheus.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Percent-encodes a query parameter.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every panel target's `expr` and every variable's metric of a Grafana dashboard, as
/// (panel title, query), with the variables filled in as "All" (and Grafana's
/// `$__rate_interval` as 5m). Fails on a panel without a query or not on `${datasource}`.
pub fn dashboard_queries(dashboard: &Value) -> Result<Vec<(String, String)>> {
    fn panels<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            panels(&p["panels"], out);
        }
    }
    let mut all = Vec::new();
    panels(&dashboard["panels"], &mut all);
    let fill = |e: &str| {
        e.replace("$__rate_interval", "5m")
            .replace("$namespace", ".*")
            .replace("$policy", ".*")
    };
    let mut queries = Vec::new();
    for p in all.iter().filter(|p| p["type"] != "row") {
        let title = p["title"].as_str().unwrap_or_default();
        let targets = p["targets"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        ensure!(!targets.is_empty(), "panel {title:?} has no query");
        ensure!(
            p["datasource"]["uid"] == "${datasource}",
            "panel {title:?}: datasource {}",
            p["datasource"]
        );
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .with_context(|| format!("panel {title:?}: a target without expr"))?;
            queries.push((title.to_owned(), fill(expr)));
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(q) = v["query"]["query"].as_str() {
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|q| q.rsplit_once(','))
                .map(|(metric, _)| metric)
                .with_context(|| format!("variable {}: {q}", v["name"]))?;
            queries.push((format!("variable {}", v["name"]), fill(inner)));
        }
    }
    Ok(queries)
}
