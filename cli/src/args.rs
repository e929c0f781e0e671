//! The flag groups several commands share, each flag declared once with one help text;
//! every command flattens the groups it takes into its own `Args` (in its module).

use std::path::PathBuf;

use clap::Args;

use crate::{Format, storm};

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

/// `-o`.
#[derive(Args, Clone, Copy, Debug)]
pub struct Output {
    /// Output format: text for people (Markdown for diff), json or yaml for scripts.
    #[arg(long, short = 'o', value_enum, default_value_t = Format::Text)]
    pub output: Format,
}

/// `-n`.
#[derive(Args, Clone, Debug, Default)]
pub struct Namespace {
    /// Namespace (files: for manifests that name none; it seeds the jitter, as in the
    /// cluster). Default: the kubeconfig context's namespace, else `default`.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
}

/// `--policy`, repeatable.
#[derive(Args, Clone, Debug, Default)]
pub struct PolicyFilter {
    /// Only these policies (metadata.name); repeatable. Default: every policy.
    #[arg(long = "policy", value_name = "NAME")]
    pub names: Vec<String>,
}

impl PolicyFilter {
    /// Whether a policy of this metadata.name is selected.
    pub fn admits(&self, name: Option<&str>) -> bool {
        self.names.is_empty() || name.is_some_and(|n| self.names.iter().any(|m| m == n))
    }

    /// ` named "a" or "b"` for messages; empty without a filter.
    pub fn describe(&self) -> String {
        if self.names.is_empty() {
            return String::new();
        }
        let quoted: Vec<String> = self.names.iter().map(|n| format!("{n:?}")).collect();
        format!(" named {}", quoted.join(" or "))
    }
}

/// `--seed`.
#[derive(Args, Clone, Copy, Debug)]
pub struct Seed {
    /// Seed for the random draws; the same seed gives the same figures.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `--samples` and `--seed`: simulated jobs that fail every run.
#[derive(Args, Clone, Copy, Debug)]
pub struct Sampling {
    /// Simulated jobs per policy.
    #[arg(long, default_value_t = 10_000)]
    pub samples: u32,
    #[command(flatten)]
    pub seed: Seed,
}

/// The storm model's setting (`rebound_policy::contention`), beside its seed. A command
/// with other storm sizes sets its own `--clients` default (`mut_arg`).
#[derive(Args, Clone, Debug)]
pub struct Storm {
    /// Numbers of clients: counts and ranges FROM..TO[:STEP], comma-separated.
    #[arg(long, value_parser = storm::parse_clients, default_value = "10..100:10")]
    pub clients: storm::Counts,
    /// How long one write holds the resource (and until its caller learns the result).
    #[arg(long, value_parser = storm::parse_write, default_value = "10ms")]
    pub write: u64,
    /// Network noise: each write reaches the resource up to this much later (uniform,
    /// from the seed), so identical delays do not keep clients in lockstep.
    #[arg(long, value_parser = storm::parse_noise, default_value = "0s")]
    pub noise: u64,
    /// Sidecars the clients are spread over (client i asks sidecar i mod N); a policy's
    /// retry budget holds for all of them together.
    #[arg(long, value_parser = storm::parse_sidecars, default_value = "1")]
    pub sidecars: u32,
}
