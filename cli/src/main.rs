//! `rebound`: validate, simulate and query RetryPolicies offline, with the same code the
//! operator and the sidecar run.

use std::{
    io::{ErrorKind, Write},
    path::PathBuf,
    process::ExitCode,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use rebound_policy::{
    Context, Decision, Policy, PolicySource, ResolvedPolicy, RetryPolicy, compile, crd_yaml,
    decide, format_millis, manifest, simulate,
};

mod report;

#[derive(Parser)]
#[command(
    name = "rebound",
    version,
    about = "Declarative retry policies for job workers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check RetryPolicy manifests; prints `file:document:field: message` for each problem.
    Validate {
        /// YAML files (multi-document; other kinds are skipped).
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
    },
    /// Show what a policy does to jobs that keep failing: delays per retry and time to give up.
    Simulate {
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Only this policy (metadata.name).
        #[arg(long)]
        policy: Option<String>,
        /// Simulated jobs per policy.
        #[arg(long, default_value_t = 10_000)]
        samples: u32,
        /// Seed for the random draws; the same seed gives the same figures.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Namespace for manifests that name none (it seeds the jitter, as in the cluster).
        #[arg(long, short = 'n', default_value = "default")]
        namespace: String,
    },
    /// Print the RetryPolicy CustomResourceDefinition.
    Crd,
    /// Ask what happens after a failure, exactly as the sidecar would answer.
    Ask {
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
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
        /// Namespace for manifests that name none (it seeds the jitter, as in the cluster).
        #[arg(long, short = 'n', default_value = "default")]
        namespace: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        // A reader that went away (`rebound simulate | head`) is not an error.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rebound: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|io| io.kind() == ErrorKind::BrokenPipe)
}

/// Writes to stdout, returning write errors instead of panicking like `print!`.
fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Validate { files } => validate(&files),
        Command::Simulate {
            files,
            policy,
            samples,
            seed,
            output,
            namespace,
        } => {
            let policies = load_valid(&files, &namespace)?;
            let selected: Vec<_> = policies
                .iter()
                .filter(|p| policy.as_deref().is_none_or(|n| p.name() == n))
                .collect();
            if selected.is_empty() {
                bail!(
                    "no valid RetryPolicy{} in the given files",
                    policy.map(|n| format!(" named {n:?}")).unwrap_or_default()
                );
            }
            let reports: Vec<_> = selected
                .iter()
                .map(|p| report::PolicyReport {
                    name: p.name().to_owned(),
                    namespace: p.namespace().to_owned(),
                    queues: p.object.spec.queues.clone(),
                    params: p.params.clone(),
                    simulation: simulate(&p.policy(), samples, seed, true),
                })
                .collect();
            match output {
                Output::Table => emit(&report::table(&reports))?,
                Output::Json => emit(&format!("{}\n", report::json(&reports)))?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Crd => {
            emit(&crd_yaml())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Ask {
            files,
            queue,
            attempt,
            job_id,
            error_class,
            elapsed,
            namespace,
        } => ask(
            &files,
            &namespace,
            &queue,
            attempt,
            job_id,
            error_class,
            elapsed,
        ),
    }
}

/// A policy read from a file that passed validation.
struct LoadedPolicy {
    object: RetryPolicy,
    params: ResolvedPolicy,
    /// `metadata.namespace`, or the one given on the command line.
    namespace: String,
}

impl LoadedPolicy {
    fn name(&self) -> &str {
        self.object.metadata.name.as_deref().unwrap_or_default()
    }
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn policy(&self) -> Policy {
        Policy::new(
            format!("{}/{}", self.namespace(), self.name()),
            self.params.clone(),
        )
    }
}

fn read(path: &PathBuf) -> Result<Vec<manifest::ManifestDocument>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    manifest::parse_manifests(&text).with_context(|| format!("{}: not valid YAML", path.display()))
}

fn validate(files: &[PathBuf]) -> Result<ExitCode> {
    let (mut valid, mut invalid) = (0, 0);
    let mut report = String::new();
    for path in files {
        // One unreadable file must not hide the problems of the others.
        let docs = match read(path) {
            Ok(docs) => docs,
            Err(e) => {
                invalid += 1;
                report.push_str(&format!("{}:0:: {e:#}\n", path.display()));
                continue;
            }
        };
        if docs.is_empty() {
            eprintln!("{}: no RetryPolicy documents", path.display());
        }
        for doc in docs {
            match doc.result {
                Ok(_) => valid += 1,
                Err(errors) => {
                    invalid += 1;
                    for e in errors {
                        report.push_str(&format!(
                            "{}:{}:{}: {}\n",
                            path.display(),
                            doc.index,
                            e.field,
                            e.message
                        ));
                    }
                }
            }
        }
    }
    emit(&report)?;
    eprintln!("{valid} valid, {invalid} invalid RetryPolicies");
    Ok(if invalid == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Every valid policy of the files; any invalid one is an error (simulating a broken file
/// would show figures for something the cluster rejects).
fn load_valid(files: &[PathBuf], default_namespace: &str) -> Result<Vec<LoadedPolicy>> {
    let mut out = Vec::new();
    for path in files {
        for doc in read(path)? {
            match doc.result {
                Ok((object, params)) => out.push(LoadedPolicy {
                    namespace: object
                        .metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| default_namespace.to_owned()),
                    object,
                    params,
                }),
                Err(errors) => bail!(
                    "{}:{}:{}: {} (run `rebound validate` for every problem)",
                    path.display(),
                    doc.index,
                    errors[0].field,
                    errors[0].message
                ),
            }
        }
    }
    Ok(out)
}

fn ask(
    files: &[PathBuf],
    default_namespace: &str,
    queue: &str,
    attempt: u32,
    job_id: Option<String>,
    error_class: Option<String>,
    elapsed: Option<String>,
) -> Result<ExitCode> {
    if attempt == 0 {
        bail!("--attempt is 1-based: the number of the run that just failed");
    }
    let elapsed_ms = elapsed
        .map(|e| {
            rebound_policy::KubeDuration::parse(&e)
                .map(|d| d.as_millis())
                .with_context(|| format!("--elapsed {e:?}"))
        })
        .transpose()?;
    let loaded = load_valid(files, default_namespace)?;
    let namespace = loaded
        .first()
        .map_or("default", |p| p.namespace())
        .to_owned();
    let sources = loaded
        .iter()
        .filter(|p| p.namespace() == namespace)
        .map(|p| PolicySource::from_object(&p.object, &p.namespace))
        .collect();
    let table = rebound_policy::PolicyTable::new(&compile(&namespace, sources).document);
    let Some(entry) = table.lookup(queue) else {
        bail!("no policy in namespace {namespace:?} governs queue {queue:?}");
    };
    let ctx = Context {
        job_id: job_id.as_deref(),
        error_class: error_class.as_deref(),
        first_failure_ms: elapsed_ms.map(|_| 0),
        now_ms: elapsed_ms,
        retry_after_ms: None,
    };
    let answer = match decide(&entry.policy, attempt, &ctx) {
        Decision::Retry { delay_ms } => format!(
            "RETRY in {} ({delay_ms} ms)  policy {}/{}\n",
            format_millis(delay_ms),
            entry.namespace,
            entry.name
        ),
        Decision::GiveUp {
            disposition,
            reason,
        } => format!(
            "GIVE_UP → {disposition}: {reason}  policy {}/{}\n",
            entry.namespace, entry.name
        ),
    };
    emit(&answer)?;
    Ok(ExitCode::SUCCESS)
}
