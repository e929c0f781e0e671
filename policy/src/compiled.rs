//! The compiled-policy document: every valid policy of a namespace, fully resolved, in one
//! versioned JSON document. The operator writes it into a ConfigMap; the sidecar reads it
//! back with [`CompiledDocument::from_json`] and looks queues up in a [`PolicyTable`].
//! See `docs/compiled-format.md`.

use std::collections::HashMap;

use crate::{
    decide::PreparedPolicy,
    digest::sha256_id,
    pattern::{self, Glob, Specificity},
    resolve::{FieldError, ResolvedPolicy, resolve},
    spec::RetryPolicySpec,
};
use serde::{Deserialize, Serialize};

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
    pub params: ResolvedPolicy,
}

impl CompiledPolicy {
    /// The identity that seeds deterministic jitter: `namespace/name`.
    pub fn identity(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
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
        let policies: Vec<CompiledPolicy> = serde_json::from_str(raw.policies.get())?;
        for p in &policies {
            let fail = |field: &str, message: String| DocumentError::Policy {
                policy: p.identity(),
                error: FieldError {
                    field: field.to_owned(),
                    message,
                },
            };
            p.params.check().map_err(|error| DocumentError::Policy {
                policy: p.identity(),
                error,
            })?;
            for (i, q) in p.queues.iter().enumerate() {
                pattern::check_pattern(q)
                    .map_err(|e| fail(&format!("queues[{i}]"), e.to_string()))?;
            }
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
        });
        outcomes.push((source.name, PolicyOutcome::Compiled { serving, lost }));
    }
    Compilation {
        document: CompiledDocument::new(namespace, policies),
        outcomes,
    }
}

/// A compiled policy ready to answer, with what the sidecar reports about it.
#[derive(Debug)]
pub struct TableEntry {
    pub policy: PreparedPolicy,
    pub name: String,
    pub namespace: String,
    pub generation: i64,
}

/// Queue → policy lookup over one compiled document.
///
/// Exact names are a hash lookup. Globs sit in a trie keyed by their literal prefix, so
/// a lookup walks the queue name once and tries only globs whose prefix the name has,
/// longest prefix first; each try is linear ([`Glob`]). No pattern is scanned whose
/// prefix cannot match, and no try backtracks.
#[derive(Debug)]
pub struct PolicyTable {
    hash: String,
    entries: Vec<TableEntry>,
    exact: HashMap<String, usize>,
    /// (pattern, entry) sorted by specificity, most specific first; stable on entry order.
    globs: Vec<(Glob, usize)>,
    prefixes: PrefixTrie,
}

/// Literal prefixes of the globs, as a trie laid out in flat arrays (a few allocations in
/// all, not two per node). Node `n`'s edges are `edge_byte/edge_child[edge_start[n]..
/// edge_start[n + 1]]`, sorted by byte; the globs whose prefix ends at `n` (indices into
/// `PolicyTable::globs`, ascending, so in precedence order) are
/// `globs[glob_start[n]..glob_start[n + 1]]`.
#[derive(Debug)]
struct PrefixTrie {
    edge_start: Box<[usize]>,
    edge_byte: Box<[u8]>,
    edge_child: Box<[usize]>,
    glob_start: Box<[usize]>,
    globs: Box<[usize]>,
}

impl PrefixTrie {
    fn build<'a>(prefixes: impl Iterator<Item = &'a [u8]>) -> Self {
        // Built with a vector per node, then laid flat; node numbers stay as built.
        #[derive(Default)]
        struct Node {
            children: Vec<(u8, usize)>,
            globs: Vec<usize>,
        }
        let mut nodes = vec![Node::default()];
        for (glob, prefix) in prefixes.enumerate() {
            let mut node = 0;
            for &b in prefix {
                let children = &nodes[node].children;
                node = match children.binary_search_by_key(&b, |&(c, _)| c) {
                    Ok(i) => children[i].1,
                    Err(at) => {
                        let next = nodes.len();
                        nodes[node].children.insert(at, (b, next));
                        nodes.push(Node::default());
                        next
                    }
                };
            }
            nodes[node].globs.push(glob);
        }
        let edges: usize = nodes.iter().map(|n| n.children.len()).sum();
        let globs: usize = nodes.iter().map(|n| n.globs.len()).sum();
        let mut edge_start = Vec::with_capacity(nodes.len() + 1);
        let mut edge_byte = Vec::with_capacity(edges);
        let mut edge_child = Vec::with_capacity(edges);
        let mut glob_start = Vec::with_capacity(nodes.len() + 1);
        let mut flat_globs = Vec::with_capacity(globs);
        for node in nodes {
            edge_start.push(edge_byte.len());
            glob_start.push(flat_globs.len());
            for (b, child) in node.children {
                edge_byte.push(b);
                edge_child.push(child);
            }
            flat_globs.extend(node.globs);
        }
        edge_start.push(edge_byte.len());
        glob_start.push(flat_globs.len());
        PrefixTrie {
            edge_start: edge_start.into(),
            edge_byte: edge_byte.into(),
            edge_child: edge_child.into(),
            glob_start: glob_start.into(),
            globs: flat_globs.into(),
        }
    }

    fn child(&self, node: usize, b: u8) -> Option<usize> {
        let (from, to) = (self.edge_start[node], self.edge_start[node + 1]);
        let i = self.edge_byte[from..to].binary_search(&b).ok()?;
        Some(self.edge_child[from + i])
    }

    /// The globs whose literal prefix ends at `node`, in precedence order.
    fn globs_at(&self, node: usize) -> &[usize] {
        &self.globs[self.glob_start[node]..self.glob_start[node + 1]]
    }
}

