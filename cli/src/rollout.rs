//! `rollout status|promote|abort|retry`: watch a policy's rollout and ask the operator to
//! act on it, as `kubectl argo rollouts` does for Deployments. Requests go into
//! `status.rollout.request` (a merge patch of the status subresource, field manager
//! `kubectl-rebound`): `spec` and the annotations stay as the GitOps engine wrote them.
//!
//! Exit codes of `status`: 0 Healthy for the current generation, 1 Degraded (rolled back,
//! or Stalled), 2 errors, 3 not finished (timeout, or in progress with `--watch=false`).
//! promote/abort/retry: 0 written, 1 refused (nothing to act on), 2 errors.

mod view;

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use futures::StreamExt;
use kube::{
    Api,
    api::{Patch, PatchParams},
    runtime::{WatchStreamExt, watcher},
};
use rebound_policy::{
    RetryPolicy,
    spec::{RolloutAction, RolloutPhase},
};
use serde_json::json;

use crate::{
    Format,
    args::{Output, parse_noise},
    load::{self, ClusterArgs},
    output,
};
use view::{State, View};

/// The field manager of the requests, visible in `managedFields`.
pub const FIELD_MANAGER: &str = "kubectl-rebound";

/// Exit code of `status` when the rollout was rolled back.
const DEGRADED: u8 = 1;
/// Exit code of `status` when it stopped before the rollout ended.
const NOT_FINISHED: u8 = 3;
/// Watch errors in a row (the watcher backs off between them) before giving up.
const MAX_WATCH_ERRORS: u32 = 5;

/// A request refused because the rollout is not in a state it applies to: exit code 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

#[derive(clap::Subcommand)]
pub enum Command {
    /// Where the rollout stands: phase, revisions, step and weight, the analysis. Watches
    /// until it ends: exit 0 Healthy, 1 Degraded, 3 timeout (2 errors).
    Status(StatusArgs),
    /// Pass the current step now (--full: serve the new revision to every job at once).
    Promote(PromoteArgs),
    /// Roll back to the stable revision now; the policy stays Degraded until spec changes
    /// or `retry`.
    Abort(Target),
    /// Start a rolled-back revision again at step 0, with fresh evidence.
    Retry(Target),
}

/// The policy a command acts on.
#[derive(clap::Args)]
pub struct Target {
    /// The RetryPolicy (metadata.name).
    policy: String,
    /// Namespace. Default: the kubeconfig context's.
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    #[command(flatten)]
    output: Output,
}

/// `rollout status`.
#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    target: Target,
    /// Keep watching until the rollout is Healthy or Degraded.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    watch: bool,
    /// Give up watching after this long (e.g. 30m); 0: never.
    #[arg(long, value_parser = parse_noise, default_value = "0s", value_name = "DURATION")]
    timeout: u64,
}

/// `rollout promote`.
#[derive(clap::Args)]
pub struct PromoteArgs {
    #[command(flatten)]
    target: Target,
    /// Skip the remaining steps and analysis: the new revision serves every job.
    #[arg(long)]
    full: bool,
}

pub fn run(cluster: &ClusterArgs, command: &Command) -> Result<ExitCode> {
    match command {
        Command::Status(args) => load::block_on(status(cluster, args)),
        Command::Promote(args) => {
            let action = if args.full {
                RolloutAction::PromoteFull
            } else {
                RolloutAction::Promote
            };
            load::block_on(request(cluster, &args.target, action))
        }
        Command::Abort(target) => load::block_on(request(cluster, target, RolloutAction::Abort)),
        Command::Retry(target) => load::block_on(request(cluster, target, RolloutAction::Retry)),
    }
}

async fn api(cluster: &ClusterArgs, target: &Target) -> Result<(Api<RetryPolicy>, String)> {
    let (client, namespace) = load::connect(cluster, target.namespace.clone()).await?;
    Ok((Api::namespaced(client, &namespace), namespace))
}

async fn read(api: &Api<RetryPolicy>, namespace: &str, name: &str) -> Result<RetryPolicy> {
    api.get_opt(name)
        .await
        .with_context(|| format!("cannot read RetryPolicy {namespace}/{name}"))?
        .with_context(|| format!("RetryPolicy {namespace}/{name} not found"))
}

/// Prints one view: a block of text, one line of JSON, or one YAML document.
fn show(format: Format, view: &View, first: bool) -> Result<()> {
    match format {
        Format::Text => {
            let gap = if first { "" } else { "\n" };
            output::emit(&format!("{gap}{}", view.text()))
        }
        Format::Json => output::emit(&format!("{}\n", serde_json::to_string(view)?)),
        Format::Yaml => output::emit(&format!("---\n{}", serde_saphyr::to_string(view)?)),
    }
}

fn exit_code(state: State) -> ExitCode {
    match state {
        State::Healthy => ExitCode::SUCCESS,
        State::Degraded => ExitCode::from(DEGRADED),
        _ => ExitCode::from(NOT_FINISHED),
    }
}

