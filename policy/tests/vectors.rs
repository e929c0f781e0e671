//! The committed cross-language test vectors are exactly what this build generates, and
//! reading them back gives `decide`'s answers.

use rebound_policy::vectors::{self, VectorFile};

const COMMITTED: &str = include_str!("../testdata/decide-vectors.json");

#[test]
fn committed_vectors_match_the_generator() {
    let generated = vectors::generate().to_json();
    assert!(
        generated == COMMITTED,
        "policy/testdata/decide-vectors.json is stale; regenerate it with `{}` and review the diff",
        vectors::REGENERATE
    );
}

#[test]
fn every_case_read_back_gets_its_expected_answer() {
    let file = VectorFile::from_json(COMMITTED).expect("vector file parses");
    assert_eq!(file.format, vectors::FORMAT);
    for case in &file.cases {
        assert_eq!(
            case.answer().expect("valid policy"),
            case.expected,
            "{}",
            case.name
        );
    }
}

#[test]
fn cases_cover_every_strategy_jitter_and_answer() {
    use std::collections::BTreeSet;
    let file = vectors::generate();
    let names: BTreeSet<_> = file.cases.iter().map(|c| c.name.clone()).collect();
    assert_eq!(names.len(), file.cases.len(), "case names are unique");
    let kinds: BTreeSet<String> = file
        .cases
        .iter()
        .map(|c| format!("{:?}/{:?}", c.policy.strategy, c.policy.jitter))
        .collect();
    assert_eq!(kinds.len(), 4 * 4 + 1, "{kinds:?}");
    let answers: BTreeSet<String> = file
        .cases
        .iter()
        .map(|c| {
            format!(
                "{:?}/{:?}/{:?}",
                c.expected.decision,
                c.expected.reason,
                c.context.job_id.is_some()
            )
        })
        .collect();
    for want in [
        "Retry/Unspecified/true",
        "Retry/Unspecified/false",
        "GiveUp/MaxAttempts/true",
        "GiveUp/MaxAttempts/false",
        "GiveUp/Deadline/true",
        "GiveUp/Deadline/false",
        "GiveUp/NonRetryable/true",
        "GiveUp/NonRetryable/false",
    ] {
        assert!(
            answers.contains(want),
            "no case answers {want}: {answers:?}"
        );
    }
}
