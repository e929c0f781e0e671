//! Helm for the chart tests: the binary `dev/build-helm.sh` builds (or `REBOUND_HELM`),
//! run with its own cache and config dirs so nothing of the user's Helm setup leaks in.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use crate::{CmdOutput, repo_root};

/// The Helm binary the tests run.
#[derive(Debug)]
pub struct Helm {
    path: PathBuf,
    home: PathBuf,
}

static HELM: OnceLock<std::result::Result<Helm, String>> = OnceLock::new();

impl Helm {
    /// `REBOUND_HELM` if set, else what `dev/build-helm.sh` prints (it builds on first use).
    pub fn get() -> Result<&'static Helm> {
        HELM.get_or_init(|| Helm::find().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("helm is not available: {e}"))
    }

    fn find() -> Result<Helm> {
        let path = match std::env::var_os("REBOUND_HELM").filter(|p| !p.is_empty()) {
            Some(p) => PathBuf::from(p),
            None => crate::process::built_tool_dir("build-helm.sh")?.join("helm"),
        };
        if !path.is_file() {
            bail!("{} does not exist", path.display());
        }
        // Helm's cache, config and data dirs for tests (git-ignored, shared by processes).
        let home = repo_root().join("target/tmp/helm-home");
        std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
        Ok(Helm { path, home })
    }

    /// The helm binary.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs helm with `args` (and `KUBECONFIG` unset: only `template` and `lint` are used).
    pub fn run<I, S>(&self, args: I) -> Result<CmdOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = Command::new(&self.path)
            .args(args)
            .current_dir(repo_root())
            .env_remove("KUBECONFIG")
            .env("HELM_CACHE_HOME", self.home.join("cache"))
            .env("HELM_CONFIG_HOME", self.home.join("config"))
            .env("HELM_DATA_HOME", self.home.join("data"))
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("could not run {}", self.path.display()))?;
        Ok(CmdOutput {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `helm template RELEASE CHART -n NAMESPACE [-f VALUES]... [--set S]...`.
    pub fn template(
        &self,
        release: &str,
        chart: &Path,
        namespace: &str,
        values: &[PathBuf],
        sets: &[String],
    ) -> Result<CmdOutput> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "template".into(),
            release.into(),
            chart.into(),
            "--namespace".into(),
            namespace.into(),
        ];
        for v in values {
            args.push("--values".into());
            args.push(v.into());
        }
        for s in sets {
            args.push("--set".into());
            args.push(s.into());
        }
        self.run(args)
    }
}

/// The chart directory `charts/NAME`.
pub fn chart_dir(name: &str) -> PathBuf {
    repo_root().join("charts").join(name)
}

/// The values files of a chart's test matrix: `charts/NAME/ci/*-values.yaml`, sorted.
pub fn ci_values(name: &str) -> Result<Vec<PathBuf>> {
    let dir = chart_dir(name).join("ci");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.to_string_lossy().ends_with("-values.yaml") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The objects of a multi-document YAML stream (what `helm template` prints).
pub fn manifests(yaml: &str) -> Result<Vec<Value>> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(yaml).context("parsing helm's output as YAML")?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// `kind/namespace/name` of an object (namespace empty for cluster-scoped ones).
pub fn object_key(obj: &Value) -> String {
    let s = |p: &str| obj.pointer(p).and_then(Value::as_str).unwrap_or("");
    format!(
        "{}/{}/{}",
        s("/kind"),
        s("/metadata/namespace"),
        s("/metadata/name")
    )
}

/// The one object of `kind` named `name` in `objects`.
pub fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Result<&'a Value> {
    let mut hits = objects.iter().filter(|o| {
        o.get("kind").and_then(Value::as_str) == Some(kind)
            && o.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
    });
    let hit = hits
        .next()
        .with_context(|| format!("no {kind} {name} in the rendered chart"))?;
    if hits.next().is_some() {
        bail!("more than one {kind} {name} in the rendered chart");
    }
    Ok(hit)
}

/// One violation Helm reports when values do not meet the chart's schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaViolation {
    /// JSON pointer of the offending value, e.g. `/replicaCount`.
    pub pointer: String,
    pub message: String,
}

/// Parses Helm's schema report, whose violation lines read `- at '/pointer': message`.
pub fn schema_violations(stderr: &str) -> Vec<SchemaViolation> {
    stderr
        .lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix("- at '")?;
            let (pointer, message) = rest.split_once("': ")?;
            Some(SchemaViolation {
                pointer: pointer.to_owned(),
                message: message.trim().to_owned(),
            })
        })
        .collect()
}

/// The message of a template's `fail`: `execution error at (FILE:LINE:COL): MESSAGE`.
pub fn template_failure(stderr: &str) -> Option<String> {
    stderr.lines().find_map(|line| {
        let rest = line.split_once("execution error at (")?.1;
        Some(rest.split_once("): ")?.1.trim().to_owned())
    })
}
