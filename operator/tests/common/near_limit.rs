//! A namespace near the ConfigMap size limit, for the tests of what is left out past it.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use rebound_policy::compiled::{CompiledDocument, MAX_DOCUMENT_BYTES};
use rebound_policy::{PolicySource, RetryPolicy, RetryPolicySpec, compile};
use serde_json::{Value, json};

use super::{CM, eventually, ready_condition, stored_document, wait_for_reason};

const WAIT: Duration = Duration::from_secs(60);

/// Waits until `left` reports `DocumentTooLarge` for the compressed limit with `served`
/// policies served, while every policy but it and `invalid` is Ready and in the document at
/// its generation. Returns the parsed message.
pub async fn left_out_alone(
    client: &kube::Client,
    ns: &str,
    left: &str,
    invalid: &[&str],
    served: usize,
) -> Result<TooLarge> {
    let grown = wait_for_reason(client, ns, left, "DocumentTooLarge", WAIT).await?;
    let message = ready_condition(&grown.status.clone().unwrap_or_default().conditions)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    let parsed = TooLarge::parse(&message)?;
    ensure!(
        parsed.limit == "compressed"
            && parsed.max == MAX_DOCUMENT_BYTES
            && parsed.bytes > MAX_DOCUMENT_BYTES
            && parsed.served == served,
        "{parsed:?}"
    );
    let typed: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let others = eventually("the others to stay Ready", WAIT, || async {
        let list = typed.list(&ListParams::default()).await?.items;
        let others: Vec<RetryPolicy> = list
            .into_iter()
            .filter(|p| {
                let name = p.metadata.name.as_deref().unwrap_or_default();
                name != left && !invalid.contains(&name)
            })
            .collect();
        let ready = others.iter().all(|p| {
            let status = p.status.clone().unwrap_or_default();
            ready_condition(&status.conditions).is_some_and(|c| {
                c.status == "True" && c.observed_generation == p.metadata.generation
            })
        });
        Ok(ready.then_some(others))
    })
    .await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let (json, _) = stored_document(&cms.get(CM).await?)?;
    let document = CompiledDocument::from_json(&json)?;
    let in_document: BTreeMap<String, i64> = document
        .policies
        .iter()
        .map(|p| (p.name.clone(), p.generation))
        .collect();
    let wanted: BTreeMap<String, i64> = others
        .iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap_or_default(),
                p.metadata.generation.unwrap_or_default(),
            )
        })
        .collect();
    ensure!(in_document == wanted, "served {in_document:?}");
    Ok(parsed)
}

