//! `diff OLD NEW`: what changed between two versions of a policy file — fields, policies
//! added or removed — and how the schedule, the give-up time and the storm figures move,
//! as Markdown for a pull-request comment or as JSON. Exit 0 no change, 1 changes, 2 error.

use std::{fmt::Write as _, path::PathBuf, process::ExitCode};

use anyhow::{Result, anyhow};
use rebound_policy::{
    BudgetSimulation, PreparedPolicy, RetryPolicy, Simulation, contention::ContentionRun,
    duration::format_approx, simulate, simulate_budget,
};
use serde_json::{Map, Value, json};

use crate::{
    args::{self, Inputs, Namespace, Output, Sampling},
    load::{self, ClusterArgs},
    output,
    simulate::policy_of,
    storm,
};

/// `diff OLD NEW`; two storm sizes by default.
#[derive(clap::Args)]
#[command(mut_arg("clients", |a| a.default_value("10,100")))]
pub struct Args {
    /// The policy file before the change.
    old: PathBuf,
    /// The policy file after the change.
    new: PathBuf,
    #[command(flatten)]
    sampling: Sampling,
    #[command(flatten)]
    storm: args::Storm,
    #[command(flatten)]
    namespace: Namespace,
    #[command(flatten)]
    output: Output,
}

/// What one diff computes, after defaults.
struct DiffArgs {
    old: PathBuf,
    new: PathBuf,
    namespace: Option<String>,
    samples: u32,
    seed: u64,
    storm: args::Storm,
}

impl DiffArgs {
    fn of(args: &Args) -> Self {
        Self {
            old: args.old.clone(),
            new: args.new.clone(),
            namespace: args.namespace.namespace.clone(),
            samples: args.sampling.samples,
            seed: args.sampling.seed.seed,
            storm: args.storm.clone(),
        }
    }
}

/// One side of a policy: its manifest and figures.
struct Side {
    name: String,
    namespace: String,
    queues: Vec<String>,
    spec: Value,
    /// What the sidecar answers from: the policy with every default applied.
    resolved: rebound_policy::ResolvedPolicy,
    sim: Simulation,
    /// What the budget does to all simulated jobs failing at once (budgeted policies).
    budget: Option<BudgetSimulation>,
    storm: Vec<ContentionRun>,
}

fn side(p: &RetryPolicy, namespace: &str, args: &DiffArgs) -> Result<Side> {
    let (name, namespace, policy): (String, String, PreparedPolicy) = policy_of(p, namespace)?;
    Ok(Side {
        queues: p.spec.queues.clone(),
        spec: serde_json::to_value(&p.spec)?,
        resolved: policy.params().clone(),
        sim: simulate(&policy, args.samples, args.seed, true),
        budget: simulate_budget(&policy, args.samples, args.seed),
        storm: storm::runs(&policy, &args.storm, args.seed),
        name,
        namespace,
    })
}

fn read(
    path: &std::path::Path,
    args: &ClusterArgs,
    namespace: &Option<String>,
) -> Result<Vec<RetryPolicy>> {
    let inputs = Inputs {
        files: vec![path.to_path_buf()],
        recursive: false,
    };
    Ok(load::namespace(args, &inputs, namespace.clone())?.policies)
}

/// Pairs old and new policies: by namespace and name, then (renames) the remaining ones
/// that share a queue, in file order.
fn pair(old: Vec<Side>, new: Vec<Side>) -> Vec<(Option<Side>, Option<Side>)> {
    let mut old: Vec<Option<Side>> = old.into_iter().map(Some).collect();
    let mut pairs: Vec<(Option<Side>, Option<Side>)> = Vec::new();
    let mut unmatched_new = Vec::new();
    for n in new {
        let same = old.iter().position(|o| {
            o.as_ref()
                .is_some_and(|o| o.name == n.name && o.namespace == n.namespace)
        });
        match same {
            Some(i) => pairs.push((old[i].take(), Some(n))),
            None => unmatched_new.push(n),
        }
    }
    for n in unmatched_new {
        let renamed = old.iter().position(|o| {
            o.as_ref().is_some_and(|o| {
                o.namespace == n.namespace && o.queues.iter().any(|q| n.queues.contains(q))
            })
        });
        match renamed {
            Some(i) => pairs.push((old[i].take(), Some(n))),
            None => pairs.push((None, Some(n))),
        }
    }
    pairs.extend(old.into_iter().flatten().map(|o| (Some(o), None)));
    pairs
}

/// Leaves of a JSON object as `(path, value)`, objects flattened and arrays kept whole.
fn leaves(prefix: &str, value: &Value, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                leaves(&format!("{prefix}.{k}"), v, out);
            }
        }
        other => out.push((prefix.to_owned(), other.clone())),
    }
}

