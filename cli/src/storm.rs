//! `storm`: many clients retrying one write at once under each policy (the contention
//! model of `rebound_policy::contention`), per number of clients.

use std::{fmt::Write as _, process::ExitCode};

use anyhow::{Result, bail};
use rebound_policy::{
    KubeDuration,
    contention::{ContentionRun, MAX_CLIENTS, simulate_contention},
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
    let d = KubeDuration::parse(text).map_err(|e| e.to_string())?;
    match d.as_millis() {
        0 => Err("a write takes at least 1ms".to_owned()),
        ms => Ok(ms),
    }
}

/// What one `storm` run computes, after defaults.
struct Setting {
    clients: Vec<u32>,
    write_ms: u64,
    seed: u64,
}

pub fn run(cluster: &ClusterArgs, args: &Args) -> Result<ExitCode> {
    let storm = Setting {
        clients: args.storm.clients.0.clone(),
        write_ms: args.storm.write,
        seed: args.seed.seed,
    };
    let ns = load::namespace(cluster, &args.inputs, args.namespace.namespace.clone())?;
    let mut results = Vec::new();
    for p in ns
        .policies
        .iter()
        .filter(|p| args.policy.admits(p.metadata.name.as_deref()))
    {
        let (name, namespace, policy) = simulate::policy_of(p, &ns.namespace)?;
        let runs: Vec<ContentionRun> = storm
            .clients
            .iter()
            .map(|&n| simulate_contention(&policy, n, storm.write_ms, storm.seed))
            .collect();
        results.push((name, namespace, runs));
    }
    if results.is_empty() {
        bail!("no RetryPolicy to simulate");
    }
    let document = json!({
        "writeMs": storm.write_ms,
        "seed": storm.seed,
        "policies": results.iter().map(|(name, namespace, runs)| json!({
            "name": name,
            "namespace": namespace,
            "runs": runs,
        })).collect::<Vec<Value>>(),
    });
    output::emit_as(args.output.output, &document, || table(&results, &storm))?;
    Ok(ExitCode::SUCCESS)
}

fn table(results: &[(String, String, Vec<ContentionRun>)], storm: &Setting) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} clients each completing one write of {} ms to one resource, all starting at once (seed {}):",
        storm
            .clients
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        storm.write_ms,
        storm.seed
    );
    for (name, namespace, runs) in results {
        let _ = writeln!(out, "\n{namespace}/{name}");
        let _ = writeln!(
            out,
            "  {:>8}  {:>12}  {:>14}  {:>9}  {:>8}",
            "clients", "calls", "last finished", "succeeded", "gave up"
        );
        for r in runs {
            let _ = writeln!(
                out,
                "  {:>8}  {:>12}  {:>14}  {:>9}  {:>8}{}",
                r.clients,
                r.calls,
                format_approx(r.completion_ms),
                r.succeeded,
                r.gave_up,
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
    fn write_durations() {
        assert_eq!(parse_write("10ms"), Ok(10));
        assert_eq!(parse_write("1s"), Ok(1000));
        assert!(parse_write("0s").is_err());
        assert!(parse_write("soon").is_err());
    }
}
