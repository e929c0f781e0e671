//! A table holds few allocations: after a reload, each small one the new table keeps can
//! pin a page of the table it replaced, so RSS no longer returns to idle. Counted by the
//! allocator, not measured as RSS.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        Mutex,
        atomic::{AtomicIsize, Ordering},
    },
};

mod support;

use rebound_policy::{CompiledDocument, CompiledPolicy, PolicyTable};
use support::params_with_errors;

/// The system allocator, counting the blocks it holds.
struct Counting;

static BLOCKS: AtomicIsize = AtomicIsize::new(0);
/// Allocations and reallocations ever made.
static MADE: AtomicIsize = AtomicIsize::new(0);
/// The counters are global: one test counts at a time.
static SERIAL: Mutex<()> = Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        MADE.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        MADE.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        BLOCKS.fetch_sub(1, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// `load`'s shape: a queue and a queue glob each, two error classes for every other one.
fn document(policies: usize) -> CompiledDocument {
    let policies = (0..policies)
        .map(|i| CompiledPolicy {
            name: format!("p{i}"),
            namespace: "bench".to_owned(),
            uid: String::new(),
            generation: 1,
            queues: vec![format!("q{i}"), format!("g{i}.*")],
            params: params_with_errors(if i % 2 == 0 {
                vec![format!("E{i}"), format!("Timeout.{i}.*")]
            } else {
                vec![]
            }),
            rollout: None,
        })
        .collect();
    CompiledDocument::new("bench", policies)
}

#[test]
fn a_table_keeps_few_allocations_per_policy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Counted from before the document: the table takes what it keeps from it.
    let before = BLOCKS.load(Ordering::Relaxed);
    let table = PolicyTable::from_document(document(2_000));
    let held = BLOCKS.load(Ordering::Relaxed) - before;
    // Identities, error classes and their prepared parts are packed in blocks the whole
    // table shares, as names and patterns are: a plain policy owns no allocation, and the
    // table's own blocks are a handful in all (one allocation each made 8 a policy).
    assert!(held <= 32, "{held} allocations held for 2,000 policies");
    assert_eq!(table.lookup("q7").map(|e| e.name()), Some("p7"));
    assert_eq!(table.lookup("g7.x").map(|e| e.namespace()), Some("bench"));
}

#[test]
fn reading_a_table_allocates_little_it_does_not_keep() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let json = document(2_000).to_json();
    let (blocks, made) = (BLOCKS.load(Ordering::Relaxed), MADE.load(Ordering::Relaxed));
    let table = PolicyTable::from_json(json.as_bytes()).expect("valid");
    let held = BLOCKS.load(Ordering::Relaxed) - blocks;
    let freed = MADE.load(Ordering::Relaxed) - made - held;
    // Names, namespaces and patterns are borrowed from the input; what is made and freed
    // is a few vectors growing by doubling, the envelope's strings and each policy's
    // parsed error classes (a vector and a string each, here 1.5 a policy), copied into
    // the shared blocks. Such a hole is refilled by the next policy's classes: the table
    // keeps no small block that could pin it.
    let per_policy = freed as f64 / 2_000.0;
    assert!(
        per_policy <= 1.6,
        "{freed} made and freed, {per_policy} a policy"
    );
    // And it keeps what the table built from a document keeps.
    assert!(held <= 32, "{held} allocations held");
    assert_eq!(table.lookup("q7").map(|e| e.name()), Some("p7"));
}
