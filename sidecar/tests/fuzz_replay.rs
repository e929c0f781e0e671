//! Replays every fuzz target's seeds (and a local `corpus/<target>` directory, when there
//! is one) on stable Rust, through the same code the fuzzer runs, so a fixed finding stays
//! fixed and the targets keep building.

#[path = "../fuzz/targets/compiled_document.rs"]
mod compiled_document;
#[path = "../fuzz/targets/manifests.rs"]
mod manifests;
#[path = "../fuzz/targets/request_handling.rs"]
mod request_handling;
#[path = "../fuzz/targets/retry_budget.rs"]
mod retry_budget;

use std::path::Path;

/// Runs `target` on every file under `seeds/<name>` and `corpus/<name>`; returns how many.
fn replay(name: &str, target: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut inputs = 0;
    for dir in [
        root.join("seeds").join(name),
        root.join("corpus").join(name),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let data = std::fs::read(&path).expect("read input");
            target(&data);
            inputs += 1;
        }
    }
    inputs
}

#[test]
fn every_fuzz_target_replays_its_seeds() {
    for (name, target) in [
        ("compiled_document", compiled_document::run as fn(&[u8])),
        ("manifests", manifests::run),
        ("request_handling", request_handling::run),
        ("retry_budget", retry_budget::run),
    ] {
        assert!(replay(name, target) > 0, "{name} has no seeds");
    }
}