/// Field changes between two specs (and the name, for a rename), sorted by path.
fn field_changes(old: &Side, new: &Side) -> Vec<Value> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    leaves("spec", &old.spec, &mut a);
    leaves("spec", &new.spec, &mut b);
    let mut paths: Vec<&String> = a.iter().chain(&b).map(|(p, _)| p).collect();
    paths.sort();
    paths.dedup();
    let get = |side: &[(String, Value)], path: &str| {
        side.iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v.clone())
            .unwrap_or(Value::Null)
    };
    let mut out = Vec::new();
    if old.name != new.name {
        out.push(json!({"path": "metadata.name", "old": old.name, "new": new.name}));
    }
    for path in paths {
        let (o, n) = (get(&a, path), get(&b, path));
        if o != n {
            out.push(json!({"path": path, "old": o, "new": n}));
        }
    }
    out
}

fn schedule(old: Option<&Side>, new: Option<&Side>) -> Vec<Value> {
    let rows = |s: Option<&Side>| s.map(|s| s.sim.retries.len()).unwrap_or(0);
    let at = |s: Option<&Side>, i: usize| {
        s.and_then(|s| s.sim.retries.get(i))
            .map(|r| json!({"p50Ms": r.p50_ms, "p99Ms": r.p99_ms}))
            .unwrap_or(Value::Null)
    };
    (0..rows(old).max(rows(new)))
        .map(|i| json!({"retry": i + 1, "old": at(old, i), "new": at(new, i)}))
        .collect()
}

fn give_up(s: Option<&Side>) -> Value {
    s.map(|s| {
        let g = s.sim.give_up_after_ms;
        json!({"p50Ms": g.p50, "p99Ms": g.p99, "maxMs": g.max,
               "maxAttempts": s.sim.max_attempts, "terminal": s.sim.terminal.to_string()})
    })
    .unwrap_or(Value::Null)
}

/// The budget's storm of one side (`simulate`'s `retryBudget`), `null` without a budget.
fn budget(s: Option<&Side>) -> Value {
    s.and_then(|s| s.budget.as_ref())
        .map(|b| {
            json!({"ratePerSecond": b.rate_per_second, "burst": b.burst, "jobs": b.jobs,
                   "retries": b.retries, "stretched": b.stretched,
                   "addedDelayP50Ms": b.added_delay_ms.p50,
                   "addedDelayP99Ms": b.added_delay_ms.p99,
                   "gaveUpDeadline": b.gave_up_deadline, "lastRetryAtMs": b.last_retry_at_ms})
        })
        .unwrap_or(Value::Null)
}

fn storm(old: Option<&Side>, new: Option<&Side>, clients: &[u32]) -> Vec<Value> {
    let at = |s: Option<&Side>, i: usize| {
        s.and_then(|s| s.storm.get(i))
            .map(|r| {
                let mut v = json!({"calls": r.calls, "completionMs": r.completion_ms,
                                   "gaveUp": r.gave_up, "truncated": r.truncated});
                if let Some(b) = &r.budget {
                    v["stretched"] = json!(b.stretched);
                    v["busiestSlot"] = json!(b.busiest_slot);
                }
                v
            })
            .unwrap_or(Value::Null)
    };
    clients
        .iter()
        .enumerate()
        .map(|(i, &n)| json!({"clients": n, "old": at(old, i), "new": at(new, i)}))
        .collect()
}

/// The JSON document (see docs/cli.md).
fn document(pairs: &[(Option<Side>, Option<Side>)], args: &DiffArgs) -> Value {
    let mut counts = Map::new();
    for k in ["added", "removed", "changed", "unchanged"] {
        counts.insert(k.to_owned(), json!(0));
    }
    let policies: Vec<Value> = pairs
        .iter()
        .map(|(old, new)| {
            let (old, new) = (old.as_ref(), new.as_ref());
            let fields = match (old, new) {
                (Some(o), Some(n)) => field_changes(o, n),
                _ => Vec::new(),
            };
            let status = match (old, new) {
                (None, _) => "added",
                (_, None) => "removed",
                _ if fields.is_empty() => "unchanged",
                _ => "changed",
            };
            if let Some(Value::Number(c)) = counts.get_mut(status) {
                *c = (c.as_u64().unwrap_or(0) + 1).into();
            }
            // A spec written differently (a default spelled out) that compiles to the same
            // policy for the same queues under the same name (jitter is keyed on it): every
            // answer stays the same.
            let same_behaviour = match (old, new) {
                (Some(o), Some(n)) => {
                    o.resolved == n.resolved
                        && o.queues == n.queues
                        && (&o.namespace, &o.name) == (&n.namespace, &n.name)
                }
                _ => false,
            };
            let current = new.or(old).expect("a pair has a side");
            json!({
                "name": current.name,
                "namespace": current.namespace,
                "status": status,
                "renamedFrom": match (old, new) {
                    (Some(o), Some(n)) if o.name != n.name => json!(o.name),
                    _ => Value::Null,
                },
                "fields": fields,
                "sameBehaviour": same_behaviour,
                "schedule": schedule(old, new),
                "giveUpAfter": {"old": give_up(old), "new": give_up(new)},
                "retryBudget": {"old": budget(old), "new": budget(new)},
                "storm": storm(old, new, &args.storm.clients.0),
            })
        })
        .collect();
    let changed = policies.iter().any(|p| p["status"] != "unchanged");
    json!({
        "old": args.old.display().to_string(),
        "new": args.new.display().to_string(),
        "changed": changed,
        "summary": counts,
        "samples": args.samples,
        "seed": args.seed,
        "writeMs": args.storm.write,
        "noiseMs": args.storm.noise,
        "sidecars": args.storm.sidecars,
        "policies": policies,
    })
}

