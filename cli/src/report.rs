//! Rendering simulation results: a table for people, JSON (a stable contract) for scripts.

use std::fmt::Write as _;

use rebound_policy::{
    BudgetSimulation, ResolvedPolicy, Simulation, duration::format_approx, format_millis,
    spec::Strategy,
};
use serde_json::{Value, json};

use crate::output;

/// A policy and its simulated schedule.
pub struct PolicyReport {
    pub name: String,
    pub namespace: String,
    pub queues: Vec<String>,
    pub params: ResolvedPolicy,
    pub simulation: Simulation,
    /// The budget's storm: all simulated jobs failing at once (policies with a budget only).
    pub budget: Option<BudgetSimulation>,
}

/// One policy's simulation as JSON, keys in the API's camelCase (see docs/cli.md): `name,
/// namespace, queues, maxAttempts, samples, seed, retries[].{retry, minMs, p50Ms, p99Ms,
/// maxMs, meanMs, jobs}, giveUpAfterMs.{p50, p99, max}, giveUpReasons, terminal, resolved`,
/// and `retryBudget.{ratePerSecond, burst, slotMs, jobs, seed, retries, stretched,
/// addedDelayMs.{p50, p99, max}, gaveUpDeadline, lastRetryAtMs}` for a budgeted policy.
/// Fields may be added, never renamed.
pub fn policy_json(r: &PolicyReport) -> Value {
    let s = &r.simulation;
    let camel = |v: serde_json::Result<Value>| output::camel_keys(v.unwrap_or_default());
    let mut out = json!({
        "name": r.name,
        "namespace": r.namespace,
        "queues": r.queues,
        "maxAttempts": s.max_attempts,
        "samples": s.samples,
        "seed": s.seed,
        "retries": camel(serde_json::to_value(&s.retries)),
        "giveUpAfterMs": s.give_up_after_ms,
        "giveUpReasons": camel(serde_json::to_value(&s.give_up_reasons)),
        "terminal": s.terminal.to_string(),
        "resolved": r.params,
    });
    if let (Some(b), Some(map)) = (&r.budget, out.as_object_mut()) {
        map.insert(
            "retryBudget".to_owned(),
            serde_json::to_value(b).unwrap_or_default(),
        );
    }
    out
}

/// `{"policies": [...]}` of [`policy_json`].
pub fn json(reports: &[PolicyReport]) -> Value {
    json!({ "policies": reports.iter().map(policy_json).collect::<Vec<_>>() })
}

fn curve(p: &ResolvedPolicy) -> String {
    let base = format_millis(p.base_ms);
    let shape = match p.strategy {
        Strategy::Exponential => format!("exponential {base} × {}", p.multiplier),
        Strategy::Linear => format!("linear {base} × retry"),
        Strategy::Constant => format!("constant {base}"),
        Strategy::Decorrelated => format!("decorrelated from {base}"),
        Strategy::Schedule => {
            let list: Vec<_> = p.schedule_ms.iter().map(|&d| format_millis(d)).collect();
            format!("schedule [{}]", list.join(", "))
        }
    };
    let jitter = match p.strategy {
        Strategy::Decorrelated => String::new(),
        _ => format!(", {:?} jitter", p.jitter).to_lowercase(),
    };
    format!("{shape}, cap {}{jitter}", format_millis(p.cap_ms))
}

/// Rows longer than this are elided in the middle; the JSON always has every retry.
const MAX_TABLE_ROWS: usize = 30;

pub fn table(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    for r in reports {
        let s = &r.simulation;
        let _ = writeln!(
            out,
            "RetryPolicy {}/{}  queues: {}\n  {}; max attempts {}{}",
            r.namespace,
            r.name,
            r.queues.join(", "),
            curve(&r.params),
            s.max_attempts,
            r.params
                .max_retry_duration_ms
                .map(|d| format!(", max retry duration {}", format_millis(d)))
                .unwrap_or_default()
        );
        let _ = writeln!(
            out,
            "  {:>6}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}",
            "retry", "min", "p50", "p99", "max", "mean"
        );
        let rows = &s.retries;
        let skip = rows.len().saturating_sub(MAX_TABLE_ROWS);
        for (i, row) in rows.iter().enumerate() {
            if skip > 0 && i == MAX_TABLE_ROWS / 2 {
                let _ = writeln!(
                    out,
                    "  {:>6}  ({skip} more retries; see --output json)",
                    "…"
                );
            }
            if skip > 0 && i >= MAX_TABLE_ROWS / 2 && i < MAX_TABLE_ROWS / 2 + skip {
                continue;
            }
            let _ = writeln!(
                out,
                "  {:>6}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}",
                row.retry,
                format_approx(row.min_ms),
                format_approx(row.p50_ms),
                format_approx(row.p99_ms),
                format_approx(row.max_ms),
                format_approx(row.mean_ms.round() as u64),
            );
        }
        let g = s.give_up_after_ms;
        let _ = writeln!(
            out,
            "  gives up after: p50 {}, p99 {}, max {} → {} ({} by max attempts, {} by deadline; {} jobs, seed {})",
            format_approx(g.p50),
            format_approx(g.p99),
            format_approx(g.max),
            s.terminal,
            s.give_up_reasons.max_attempts,
            s.give_up_reasons.deadline,
            s.samples,
            s.seed
        );
        if let (Some(b), Some(budget)) = (&r.budget, r.params.retry_budget) {
            let _ = writeln!(
                out,
                "  retry budget {budget}: if all {} jobs failed at once, {} of {} retries stretched \
                 (added p50 {}, p99 {}, max {}), {} gave up at the deadline, last retry at {}",
                b.jobs,
                b.stretched,
                b.retries,
                format_approx(b.added_delay_ms.p50),
                format_approx(b.added_delay_ms.p99),
                format_approx(b.added_delay_ms.max),
                b.gave_up_deadline,
                format_approx(b.last_retry_at_ms),
            );
        }
        out.push('\n');
    }
    out
}
