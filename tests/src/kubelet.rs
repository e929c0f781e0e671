//! Standing in for the kubelet, which the local control plane does not have: run a
//! workspace binary as a Pod's container would run, with the container's arguments and
//! environment (downward API resolved, `$(VAR)` expanded) and as the Pod's service account
//! (a client certificate for `system:serviceaccount:NS:NAME`, so only its RBAC applies).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Container;

use rebound_test_support::workspace_binary;

use crate::{Cluster, repo_root, unique_name};

/// A process started for a Pod; killed when dropped.
pub struct Running {
    child: Child,
    pub log: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    /// The last lines of its log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// The container's arguments with `$(VAR)` expanded from its environment, and that
/// environment with the downward API resolved for Pod `pod` in `namespace` on 127.0.0.1.
pub fn resolve(
    container: &Container,
    pod: &str,
    namespace: &str,
) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let mut env = BTreeMap::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), None) => v.clone(),
            (None, Some(from)) => {
                let path = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .with_context(|| format!("env {} is not a fieldRef", var.name))?;
                match path {
                    "metadata.name" => pod.to_owned(),
                    "metadata.namespace" => namespace.to_owned(),
                    "status.podIP" => "127.0.0.1".to_owned(),
                    // A process is in no Pod: no UID, so nothing it writes is owned.
                    "metadata.uid" => String::new(),
                    other => bail!("env {}: no stand-in for {other}", var.name),
                }
            }
            _ => bail!("env {} has neither value nor valueFrom", var.name),
        };
        env.insert(var.name.clone(), value);
    }
    let args = container
        .args
        .iter()
        .flatten()
        .map(|a| {
            env.iter()
                .fold(a.clone(), |a, (k, v)| a.replace(&format!("$({k})"), v))
        })
        .collect();
    Ok((args, env))
}

/// Replaces the value of each `--flag=` in `moved` (listen addresses, socket paths: the
/// Pod's are not free on this machine) and appends `extra`.
pub fn move_flags(
    args: Vec<String>,
    moved: &BTreeMap<&str, String>,
    extra: &[String],
) -> Vec<String> {
    args.into_iter()
        .map(|a| match a.split_once('=') {
            Some((flag, _)) if moved.contains_key(flag) => format!("{flag}={}", moved[flag]),
            _ => a,
        })
        .chain(extra.iter().cloned())
        .collect()
}

/// Starts workspace binary `binary` with exactly `args` and `env` (nothing inherited), as
/// service account `namespace/service_account`.
pub fn start_as(
    cluster: &Cluster,
    binary: &str,
    namespace: &str,
    service_account: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
) -> Result<Running> {
    let kubeconfig = cluster.mint_user_kubeconfig(
        &format!("system:serviceaccount:{namespace}:{service_account}"),
        &[
            "system:serviceaccounts",
            &format!("system:serviceaccounts:{namespace}"),
        ],
    )?;
    let dir = repo_root().join("target/tmp");
    std::fs::create_dir_all(&dir)?;
    let log = dir.join(format!("{}.log", unique_name(binary)));
    eprintln!(
        "kubelet: {binary} {args:?} env {env:?} as {namespace}/{service_account} (log {})",
        log.display()
    );
    let child = Command::new(workspace_binary(binary)?)
        .env_clear()
        .envs(env)
        .env("KUBECONFIG", &kubeconfig)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("starting {binary}"))?;
    Ok(Running { child, log })
}
