//! `explain QUEUE`: which policy serves a queue and why. The answer is the policy crate's
//! own compilation and lookup (what the operator writes and the sidecar serves); this
//! module only names why every other matching pattern does not win.

use std::process::ExitCode;

use anyhow::Result;
use rebound_policy::{
    PolicyOutcome, PolicySource, PolicyTable, RetryPolicy, compile,
    compiled::CompiledDocument,
    pattern::{self, Specificity},
};
use serde_json::{Value, json};

use crate::{
    args::{Inputs, Namespace, Output, Sampling},
    load::{self, ClusterArgs},
    output, report, simulate,
};

/// `explain QUEUE`.
#[derive(clap::Args)]
pub struct Args {
    /// The queue name, as the job library names it.
    queue: String,
    #[command(flatten)]
    inputs: Inputs,
    #[command(flatten)]
    namespace: Namespace,
    #[command(flatten)]
    output: Output,
    #[command(flatten)]
    sampling: Sampling,
}

pub fn run(cluster: &ClusterArgs, args: &Args) -> Result<ExitCode> {
    let Sampling { samples, seed } = args.sampling;
    let (queue, seed, format) = (&args.queue, seed.seed, args.output.output);
    let ns = load::namespace(cluster, &args.inputs, args.namespace.namespace.clone())?;
    let policies: Vec<RetryPolicy> = ns
        .policies
        .into_iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(ns.namespace.as_str()))
        .collect();
    let value = explain(
        &ns.namespace,
        &policies,
        ns.configmap.as_ref(),
        &cluster.configmap,
        queue,
        samples,
        seed,
    )?;
    output::emit_as(format, &value, || text(&value))?;
    Ok(ExitCode::SUCCESS)
}

/// One pattern of one policy that matches the queue.
struct Candidate<'a> {
    policy: &'a str,
    pattern: &'a str,
    exact: bool,
    /// Position of the policy in precedence order (older first, then name).
    rank: usize,
}

fn explain(
    namespace: &str,
    policies: &[RetryPolicy],
    configmap: Option<&Option<CompiledDocument>>,
    configmap_name: &str,
    queue: &str,
    samples: u32,
    seed: u64,
) -> Result<Value> {
    let sources: Vec<PolicySource> = policies
        .iter()
        .map(|p| PolicySource::from_object(p, namespace))
        .collect();
    let compilation = compile(namespace, sources);
    let doc = &compilation.document;
    let table = PolicyTable::new(doc);
    let served_by = table.lookup(queue).map(|e| e.name().to_owned());

    // Every written pattern of every policy that matches, in precedence order.
    let mut candidates = Vec::new();
    for (rank, (name, _)) in compilation.outcomes.iter().enumerate() {
        let Some(p) = policies
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
        else {
            continue;
        };
        for written in &p.spec.queues {
            if pattern::matches(written, queue) {
                candidates.push(Candidate {
                    policy: name,
                    pattern: written,
                    exact: !written.contains('*'),
                    rank,
                });
            }
        }
    }
    let winner = served_by.as_deref().and_then(|name| {
        let serving = doc.policies.iter().find(|p| p.name == name)?;
        let mut mine: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| {
                c.policy == name
                    && serving
                        .queues
                        .contains(&pattern::normalize(c.pattern).into_owned())
            })
            .collect();
        mine.sort_by(|a, b| {
            b.exact
                .cmp(&a.exact)
                .then(Specificity::of(b.pattern).cmp(&Specificity::of(a.pattern)))
        });
        mine.first().map(|c| (c.policy, c.pattern, c.exact, c.rank))
    });

    let candidates: Vec<Value> = candidates
        .iter()
        .map(|c| {
            let (outcome, beaten_by) = verdict(c, &compilation.outcomes[c.rank].1, winner);
            json!({
                "policy": c.policy,
                "pattern": c.pattern,
                "match": if c.exact { "exact" } else { "glob" },
                "outcome": outcome,
                "beatenBy": beaten_by,
                "ready": ready(policies, c.policy),
            })
        })
        .collect();

    let schedule = match served_by.as_deref() {
        Some(name) => policies
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
            .map(|p| simulate::policy_report(p, namespace, samples, seed))
            .transpose()?
            .map(|r| report::policy_json(&r)),
        None => None,
    };

    let configmap = configmap.map(|cm| match cm {
        None => json!({"name": configmap_name, "found": false}),
        Some(found) => {
            let serves = PolicyTable::new(found)
                .lookup(queue)
                .map(|e| e.name().to_owned());
            json!({
                "name": configmap_name,
                "found": true,
                "hash": found.hash,
                "expectedHash": doc.hash,
                "inSync": found.hash == doc.hash,
                "servedBy": serves,
            })
        }
    });

    Ok(json!({
        "queue": queue,
        "namespace": namespace,
        "servedBy": winner.map(|(policy, pattern, exact, _)| json!({
            "policy": policy,
            "pattern": pattern,
            "match": if exact { "exact" } else { "glob" },
        })),
        "candidates": candidates,
        "schedule": schedule,
        "retryBudget": served_by.as_deref().map_or(Value::Null, |name| retry_budget(policies, name)),
        "configMap": configmap,
    }))
}

