//! `rebound` (also installed as `kubectl-rebound`): validate, simulate, explain and ask
//! RetryPolicies, from files or from a cluster, with the same code the operator and the
//! sidecar run.
//!
//! Exit codes: 0 all good; 1 findings (an invalid policy); 2 usage or I/O errors.

use std::{ffi::OsString, path::PathBuf, process::ExitCode};

use anyhow::Result;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

mod ask;
mod cluster;
mod complete;
mod diff;
mod explain;
mod input;
mod output;
mod plot;
mod report;
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
    cluster: cluster::ClusterArgs,
    #[command(subcommand)]
    command: Command,
}

/// Where policies come from: files (`-f`), or the cluster when no `-f` is given.
#[derive(Args, Clone, Debug, Default)]
pub struct Inputs {
    /// Files, directories (their *.yaml, *.yml, *.json) or `-` for stdin; repeatable.
    #[arg(short = 'f', long = "filename", num_args = 1..)]
    pub files: Vec<PathBuf>,
    /// Also read the subdirectories of directories given with -f.
    #[arg(short = 'R', long)]
    pub recursive: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Check RetryPolicy manifests; text output is `file:document:field: message` per problem.
    Validate {
        #[command(flatten)]
        inputs: Inputs,
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Show what a policy does to jobs that keep failing: delays per retry and time to give up.
    /// Without -f, reads the RetryPolicies of the namespace from the cluster.
    Simulate {
        #[command(flatten)]
        inputs: Inputs,
        /// Only this policy (metadata.name).
        #[arg(long)]
        policy: Option<String>,
        /// Simulated jobs per policy.
        #[arg(long, default_value_t = 10_000)]
        samples: u32,
        /// Seed for the random draws; the same seed gives the same figures.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
        output: Format,
        /// Namespace (files: for manifests that name none; it seeds the jitter, as in the
        /// cluster). Default: the kubeconfig context's namespace, else `default`.
        #[arg(long, short = 'n')]
        namespace: Option<String>,
    },
    /// Which policy serves a queue and why (exact name or glob, shadowed policies), and its
    /// schedule. Without -f, reads the namespace's RetryPolicies and compiled ConfigMap.
    Explain {
        /// The queue name, as the job library names it.
        queue: String,
        #[command(flatten)]
        inputs: Inputs,
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
        output: Format,
        /// Simulated jobs for the schedule.
        #[arg(long, default_value_t = 10_000)]
        samples: u32,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Many clients retrying one write at once under each policy (the optimistic-concurrency
    /// model of "Exponential Backoff And Jitter"): calls made and time until the last client
    /// finished, per number of clients. Without -f, reads the namespace's RetryPolicies.
    Storm {
        #[command(flatten)]
        inputs: Inputs,
        /// Only this policy (metadata.name).
        #[arg(long)]
        policy: Option<String>,
        /// Numbers of clients: counts and ranges FROM..TO[:STEP], comma-separated.
        #[arg(long, value_parser = storm::parse_clients, default_value = "10..100:10")]
        clients: storm::Counts,
        /// How long one write holds the resource (and until its caller learns the result).
        #[arg(long, value_parser = storm::parse_write, default_value = "10ms")]
        write: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Draw a policy's schedule or a retry storm as SVG (to stdout, or --out FILE).
    Plot {
        #[command(subcommand)]
        what: PlotCommand,
    },
    /// Compare two versions of a policy file: fields, added and removed policies, and how
    /// the schedule, the give-up time and the storm figures move (Markdown, or -o json).
    /// Exit 0 no change, 1 changes, 2 errors (as diff(1)).
    Diff {
        old: PathBuf,
        new: PathBuf,
        #[arg(long, default_value_t = 10_000)]
        samples: u32,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Storm sizes compared (as `storm --clients`).
        #[arg(long, value_parser = storm::parse_clients, default_value = "10,100")]
        clients: storm::Counts,
        #[arg(long, value_parser = storm::parse_write, default_value = "10ms")]
        write: u64,
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        /// `text` is Markdown.
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Print the RetryPolicy CustomResourceDefinition.
    Crd,
    /// Ask what happens after a failure, exactly as the sidecar would answer. Without -f,
    /// asks the namespace's compiled ConfigMap, which is what the sidecars serve.
    Ask {
        #[command(flatten)]
        inputs: Inputs,
        #[arg(long)]
        queue: String,
        /// 1-based number of the run that just failed.
        #[arg(long)]
        attempt: u32,
        #[arg(long)]
        job_id: Option<String>,
        #[arg(long)]
        error_class: Option<String>,
        /// Time since the first failure, e.g. `90s`.
        #[arg(long)]
        elapsed: Option<String>,
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Print a shell completion script.
    Completion {
        #[arg(value_enum)]
        shell: Shell,
    },
}

#[derive(Subcommand)]
enum PlotCommand {
    /// Delay bands per retry (min–p50–p99–max) and the share of jobs given up over time,
    /// one row per policy.
    Schedule {
        #[command(flatten)]
        inputs: Inputs,
        /// Only these policies (metadata.name); repeatable.
        #[arg(long)]
        policy: Vec<String>,
        #[arg(long, default_value_t = 10_000)]
        samples: u32,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        /// Write the SVG here instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Calls and time until the last client finished against the number of clients (the
    /// `storm` model), one line per policy; give several -f to compare versions.
    Storm {
        #[command(flatten)]
        inputs: Inputs,
        /// Only these policies (metadata.name); repeatable.
        #[arg(long)]
        policy: Vec<String>,
        #[arg(long, value_parser = storm::parse_clients, default_value = "10..100:10")]
        clients: storm::Counts,
        #[arg(long, value_parser = storm::parse_write, default_value = "10ms")]
        write: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        /// Write the SVG here instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Shell {
    Bash,
    Zsh,
    Fish,
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
            if e.downcast_ref::<Findings>().is_some() {
                ExitCode::from(1)
            } else {
                ExitCode::from(2)
            }
        }
    }
}

fn run(cli: Cli, name: &str) -> Result<ExitCode> {
    let cluster = cli.cluster;
    match cli.command {
        Command::Validate { inputs, output } => validate::run(&inputs, output),
        Command::Simulate {
            inputs,
            policy,
            samples,
            seed,
            output,
            namespace,
        } => simulate::run(
            &cluster,
            &inputs,
            namespace,
            policy.as_deref(),
            samples,
            seed,
            output,
        ),
        Command::Explain {
            queue,
            inputs,
            namespace,
            output,
            samples,
            seed,
        } => explain::run(&cluster, &inputs, namespace, &queue, samples, seed, output),
        Command::Storm {
            inputs,
            policy,
            clients,
            write,
            seed,
            namespace,
            output,
        } => storm::run(
            &cluster,
            &inputs,
            namespace,
            &storm::StormArgs {
                only: policy.as_deref(),
                clients: &clients.0,
                write_ms: write,
                seed,
            },
            output,
        ),
        Command::Plot { what } => match what {
            PlotCommand::Schedule {
                inputs,
                policy,
                samples,
                seed,
                namespace,
                out,
            } => {
                let policies = plot::load(&cluster, &inputs, namespace, &policy)?;
                plot::write(&plot::schedule_svg(&policies, samples, seed), out.as_ref())
            }
            PlotCommand::Storm {
                inputs,
                policy,
                clients,
                write,
                seed,
                namespace,
                out,
            } => {
                let policies = plot::load(&cluster, &inputs, namespace, &policy)?;
                let series = plot::storm_series(&policies, &clients.0, write, seed);
                plot::write(&plot::storm_svg(&series, write, seed), out.as_ref())
            }
        },
        Command::Diff {
            old,
            new,
            samples,
            seed,
            clients,
            write,
            namespace,
            output,
        } => diff::run(
            &cluster,
            &diff::DiffArgs {
                old,
                new,
                namespace,
                samples,
                seed,
                clients: clients.0,
                write_ms: write,
            },
            output,
        ),
        Command::Crd => {
            output::emit(&rebound_policy::crd_yaml())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Ask {
            inputs,
            queue,
            attempt,
            job_id,
            error_class,
            elapsed,
            namespace,
            output,
        } => ask::run(
            &cluster,
            &inputs,
            namespace,
            &ask::Question {
                queue,
                attempt,
                job_id,
                error_class,
                elapsed,
            },
            output,
        ),
        Command::Completion { shell } => {
            let shell = match shell {
                Shell::Bash => clap_complete::Shell::Bash,
                Shell::Zsh => clap_complete::Shell::Zsh,
                Shell::Fish => clap_complete::Shell::Fish,
            };
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), name, &mut out);
            output::emit(&String::from_utf8_lossy(&out))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
