//! A table's decision series and retry budgets cost about nothing per policy until the
//! policy decides or is budgeted: at 10,000 policies they were 2.3 MiB of a 10 MiB
//! sidecar at rest. Counted by the allocator, not measured as RSS.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicIsize, Ordering},
};

use rebound_policy::PolicyTable;
use rebound_sidecar::{metrics::Metrics, retry_budgets::Budgets, testkit};

/// The system allocator, counting the blocks and bytes it holds.
struct Counting;

static BLOCKS: AtomicIsize = AtomicIsize::new(0);
static BYTES: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        BLOCKS.fetch_sub(1, Ordering::Relaxed);
        BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn held() -> (isize, isize) {
    (
        BLOCKS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    )
}

const POLICIES: usize = 10_000;

#[test]
fn series_and_budgets_of_policies_that_never_decided_cost_a_pointer_each() {
    let table = PolicyTable::from_document(testkit::document("load", POLICIES, 0));
    let metrics = Metrics::default();

    let (blocks, bytes) = held();
    let budgets = Budgets::build(&table, None, &metrics);
    let decisions = metrics.decisions().build(&table);
    let (blocks, bytes) = (held().0 - blocks, held().1 - bytes);

    // One block of slots for the decisions; nothing for budgets, as no policy has one.
    assert!(blocks <= 2, "{blocks} allocations for {POLICIES} policies");
    let per_policy = bytes as f64 / POLICIES as f64;
    assert!(per_policy <= 16.0, "{bytes} bytes, {per_policy} a policy");
    assert_eq!((budgets.len(), decisions.len()), (0, POLICIES));
}