/// Server-side applies a manifest (force: the tests own these objects).
pub async fn apply(api: &Api<DynamicObject>, manifest: &Value) -> Result<()> {
    let name = manifest["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let object: DynamicObject = serde_json::from_value(manifest.clone())?;
    api.patch(
        &name,
        &PatchParams::apply("at-rest-test").force(),
        &Patch::Apply(&object),
    )
    .await
    .with_context(|| format!("applying {name}"))?;
    Ok(())
}

/// The `DocumentTooLarge` message, parsed by the grammar of `docs/operator.md`:
/// `<limit> limit exceeded: <bytes> > <max> bytes; serving <served> policies in ConfigMap
/// <name> without this one`.
#[derive(Debug, PartialEq)]
pub struct TooLarge {
    pub limit: String,
    pub bytes: usize,
    pub max: usize,
    pub served: usize,
}

impl TooLarge {
    pub fn parse(message: &str) -> Result<Self> {
        let words: Vec<&str> = message.split_whitespace().collect();
        match words.as_slice() {
            [
                limit,
                "limit",
                "exceeded:",
                bytes,
                ">",
                max,
                "bytes;",
                "serving",
                served,
                "policies",
                "in",
                "ConfigMap",
                _,
                "without",
                "this",
                "one",
            ] => Ok(Self {
                limit: (*limit).to_owned(),
                bytes: bytes.parse()?,
                max: max.parse()?,
                served: served.parse()?,
            }),
            _ => bail!("not the DocumentTooLarge grammar: {message:?}"),
        }
    }
}

pub const SMALL: usize = 1;
pub const FULL: usize = 64;

pub fn name(i: usize) -> String {
    format!("p{i:02}")
}

/// A namespace whose policies' queues and error classes are pseudo-random text (fixed
/// seed; gzip cannot shrink them much), sized so that all fit in the ConfigMap compressed
/// while `p00` is small, and not once `p00` has grown to full size: `p01`.. are full, the
/// last one is a filler of as many queues as that takes.
pub struct Shape {
    namespace: String,
    pub count: usize,
    filler: usize,
}

impl Shape {
    pub fn new(namespace: &str) -> Result<Self> {
        let mut shape = Self {
            namespace: namespace.to_owned(),
            count: 2,
            filler: FULL,
        };
        let full = shape.compressed(&[0, 1])? - shape.compressed(&[0])?;
        let target = MAX_DOCUMENT_BYTES - 9 * 1024;
        let base = shape.compressed(&[0])?;
        // p00, the full ones, and the filler; the estimate adds up policies as if gzip
        // compressed each alone, which it does not quite.
        shape.count = 2 + (target - base) / full;
        shape.filler = 1;
        while shape.total(SMALL)? > target {
            shape.count -= 1;
        }
        // Then the filler's queues, by bisection, to land just under the target.
        let (mut lo, mut hi) = (1, FULL);
        while lo < hi {
            shape.filler = (lo + hi).div_ceil(2);
            if shape.total(SMALL)? <= target {
                lo = shape.filler;
            } else {
                hi = shape.filler - 1;
            }
        }
        shape.filler = lo;
        let (small, grown) = (shape.total(SMALL)?, shape.total(FULL)?);
        ensure!(
            small + 3 * 1024 <= MAX_DOCUMENT_BYTES && grown >= MAX_DOCUMENT_BYTES + 3 * 1024,
            "the shape does not straddle the limit: {small} / {grown} bytes"
        );
        eprintln!(
            "{} policies, {small} bytes compressed; {grown} with p00 grown",
            shape.count
        );
        Ok(shape)
    }

    pub fn queues(&self, i: usize) -> usize {
        if i + 1 == self.count {
            self.filler
        } else {
            FULL
        }
    }

    fn total(&self, first: usize) -> Result<usize> {
        let sources: Vec<PolicySource> = (0..self.count)
            .map(|i| self.source(i, if i == 0 { first } else { self.queues(i) }))
            .collect::<Result<_>>()?;
        gz_len(&self.namespace, sources)
    }

    fn compressed(&self, which: &[usize]) -> Result<usize> {
        let sources = which
            .iter()
            .map(|&i| self.source(i, if i == 0 { SMALL } else { FULL }))
            .collect::<Result<_>>()?;
        gz_len(&self.namespace, sources)
    }

    fn source(&self, i: usize, queues: usize) -> Result<PolicySource> {
        let spec: RetryPolicySpec =
            serde_json::from_value(self.manifest(i, queues)["spec"].clone())?;
        Ok(PolicySource {
            name: name(i),
            namespace: self.namespace.clone(),
            // As long as a real uid.
            uid: format!("{:08x}-0000-4000-8000-{:012x}", i * 7919, i * 104_729),
            generation: 1,
            created: Some(0),
            spec,
        })
    }

    pub fn manifest(&self, i: usize, queues: usize) -> Value {
        let mut x = i as u64 + 1;
        let mut noise =
            |kind: &str, j: usize| format!("{kind}-{i}-{j}-{}", super::incompressible(&mut x, 230));
        let queues: Vec<String> = (0..queues).map(|j| noise("q", j)).collect();
        let errors: Vec<String> = (0..queues.len()).map(|j| noise("e", j)).collect();
        json!({
            "apiVersion": "rebound.dev/v1alpha1", "kind": "RetryPolicy",
            "metadata": {"name": name(i), "namespace": self.namespace},
            "spec": {"queues": queues, "nonRetryableErrors": errors},
        })
    }
}

/// The gzip'd size of the namespace's document, as the operator compresses it.
fn gz_len(namespace: &str, sources: Vec<PolicySource>) -> Result<usize> {
    use std::io::Write;
    let json = compile(namespace, sources).document.to_json();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(json.as_bytes())?;
    Ok(gz.finish()?.len())
}
