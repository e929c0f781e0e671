//! The compiled-policy document: every valid policy of a namespace, fully resolved, in one
//! versioned JSON document. The operator writes it into a ConfigMap; the sidecar reads it
//! back with [`CompiledDocument::from_json`] and looks queues up in a [`PolicyTable`].
//! See `docs/compiled-format.md`.

mod read;
mod rollout;
mod table;

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{
    digest::sha256_id,
    pattern,
    resolve::{FieldError, ResolvedPolicy, resolve},
    rollout::assign::Exposure,
    spec::RetryPolicySpec,
};

pub use rollout::{CompiledRollout, RolloutEntry, Selected, compiled_rollout};
pub use table::{PolicyTable, TableEntry};

/// The format identifier; bumped on any incompatible change.
pub const FORMAT: &str = "rebound.dev/compiled-policies/v1";
/// The ConfigMap key that holds the document.
pub const CONFIGMAP_KEY: &str = "policies.json";
/// Largest document the operator writes: a ConfigMap holds at most 1 MiB in total, and
/// the margin leaves room for metadata and managed fields.
pub const MAX_DOCUMENT_BYTES: usize = 900 * 1024;
/// Largest document JSON a reader inflates from the compressed form: the operator stores a
/// document over [`MAX_DOCUMENT_BYTES`] gzip'd in `binaryData` under [`CONFIGMAP_KEY`]
/// (the compressed bytes at most `MAX_DOCUMENT_BYTES`), as long as its JSON stays within
/// this; the sidecar refuses to inflate past it.
pub const MAX_INFLATED_DOCUMENT_BYTES: usize = 8 * 1024 * 1024;

/// One namespace's compiled policies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompiledDocument {
    pub format: String,
    pub namespace: String,
    /// `sha256:<hex>` over the JSON encoding of `policies`; lets anyone check convergence.
    pub hash: String,
    /// In precedence order: on equal pattern specificity the earlier policy wins.
    pub policies: Vec<CompiledPolicy>,
}

/// One policy as the sidecar needs it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompiledPolicy {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub generation: i64,
    /// The patterns this policy serves, after conflicts were resolved.
    pub queues: Vec<String>,
    /// The stable revision's parameters: what answers every job when no rollout runs.
    pub params: ResolvedPolicy,
    /// Present while a change of the policy rolls out: the new revision and its exposure.
    /// Readers before it ignore the field (no `deny_unknown_fields`) and serve `params`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<CompiledRollout>,
}

impl CompiledPolicy {
    /// The identity that seeds deterministic jitter: `namespace/name`. Built by hand, not
    /// with `format!`: a reload of 10,000 policies makes it three times per policy.
    pub fn identity(&self) -> String {
        identity(&self.namespace, &self.name)
    }
}

/// `namespace/name`, sized once.
fn identity(namespace: &str, name: &str) -> String {
    let mut identity = String::with_capacity(namespace.len() + 1 + name.len());
    identity.push_str(namespace);
    identity.push('/');
    identity.push_str(name);
    identity
}

/// A compiled document that cannot be used; the sidecar keeps its last good one.
#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    #[error("not a compiled policy document: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("unsupported format {found:?} (this build reads {FORMAT:?})")]
    Format { found: String },
    #[error("hash mismatch: document says {stated}, content hashes to {actual}")]
    Hash { stated: String, actual: String },
    #[error("policy {policy}: {error}")]
    Policy { policy: String, error: FieldError },
}

impl CompiledDocument {
    /// Builds a document and stamps its hash.
    pub fn new(namespace: impl Into<String>, policies: Vec<CompiledPolicy>) -> Self {
        let hash = content_hash(&policies);
        Self {
            format: FORMAT.to_owned(),
            namespace: namespace.into(),
            hash,
            policies,
        }
    }

    pub fn to_json(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses and fully checks a document from outside the process: format, hash and every
    /// policy's invariants. Any failure rejects the whole document.
    ///
    /// The hash is checked over the bytes of `policies` exactly as they appear in the
    /// input, so parsing and re-encoding (floats included) can never disagree with the
    /// writer, and no second serialisation is paid for on every reload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, DocumentError> {
        let raw = RawDocument::read(bytes)?;
        let policies: Vec<CompiledPolicy> = serde_json::from_str(raw.policies.get())?;
        for p in &policies {
            check_policy(
                &p.namespace,
                &p.name,
                &p.params,
                p.queues.iter().map(String::as_str),
                p.rollout.as_ref(),
            )?;
        }
        Ok(Self {
            format: raw.format,
            namespace: raw.namespace,
            hash: raw.hash,
            policies,
        })
    }
}

/// The document with `policies` kept as the exact input bytes, for hashing.
#[derive(Deserialize)]
struct RawDocument<'a> {
    format: String,
    namespace: String,
    hash: String,
    #[serde(borrow)]
    policies: &'a serde_json::value::RawValue,
}

