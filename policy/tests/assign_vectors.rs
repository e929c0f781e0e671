//! The committed rollout-assignment vectors are exactly what this build generates, read
//! back they get the assignment's answers, and they cover what a port can get wrong.

use std::collections::BTreeSet;

use rebound_policy::vectors::{
    self,
    assign::{self, AssignFile, WireArm},
};

const COMMITTED: &str = include_str!("../testdata/assign-vectors.json");

#[test]
fn committed_assign_vectors_match_the_generator() {
    assert!(
        assign::generate().to_json() == COMMITTED,
        "policy/testdata/assign-vectors.json is stale; regenerate it with `{}` and review the diff",
        vectors::REGENERATE
    );
}

#[test]
fn every_assign_case_read_back_gets_its_expected_arm() {
    let file = AssignFile::from_json(COMMITTED).expect("vector file parses");
    assert_eq!(file.format, assign::FORMAT);
    for case in &file.cases {
        assert_eq!(
            case.answer().expect("valid"),
            case.expected,
            "{}",
            case.name
        );
    }
}

#[test]
fn assign_cases_cover_the_edges() {
    let file = assign::generate();
    let cases = &file.cases;
    let names: BTreeSet<_> = cases.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    let revisions: BTreeSet<_> = cases.iter().map(|c| c.revision.as_str()).collect();
    assert!(revisions.len() >= 3, "{revisions:?}");
    let any = |what: &str, f: &dyn Fn(&assign::AssignCase) -> bool| {
        assert!(cases.iter().any(f), "no case with {what}");
    };
    any("no job id", &|c| c.job_id.is_none());
    any("an empty job id", &|c| c.job_id.as_deref() == Some(""));
    any("a non-ASCII job id", &|c| {
        c.job_id.as_deref().is_some_and(|id| !id.is_ascii())
    });
    any("no first failure", &|c| c.first_failure_unix_ms.is_none());
    any("no step started", &|c| c.steps.is_empty());
    any("two steps starting together", &|c| {
        c.steps
            .windows(2)
            .any(|w| w[0].start_unix_ms == w[1].start_unix_ms)
    });
    // The edges of the rule `bucket < weight`, at the smallest and largest weight.
    let last_weight = |c: &assign::AssignCase| {
        let t = c.first_failure_unix_ms.unwrap_or(c.now_unix_ms);
        c.steps
            .iter()
            .rev()
            .find(|s| s.start_unix_ms <= t)
            .map(|s| s.weight)
    };
    for (weight, bucket, arm) in [
        (1, 0, WireArm::Canary),
        (1, 1, WireArm::Stable),
        (99, 98, WireArm::Canary),
        (99, 99, WireArm::Stable),
        (10, 9, WireArm::Canary),
        (10, 10, WireArm::Stable),
        (50, 49, WireArm::Canary),
        (50, 50, WireArm::Stable),
    ] {
        any(&format!("weight {weight}, bucket {bucket}"), &|c| {
            last_weight(c) == Some(weight)
                && c.expected.bucket == Some(bucket)
                && c.expected.arm == arm
        });
    }
    // Every step boundary, just before and at it, by first failure and by now.
    for c in cases.iter().filter(|c| c.steps.len() == 2) {
        for s in &c.steps {
            for t in [s.start_unix_ms - 1, s.start_unix_ms] {
                any(&format!("{t} as first failure"), &|d| {
                    d.steps == c.steps && d.first_failure_unix_ms == Some(t)
                });
            }
        }
    }
    any("a step boundary as now", &|c| {
        c.first_failure_unix_ms.is_none()
            && c.steps.iter().any(|s| s.start_unix_ms == c.now_unix_ms)
    });
}
