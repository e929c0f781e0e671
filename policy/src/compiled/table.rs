//! The queue table the sidecar answers from: queue → policy lookup over one compiled
//! document, each entry answering through [`PolicyView`] (and, in rollout, holding the
//! new revision too).
//!
//! The table keeps its queue names and patterns packed in two blocks of bytes, and its
//! entries' identities, error classes and schedules in blocks they share, with `u32`
//! offsets, not one allocation each: a table of 10,000 policies is then a few large
//! allocations, so freeing the table it replaces returns whole pages instead of leaving
//! them pinned by the new table's strings.

use std::{
    hash::{BuildHasher, RandomState},
    sync::Arc,
};

use crate::{
    decide::{Core, PolicyView, first_match, hash_bytes},
    pattern::{self, Specificity, Stars},
    resolve::{Disposition, ResolvedPolicy, RetryBudget},
    spec::{JitterKind, Strategy},
};

use super::{CompiledDocument, rollout::RolloutEntry};

/// A compiled policy ready to answer, with what the sidecar reports about it. Its
/// identity, error classes and schedule are kept in blocks the whole table shares, so
/// a policy without a rollout or a dead-letter queue owns no allocation of its own.
#[derive(Debug)]
pub struct TableEntry {
    shared: Arc<Shared>,
    /// `namespace/name` in the shared text.
    identity: Span,
    namespace_len: u32,
    identity_seed: u64,
    /// Into [`Shared::errors`] and [`Shared::schedules`].
    errors: Span,
    schedule: Span,
    params: Scalars,
    pub generation: i64,
    /// The new revision while a change rolls out; see [`TableEntry::select`].
    pub rollout: Option<Box<RolloutEntry>>,
}

/// `start..end` in one of the shared blocks.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: u32,
    end: u32,
}

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// A [`ResolvedPolicy`] less what the shared blocks keep.
#[derive(Debug)]
struct Scalars {
    strategy: Strategy,
    jitter: JitterKind,
    max_attempts: u32,
    base_ms: u64,
    multiplier: f64,
    cap_ms: u64,
    jitter_ratio: f64,
    max_retry_duration_ms: Option<u64>,
    terminal: Disposition,
    retry_budget: Option<RetryBudget>,
}

/// What the entries of one table keep back to back, built before the entries point at it.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Identities and error-class patterns.
    text: String,
    /// An error class: its text in `text`, and its parts prepared for matching.
    errors: Vec<(Span, Option<Stars>)>,
    schedules: Vec<u64>,
}

/// Fills a [`Shared`] policy by policy; entries point at a placeholder until
/// [`Packer::finish`] hands them the finished block.
#[derive(Debug, Default)]
pub(super) struct Packer {
    shared: Shared,
    placeholder: Arc<Shared>,
}

impl Packer {
    pub(super) fn entry(
        &mut self,
        namespace: &str,
        name: &str,
        generation: i64,
        params: ResolvedPolicy,
        rollout: impl FnOnce(&str) -> Option<Box<RolloutEntry>>,
    ) -> TableEntry {
        let shared = &mut self.shared;
        let identity = push_text(&mut shared.text, &[namespace, "/", name]);
        let errors_start = shared.errors.len() as u32;
        for class in &params.non_retryable_errors {
            let span = push_text(&mut shared.text, &[class]);
            shared.errors.push((span, Stars::of(class)));
        }
        let schedule_start = shared.schedules.len() as u32;
        shared.schedules.extend_from_slice(&params.schedule_ms);
        let text = &shared.text[identity.range()];
        TableEntry {
            identity,
            namespace_len: namespace.len() as u32,
            identity_seed: hash_bytes(text.as_bytes()),
            errors: Span {
                start: errors_start,
                end: shared.errors.len() as u32,
            },
            schedule: Span {
                start: schedule_start,
                end: shared.schedules.len() as u32,
            },
            rollout: rollout(text),
            shared: Arc::clone(&self.placeholder),
            generation,
            params: Scalars {
                strategy: params.strategy,
                jitter: params.jitter,
                max_attempts: params.max_attempts,
                base_ms: params.base_ms,
                multiplier: params.multiplier,
                cap_ms: params.cap_ms,
                jitter_ratio: params.jitter_ratio,
                max_retry_duration_ms: params.max_retry_duration_ms,
                terminal: params.terminal,
                retry_budget: params.retry_budget,
            },
        }
    }

