//! `ask`: one decision, computed exactly as the sidecar computes it, from manifests or
//! from the namespace's compiled ConfigMap (what the sidecars serve).

use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use rebound_policy::{
    Context, Decision, Disposition, PolicySource, PolicyTable, compile, compiled::CompiledDocument,
    decide, format_millis,
};
use serde_json::{Value, json};

use crate::{
    args::{Inputs, Namespace, Output},
    load::{self, ClusterArgs},
    output,
};

/// `ask`: the question, as the sidecar's Decide request puts it.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    inputs: Inputs,
    /// The queue of the job that failed.
    #[arg(long)]
    queue: String,
    /// 1-based number of the run that just failed.
    #[arg(long)]
    attempt: u32,
    /// The job's id (it seeds the jitter).
    #[arg(long)]
    job_id: Option<String>,
    /// The class of the error the run failed with (matched against `nonRetryableErrors`).
    #[arg(long)]
    error_class: Option<String>,
    /// Time since the first failure, e.g. `90s`.
    #[arg(long)]
    elapsed: Option<String>,
    #[command(flatten)]
    namespace: Namespace,
    #[command(flatten)]
    output: Output,
}

pub fn run(cluster: &ClusterArgs, q: &Args) -> Result<ExitCode> {
    let (inputs, namespace, format) = (&q.inputs, q.namespace.namespace.clone(), q.output.output);
    if q.attempt == 0 {
        bail!("--attempt is 1-based: the number of the run that just failed");
    }
    let elapsed_ms = q
        .elapsed
        .as_ref()
        .map(|e| {
            rebound_policy::KubeDuration::parse(e)
                .map(|d| d.as_millis())
                .with_context(|| format!("--elapsed {e:?}"))
        })
        .transpose()?;
    let (doc, source) = if inputs.files.is_empty() {
        let doc = load::block_on(async {
            let (client, ns) = load::connect(cluster, namespace).await?;
            match load::compiled_document(&client, &ns, &cluster.configmap).await? {
                Some(doc) => Ok(doc),
                None => bail!(
                    "no ConfigMap {ns}/{} (is the operator running, and watching {ns:?}?)",
                    cluster.configmap
                ),
            }
        })?;
        (doc, "configMap")
    } else {
        let default_ns = namespace.clone().unwrap_or_else(|| "default".to_owned());
        let policies = load::from_files(inputs, &default_ns)?;
        let ns = namespace.unwrap_or_else(|| {
            policies
                .first()
                .and_then(|p| p.metadata.namespace.clone())
                .unwrap_or(default_ns)
        });
        let sources = policies
            .iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(ns.as_str()))
            .map(|p| PolicySource::from_object(p, &ns))
            .collect();
        (compile(&ns, sources).document, "files")
    };
    let answer = answer(&doc, q, elapsed_ms, source)?;
    output::emit_as(format, &answer, || text(&answer))?;
    Ok(ExitCode::SUCCESS)
}

/// The decision as JSON: the sidecar's DecideResponse fields in the API's camelCase.
fn answer(
    doc: &CompiledDocument,
    q: &Args,
    elapsed_ms: Option<u64>,
    source: &str,
) -> Result<Value> {
    let table = PolicyTable::new(doc);
    let Some(entry) = table.lookup(&q.queue) else {
        bail!(
            "no policy in namespace {:?} governs queue {:?}",
            doc.namespace,
            q.queue
        );
    };
    let ctx = Context {
        job_id: q.job_id.as_deref(),
        error_class: q.error_class.as_deref(),
        first_failure_ms: elapsed_ms.map(|_| 0),
        now_ms: elapsed_ms,
        retry_after_ms: None,
    };
    let mut out = json!({
        "queue": q.queue,
        "attempt": q.attempt,
        "source": source,
        "policy": {
            "name": entry.name,
            "namespace": entry.namespace,
            "generation": entry.generation,
            "configHash": table.hash(),
        },
    });
    let fields = match decide(&entry.policy, q.attempt, &ctx) {
        Decision::Retry { delay_ms } => json!({
            "decision": "Retry",
            "delayMs": delay_ms,
            "delay": format_millis(delay_ms),
        }),
        Decision::GiveUp {
            disposition,
            reason,
        } => {
            let (kind, dlq) = match &disposition {
                Disposition::Drop => ("drop", None),
                Disposition::DeadLetter { dead_letter_queue } => {
                    ("deadLetter", Some(dead_letter_queue.clone()))
                }
            };
            json!({
                "decision": "GiveUp",
                "disposition": kind,
                "deadLetterQueue": dlq,
                "reason": reason.code(),
                "reasonMessage": reason.to_string(),
            })
        }
    };
    if let (Value::Object(out), Value::Object(fields)) = (&mut out, fields) {
        out.extend(fields);
    }
    Ok(out)
}

fn text(a: &Value) -> String {
    let s = |k: &str| a[k].as_str().unwrap_or_default().to_owned();
    let policy = format!(
        "{}/{}",
        a["policy"]["namespace"].as_str().unwrap_or_default(),
        a["policy"]["name"].as_str().unwrap_or_default()
    );
    if s("decision") == "Retry" {
        format!(
            "RETRY in {} ({} ms)  policy {policy}\n",
            s("delay"),
            a["delayMs"]
        )
    } else {
        let to = match a["deadLetterQueue"].as_str() {
            Some(q) => format!("deadLetter:{q}"),
            None => s("disposition"),
        };
        format!("GIVE_UP → {to}: {}  policy {policy}\n", s("reasonMessage"))
    }
}