impl PolicyTable {
    /// Indexes a document the caller keeps (its policies are copied).
    pub fn new(doc: &CompiledDocument) -> Self {
        Self::from_document(doc.clone())
    }

    /// Indexes a document, taking its names, patterns and parameters instead of copying
    /// them: a reload of 10,000 policies then allocates and frees half as much.
    pub fn from_document(doc: CompiledDocument) -> Self {
        // Sized once for the exact names instead of grown.
        let exact_names = doc
            .policies
            .iter()
            .flat_map(|p| &p.queues)
            .filter(|q| !q.contains('*'))
            .count();
        let mut exact = HashMap::with_capacity(exact_names);
        let mut globs = Vec::new();
        let mut entries = Vec::with_capacity(doc.policies.len());
        for (index, p) in doc.policies.into_iter().enumerate() {
            let identity = p.identity();
            for q in p.queues {
                if q.contains('*') {
                    globs.push((q, index));
                } else {
                    exact.entry(q).or_insert(index);
                }
            }
            entries.push(TableEntry {
                policy: PreparedPolicy::new(identity, p.params),
                name: p.name,
                namespace: p.namespace,
                generation: p.generation,
            });
        }
        // Most specific first; on equal specificity the earlier policy (the document is in
        // precedence order). Keys are computed once per pattern, not once per comparison.
        globs.sort_by_cached_key(|(pattern, index)| {
            (std::cmp::Reverse(Specificity::of(pattern)), *index)
        });
        let globs: Vec<(Glob, usize)> = globs
            .into_iter()
            .map(|(pattern, index)| (Glob::new(&pattern), index))
            .collect();
        let prefixes = PrefixTrie::build(globs.iter().map(|(g, _)| g.literal_prefix()));
        Self {
            hash: doc.hash,
            entries,
            exact,
            globs,
            prefixes,
        }
    }

    /// The policy that governs `queue`: an exact name first, then the most specific glob.
    pub fn lookup(&self, queue: &str) -> Option<&TableEntry> {
        self.lookup_counting(queue, &mut 0)
    }

    /// [`PolicyTable::lookup`], adding the matching work done (trie levels walked plus
    /// glob byte steps) to `steps`, so tests can bound it without timing.
    pub fn lookup_counting(&self, queue: &str, steps: &mut u64) -> Option<&TableEntry> {
        *steps += 1;
        let index = match self.exact.get(queue) {
            Some(&i) => i,
            None => self.glob_lookup(queue, steps)?,
        };
        self.entries.get(index)
    }

    fn glob_lookup(&self, queue: &str, steps: &mut u64) -> Option<usize> {
        // The trie is at most MAX_NAME_LEN deep; the path holds the root and one node per level.
        let mut path = [0usize; pattern::MAX_NAME_LEN + 1];
        let mut depth = 0;
        for &b in queue.as_bytes() {
            *steps += 1;
            match self.prefixes.child(path[depth], b) {
                Some(next) if depth < pattern::MAX_NAME_LEN => {
                    depth += 1;
                    path[depth] = next;
                }
                _ => break,
            }
        }
        // Longer literal prefixes are more specific, so deeper nodes come first.
        path[..=depth].iter().rev().find_map(|&node| {
            self.prefixes.globs_at(node).iter().find_map(|&g| {
                let (glob, entry) = &self.globs[g];
                glob.matches_counting(queue, steps).then_some(*entry)
            })
        })
    }

    pub fn hash(&self) -> &str {
        &self.hash
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
