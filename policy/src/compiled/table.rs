//! The queue table the sidecar answers from: queue → policy lookup over one compiled
//! document, each entry holding its prepared policy (and, in rollout, both revisions).
//!
//! The table keeps its queue names and patterns packed in two blocks of bytes with `u32`
//! offsets, not one allocation each: a table of 10,000 policies is then a few large
//! allocations plus a few small ones per entry, so freeing the table it replaces returns
//! whole pages instead of leaving them pinned by the new table's strings.

use std::hash::{BuildHasher, RandomState};

use crate::{
    decide::PreparedPolicy,
    pattern::{self, Specificity, Stars},
};

use super::{CompiledDocument, rollout::RolloutEntry};

/// A compiled policy ready to answer, with what the sidecar reports about it.
#[derive(Debug)]
pub struct TableEntry {
    /// Its identity is `namespace/name`; [`TableEntry::name`] and
    /// [`TableEntry::namespace`] are read from it rather than kept twice.
    pub policy: PreparedPolicy,
    /// Bytes of the namespace at the start of the identity.
    namespace_len: usize,
    pub generation: i64,
    /// The new revision while a change rolls out; see [`TableEntry::select`].
    pub rollout: Option<Box<RolloutEntry>>,
}

impl TableEntry {
    pub fn name(&self) -> &str {
        self.policy
            .identity()
            .get(self.namespace_len + 1..)
            .unwrap_or_default()
    }

    pub fn namespace(&self) -> &str {
        self.policy
            .identity()
            .get(..self.namespace_len)
            .unwrap_or_default()
    }
}

/// Queue → policy lookup over one compiled document.
///
/// Exact names are a hash lookup. Globs sit in a trie keyed by their literal prefix, so
/// a lookup walks the queue name once and tries only globs whose prefix the name has,
/// longest prefix first; each try is linear (the matcher of [`pattern::Glob`]). No
/// pattern is scanned whose prefix cannot match, and no try backtracks.
#[derive(Debug)]
pub struct PolicyTable {
    hash: String,
    entries: Vec<TableEntry>,
    exact: ExactIndex,
    globs: PackedGlobs,
    prefixes: PrefixTrie,
}

/// Exact queue names → entry, open addressing over one block of name bytes.
#[derive(Debug)]
struct ExactIndex {
    /// Every name once, back to back.
    bytes: Box<[u8]>,
    /// `(end of the name in bytes, entry)`; a name starts where the one before ends.
    names: Box<[(u32, u32)]>,
    /// Indices into `names`, [`EMPTY`] for a free slot; a power of two, at most half full.
    slots: Box<[u32]>,
    keys: RandomState,
}

const EMPTY: u32 = u32::MAX;

/// Name `at` of `names` (ends in `bytes`): it starts where the one before ends.
fn name_at<'a>(bytes: &'a [u8], names: &[(u32, u32)], at: usize) -> &'a [u8] {
    let from = at
        .checked_sub(1)
        .map_or(0, |before| names[before].0 as usize);
    &bytes[from..names[at].0 as usize]
}

impl ExactIndex {
    /// `names` in precedence order: the first entry to name a queue keeps it.
    fn build<'a>(
        names: impl Iterator<Item = (&'a str, usize)>,
        count: usize,
        bytes: usize,
    ) -> Self {
        let keys = RandomState::new();
        let mut slots = vec![EMPTY; (count * 2).next_power_of_two().max(2)].into_boxed_slice();
        let mask = slots.len() - 1;
        let mut packed = Vec::with_capacity(bytes);
        let mut kept: Vec<(u32, u32)> = Vec::with_capacity(count);
        for (name, entry) in names {
            let mut slot = keys.hash_one(name.as_bytes()) as usize & mask;
            let fresh = loop {
                match slots[slot] {
                    EMPTY => break true,
                    at if name_at(&packed, &kept, at as usize) == name.as_bytes() => break false,
                    _ => slot = (slot + 1) & mask,
                }
            };
            if fresh {
                slots[slot] = kept.len() as u32;
                packed.extend_from_slice(name.as_bytes());
                kept.push((packed.len() as u32, entry as u32));
            }
        }
        Self {
            bytes: packed.into_boxed_slice(),
            names: kept.into_boxed_slice(),
            slots,
            keys,
        }
    }

    fn get(&self, name: &str) -> Option<usize> {
        let mask = self.slots.len() - 1;
        let mut slot = self.keys.hash_one(name.as_bytes()) as usize & mask;
        loop {
            match self.slots[slot] {
                EMPTY => return None,
                at if name_at(&self.bytes, &self.names, at as usize) == name.as_bytes() => {
                    return Some(self.names[at as usize].1 as usize);
                }
                _ => slot = (slot + 1) & mask,
            }
        }
    }
}

