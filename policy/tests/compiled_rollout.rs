//! A compiled policy in rollout: the `rollout` field read back, checked field by field,
//! covered by the hash, and answered by the table with the revision the assignment picks.

use rebound_policy::{
    CompiledDocument, CompiledPolicy, Context, Decision, PolicyTable, ResolvedPolicy,
    compiled::{CompiledRollout, DocumentError},
    resolve,
    rollout::assign::{Arm, Exposure, Step, arm, revision_id},
    spec::RetryPolicySpec,
};

const T0: u64 = 1_800_000_000_000;
const MINUTE: u64 = 60_000;

fn params(max_attempts: u32) -> ResolvedPolicy {
    let spec: RetryPolicySpec = serde_json::from_value(
        serde_json::json!({"queues": ["payments"], "maxAttempts": max_attempts,
                           "backoff": {"base": "1s", "cap": "1m"}}),
    )
    .expect("spec");
    resolve(&spec).expect("valid")
}

fn rollout(steps: &[(u32, u64)]) -> CompiledRollout {
    CompiledRollout {
        revision: revision_id(&params(2)),
        stable_revision: revision_id(&params(25)),
        canary: params(2),
        steps: steps
            .iter()
            .map(|&(weight, start_unix_ms)| Step {
                weight,
                start_unix_ms,
            })
            .collect(),
    }
}

fn document(rollout: Option<CompiledRollout>) -> CompiledDocument {
    CompiledDocument::new(
        "shop",
        vec![CompiledPolicy {
            name: "payments".into(),
            namespace: "shop".into(),
            uid: "u".into(),
            generation: 2,
            queues: vec!["payments".into()],
            params: params(25),
            rollout,
        }],
    )
}

/// The document's policies changed by `edit` (on the rollout), with a matching hash.
fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut value = serde_json::to_value(document(Some(rollout(&[(10, T0)])))).expect("json");
    edit(&mut value["policies"][0]["rollout"]);
    let policies = value["policies"].to_string();
    format!(
        r#"{{"format":{:?},"namespace":"shop","hash":{:?},"policies":{policies}}}"#,
        rebound_policy::compiled::FORMAT,
        rebound_policy::digest::sha256_id(policies.as_bytes()),
    )
}

#[test]
fn a_rollout_reads_back_and_a_document_without_one_is_unchanged() {
    let doc = document(Some(rollout(&[(10, T0), (50, T0 + 10 * MINUTE)])));
    let back = CompiledDocument::from_json(doc.to_json().as_bytes()).expect("valid");
    assert_eq!(back, doc);
    let plain = document(None);
    let json: serde_json::Value = serde_json::from_str(&plain.to_json()).expect("json");
    assert!(
        json["policies"][0].get("rollout").is_none(),
        "no rollout, no field: {json}"
    );
    assert_ne!(plain.hash, doc.hash, "the hash covers the rollout");
}

#[test]
fn the_hash_covers_the_rollout() {
    let json = document(Some(rollout(&[(10, T0)]))).to_json();
    let tampered = json.replace("\"weight\":10", "\"weight\":90");
    assert_ne!(tampered, json);
    assert!(matches!(
        CompiledDocument::from_json(tampered.as_bytes()),
        Err(DocumentError::Hash { .. })
    ));
}

