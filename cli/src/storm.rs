//! `storm`: many clients retrying one write at once under each policy (the contention
//! model of `rebound_policy::contention`), per number of clients.

use std::{fmt::Write as _, process::ExitCode};

use anyhow::{Result, bail};
use rebound_policy::{
    KubeDuration, Policy,
    contention::{self, ContentionRun, MAX_CLIENTS, MAX_SIDECARS, run_storm},
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

/// The model's run for each client count of `flags`, in order.
pub fn runs(policy: &Policy, flags: &args::Storm, seed: u64) -> Vec<ContentionRun> {
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
