//! `simulate`: the schedule of each policy, from manifests or from the cluster.

use std::process::ExitCode;

use anyhow::{Result, bail};
use rebound_policy::{PreparedPolicy, RetryPolicy, resolve, simulate, simulate_budget};

use crate::{
    Findings,
    args::{Inputs, Namespace, Output, PolicyFilter, Sampling},
    load::{self, ClusterArgs},
    output, report,
};

/// `simulate`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    inputs: Inputs,
    #[command(flatten)]
    policy: PolicyFilter,
    #[command(flatten)]
    sampling: Sampling,
    #[command(flatten)]
    namespace: Namespace,
    #[command(flatten)]
    output: Output,
}

/// A policy's report, or a finding if its spec is invalid (possible for objects read from
/// a cluster whose CRD is older than this build).
pub fn policy_report(
    p: &RetryPolicy,
    namespace: &str,
    samples: u32,
    seed: u64,
) -> Result<report::PolicyReport> {
    let (name, namespace, policy) = policy_of(p, namespace)?;
    Ok(report::PolicyReport {
        simulation: simulate(&policy, samples, seed, true),
        budget: simulate_budget(&policy, samples, seed),
        name,
        namespace,
        queues: p.spec.queues.clone(),
        params: policy.params().clone(),
    })
}

/// The policy's name, namespace and decision input (identity `namespace/name`, which seeds
/// the jitter as in the cluster), or a finding if its spec is invalid.
pub fn policy_of(p: &RetryPolicy, namespace: &str) -> Result<(String, String, PreparedPolicy)> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let namespace = p
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| namespace.to_owned());
    let params = resolve(&p.spec).map_err(|errors| {
        Findings(format!(
            "RetryPolicy {namespace}/{name}: {}: {}",
            errors[0].field, errors[0].message
        ))
    })?;
    let policy = PreparedPolicy::new(format!("{namespace}/{name}"), params);
    Ok((name, namespace, policy))
}

pub fn run(cluster: &ClusterArgs, args: &Args) -> Result<ExitCode> {
    let ns = load::namespace(cluster, &args.inputs, args.namespace.namespace.clone())?;
    let Sampling { samples, seed } = args.sampling;
    let reports = ns
        .policies
        .iter()
        .filter(|p| args.policy.admits(p.metadata.name.as_deref()))
        .map(|p| policy_report(p, &ns.namespace, samples, seed.seed))
        .collect::<Result<Vec<_>>>()?;
    if reports.is_empty() {
        let named = args.policy.describe();
        if args.inputs.files.is_empty() {
            bail!("no RetryPolicy{named} in namespace {:?}", ns.namespace);
        }
        bail!("no valid RetryPolicy{named} in the given files");
    }
    let format = args.output.output;
    output::emit_as(format, &report::json(&reports), || report::table(&reports))?;
    Ok(ExitCode::SUCCESS)
}
