//! `rebound` (also installed as `kubectl-rebound`): validate, simulate, explain and ask
//! RetryPolicies, from files or from a cluster, with the same code the operator and the
//! sidecar run.
//!
//! Exit codes: 0 all good; 1 findings (an invalid policy, a refused rollout request); 2
//! usage or I/O errors; `rollout status` adds 3 (not finished).

use std::{ffi::OsString, process::ExitCode};

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod args;
mod ask;
mod check;
mod complete;
mod diff;
mod explain;
pub mod inject;
mod input;
mod load;
mod output;
mod plot;
mod report;
mod rollout;
mod simulate;
mod storm;
mod svg;
mod validate;

pub use output::Format;

/// An error that is a finding about the input (an invalid policy): exit code 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Findings(pub String);

#[derive(Parser)]
#[command(
    name = "rebound",
    version,
    propagate_version = true,
    about = "Declarative retry policies for job workers"
)]
pub struct Cli {
    #[command(flatten)]
    cluster: load::ClusterArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check RetryPolicy manifests; text output is `file:document:field: message` per problem.
    Validate(validate::Args),
    /// Show what a policy does to jobs that keep failing: delays per retry and time to give up.
    /// Without -f, reads the RetryPolicies of the namespace from the cluster.
    Simulate(simulate::Args),
    /// Which policy serves a queue and why (exact name or glob, shadowed policies), and its
    /// schedule. Without -f, reads the namespace's RetryPolicies and compiled ConfigMap.
    Explain(explain::Args),
    /// Many clients retrying one write at once under each policy (the optimistic-concurrency
    /// model of "Exponential Backoff And Jitter"): calls made and time until the last client
    /// finished, per number of clients. Without -f, reads the namespace's RetryPolicies.
    Storm(storm::Args),
    /// Draw a policy's schedule or a retry storm as SVG (to stdout, or --out FILE).
    Plot {
        #[command(subcommand)]
        what: plot::Command,
    },
    /// Compare two versions of a policy file: fields, added and removed policies, and how
    /// the schedule, the give-up time and the storm figures move (Markdown, or -o json).
    /// Exit 0 no change, 1 changes, 2 errors (as diff(1)).
    Diff(diff::Args),
    /// Print the RetryPolicy CustomResourceDefinition.
    Crd,
    /// Ask what happens after a failure, exactly as the sidecar would answer. Without -f,
    /// asks the namespace's compiled ConfigMap, which is what the sidecars serve.
    Ask(ask::Args),
    /// Print a shell completion script.
    Completion(complete::Args),
    /// Is Rebound healthy here (CRD, operator, admission policies, injection parameters) and
    /// is every injected Pod current (sidecar image, configuration, fleet Lease)? One
    /// verdict per line, or -o json; exit 1 when anything failed.
    Check(check::Args),
    /// Add the Rebound sidecar to the Pod templates of manifests annotated
    /// rebound.dev/inject: "true", exactly as the chart's admission policy does.
    Inject(inject::Args),
    /// Watch a policy's rollout (status) and promote, abort or retry it.
    Rollout {
        #[command(subcommand)]
        what: rollout::Command,
    },
}

/// The command name users type: `kubectl rebound` when run as the kubectl plugin.
fn invoked_as(argv0: Option<&OsString>) -> &'static str {
    let stem = argv0
        .map(std::path::Path::new)
        .and_then(|p| p.file_stem())
        .and_then(|s| s.to_str());
    match stem {
        Some(s) if s.starts_with("kubectl_complete-rebound") => "kubectl_complete-rebound",
        Some(s) if s.starts_with("kubectl-rebound") => "kubectl-rebound",
        _ => "rebound",
    }
}

/// Parses the command line and runs it; the binaries' whole `main`.
pub fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let name = invoked_as(args.first());
    if name == "kubectl_complete-rebound" {
        let words: Vec<String> = args
            .iter()
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        return match output::emit(&complete::answer(&Cli::command(), &words)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::from(2),
        };
    }
    let mut command = Cli::command();
    if name == "kubectl-rebound" {
        command = command
            .bin_name("kubectl rebound")
            .display_name("kubectl rebound");
    }
    let cli = match command
        .try_get_matches_from(&args)
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        // --help and --version exit 0, usage errors 2 (clap's own convention).
        Err(e) => e.exit(),
    };
    match run(cli, name) {
        Ok(code) => code,
        // A reader that went away (`rebound simulate | head`) is not an error.
        Err(e) if output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            if e.downcast_ref::<Findings>().is_some()
                || e.downcast_ref::<rollout::Refused>().is_some()
            {
                ExitCode::from(1)
            } else {
                ExitCode::from(2)
            }
        }
    }
}

/// Dispatches to the command's module.
fn run(cli: Cli, name: &str) -> Result<ExitCode> {
    let cluster = &cli.cluster;
    match cli.command {
        Command::Validate(args) => validate::run(&args),
        Command::Simulate(args) => simulate::run(cluster, &args),
        Command::Explain(args) => explain::run(cluster, &args),
        Command::Storm(args) => storm::run(cluster, &args),
        Command::Plot { what } => plot::run(cluster, &what),
        Command::Diff(args) => diff::run(cluster, &args),
        Command::Crd => {
            output::emit(&rebound_policy::crd_yaml())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Ask(args) => ask::run(cluster, &args),
        Command::Completion(args) => complete::script(&args, &mut Cli::command(), name),
        Command::Check(args) => check::run(cluster, &args),
        Command::Inject(args) => inject::run(&args),
        Command::Rollout { what } => rollout::run(cluster, &what),
    }
}