/// The globs, most specific first (stable on entry order), their text back to back.
#[derive(Debug, Default)]
struct PackedGlobs {
    bytes: Box<[u8]>,
    globs: Box<[PackedGlob]>,
}

#[derive(Debug)]
struct PackedGlob {
    /// `bytes[start..end]`; the offsets in `stars` are relative to `start`.
    start: u32,
    end: u32,
    entry: u32,
    stars: Option<Stars>,
}

impl PackedGlobs {
    fn text(&self, glob: &PackedGlob) -> &[u8] {
        &self.bytes[glob.start as usize..glob.end as usize]
    }

    fn literal_prefix(&self, glob: &PackedGlob) -> &[u8] {
        Stars::literal_prefix(glob.stars.as_ref(), self.text(glob))
    }
}

/// The globs (in the order given) with their text copied into one block.
fn pack_globs(globs: &[(&str, usize)], bytes: usize) -> PackedGlobs {
    let mut packed = Vec::with_capacity(bytes);
    let globs = globs
        .iter()
        .map(|&(pattern, entry)| {
            let start = packed.len() as u32;
            packed.extend_from_slice(pattern.as_bytes());
            PackedGlob {
                start,
                end: packed.len() as u32,
                entry: entry as u32,
                stars: Stars::of(pattern),
            }
        })
        .collect();
    PackedGlobs {
        bytes: packed.into_boxed_slice(),
        globs,
    }
}

/// Literal prefixes of the globs, as a trie laid out in flat arrays (a few allocations in
/// all, not two per node). Node `n`'s edges are `edge_byte/edge_child[edge_start[n]..
/// edge_start[n + 1]]`, sorted by byte; the globs whose prefix ends at `n` (indices into
/// `PackedGlobs::globs`, ascending, so in precedence order) are
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

    /// Indexes a document, taking its parameters instead of copying them. Names and
    /// patterns are copied once into the packed blocks, each sized before it is filled.
    pub fn from_document(doc: CompiledDocument) -> Self {
        let (mut exact_count, mut exact_bytes, mut glob_bytes) = (0, 0, 0);
        let mut globs = Vec::new();
        for (index, p) in doc.policies.iter().enumerate() {
            for q in &p.queues {
                if q.contains('*') {
                    glob_bytes += q.len();
                    globs.push((q.as_str(), index));
                } else {
                    exact_count += 1;
                    exact_bytes += q.len();
                }
            }
        }
        let exact = ExactIndex::build(
            doc.policies.iter().enumerate().flat_map(|(index, p)| {
                p.queues
                    .iter()
                    .filter(|q| !q.contains('*'))
                    .map(move |q| (q.as_str(), index))
            }),
            exact_count,
            exact_bytes,
        );
        // Most specific first; on equal specificity the earlier policy (the document is in
        // precedence order). Keys are computed once per pattern, not once per comparison.
        globs.sort_by_cached_key(|(pattern, index)| {
            (std::cmp::Reverse(Specificity::of(pattern)), *index)
        });
        let globs = pack_globs(&globs, glob_bytes);
        let prefixes = PrefixTrie::build(globs.globs.iter().map(|g| globs.literal_prefix(g)));
        let mut entries = Vec::with_capacity(doc.policies.len());
        for p in doc.policies {
            let identity = p.identity();
            entries.push(TableEntry {
                rollout: p.rollout.and_then(|r| RolloutEntry::new(&identity, r)),
                policy: PreparedPolicy::new(identity, p.params),
                namespace_len: p.namespace.len(),
                generation: p.generation,
            });
        }
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
        self.entries.get(self.position_counting(queue, steps)?)
    }

    /// The position in document order ([`PolicyTable::entries`]) of the policy that
    /// governs `queue`: what state kept beside the table per policy is indexed by.
    pub fn position(&self, queue: &str) -> Option<usize> {
        self.position_counting(queue, &mut 0)
    }

    fn position_counting(&self, queue: &str, steps: &mut u64) -> Option<usize> {
        *steps += 1;
        self.exact
            .get(queue)
            .or_else(|| self.glob_lookup(queue, steps))
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
                let glob = &self.globs.globs[g as usize];
                let text = self.globs.text(glob);
                Stars::matches(glob.stars.as_ref(), text, queue.as_bytes(), steps)
                    .then_some(glob.entry as usize)
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