impl<'a> RawDocument<'a> {
    /// Reads the envelope and checks the format and the hash over `policies`' bytes: what
    /// both readers ([`CompiledDocument::from_json`], [`PolicyTable::from_json`]) do first.
    fn read(bytes: &'a [u8]) -> Result<Self, DocumentError> {
        let raw: RawDocument<'_> = serde_json::from_slice(bytes)?;
        if raw.format != FORMAT {
            return Err(DocumentError::Format { found: raw.format });
        }
        let actual = sha256_id(raw.policies.get().as_bytes());
        if actual != raw.hash {
            return Err(DocumentError::Hash {
                stated: raw.hash,
                actual,
            });
        }
        Ok(raw)
    }
}

/// The invariants of one policy read from outside the process (its parameters, each
/// queue pattern, its rollout), checked alike by both readers; the first failure names
/// the policy and the field. Returns the rollout's exposure, built by the check.
fn check_policy<'q>(
    namespace: &str,
    name: &str,
    params: &ResolvedPolicy,
    queues: impl Iterator<Item = &'q str>,
    rollout: Option<&CompiledRollout>,
) -> Result<Option<Exposure>, DocumentError> {
    let fail = |error| DocumentError::Policy {
        policy: identity(namespace, name),
        error,
    };
    params.check().map_err(fail)?;
    for (i, q) in queues.enumerate() {
        pattern::check_pattern(q).map_err(|e| {
            fail(FieldError {
                field: format!("queues[{i}]"),
                message: e.to_string(),
            })
        })?;
    }
    rollout
        .map(CompiledRollout::exposure)
        .transpose()
        .map_err(fail)
}

/// The hash of the policies as [`CompiledDocument::to_json`] writes them.
fn content_hash(policies: &[CompiledPolicy]) -> String {
    sha256_id(&serde_json::to_vec(policies).unwrap_or_default())
}

/// A policy as the compiler receives it from the API (or a file).
#[derive(Clone, Debug)]
pub struct PolicySource {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub generation: i64,
    /// Creation time as Unix seconds; older wins ties. `None` sorts last.
    pub created: Option<i64>,
    pub spec: RetryPolicySpec,
}

impl PolicySource {
    /// The compiler's view of a RetryPolicy object; `default_namespace` applies when the
    /// object names none (a manifest not yet applied).
    pub fn from_object(policy: &crate::RetryPolicy, default_namespace: &str) -> Self {
        let meta = &policy.metadata;
        Self {
            name: meta.name.clone().unwrap_or_default(),
            namespace: meta
                .namespace
                .clone()
                .unwrap_or_else(|| default_namespace.to_owned()),
            uid: meta.uid.clone().unwrap_or_default(),
            generation: meta.generation.unwrap_or(0),
            created: meta.creation_timestamp.as_ref().map(|t| t.0.as_second()),
            spec: policy.spec.clone(),
        }
    }
}

/// What compiling did to one policy.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyOutcome {
    /// In the document, serving these patterns (all of its queues unless `lost` is non-empty).
    Compiled {
        serving: Vec<String>,
        lost: Vec<LostQueue>,
    },
    /// Left out: the spec fails validation.
    Invalid(Vec<FieldError>),
}

/// A queue pattern that another policy won.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostQueue {
    pub pattern: String,
    /// Name of the winning policy.
    pub winner: String,
}

/// The result of compiling a namespace.
#[derive(Clone, Debug)]
pub struct Compilation {
    pub document: CompiledDocument,
    /// One per input policy, keyed by name.
    pub outcomes: Vec<(String, PolicyOutcome)>,
}

impl Compilation {
    pub fn outcome(&self, name: &str) -> Option<&PolicyOutcome> {
        self.outcomes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, o)| o)
    }
}

/// Compiles the policies of one namespace: validates each, orders them by precedence (older
/// first, then name), gives each pattern to the first policy that declares it, and builds
/// the document. Pure and deterministic: the same inputs always give the same hash.
pub fn compile(namespace: &str, mut sources: Vec<PolicySource>) -> Compilation {
    sources.sort_by(|a, b| pattern::policy_order((a.created, &a.name), (b.created, &b.name)));
    let mut owner: HashMap<String, String> = HashMap::new();
    let mut policies = Vec::new();
    let mut outcomes = Vec::new();
    for source in sources {
        let params = match resolve(&source.spec) {
            Ok(params) => params,
            Err(errors) => {
                outcomes.push((source.name, PolicyOutcome::Invalid(errors)));
                continue;
            }
        };
        let mut serving = Vec::new();
        let mut lost = Vec::new();
        for written in &source.spec.queues {
            // Equivalent patterns (`a-*`, `a-**`) are one pattern, so they conflict.
            let pattern = pattern::normalize(written).into_owned();
            match owner.get(&pattern) {
                // The same pattern spelled twice in this policy (`a-*`, `a-**`): served once.
                Some(winner) if *winner == source.name => {}
                Some(winner) => lost.push(LostQueue {
                    pattern: written.clone(),
                    winner: winner.clone(),
                }),
                None => {
                    owner.insert(pattern.clone(), source.name.clone());
                    serving.push(pattern);
                }
            }
        }
        policies.push(CompiledPolicy {
            name: source.name.clone(),
            namespace: source.namespace,
            uid: source.uid,
            generation: source.generation,
            queues: serving.clone(),
            params,
            rollout: None,
        });
        outcomes.push((source.name, PolicyOutcome::Compiled { serving, lost }));
    }
    Compilation {
        document: CompiledDocument::new(namespace, policies),
        outcomes,
    }
}