/// `old → new (+12%)` for milliseconds or counts; `—` for a missing side.
fn movement(old: &Value, new: &Value, key: &str, time: bool) -> String {
    let show = |v: &Value| match v.get(key).and_then(Value::as_u64) {
        Some(x) if time => format_approx(x),
        Some(x) => x.to_string(),
        None => "—".to_owned(),
    };
    let (o, n) = (
        old.get(key).and_then(Value::as_u64),
        new.get(key).and_then(Value::as_u64),
    );
    match (o, n) {
        (Some(o), Some(n)) if o == n => show(new),
        (Some(o), Some(n)) if o > 0 => {
            let change = (n as f64 / o as f64 - 1.0) * 100.0;
            format!("{} → {} ({change:+.0}%)", show(old), show(new))
        }
        _ => format!("{} → {}", show(old), show(new)),
    }
}

/// ` with up to 5 ms of noise over 4 sidecars` when set.
fn storm_setting(doc: &Value) -> String {
    let mut out = String::new();
    if let Some(n) = doc["noiseMs"].as_u64().filter(|&n| n > 0) {
        let _ = write!(out, " with up to {n} ms of network noise");
    }
    if let Some(n) = doc["sidecars"].as_u64().filter(|&n| n > 1) {
        let _ = write!(out, " over {n} sidecars");
    }
    out
}

/// The budget section: what the budget does to all simulated jobs failing at once, old
/// and new; nothing when neither side has a budget.
fn budget_table(out: &mut String, b: &Value) {
    let (old, new) = (&b["old"], &b["new"]);
    if old.is_null() && new.is_null() {
        return;
    }
    let show = |v: &Value| match (v["ratePerSecond"].as_u64(), v["burst"].as_u64()) {
        (Some(r), Some(b)) => format!("{r}/s, burst {b}"),
        _ => "none".to_owned(),
    };
    let _ = writeln!(
        out,
        "| retry budget (all jobs failing at once) | old → new |\n|---|---|"
    );
    let budget = if show(old) == show(new) {
        show(new)
    } else {
        format!("{} → {}", show(old), show(new))
    };
    let _ = writeln!(out, "| budget | {budget} |");
    for (label, key, time) in [
        ("retries scheduled", "retries", false),
        ("moved later", "stretched", false),
        ("added delay p50", "addedDelayP50Ms", true),
        ("added delay p99", "addedDelayP99Ms", true),
        ("gave up (deadline)", "gaveUpDeadline", false),
        ("last retry at", "lastRetryAtMs", true),
    ] {
        let _ = writeln!(out, "| {label} | {} |", movement(old, new, key, time));
    }
    out.push('\n');
}

/// Whether a storm run stopped at the call bound: `no`, `yes`, or `no → yes`.
fn cut_short(old: &Value, new: &Value) -> String {
    let show = |v: &Value| match v.get("truncated") {
        Some(Value::Bool(true)) => "yes",
        Some(_) => "no",
        None => "—",
    };
    let (o, n) = (show(old), show(new));
    if o == n {
        n.to_owned()
    } else {
        format!("{o} → {n}")
    }
}

fn code(v: &Value) -> String {
    match v {
        Value::Null => "—".to_owned(),
        Value::String(s) => format!("`{s}`"),
        other => format!("`{other}`"),
    }
}

/// Retry rows shown in Markdown before the middle is elided; the JSON has every retry.
const MAX_ROWS: usize = 12;

