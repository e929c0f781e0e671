//! Helpers the tests and benchmark programs of Rebound's crates share.
//!
//! It depends on no other crate of the workspace, so every crate can take it as a
//! dev-dependency without a cycle between crates.

pub mod metrics;

use std::hash::BuildHasher;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

/// How often [`eventually`] and [`eventually_blocking`] ask again.
const POLL_EVERY: Duration = Duration::from_millis(50);

/// A loopback address with a port free now, for a process the test starts next (free until
/// someone binds it: a server that can bind port 0 and report it is safer still).
///
/// Drawn above the kernel's ephemeral range when there is room: every outgoing connection
/// on the machine (an API server opening dozens to etcd as it starts, for one) takes its
/// local port from that range, and could take a port the OS had just handed out here.
pub fn free_port() -> std::io::Result<SocketAddr> {
    let above_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().nth(1)?.parse::<u16>().ok())
        .filter(|&high| high <= 65_535 - 1_000);
    if let Some(high) = above_ephemeral {
        let span = 65_535 - u64::from(high);
        // std's randomly keyed hasher: concurrent test processes draw apart.
        let random = std::collections::hash_map::RandomState::new();
        for attempt in 0..64_u32 {
            let port = u64::from(high) + 1 + random.hash_one(attempt) % span;
            let port = u16::try_from(port).unwrap_or(u16::MAX);
            if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
                return listener.local_addr();
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// A response to [`http_get`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpResponse {
    /// The status code of the status line.
    pub status: u16,
    /// The header lines, as sent (`name: value`).
    pub headers: Vec<String>,
    pub body: String,
}

impl HttpResponse {
    /// The value of the first header `name` (case-insensitive), trimmed.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
        })
    }

    /// The body of a `200` response, else an error naming the status.
    pub fn ok(self) -> Result<String> {
        ensure!(self.status == 200, "HTTP status {}", self.status);
        Ok(self.body)
    }
}

/// A minimal blocking HTTP/1.1 `GET path` (the admin and metrics ports are plain HTTP on
/// localhost): connects within 2 s, reads until the server closes or is idle for 5 s.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    // One write: `write!` on an unbuffered stream sends each piece as its own segment.
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    // Read until the server closes; a server that answers and keeps the connection open
    // ends the read with the timeout, and what it sent is the answer.
    let mut bytes = Vec::new();
    if let Err(e) = stream.read_to_end(&mut bytes)
        && bytes.is_empty()
    {
        return Err(anyhow::Error::new(e).context(format!("reading the answer to GET {path}")));
    }
    let response = String::from_utf8_lossy(&bytes);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("GET {path}: malformed HTTP response"))?;
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| anyhow!("GET {path}: no status in {status_line:?}"))?;
    Ok(HttpResponse {
        status,
        headers: lines.map(str::to_owned).collect(),
        body: body.to_owned(),
    })
}

/// Asks `check` until it answers `Some`, or fails after `timeout` with the last error
/// `check` returned (if any) as the cause.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last_error = match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(e) => Some(e),
        };
        if Instant::now() > deadline {
            return Err(timed_out(what, timeout, last_error));
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// [`eventually`] for code without an async runtime: sleeps the thread between asks.
pub fn eventually_blocking<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        let last_error = match check() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(e) => Some(e),
        };
        if Instant::now() > deadline {
            return Err(timed_out(what, timeout, last_error));
        }
        std::thread::sleep(POLL_EVERY);
    }
}

fn timed_out(what: &str, timeout: Duration, last_error: Option<anyhow::Error>) -> anyhow::Error {
    let message = format!("timed out after {timeout:?} waiting for {what}");
    match last_error {
        Some(e) => e.context(message),
        None => anyhow!(message),
    }
}

/// A binary of this workspace, next to the running test's `deps/` directory (Cargo builds
/// a package's binaries before its integration tests; other packages' with
/// `cargo build --bins`).
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .context("the test executable has no target directory")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} is missing: run `cargo test --workspace` (or `cargo build --bins`) first",
            path.display()
        );
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_lie_above_the_ephemeral_range_and_are_free() -> Result<()> {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?;
        let high: u16 = range.split_whitespace().nth(1).context("range")?.parse()?;
        for _ in 0..20 {
            let addr = free_port()?;
            if high <= 65_535 - 1_000 {
                ensure!(
                    addr.port() > high,
                    "{addr} in the ephemeral range up to {high}"
                );
            }
            TcpListener::bind(addr)?;
        }
        Ok(())
    }

    #[test]
    fn a_response_is_split_into_status_headers_and_body() -> Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let server = std::thread::spawn(move || -> std::io::Result<()> {
            let (mut stream, _) = listener.accept()?;
            // Read the whole request head, as a real server does: closing with unread
            // bytes makes the kernel reset the connection instead of ending it.
            let mut request = Vec::new();
            let mut chunk = [0u8; 256];
            while !request.ends_with(b"\r\n\r\n") {
                let read = stream.read(&mut chunk)?;
                if read == 0 {
                    break;
                }
                request.extend_from_slice(&chunk[..read]);
            }
            stream.write_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nX-A: b\r\n\r\nno such path",
            )
        });
        let response = http_get(addr, "/missing")?;
        server
            .join()
            .map_err(|_| anyhow!("server thread panicked"))??;
        assert_eq!(response.status, 404);
        assert_eq!(response.header("content-type"), Some("text/plain"));
        assert_eq!(response.header("x-b"), None);
        assert_eq!(response.body, "no such path");
        assert!(response.ok().is_err());
        Ok(())
    }

    #[test]
    fn eventually_blocking_returns_the_first_answer_and_the_last_error_on_timeout() {
        let mut asked = 0;
        let found = eventually_blocking("the third ask", Duration::from_secs(60), || {
            asked += 1;
            Ok((asked == 3).then_some(asked))
        });
        assert_eq!(found.ok(), Some(3));

        let failed: Result<()> = eventually_blocking("nothing", Duration::ZERO, || bail!("down"));
        let failed = failed.err().map(|e| e.root_cause().to_string());
        assert_eq!(failed.as_deref(), Some("down"));
    }
}
