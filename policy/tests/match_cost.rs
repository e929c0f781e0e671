//! Matching work is bounded by the lengths involved, never by backtracking or by how many
//! patterns a namespace holds: counted in byte steps, not timed.

mod support;

use rebound_policy::{
    CompiledDocument, CompiledPolicy, PolicyTable, PreparedPolicy, pattern::Glob,
};
use support::params_with_errors;

/// The review's worst valid namespace: 50 policies × 64 queue patterns and 64 error
/// patterns of the form `*aaa…(125)…b<i>.<j>`.
fn hostile_patterns(policy: usize) -> Vec<String> {
    (0..64)
        .map(|j| format!("*{}b{policy}.{j}", "a".repeat(125)))
        .collect()
}

fn hostile_document() -> CompiledDocument {
    let policies = (0..50)
        .map(|i| CompiledPolicy {
            name: format!("p{i}"),
            namespace: "ns".to_owned(),
            uid: String::new(),
            generation: 1,
            queues: hostile_patterns(i),
            params: params_with_errors(hostile_patterns(i)),
            rollout: None,
        })
        .collect();
    CompiledDocument::new("ns", policies)
}

#[test]
fn one_glob_is_linear_in_name_and_pattern() {
    let cases = [
        (format!("*{}b", "a".repeat(125)), "a".repeat(253)),
        (format!("*{}b*", "a".repeat(125)), "a".repeat(253)),
        (format!("{}*b", "a".repeat(120)), "a".repeat(253)),
        ("a*a*a*a*a*a*a*a*a*a*a*a*b".repeat(5), "a".repeat(253)),
        (
            format!("*{}", "ab".repeat(60)),
            format!("{}c", "ab".repeat(126)),
        ),
        (format!("*{}*", "aab".repeat(40)), "aa".repeat(126)),
    ];
    for (pattern, name) in &cases {
        let mut steps = 0;
        let _ = Glob::new(pattern).matches_counting(name, &mut steps);
        let bound = (2 * (name.len() + pattern.len())) as u64;
        assert!(
            steps <= bound,
            "{pattern:?} against {} bytes: {steps} steps, bound {bound}",
            name.len()
        );
    }
}

#[test]
fn queue_lookup_in_the_hostile_namespace_is_bounded() {
    let table = PolicyTable::new(&hostile_document());
    let queue = "a".repeat(253);
    let mut steps = 0;
    assert!(table.lookup_counting(&queue, &mut steps).is_none());
    // One walk of the name, then one step per glob whose (empty) prefix matches and whose
    // suffix differs in its last byte: far from 3,200 × 253 × 125.
    assert!(steps <= 253 + 2 * 3_200, "{steps} steps");

    // A matching queue costs the same order of work.
    let mut steps = 0;
    let hit = format!("{}b49.63", "a".repeat(200));
    assert_eq!(
        table.lookup_counting(&hit, &mut steps).map(|e| e.name()),
        Some("p49")
    );
    assert!(steps <= 253 + 2 * 3_200 + 2 * 253, "{steps} steps");
}

#[test]
fn error_class_matching_in_the_hostile_policy_is_bounded() {
    let policy = PreparedPolicy::new("ns/p0", params_with_errors(hostile_patterns(0)));
    let class = "a".repeat(253);
    let mut steps = 0;
    assert_eq!(policy.non_retryable_match(&class, &mut steps), None);
    assert!(steps <= 2 * 64, "{steps} steps");
}

#[test]
fn prefix_index_tries_only_globs_whose_prefix_the_queue_has() {
    // 3,000 globs with distinct literal prefixes: a lookup tries a handful, not all.
    let policies = (0..50)
        .map(|i| CompiledPolicy {
            name: format!("p{i}"),
            namespace: "ns".to_owned(),
            uid: String::new(),
            generation: 1,
            queues: (0..60).map(|j| format!("team{i}.svc{j}.*")).collect(),
            params: params_with_errors(vec![]),
            rollout: None,
        })
        .collect();
    let table = PolicyTable::new(&CompiledDocument::new("ns", policies));
    let mut steps = 0;
    let found = table.lookup_counting("team42.svc17.emails", &mut steps);
    assert_eq!(found.map(|e| e.name()), Some("p42"));
    assert!(steps <= 3 * 20, "{steps} steps");
}
