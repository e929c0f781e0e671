//! The queue table the sidecar answers from: queue → policy lookup over one compiled
//! document, each entry holding its prepared policy (and, in rollout, both revisions).

use std::collections::HashMap;

use crate::{
    decide::PreparedPolicy,
    pattern::{self, Glob, Specificity},
};

use super::{CompiledDocument, rollout::RolloutEntry};

/// A compiled policy ready to answer, with what the sidecar reports about it.
#[derive(Debug)]
pub struct TableEntry {
    pub policy: PreparedPolicy,
    pub name: String,
    pub namespace: String,
    pub generation: i64,
    /// The new revision while a change rolls out; see [`TableEntry::select`].
    pub rollout: Option<Box<RolloutEntry>>,
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
    globs: Box<[(Glob, u32)]>,
    prefixes: PrefixTrie,
}

/// Literal prefixes of the globs, as a trie laid out in flat arrays (a few allocations in
/// all, not two per node). Node `n`'s edges are `edge_byte/edge_child[edge_start[n]..
/// edge_start[n + 1]]`, sorted by byte; the globs whose prefix ends at `n` (indices into
/// `PolicyTable::globs`, ascending, so in precedence order) are
/// `globs[glob_start[n]..glob_start[n + 1]]`. Indices are `u32`, half the bytes of
/// `usize`: a document is at most 8 MiB, so nodes, edges and globs stay far below 2³².
#[derive(Debug)]
struct PrefixTrie {
    edge_start: Box<[u32]>,
    edge_byte: Box<[u8]>,
    edge_child: Box<[u32]>,
    glob_start: Box<[u32]>,
    globs: Box<[u32]>,
}

impl PrefixTrie {
    fn build<'a>(prefixes: impl Iterator<Item = &'a [u8]>) -> Self {
        // Built with a vector per node, then laid flat; node numbers stay as built.
        #[derive(Default)]
        struct Node {
            children: Vec<(u8, u32)>,
            globs: Vec<u32>,
        }
        let mut nodes = vec![Node::default()];
        for (glob, prefix) in prefixes.enumerate() {
            let mut node = 0;
            for &b in prefix {
                let children = &nodes[node].children;
                node = match children.binary_search_by_key(&b, |&(c, _)| c) {
                    Ok(i) => children[i].1 as usize,
                    Err(at) => {
                        let next = nodes.len();
                        nodes[node].children.insert(at, (b, next as u32));
                        nodes.push(Node::default());
                        next
                    }
                };
            }
            nodes[node].globs.push(glob as u32);
        }
        let edges: usize = nodes.iter().map(|n| n.children.len()).sum();
        let globs: usize = nodes.iter().map(|n| n.globs.len()).sum();
        let mut edge_start = Vec::with_capacity(nodes.len() + 1);
        let mut edge_byte = Vec::with_capacity(edges);
        let mut edge_child = Vec::with_capacity(edges);
        let mut glob_start = Vec::with_capacity(nodes.len() + 1);
        let mut flat_globs = Vec::with_capacity(globs);
        for node in nodes {
            edge_start.push(edge_byte.len() as u32);
            glob_start.push(flat_globs.len() as u32);
            for (b, child) in node.children {
                edge_byte.push(b);
                edge_child.push(child);
            }
            flat_globs.extend(node.globs);
        }
        edge_start.push(edge_byte.len() as u32);
        glob_start.push(flat_globs.len() as u32);
        PrefixTrie {
            edge_start: edge_start.into(),
            edge_byte: edge_byte.into(),
            edge_child: edge_child.into(),
            glob_start: glob_start.into(),
            globs: flat_globs.into(),
        }
    }

    fn child(&self, node: usize, b: u8) -> Option<usize> {
        let (from, to) = (
            self.edge_start[node] as usize,
            self.edge_start[node + 1] as usize,
        );
        let i = self.edge_byte[from..to].binary_search(&b).ok()?;
        Some(self.edge_child[from + i] as usize)
    }

    /// The globs whose literal prefix ends at `node`, in precedence order.
    fn globs_at(&self, node: usize) -> &[u32] {
        &self.globs[self.glob_start[node] as usize..self.glob_start[node + 1] as usize]
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
                rollout: p.rollout.and_then(|r| RolloutEntry::new(&identity, r)),
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
        let globs: Box<[(Glob, u32)]> = globs
            .into_iter()
            .map(|(pattern, index)| (Glob::from_owned(pattern), index as u32))
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
                let (glob, entry) = &self.globs[g as usize];
                glob.matches_counting(queue, steps)
                    .then_some(*entry as usize)
            })
        })
    }

    pub fn hash(&self) -> &str {
        &self.hash
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every entry once, in document order.
    pub fn entries(&self) -> &[TableEntry] {
        &self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
