//! A sidecar process started by a benchmark, and what `/proc` says about it.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

/// A child process killed (and its scratch directory removed) when dropped.
pub struct Spawned {
    pub child: Child,
    pub dir: PathBuf,
}

impl Spawned {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `kB` field of `/proc/<pid>/status` (0 when unreadable).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// Total RSS with its anonymous (heap, stacks) and file-backed (the binary's code and
/// libc, shared and evictable) parts.
pub fn rss_detail(pid: u32) -> String {
    format!(
        "{} (anonymous {}, file-backed {})",
        mib(status_kib(pid, "VmRSS:")),
        mib(status_kib(pid, "RssAnon:")),
        mib(status_kib(pid, "RssFile:"))
    )
}

/// CPU time the process's main thread (the sidecar's runtime thread, which serves every
/// call) has used, in ns.
pub fn main_thread_cpu_ns(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// `given`, else the `rebound-sidecar` binary next to the running program: examples are
/// built into `target/<profile>/examples`, the binary one level up.
pub fn sidecar_binary(given: Option<PathBuf>) -> std::io::Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path);
    }
    let exe = std::env::current_exe()?;
    exe.parent()
        .and_then(|examples| examples.parent())
        .map(|dir| dir.join("rebound-sidecar"))
        .ok_or_else(|| std::io::Error::other("the running program has no parent directory"))
}

/// Starts `bin` on a policies file, serving gRPC on `grpc` and the admin port on `admin`,
/// logging errors only; `dir` (its scratch directory) is removed when it is dropped.
pub fn spawn_on_policies_file(
    bin: &Path,
    policies: &Path,
    grpc: SocketAddr,
    admin: SocketAddr,
    dir: PathBuf,
) -> std::io::Result<Spawned> {
    let child = Command::new(bin)
        .arg("--policies-file")
        .arg(policies)
        .args([
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
        ])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| std::io::Error::other(format!("cannot start {}: {e}", bin.display())))?;
    Ok(Spawned { child, dir })
}
