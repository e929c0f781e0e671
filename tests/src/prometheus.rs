//! Prometheus and promtool for the monitoring tests: the binaries `dev/build-prometheus.sh`
//! builds (or those in `REBOUND_PROMETHEUS_BIN_DIR`).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};

use crate::CmdOutput;

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