fn markdown(doc: &Value) -> String {
    let mut out = String::new();
    let s = &doc["summary"];
    let _ = writeln!(
        out,
        "### RetryPolicy changes: {} changed, {} added, {} removed, {} unchanged\n",
        s["changed"], s["added"], s["removed"], s["unchanged"]
    );
    let _ = writeln!(
        out,
        "`{}` → `{}`; figures from {} simulated jobs per policy and a storm of {} ms writes{}, seed {}.",
        doc["old"].as_str().unwrap_or_default(),
        doc["new"].as_str().unwrap_or_default(),
        doc["samples"],
        doc["writeMs"],
        storm_setting(doc),
        doc["seed"]
    );
    for p in doc["policies"].as_array().into_iter().flatten() {
        let status = p["status"].as_str().unwrap_or_default();
        if status == "unchanged" {
            continue;
        }
        let renamed = p["renamedFrom"]
            .as_str()
            .map(|o| format!(", renamed from `{o}`"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "\n#### `{}/{}` — {status}{renamed}\n",
            p["namespace"].as_str().unwrap_or_default(),
            p["name"].as_str().unwrap_or_default()
        );
        if p["sameBehaviour"] == true {
            let _ = writeln!(
                out,
                "Same compiled policy: only how the spec is written changed; every answer stays the same.\n"
            );
        }
        let fields = p["fields"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if !fields.is_empty() {
            let _ = writeln!(out, "| field | old | new |\n|---|---|---|");
            for f in fields {
                let _ = writeln!(
                    out,
                    "| `{}` | {} | {} |",
                    f["path"].as_str().unwrap_or_default(),
                    code(&f["old"]),
                    code(&f["new"])
                );
            }
            out.push('\n');
        }
        let g = &p["giveUpAfter"];
        let _ = writeln!(
            out,
            "Gives up after: p50 {}, p99 {}, max {}.\n",
            movement(&g["old"], &g["new"], "p50Ms", true),
            movement(&g["old"], &g["new"], "p99Ms", true),
            movement(&g["old"], &g["new"], "maxMs", true)
        );
        let rows = p["schedule"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if !rows.is_empty() {
            let _ = writeln!(out, "| retry | p50 delay | p99 delay |\n|---:|---|---|");
            let skip = rows.len().saturating_sub(MAX_ROWS);
            for (i, r) in rows.iter().enumerate() {
                if skip > 0 && i == MAX_ROWS / 2 {
                    let _ = writeln!(out, "| … | {skip} more retries (`-o json`) | |");
                }
                if skip > 0 && i >= MAX_ROWS / 2 && i < MAX_ROWS / 2 + skip {
                    continue;
                }
                let _ = writeln!(
                    out,
                    "| {} | {} | {} |",
                    r["retry"],
                    movement(&r["old"], &r["new"], "p50Ms", true),
                    movement(&r["old"], &r["new"], "p99Ms", true)
                );
            }
            out.push('\n');
        }
        budget_table(&mut out, &p["retryBudget"]);
        let storm = p["storm"].as_array().map(Vec::as_slice).unwrap_or_default();
        if !storm.is_empty() {
            let _ = writeln!(
                out,
                "| storm clients | calls | last finished | gave up | cut short |\n|---:|---|---|---|---|"
            );
            for r in storm {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} |",
                    r["clients"],
                    movement(&r["old"], &r["new"], "calls", false),
                    movement(&r["old"], &r["new"], "completionMs", true),
                    movement(&r["old"], &r["new"], "gaveUp", false),
                    cut_short(&r["old"], &r["new"])
                );
            }
            if storm
                .iter()
                .any(|r| r["old"]["truncated"] == true || r["new"]["truncated"] == true)
            {
                let _ = writeln!(
                    out,
                    "\nA run cut short stopped at the bound of writes: its figures are lower bounds."
                );
            }
        }
    }
    if doc["changed"] == false {
        let _ = writeln!(out, "\nNo policy changed.");
    }
    out
}

pub fn run(cluster: &ClusterArgs, args: &Args) -> Result<ExitCode> {
    let format = args.output.output;
    let args = &DiffArgs::of(args);
    // Every failure is exit 2 here (1 means "changes"), findings in the files included.
    let sides = |path: &PathBuf| -> Result<Vec<Side>> {
        let policies = read(path, cluster, &args.namespace)?;
        let default_ns = args
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned());
        policies
            .iter()
            .map(|p| side(p, &default_ns, args))
            .collect()
    };
    let old = sides(&args.old).map_err(|e| anyhow!("{}: {e:#}", args.old.display()))?;
    let new = sides(&args.new).map_err(|e| anyhow!("{}: {e:#}", args.new.display()))?;
    let doc = document(&pair(old, new), args);
    output::emit_as(format, &doc, || markdown(&doc))?;
    Ok(if doc["changed"] == true {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_short_names_both_sides_when_they_differ() {
        let (no, yes) = (json!({"truncated": false}), json!({"truncated": true}));
        assert_eq!(cut_short(&no, &yes), "no → yes");
        assert_eq!(cut_short(&yes, &yes), "yes");
        assert_eq!(cut_short(&Value::Null, &no), "— → no");
    }
}
