//! `validate`: every problem of every document, and an exit code CI can branch on.

use std::process::ExitCode;

use anyhow::{Result, bail};
use serde_json::{Value, json};

use crate::{
    args::{Inputs, Output},
    input::{self, Parsed},
    output,
};

/// `validate`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    inputs: Inputs,
    #[command(flatten)]
    output: Output,
}

pub fn run(args: &Args) -> Result<ExitCode> {
    let (inputs, format) = (&args.inputs, args.output.output);
    if inputs.files.is_empty() {
        bail!("validate needs -f FILE|DIR|- (files to check)");
    }
    let (mut valid, mut invalid, mut unreadable) = (0u32, 0u32, 0u32);
    let mut documents = Vec::new();
    let mut source_errors = Vec::new();
    let mut text = String::new();
    let mut notes = Vec::new();
    for source in input::sources(inputs)? {
        let (name, parsed) = source.parse();
        let docs = match parsed {
            Parsed::Documents(docs) => docs,
            Parsed::NotYaml(e) => {
                invalid += 1;
                text.push_str(&format!("{name}:0:: not valid YAML: {e}\n"));
                source_errors
                    .push(json!({"source": name, "reason": "NotYaml", "message": e.to_string()}));
                continue;
            }
            Parsed::Unreadable(e) => {
                unreadable += 1;
                notes.push(format!("{name}: {e:#}"));
                source_errors.push(
                    json!({"source": name, "reason": "Unreadable", "message": format!("{e:#}")}),
                );
                continue;
            }
        };
        if docs.is_empty() {
            notes.push(format!("{name}: no RetryPolicy documents"));
        }
        for doc in docs {
            let errors: Vec<Value> = match &doc.result {
                Ok(_) => {
                    valid += 1;
                    Vec::new()
                }
                Err(errors) => {
                    invalid += 1;
                    errors
                        .iter()
                        .map(|e| {
                            text.push_str(&format!(
                                "{name}:{}:{}: {}\n",
                                doc.index, e.field, e.message
                            ));
                            json!({"field": e.field, "message": e.message})
                        })
                        .collect()
                }
            };
            let namespace = doc
                .result
                .as_ref()
                .ok()
                .and_then(|(p, _)| p.metadata.namespace.clone());
            documents.push(json!({
                "source": name,
                "index": doc.index,
                "name": doc.name,
                "namespace": namespace,
                "valid": errors.is_empty(),
                "errors": errors,
            }));
        }
    }
    let report = json!({
        "valid": valid,
        "invalid": invalid,
        "unreadable": unreadable,
        "documents": documents,
        "sourceErrors": source_errors,
    });
    output::emit_as(format, &report, || text)?;
    for note in notes {
        eprintln!("{note}");
    }
    eprintln!("{valid} valid, {invalid} invalid RetryPolicies");
    Ok(if unreadable > 0 {
        ExitCode::from(2)
    } else if invalid > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
