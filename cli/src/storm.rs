//! `storm`: many clients retrying one write at once under each policy (the contention
//! model of `rebound_policy::contention`), per number of clients.

use std::{fmt::Write as _, process::ExitCode};

use anyhow::{Result, bail};
use rebound_policy::{
    PreparedPolicy,
    contention::{self, ContentionRun, run_storm},
    duration::format_approx,
};
use serde_json::{Value, json};

use crate::{
    args::{self, Inputs, Namespace, Output, PolicyFilter, Seed},
    load::{self, ClusterArgs},
    output, simulate,
};

/// `storm`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    inputs: Inputs,
    #[command(flatten)]
    policy: PolicyFilter,
    #[command(flatten)]
    storm: args::Storm,
    #[command(flatten)]
    seed: Seed,
    #[command(flatten)]
    namespace: Namespace,
    #[command(flatten)]
    output: Output,
}

/// The model's run for each client count of `flags`, in order.
pub fn runs(policy: &PreparedPolicy, flags: &args::Storm, seed: u64) -> Vec<ContentionRun> {
    flags
        .clients
        .0
        .iter()
        .map(|&clients| {
            let storm = contention::Storm {
                clients,
                write_ms: flags.write,
                seed,
                noise_ms: flags.noise,
                sidecars: flags.sidecars,
            };
            run_storm(policy, &storm)
        })
        .collect()
}

pub fn run(cluster: &ClusterArgs, args: &Args) -> Result<ExitCode> {
    let (storm, seed) = (&args.storm, args.seed.seed);
    let ns = load::namespace(cluster, &args.inputs, args.namespace.namespace.clone())?;
    let mut results = Vec::new();
    for p in ns
        .policies
        .iter()
        .filter(|p| args.policy.admits(p.metadata.name.as_deref()))
    {
        let (name, namespace, policy) = simulate::policy_of(p, &ns.namespace)?;
        results.push((name, namespace, runs(&policy, storm, seed)));
    }
    if results.is_empty() {
        bail!("no RetryPolicy to simulate");
    }
    let document = json!({
        "writeMs": storm.write,
        "noiseMs": storm.noise,
        "sidecars": storm.sidecars,
        "seed": seed,
        "policies": results.iter().map(|(name, namespace, runs)| json!({
            "name": name,
            "namespace": namespace,
            "runs": runs,
        })).collect::<Vec<Value>>(),
    });
    output::emit_as(args.output.output, &document, || {
        table(&results, storm, seed)
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `10 ms writes`, with the noise and sidecars when set: the storm in words.
pub fn describe(storm: &args::Storm) -> String {
    let mut out = format!("{} ms writes", storm.write);
    if storm.noise > 0 {
        let _ = write!(out, " with up to {} ms of network noise", storm.noise);
    }
    if storm.sidecars > 1 {
        let _ = write!(out, ", clients spread over {} sidecars", storm.sidecars);
    }
    out
}

fn table(
    results: &[(String, String, Vec<ContentionRun>)],
    storm: &args::Storm,
    seed: u64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} clients each completing one write to one resource, all starting at once ({}, seed {seed}):",
        storm
            .clients
            .0
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        describe(storm),
    );
    for (name, namespace, runs) in results {
        let _ = writeln!(out, "\n{namespace}/{name}");
        let budgeted = runs.iter().any(|r| r.budget.is_some());
        let _ = write!(
            out,
            "  {:>8}  {:>12}  {:>14}  {:>9}  {:>8}",
            "clients", "calls", "last finished", "succeeded", "gave up"
        );
        if budgeted {
            let _ = write!(out, "  {:>9}  {:>12}", "stretched", "busiest slot");
        }
        out.push('\n');
        for r in runs {
            let _ = write!(
                out,
                "  {:>8}  {:>12}  {:>14}  {:>9}  {:>8}",
                r.clients,
                r.calls,
                format_approx(r.completion_ms),
                r.succeeded,
                r.gave_up,
            );
            if let Some(b) = &r.budget {
                let _ = write!(
                    out,
                    "  {:>9}  {:>12}",
                    b.stretched,
                    format!("{}/{}", b.busiest_slot, b.burst)
                );
            }
            let _ = writeln!(
                out,
                "{}",
                if r.truncated {
                    "  (stopped at the call bound)"
                } else {
                    ""
                }
            );
        }
    }
    out
}
