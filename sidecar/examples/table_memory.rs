//! The heap a policy table holds, counted by the allocator itself (no RSS noise): the
//! generated table of `load` (`--policies`, default 10,000: a queue, a queue glob and, for
//! half of them, two error classes each), the table as the sidecar reads it on a
//! reload, and the part of it that is the prepared globs; the number of live allocations
//! too (each small one can pin a page after a reload) and of those the read made and
//! freed again (each can leave a hole); the decision series and budgets before any
//! decision; and the whole snapshot a request reads (table, retry budgets, decision
//! series). With `--rollout`, every policy is in rollout (two revisions each). A program
//! that prints figures.
//!
//! cargo run --release -p rebound-sidecar --features testkit --example table_memory [-- --rollout]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use anyhow::Result;
use rebound_policy::{CompiledDocument, PolicyTable, pattern::Glob};
use rebound_sidecar::{answer::Snapshot, metrics::Decisions, retry_budgets::Budgets, testkit};

/// The system allocator, counting the bytes it holds.
struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);
static BLOCKS: AtomicIsize = AtomicIsize::new(0);
/// Allocations and reallocations ever made: what a read made beyond the blocks it keeps.
static MADE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        MADE.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        BLOCKS.fetch_sub(1, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HELD.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        MADE.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn held() -> (isize, isize) {
    (HELD.load(Ordering::Relaxed), BLOCKS.load(Ordering::Relaxed))
}

fn since(before: (isize, isize)) -> (isize, isize) {
    let now = held();
    (now.0 - before.0, now.1 - before.1)
}

fn mib(bytes: isize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> Result<()> {
    let policies = std::env::args()
        .skip_while(|a| a != "--policies")
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(10_000);
    let rollout = std::env::args().any(|a| a == "--rollout");
    let doc = testkit::document("load", policies, 0);
    let doc = if rollout {
        testkit::in_rollout(doc, 1_800_000_000_000)
    } else {
        doc
    };
    let json = doc.to_json();

    let (before, made) = (held(), MADE.load(Ordering::Relaxed));
    let table = PolicyTable::from_json(json.as_bytes())?;
    let (table_bytes, table_blocks) = since(before);
    let transient = MADE.load(Ordering::Relaxed) - made - table_blocks;

    let before = held();
    let series = (Budgets::detached(&table), Decisions::detached(&table));
    let (series_bytes, series_blocks) = since(before);
    drop(series);

    let parsed = CompiledDocument::from_json(json.as_bytes())?;
    let before = held();
    let snapshot = Snapshot::new(&parsed);
    let (snapshot_bytes, _) = since(before);
    drop((snapshot, parsed));

    let patterns: Vec<String> = CompiledDocument::from_json(json.as_bytes())?
        .policies
        .iter()
        .flat_map(|p| p.queues.iter().chain(&p.params.non_retryable_errors))
        .filter(|q| q.contains('*'))
        .cloned()
        .collect();
    let before = held();
    let globs: Vec<Glob> = patterns.iter().map(|p| Glob::new(p)).collect();
    let (glob_bytes, _) = since(before);

    println!(
        "{policies} policies{}, document {:.2} MiB: table {:.2} MiB ({:.0} B a policy); \
         its {} globs prepared alone {:.2} MiB ({:.0} B a glob); {table_blocks} allocations \
         held ({:.1} a policy), {transient} more made and freed while reading it ({:.1} a \
         policy); decision series and budgets before any decision {:.3} MiB ({:.1} B, {:.4} \
         allocations a policy); the snapshot a request reads {:.2} MiB",
        if rollout { " all in rollout" } else { "" },
        mib(json.len() as isize),
        mib(table_bytes),
        table_bytes as f64 / policies.max(1) as f64,
        globs.len(),
        mib(glob_bytes),
        glob_bytes as f64 / globs.len().max(1) as f64,
        table_blocks as f64 / policies.max(1) as f64,
        transient as f64 / policies.max(1) as f64,
        mib(series_bytes),
        series_bytes as f64 / policies.max(1) as f64,
        series_blocks as f64 / policies.max(1) as f64,
        mib(snapshot_bytes),
    );
    drop((table, globs));
    Ok(())
}