    /// Points `entries` (made by this packer) at the finished block.
    fn finish(self, entries: &mut [TableEntry]) {
        let mut shared = self.shared;
        shared.text.shrink_to_fit();
        shared.errors.shrink_to_fit();
        shared.schedules.shrink_to_fit();
        let shared = Arc::new(shared);
        for entry in entries {
            entry.shared = Arc::clone(&shared);
        }
    }
}

/// `parts` appended to `text` as one string; a document is at most 8 MiB, so offsets fit.
fn push_text(text: &mut String, parts: &[&str]) -> Span {
    let start = text.len() as u32;
    parts.iter().for_each(|p| text.push_str(p));
    Span {
        start,
        end: text.len() as u32,
    }
}

impl TableEntry {
    pub fn identity(&self) -> &str {
        &self.shared.text[self.identity.range()]
    }

    pub fn name(&self) -> &str {
        self.identity()
            .get(self.namespace_len as usize + 1..)
            .unwrap_or_default()
    }

    pub fn namespace(&self) -> &str {
        self.identity()
            .get(..self.namespace_len as usize)
            .unwrap_or_default()
    }

    pub fn terminal(&self) -> &Disposition {
        &self.params.terminal
    }

    pub fn retry_budget(&self) -> Option<RetryBudget> {
        self.params.retry_budget
    }

    /// The (stable revision's) parameters as written, rebuilt: this allocates, so it is
    /// for reports, not for answering.
    pub fn resolved(&self) -> ResolvedPolicy {
        let p = &self.params;
        ResolvedPolicy {
            strategy: p.strategy,
            base_ms: p.base_ms,
            multiplier: p.multiplier,
            cap_ms: p.cap_ms,
            jitter: p.jitter,
            jitter_ratio: p.jitter_ratio,
            schedule_ms: self.shared.schedules[self.schedule.range()].to_vec(),
            max_attempts: p.max_attempts,
            max_retry_duration_ms: p.max_retry_duration_ms,
            non_retryable_errors: self.shared.errors[self.errors.range()]
                .iter()
                .map(|(span, _)| self.shared.text[span.range()].to_owned())
                .collect(),
            terminal: p.terminal.clone(),
            retry_budget: p.retry_budget,
        }
    }
}

impl PolicyView for TableEntry {
    fn identity(&self) -> &str {
        TableEntry::identity(self)
    }

    fn identity_seed(&self) -> u64 {
        self.identity_seed
    }

    fn core(&self) -> Core<'_> {
        let p = &self.params;
        Core {
            strategy: p.strategy,
            base_ms: p.base_ms,
            multiplier: p.multiplier,
            cap_ms: p.cap_ms,
            jitter: p.jitter,
            jitter_ratio: p.jitter_ratio,
            schedule_ms: &self.shared.schedules[self.schedule.range()],
            max_attempts: p.max_attempts,
            max_retry_duration_ms: p.max_retry_duration_ms,
            terminal: &p.terminal,
        }
    }

    fn non_retryable_match(&self, error_class: &str, steps: &mut u64) -> Option<&str> {
        let text = &self.shared.text;
        first_match(
            self.shared.errors[self.errors.range()]
                .iter()
                .map(|(span, stars)| (&text[span.range()], stars.as_ref())),
            error_class,
            steps,
        )
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
    namespace: String,
    hash: String,
    entries: Vec<TableEntry>,
    exact: ExactIndex,
    globs: PackedGlobs,
    prefixes: PrefixTrie,
}

/// The lookup structures over the queue patterns.
pub(super) struct Indexes {
    exact: ExactIndex,
    globs: PackedGlobs,
    prefixes: PrefixTrie,
}