#[test]
fn a_malformed_rollout_is_refused_naming_the_field() {
    use serde_json::json;
    let field = |edit: &dyn Fn(&mut serde_json::Value)| match CompiledDocument::from_json(
        edited(edit).as_bytes(),
    ) {
        Err(DocumentError::Policy { policy, error }) => {
            assert_eq!(policy, "shop/payments");
            Ok(error.field)
        }
        Err(other) => Err(other.to_string()),
        Ok(_) => Err("accepted".to_owned()),
    };
    assert_eq!(
        field(&|_| {}),
        Err("accepted".into()),
        "the base case is valid"
    );
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "rollout.revision",
            Box::new(|r| r["revision"] = json!("sha256:12")),
        ),
        (
            "rollout.stableRevision",
            Box::new(|r| r["stableRevision"] = json!("v1")),
        ),
        (
            "rollout.steps[0].weight",
            Box::new(|r| r["steps"][0]["weight"] = json!(0)),
        ),
        (
            "rollout.steps[0].weight",
            Box::new(|r| r["steps"][0]["weight"] = json!(100)),
        ),
        (
            "rollout.steps[1].weight",
            Box::new(|r| {
                r["steps"] = json!([{"weight": 20, "startUnixMs": T0},
                                    {"weight": 20, "startUnixMs": T0 + 1}])
            }),
        ),
        (
            "rollout.steps[1].startUnixMs",
            Box::new(|r| {
                r["steps"] = json!([{"weight": 20, "startUnixMs": T0},
                                    {"weight": 30, "startUnixMs": T0 - 1}])
            }),
        ),
        (
            "rollout.steps",
            Box::new(|r| {
                r["steps"] = (1..=11)
                    .map(|w| json!({"weight": w, "startUnixMs": T0}))
                    .collect()
            }),
        ),
        (
            "rollout.canary.capMs",
            Box::new(|r| r["canary"]["capMs"] = json!(1)),
        ),
    ];
    for (want, edit) in cases {
        assert_eq!(field(edit.as_ref()), Ok(want.to_owned()));
    }
    // Not a field error: a weight that is no integer fails to parse at all.
    assert!(matches!(
        CompiledDocument::from_json(edited(|r| r["steps"][0]["weight"] = json!(-1)).as_bytes()),
        Err(DocumentError::Parse(_))
    ));
}

/// The table answers each job with the revision `arm` picks: the canary's parameters
/// (maxAttempts 2 gives up after attempt 2) and its id, or the stable ones.
#[test]
fn the_table_answers_each_job_from_its_revision() {
    let r = rollout(&[(10, T0), (50, T0 + 10 * MINUTE)]);
    let exposure = Exposure::new(r.revision.clone(), r.steps.clone()).expect("valid");
    let table = PolicyTable::from_document(document(Some(r.clone())));
    let entry = table.lookup("payments").expect("entry");
    let (mut canary, mut stable) = (0, 0);
    for i in 0..2000 {
        let id = format!("job-{i}");
        let first = T0 + (i % 20) * MINUTE;
        let ctx = Context {
            job_id: Some(&id),
            first_failure_ms: Some(first),
            now_ms: Some(first + 5 * MINUTE),
            ..Context::default()
        };
        let (decision, selected) = entry.decide(2, &ctx);
        let expected = arm(&exposure, Some(&id), Some(first), first + 5 * MINUTE);
        assert_eq!(selected.arm, expected, "{id}");
        match expected {
            Arm::Canary => {
                canary += 1;
                assert_eq!(selected.revision, r.revision);
                assert!(matches!(decision, Decision::GiveUp { .. }), "{id}");
            }
            Arm::Stable => {
                stable += 1;
                assert_eq!(selected.revision, r.stable_revision);
                assert!(matches!(decision, Decision::Retry { .. }), "{id}");
            }
        }
    }
    assert!(
        canary > 300 && stable > 1000,
        "{canary} canary, {stable} stable"
    );
    // No job id: the stable revision.
    let ctx = Context {
        now_ms: Some(T0 + 60 * MINUTE),
        ..Context::default()
    };
    assert_eq!(entry.select(&ctx).revision, r.stable_revision);
    // A policy without a rollout names no revision.
    let plain = PolicyTable::from_document(document(None));
    let entry = plain.lookup("payments").expect("entry");
    let selected = entry.select(&Context {
        job_id: Some("job-1"),
        now_ms: Some(T0),
        ..Context::default()
    });
    assert_eq!((selected.arm, selected.revision), (Arm::Stable, ""));
}
