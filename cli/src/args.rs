//! The flag groups several commands share, each flag declared once with one help text;
//! every command flattens the groups it takes into its own `Args` (in its module).

use std::path::PathBuf;

use clap::Args;

use rebound_policy::{
    KubeDuration,
    contention::{MAX_CLIENTS, MAX_SIDECARS},
};

use crate::Format;

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
    #[arg(long, value_parser = parse_clients, default_value = "10..100:10")]
    pub clients: Counts,
    /// How long one write holds the resource (and until its caller learns the result).
    #[arg(long, value_parser = parse_write, default_value = "10ms")]
    pub write: u64,
    /// Network noise: each write reaches the resource up to this much later (uniform,
    /// from the seed), so identical delays do not keep clients in lockstep.
    #[arg(long, value_parser = parse_noise, default_value = "0s")]
    pub noise: u64,
    /// Sidecars the clients are spread over (client i asks sidecar i mod N); a policy's
    /// retry budget holds for all of them together.
    #[arg(long, value_parser = parse_sidecars, default_value = "1")]
    pub sidecars: u32,
}

/// Client counts in one run, at most: each is a whole simulation.
const MAX_COUNTS: usize = 1_000;

/// Numbers of clients to simulate, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counts(pub Vec<u32>);

/// Parses `--clients`: counts and ranges `FROM..TO[:STEP]` (TO included), comma-separated.
pub fn parse_clients(text: &str) -> Result<Counts, String> {
    let mut counts = Vec::new();
    for item in text.split(',').map(str::trim) {
        let number = |s: &str| {
            s.parse::<u32>()
                .map_err(|_| format!("{s:?} is not a whole number of clients"))
        };
        let (from, to, step) = match item.split_once("..") {
            None => {
                let n = number(item)?;
                (n, n, 1)
            }
            Some((from, rest)) => {
                let (to, step) = rest.split_once(':').unwrap_or((rest, "1"));
                (number(from)?, number(to)?, number(step)?)
            }
        };
        if from == 0 || to < from || step == 0 {
            return Err(format!(
                "{item:?}: counts start at 1, ranges go up, steps are at least 1"
            ));
        }
        if to > MAX_CLIENTS {
            return Err(format!("{item:?}: at most {MAX_CLIENTS} clients"));
        }
        let mut n = from;
        while n <= to {
            if counts.len() == MAX_COUNTS {
                return Err(format!("more than {MAX_COUNTS} client counts"));
            }
            counts.push(n);
            n = match n.checked_add(step) {
                Some(next) => next,
                None => break,
            };
        }
    }
    Ok(Counts(counts))
}

/// Parses `--write`: a Kubernetes duration of at least 1 ms.
pub fn parse_write(text: &str) -> Result<u64, String> {
    match parse_noise(text)? {
        0 => Err("a write takes at least 1ms".to_owned()),
        ms => Ok(ms),
    }
}

/// Parses `--noise`: a Kubernetes duration, or zero (`0`, `0s`, `0ms`) for none.
pub fn parse_noise(text: &str) -> Result<u64, String> {
    let unit = text.trim_start_matches('0');
    if text.starts_with('0') && ["", "ms", "s", "m", "h"].contains(&unit) {
        return Ok(0);
    }
    let d = KubeDuration::parse(text).map_err(|e| e.to_string())?;
    Ok(d.as_millis())
}

/// Parses `--sidecars`: 1 to [`MAX_SIDECARS`].
pub fn parse_sidecars(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(n) if (1..=MAX_SIDECARS).contains(&n) => Ok(n),
        _ => Err(format!("{text:?}: 1 to {MAX_SIDECARS} sidecars")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_counts_and_ranges() {
        assert_eq!(parse_clients("1,5"), Ok(Counts(vec![1, 5])));
        assert_eq!(parse_clients("10..40:10"), Ok(Counts(vec![10, 20, 30, 40])));
        assert_eq!(parse_clients("1..3, 8"), Ok(Counts(vec![1, 2, 3, 8])));
        for bad in ["0", "5..1", "1..5:0", "x", "1..200000", "1..100000"] {
            assert!(parse_clients(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn noise_and_sidecars() {
        assert_eq!(parse_noise("0s"), Ok(0));
        assert_eq!(parse_noise("0"), Ok(0));
        assert_eq!(parse_noise("15ms"), Ok(15));
        assert!(parse_noise("0x").is_err());
        assert_eq!(parse_sidecars("6"), Ok(6));
        for bad in ["0", "-1", "x", "10001"] {
            assert!(parse_sidecars(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn write_durations() {
        assert_eq!(parse_write("10ms"), Ok(10));
        assert_eq!(parse_write("1s"), Ok(1000));
        assert!(parse_write("0s").is_err());
        assert!(parse_write("soon").is_err());
    }
}