impl Indexes {
    /// `(pattern, entry)` in precedence order (document order). The patterns are walked
    /// twice: once to size the packed blocks, once to fill them.
    pub(super) fn build<'a>(queues: impl Iterator<Item = (&'a str, usize)> + Clone) -> Self {
        let (mut exact_count, mut exact_bytes, mut glob_bytes) = (0, 0, 0);
        let mut globs = Vec::new();
        for (q, index) in queues.clone() {
            if q.contains('*') {
                glob_bytes += q.len();
                globs.push((q, index));
            } else {
                exact_count += 1;
                exact_bytes += q.len();
            }
        }
        let exact = ExactIndex::build(
            queues.filter(|(q, _)| !q.contains('*')),
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
        Self {
            exact,
            globs,
            prefixes,
        }
    }
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
    /// Laid flat directly, with no allocation per node: the prefixes are sorted, so the
    /// nodes come out in preorder, each node's children by increasing byte, and the globs
    /// grouped by the node their prefix ends at.
    fn build<'a>(prefixes: impl Iterator<Item = &'a [u8]>) -> Self {
        let prefixes: Vec<&[u8]> = prefixes.collect();
        // Stable: globs with the same prefix stay in precedence order.
        let mut order: Vec<u32> = (0..prefixes.len() as u32).collect();
        order.sort_by_key(|&g| prefixes[g as usize]);
        // Node `n > 0` hangs off `parent[n - 1]` by `byte[n - 1]`; the root is node 0.
        let (mut parent, mut byte) = (Vec::<u32>::new(), Vec::<u8>::new());
        let mut ends = Vec::with_capacity(order.len());
        // The nodes of the previous prefix, root first.
        let mut path = vec![0u32];
        let mut previous: &[u8] = &[];
        for &g in &order {
            let prefix = prefixes[g as usize];
            let common = prefix
                .iter()
                .zip(previous)
                .take_while(|(a, b)| a == b)
                .count();
            path.truncate(common + 1);
            for &b in &prefix[common..] {
                let node = parent.len() as u32 + 1;
                parent.push(path[path.len() - 1]);
                byte.push(b);
                path.push(node);
            }
            ends.push(path[path.len() - 1]);
            previous = prefix;
        }
        let nodes = parent.len() + 1;
        let edge_start = starts(parent.iter().copied(), nodes);
        let mut fill: Vec<u32> = edge_start[..nodes].to_vec();
        let mut edge_byte = vec![0u8; parent.len()].into_boxed_slice();
        let mut edge_child = vec![0u32; parent.len()].into_boxed_slice();
        for (child, (&p, &b)) in parent.iter().zip(&byte).enumerate() {
            let at = fill[p as usize] as usize;
            edge_byte[at] = b;
            edge_child[at] = child as u32 + 1;
            fill[p as usize] += 1;
        }
        PrefixTrie {
            glob_start: starts(ends.iter().copied(), nodes),
            edge_start,
            edge_byte,
            edge_child,
            globs: order.into_boxed_slice(),
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

impl From<CompiledDocument> for PolicyTable {
    fn from(doc: CompiledDocument) -> Self {
        Self::from_document(doc)
    }
}

/// `starts[n]..starts[n + 1]` for each node `n` owning the items at the positions
/// `owners` gives, in order of node: a count per node, then running sums.
fn starts(owners: impl Iterator<Item = u32>, nodes: usize) -> Box<[u32]> {
    let mut starts = vec![0u32; nodes + 1];
    for n in owners {
        starts[n as usize + 1] += 1;
    }
    for n in 1..=nodes {
        starts[n] += starts[n - 1];
    }
    starts.into_boxed_slice()
}

impl PolicyTable {
    /// Indexes a document the caller keeps (its policies are copied).
    pub fn new(doc: &CompiledDocument) -> Self {
        Self::from_document(doc.clone())
    }

    /// Indexes a document, taking its parameters instead of copying them. Names and
    /// patterns are copied once into the packed blocks, each sized before it is filled.
    pub fn from_document(doc: CompiledDocument) -> Self {
        let indexes = Indexes::build(
            doc.policies
                .iter()
                .enumerate()
                .flat_map(|(index, p)| p.queues.iter().map(move |q| (q.as_str(), index))),
        );
        let mut packer = Packer::default();
        let entries = doc
            .policies
            .into_iter()
            .map(|p| {
                let rollout = p.rollout;
                packer.entry(&p.namespace, &p.name, p.generation, p.params, |identity| {
                    rollout.and_then(|r| RolloutEntry::new(identity, r))
                })
            })
            .collect();
        Self::assemble(doc.namespace, doc.hash, entries, packer, indexes)
    }

    /// `entries` may have grown by doubling while a document was read; shrinking gives
    /// the spare capacity back (in place for a block this large).
    pub(super) fn assemble(
        namespace: String,
        hash: String,
        mut entries: Vec<TableEntry>,
        packer: Packer,
        indexes: Indexes,
    ) -> Self {
        entries.shrink_to_fit();
        packer.finish(&mut entries);
        Self {
            namespace,
            hash,
            entries,
            exact: indexes.exact,
            globs: indexes.globs,
            prefixes: indexes.prefixes,
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

    /// The document's content hash, `sha256:<hex>`.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The namespace the document was compiled for.
    pub fn namespace(&self) -> &str {
        &self.namespace
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