/// Why a matching pattern does (not) serve the queue: `serving`, `invalidSpec` (the policy
/// is left out), `conflict` (an older policy declares the same pattern),
/// `exactMatchWins`, `moreSpecificGlobWins`, `earlierPolicyWins` (equally specific globs:
/// the older policy, then the name, wins).
fn verdict(
    c: &Candidate,
    outcome: &PolicyOutcome,
    winner: Option<(&str, &str, bool, usize)>,
) -> (&'static str, Option<String>) {
    let lost = match outcome {
        PolicyOutcome::Invalid(_) => return ("invalidSpec", None),
        PolicyOutcome::Compiled { lost, .. } => lost,
    };
    if let Some(l) = lost.iter().find(|l| l.pattern == c.pattern) {
        return ("conflict", Some(l.winner.clone()));
    }
    let Some((policy, pattern, exact, rank)) = winner else {
        // Unreachable: a compiled matching pattern means the lookup finds a winner.
        return ("unserved", None);
    };
    if policy == c.policy && pattern == c.pattern {
        return ("serving", None);
    }
    let by = Some(policy.to_owned());
    if exact {
        return ("exactMatchWins", by);
    }
    if Specificity::of(pattern) > Specificity::of(c.pattern) {
        return ("moreSpecificGlobWins", by);
    }
    debug_assert!(rank <= c.rank);
    ("earlierPolicyWins", by)
}

/// The policy's Ready condition as the operator reported it, if read from a cluster.
fn ready(policies: &[RetryPolicy], name: &str) -> Value {
    policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map_or(
            Value::Null,
            |c| json!({"status": c.status, "reason": c.reason, "message": c.message}),
        )
}

/// The serving policy's retry budget as the operator's status words it for the fleet
/// (`500/s, burst 50 (100ms slots) for 6 sidecars`), if read from a cluster.
fn retry_budget(policies: &[RetryPolicy], name: &str) -> Value {
    policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .and_then(|p| p.status.as_ref()?.summary.as_ref()?.retry_budget.clone())
        .map_or(Value::Null, Value::String)
}

fn text(v: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut out = format!(
        "Queue {} in namespace {}\n",
        s(&v["queue"]),
        s(&v["namespace"])
    );
    match v["servedBy"].as_object() {
        Some(w) => out.push_str(&format!(
            "  served by RetryPolicy {} ({} match on {:?})\n",
            s(&w["policy"]),
            s(&w["match"]),
            s(&w["pattern"])
        )),
        None => out.push_str("  served by no policy: the sidecar answers NOT_FOUND\n"),
    }
    for c in v["candidates"].as_array().into_iter().flatten() {
        if c["outcome"] == "serving" {
            continue;
        }
        let by = c["beatenBy"]
            .as_str()
            .map(|b| format!(" ({b})"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  not {} via {:?}: {}{by}\n",
            s(&c["policy"]),
            s(&c["pattern"]),
            s(&c["outcome"])
        ));
    }
    if let Some(cm) = v["configMap"].as_object() {
        if cm["found"] == true {
            let sync = if cm["inSync"] == true {
                "in sync"
            } else {
                "NOT in sync (the operator has not compiled the current policies)"
            };
            out.push_str(&format!("  ConfigMap {}: {sync}\n", s(&cm["name"])));
        } else {
            out.push_str(&format!(
                "  ConfigMap {}: missing (is the operator running?)\n",
                s(&cm["name"])
            ));
        }
    }
    if let Some(budget) = v["retryBudget"].as_str() {
        out.push_str(&format!("  retry budget: {budget}\n"));
    }
    if let Some(p) = v["schedule"].as_object() {
        let retries: Vec<String> = p["retries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| rebound_policy::duration::format_approx(r["p50Ms"].as_u64().unwrap_or(0)))
            .collect();
        let g = &p["giveUpAfterMs"];
        out.push_str(&format!(
            "  schedule: max attempts {}; p50 delay per retry [{}]; gives up after p50 {}, max {} → {}\n",
            p["maxAttempts"],
            retries.join(", "),
            rebound_policy::duration::format_approx(g["p50"].as_u64().unwrap_or(0)),
            rebound_policy::duration::format_approx(g["max"].as_u64().unwrap_or(0)),
            s(&p["terminal"])
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fleet line is the operator's status text, read back, not computed again.
    #[test]
    fn shows_the_retry_budget_the_operator_reported() {
        let mut policy: RetryPolicy = serde_json::from_value(json!({
            "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u1", "generation": 1},
            "spec": {"queues": ["orders"], "retryBudget": {"ratePerSecond": 500, "burst": 50}},
        }))
        .expect("policy");
        let ask = |p: &RetryPolicy| {
            explain(
                "shop",
                std::slice::from_ref(p),
                None,
                "rebound-policies",
                "orders",
                20,
                1,
            )
            .expect("explain")
        };
        assert_eq!(
            ask(&policy)["retryBudget"],
            Value::Null,
            "from files: no status"
        );
        let shared = "500/s, burst 50 (100ms slots) for 6 sidecars";
        policy.status = Some(
            serde_json::from_value(json!({"summary": {
                "maxAttempts": 10, "cap": "10m", "terminal": "drop",
                "giveUpAfter": {"p50": "1m", "p99": "2m", "max": "3m"},
                "retryBudget": shared,
            }}))
            .expect("status"),
        );
        let v = ask(&policy);
        assert_eq!(v["retryBudget"], shared);
        assert!(
            text(&v)
                .lines()
                .any(|l| l == format!("  retry budget: {shared}"))
        );
    }
}
