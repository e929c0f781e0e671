//! `ask`: one decision, computed exactly as the sidecar computes it, from manifests or
//! from the namespace's compiled ConfigMap (what the sidecars serve).

use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use rebound_policy::{
    Context, Decision, Disposition, PolicySource, PolicyTable, compile, compiled::CompiledDocument,
    format_millis,
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
    // The clock is real so that a policy in rollout answers with the revision a job
    // failing now would get; `--elapsed` places the first failure that long before.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let ctx = Context {
        job_id: q.job_id.as_deref(),
        error_class: q.error_class.as_deref(),
        first_failure_ms: elapsed_ms.map(|e| now_ms.saturating_sub(e)),
        now_ms: Some(now_ms),
        retry_after_ms: None,
    };
    let mut out = json!({
        "queue": q.queue,
        "attempt": q.attempt,
        "source": source,
        "policy": {
            "name": entry.name(),
            "namespace": entry.namespace(),
            "generation": entry.generation,
            "configHash": table.hash(),
        },
    });
    let (decision, selected) = entry.decide(q.attempt, &ctx);
    if !selected.revision.is_empty() {
        out["revision"] = json!(selected.revision);
    }
    let fields = match decision {
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

#[cfg(test)]
mod tests {
    use clap::Parser;
    use rebound_policy::{
        CompiledPolicy, ResolvedPolicy,
        compiled::CompiledRollout,
        resolve,
        rollout::assign::{Exposure, Step, revision_id},
    };

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn params(max_attempts: u32) -> ResolvedPolicy {
        let spec = serde_json::from_value(json!({"queues": ["payments"],
            "maxAttempts": max_attempts, "backoff": {"base": "1s", "cap": "1m"}}))
        .expect("spec");
        resolve(&spec).expect("valid")
    }

    /// `payments` rolling out maxAttempts 25 → 2, its one step started an hour ago.
    fn in_rollout(weight: u32) -> (CompiledDocument, Exposure) {
        let hour_ago = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64
            - 3_600_000;
        let rollout = CompiledRollout {
            revision: revision_id(&params(2)),
            stable_revision: revision_id(&params(25)),
            canary: params(2),
            steps: vec![Step {
                weight,
                start_unix_ms: hour_ago,
            }],
        };
        let exposure = rollout.exposure().expect("valid rollout");
        let policy = CompiledPolicy {
            name: "payments".into(),
            namespace: "shop".into(),
            uid: "u".into(),
            generation: 2,
            queues: vec!["payments".into()],
            params: params(25),
            rollout: Some(rollout),
        };
        (CompiledDocument::new("shop", vec![policy]), exposure)
    }

    fn ask(doc: &CompiledDocument, job_id: &str) -> Value {
        let cli = Cli::try_parse_from([
            "ask",
            "--queue",
            "payments",
            "--attempt",
            "2",
            "--job-id",
            job_id,
        ])
        .expect("arguments");
        answer(doc, &cli.args, None, "files").expect("answer")
    }

    #[test]
    fn a_job_in_the_canary_is_answered_by_the_new_revision() {
        let (doc, exposure) = in_rollout(50);
        let (mut canary, mut stable) = (0, 0);
        for i in 0..40 {
            let job = format!("job-{i}");
            let a = ask(&doc, &job);
            if exposure.bucket(&job) < 50 {
                canary += 1;
                assert_eq!(a["revision"], json!(revision_id(&params(2))), "{job}");
                assert_eq!(a["decision"], "GiveUp", "{job}: the canary allows 2 runs");
            } else {
                stable += 1;
                assert_eq!(a["revision"], json!(revision_id(&params(25))), "{job}");
                assert_eq!(
                    a["decision"], "Retry",
                    "{job}: the stable revision allows 25"
                );
            }
        }
        assert!(
            canary > 0 && stable > 0,
            "both arms asked: {canary} / {stable}"
        );
    }
}