async fn status(cluster: &ClusterArgs, args: &StatusArgs) -> Result<ExitCode> {
    let target = &args.target;
    let (api, namespace) = api(cluster, target).await?;
    let format = target.output.output;
    let policy = read(&api, &namespace, &target.policy).await?;
    let mut last = View::of(&policy);
    show(format, &last, true)?;
    if last.state.is_final() || !args.watch {
        return Ok(exit_code(last.state));
    }
    let watch = async {
        let mut errors = 0;
        let mut stream = watcher::watch_object(api, &target.policy)
            .default_backoff()
            .boxed();
        while let Some(event) = stream.next().await {
            let policy = match event {
                Ok(Some(policy)) => policy,
                Ok(None) => anyhow::bail!("RetryPolicy {namespace}/{} deleted", target.policy),
                Err(e) => {
                    errors += 1;
                    if errors >= MAX_WATCH_ERRORS {
                        return Err(e).context("watching the RetryPolicy");
                    }
                    eprintln!("watching the RetryPolicy: {e}; retrying");
                    continue;
                }
            };
            errors = 0;
            let view = View::of(&policy);
            if view != last {
                show(format, &view, false)?;
                last = view;
            }
            if last.state.is_final() {
                break;
            }
        }
        Ok(exit_code(last.state))
    };
    if args.timeout == 0 {
        return watch.await;
    }
    let limit = std::time::Duration::from_millis(args.timeout);
    match tokio::time::timeout(limit, watch).await {
        Ok(result) => result,
        Err(_) => {
            eprintln!(
                "timed out after {} waiting for RetryPolicy {namespace}/{} to finish its rollout",
                rebound_policy::format_millis(args.timeout),
                target.policy
            );
            Ok(ExitCode::from(NOT_FINISHED))
        }
    }
}

/// Why `action` does not apply to a rollout in `phase`, if it does not.
fn refusal(action: RolloutAction, phase: RolloutPhase) -> Option<&'static str> {
    match (action, phase) {
        (RolloutAction::Retry, RolloutPhase::Degraded) => None,
        (RolloutAction::Retry, _) => Some("only a rolled-back (Degraded) rollout can be retried"),
        (_, RolloutPhase::Healthy) => Some("no rollout is in progress (the policy is Healthy)"),
        (_, RolloutPhase::Degraded) => Some(
            "the rollout was rolled back (Degraded): revert the change in Git, or `kubectl rebound rollout retry`",
        ),
        _ => None,
    }
}

/// A random request id, 16 hex digits: each request is acted on once.
fn request_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is keyed from the OS's randomness.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

fn action_name(action: RolloutAction) -> &'static str {
    match action {
        RolloutAction::Promote => "Promote",
        RolloutAction::PromoteFull => "PromoteFull",
        RolloutAction::Abort => "Abort",
        RolloutAction::Retry => "Retry",
    }
}

/// Writes `status.rollout.request` for the revision read, unless the state refuses it.
async fn request(
    cluster: &ClusterArgs,
    target: &Target,
    action: RolloutAction,
) -> Result<ExitCode> {
    let (api, namespace) = api(cluster, target).await?;
    let name = &target.policy;
    let what = format!("RetryPolicy {namespace}/{name}");
    // The patch carries the resourceVersion read: if the status moved meanwhile (a step
    // passed, a new revision), it is read and judged again.
    for _ in 0..3 {
        let policy = read(&api, &namespace, name).await?;
        let status = policy.status.as_ref();
        let Some(rollout) = status.and_then(|s| s.rollout.as_ref()) else {
            let why = if policy.spec.rollout.is_none() {
                "it declares no spec.rollout"
            } else {
                "rebound-operator has not written its rollout status yet"
            };
            return Err(Refused(format!("{what}: nothing to {action:?}: {why}")).into());
        };
        let generation = policy.metadata.generation;
        if status.and_then(|s| s.observed_generation) != generation {
            return Err(Refused(format!(
                "{what}: rebound-operator has not observed generation {} yet: try again once \
                 `kubectl rebound rollout status` shows it",
                generation.unwrap_or_default()
            ))
            .into());
        }
        if let Some(why) = refusal(action, rollout.phase) {
            return Err(Refused(format!("{what}: nothing to {action:?}: {why}")).into());
        }
        let id = request_id();
        let body = json!({
            "metadata": {"resourceVersion": policy.metadata.resource_version},
            "status": {"rollout": {"request": {
                "action": action_name(action),
                "revision": rollout.revision,
                "step": rollout.step,
                "id": id,
            }}},
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..Default::default()
        };
        match api.patch_status(name, &params, &Patch::Merge(&body)).await {
            Ok(_) => {
                let report = json!({
                    "namespace": namespace, "name": name, "action": action_name(action),
                    "revision": rollout.revision, "id": id,
                });
                output::emit_as(target.output.output, &report, || {
                    format!(
                        "{} requested for {what}, revision {} (request {id}); \
                         `kubectl rebound rollout status` shows when it is acted on\n",
                        action_name(action),
                        view::short(&rollout.revision)
                    )
                })?;
                return Ok(ExitCode::SUCCESS);
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(kube::Error::Api(s)) if s.code == 403 => {
                anyhow::bail!(
                    "{what}: not allowed to patch retrypolicies/status ({}); see `kubectl rebound \
                     rollout` in docs/cli.md for the role it needs",
                    s.message
                )
            }
            Err(e) => return Err(e).with_context(|| format!("cannot write the request on {what}")),
        }
    }
    anyhow::bail!("{what}: its status kept changing while the request was written; try again")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_apply_to_running_rollouts_and_retry_to_rolled_back_ones() {
        use RolloutAction::*;
        use RolloutPhase::*;
        for action in [Promote, PromoteFull, Abort] {
            assert!(refusal(action, Progressing).is_none());
            assert!(refusal(action, Paused).is_none());
            assert!(refusal(action, Healthy).is_some());
            assert!(refusal(action, Degraded).is_some());
        }
        assert!(refusal(Retry, Degraded).is_none());
        for phase in [Healthy, Progressing, Paused] {
            assert!(refusal(Retry, phase).is_some());
        }
    }

    #[test]
    fn request_ids_are_16_hex_and_differ() {
        let (a, b) = (request_id(), request_id());
        assert_eq!(a.len(), 16);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
