//! Invalid RetryPolicies are rejected by the API server at apply time (schema and CEL
//! rules of the CRD), with a message that names the offending field.
//!
//! Each case changes one thing in a valid baseline policy, so a rejection can only come
//! from the rule under test. Every case is applied twice: with client-side
//! `kubectl apply` and with `kubectl apply --server-side`.

use kube::Api;
use kube::api::{DynamicObject, ListParams};
use rebound_tests::{TestEnv, retry_policy_resource};
use serde_json::{Value, json};

/// A valid policy that uses every spec field.
fn baseline(name: &str) -> Value {
    json!({
        "apiVersion": "rebound.dev/v1alpha1",
        "kind": "RetryPolicy",
        "metadata": { "name": name },
        "spec": {
            "queues": ["orders", "orders-*"],
            "backoff": {
                "strategy": "exponential",
                "base": "1s",
                "multiplier": 2,
                "cap": "5m",
                "jitter": { "kind": "full" }
            },
            "maxAttempts": 5,
            "maxRetryDuration": "1h30m",
            "nonRetryableErrors": ["ValidationError", "http.4*"],
            "terminal": { "action": "deadLetter", "deadLetterQueue": "orders-dead" },
            "rollout": {
                "steps": [
                    { "weight": 10, "pause": "10m", "maxDuration": "1h" },
                    { "weight": 50 }
                ],
                "analysis": {
                    "maxRelativeIncrease": 0.2,
                    "alpha": 0.05,
                    "minFailedJobs": 200,
                    "onInconclusive": "Abort"
                }
            }
        }
    })
}

enum Edit {
    Set(&'static str, Value),
    Remove(&'static str),
}
use Edit::{Remove, Set};

struct Case {
    name: &'static str,
    edits: Vec<Edit>,
    /// Every one of these must appear in kubectl's error output: the field path first,
    /// then a fragment of the message.
    expect: &'static [&'static str],
}

fn cases() -> Vec<Case> {
    let sixty_five: Vec<String> = (0..65).map(|i| format!("q{i}")).collect();
    vec![
        Case {
            name: "cap-below-base",
            edits: vec![
                Set("spec.backoff.base", json!("1m")),
                Set("spec.backoff.cap", json!("30s")),
            ],
            expect: &["spec.backoff.cap", "cap must be at least base"],
        },
        Case {
            name: "zero-base",
            edits: vec![Set("spec.backoff.base", json!("0s"))],
            expect: &["spec.backoff.base", "must be at least 1ms"],
        },
        Case {
            name: "zero-max-retry-duration",
            edits: vec![Set("spec.maxRetryDuration", json!("0ms"))],
            expect: &["spec.maxRetryDuration", "must be at least 1ms"],
        },
        Case {
            name: "malformed-duration",
            edits: vec![Set("spec.maxRetryDuration", json!("10 minutes"))],
            expect: &["spec.maxRetryDuration", "should match"],
        },
        Case {
            name: "multiplier-below-one",
            edits: vec![Set("spec.backoff.multiplier", json!(0.5))],
            expect: &["spec.backoff.multiplier", "greater than or equal to 1"],
        },
        Case {
            name: "max-attempts-zero",
            edits: vec![Set("spec.maxAttempts", json!(0))],
            expect: &["spec.maxAttempts", "greater than or equal to 1"],
        },
        Case {
            name: "max-attempts-10001",
            edits: vec![Set("spec.maxAttempts", json!(10001))],
            expect: &["spec.maxAttempts", "less than or equal to 10000"],
        },
        Case {
            name: "dead-letter-without-queue",
            edits: vec![Remove("spec.terminal.deadLetterQueue")],
            expect: &[
                "spec.terminal.deadLetterQueue",
                "deadLetterQueue is required when action is deadLetter",
            ],
        },
        Case {
            name: "drop-with-dead-letter-queue",
            edits: vec![Set("spec.terminal.action", json!("drop"))],
            expect: &[
                "spec.terminal.deadLetterQueue",
                "applies only to action deadLetter",
            ],
        },
        Case {
            name: "unknown-terminal-action",
            edits: vec![Set("spec.terminal.action", json!("retryForever"))],
            expect: &["spec.terminal.action", "Unsupported value"],
        },
        Case {
            name: "empty-queues",
            edits: vec![Set("spec.queues", json!([]))],
            expect: &["spec.queues", "should have at least 1 items"],
        },
        Case {
            name: "missing-queues",
            edits: vec![Remove("spec.queues")],
            expect: &["spec.queues", "Required value"],
        },
        Case {
            name: "malformed-queue-pattern",
            edits: vec![Set("spec.queues", json!(["orders", "bad queue!"]))],
            expect: &["spec.queues[1]", "should match"],
        },
        Case {
            name: "too-many-queues",
            edits: vec![Set("spec.queues", json!(sixty_five))],
            expect: &["spec.queues", "at most 64 items"],
        },
        Case {
            name: "unknown-strategy",
            edits: vec![Set("spec.backoff.strategy", json!("fibonacci"))],
            expect: &["spec.backoff.strategy", "Unsupported value"],
        },
        Case {
            name: "schedule-strategy-with-empty-schedule",
            edits: vec![Set(
                "spec.backoff",
                json!({ "strategy": "schedule", "schedule": [], "cap": "1h" }),
            )],
            expect: &["spec.backoff.schedule", "should have at least 1 items"],
        },
        Case {
            name: "schedule-strategy-without-schedule",
            edits: vec![Set(
                "spec.backoff",
                json!({ "strategy": "schedule", "cap": "1h" }),
            )],
            expect: &[
                "spec.backoff.schedule",
                "schedule must list at least one delay",
            ],
        },
        Case {
            name: "schedule-entry-above-cap",
            edits: vec![Set(
                "spec.backoff",
                json!({ "strategy": "schedule", "schedule": ["1s", "2h"], "cap": "1h" }),
            )],
            expect: &["spec.backoff.schedule", "at most cap"],
        },
        Case {
            name: "multiplier-with-linear",
            edits: vec![Set("spec.backoff.strategy", json!("linear"))],
            expect: &["spec.backoff.multiplier", "only to strategy exponential"],
        },
        Case {
            name: "jitter-with-decorrelated",
            edits: vec![
                Set("spec.backoff.strategy", json!("decorrelated")),
                Remove("spec.backoff.multiplier"),
            ],
            expect: &["spec.backoff.jitter", "decorrelated"],
        },
        Case {
            name: "jitter-ratio-zero",
            edits: vec![Set(
                "spec.backoff.jitter",
                json!({ "kind": "proportional", "ratio": 0 }),
            )],
            expect: &["spec.backoff.jitter.ratio", "should be greater than 0"],
        },
        Case {
            name: "jitter-ratio-above-one",
            edits: vec![Set(
                "spec.backoff.jitter",
                json!({ "kind": "proportional", "ratio": 1.5 }),
            )],
            expect: &["spec.backoff.jitter.ratio", "less than or equal to 1"],
        },
        Case {
            name: "jitter-ratio-with-full",
            edits: vec![Set(
                "spec.backoff.jitter",
                json!({ "kind": "full", "ratio": 0.5 }),
            )],
            expect: &[
                "spec.backoff.jitter.ratio",
                "ratio is required with kind proportional",
            ],
        },
        Case {
            name: "unknown-jitter-kind",
            edits: vec![Set("spec.backoff.jitter.kind", json!("gaussian"))],
            expect: &["spec.backoff.jitter.kind", "Unsupported value"],
        },
        Case {
            name: "rollout-weights-not-increasing",
            edits: vec![Set(
                "spec.rollout.steps",
                json!([{"weight": 50}, {"weight": 10}]),
            )],
            expect: &["spec.rollout.steps", "weights must increase strictly"],
        },
        Case {
            name: "rollout-weight-all-jobs",
            edits: vec![Set("spec.rollout.steps", json!([{"weight": 100}]))],
            expect: &["spec.rollout.steps[0].weight", "less than or equal to 99"],
        },
        Case {
            name: "rollout-max-duration-below-pause",
            edits: vec![Set(
                "spec.rollout.steps",
                json!([{"weight": 10, "pause": "1h", "maxDuration": "30m"}]),
            )],
            expect: &[
                "spec.rollout.steps[0].maxDuration",
                "maxDuration must be at least pause",
            ],
        },
        Case {
            name: "rollout-alpha-zero",
            edits: vec![Set("spec.rollout.analysis.alpha", json!(0))],
            expect: &["spec.rollout.analysis.alpha", "at least 0.001"],
        },
        Case {
            name: "rollout-unknown-on-inconclusive",
            edits: vec![Set("spec.rollout.analysis.onInconclusive", json!("Retry"))],
            expect: &["spec.rollout.analysis.onInconclusive", "Unsupported value"],
        },
        Case {
            name: "unknown-field",
            edits: vec![Set("spec.retries", json!(3))],
            expect: &["spec.retries"],
        },
    ]
}

fn apply_edit(doc: &mut Value, edit: &Edit) {
    let (path, value) = match edit {
        Set(path, value) => (*path, Some(value.clone())),
        Remove(path) => (*path, None),
    };
    let mut keys: Vec<&str> = path.split('.').collect();
    let last = keys.pop().expect("a non-empty path");
    let mut node = doc;
    for key in keys {
        node = node
            .get_mut(key)
            .unwrap_or_else(|| panic!("{path}: no {key} in the baseline"));
    }
    let object = node.as_object_mut().expect("edit inside an object");
    match value {
        Some(v) => {
            object.insert(last.to_string(), v);
        }
        None => {
            object
                .remove(last)
                .unwrap_or_else(|| panic!("{path}: nothing to remove"));
        }
    }
}

#[tokio::test]
async fn the_baseline_policy_is_accepted() {
    let env = TestEnv::new("validation-ok").await.expect("test env");
    for (mode, extra) in [
        ("client-side", None),
        ("server-side", Some("--server-side")),
    ] {
        let name = format!("baseline-{mode}");
        let doc = baseline(&name).to_string();
        let mut args = vec!["apply", "-f", "-"];
        args.extend(extra);
        let out = env.kubectl_stdin(args, &doc).expect("run kubectl");
        assert!(
            out.success(),
            "{mode}: the baseline was rejected:\n{}",
            out.stderr
        );
    }
}

#[tokio::test]
async fn invalid_policies_are_rejected_naming_the_field() {
    let env = TestEnv::new("validation-bad").await.expect("test env");
    let cases = cases();
    assert!(cases.len() >= 10);
    let mut failures = Vec::new();

    for case in &cases {
        let mut doc = baseline(case.name);
        for edit in &case.edits {
            apply_edit(&mut doc, edit);
        }
        let doc = doc.to_string();
        for (mode, extra) in [
            ("client-side", None),
            ("server-side", Some("--server-side")),
        ] {
            let mut args = vec!["apply", "-f", "-"];
            args.extend(extra);
            let out = env.kubectl_stdin(args, &doc).expect("run kubectl");
            let text = format!("{}{}", out.stdout, out.stderr);
            if out.success() {
                failures.push(format!("{} ({mode}): accepted:\n  {doc}", case.name));
                // Remove it so the other mode starts from scratch.
                let _ = env.kubectl(["delete", "retrypolicy", case.name, "--wait=false"]);
                continue;
            }
            if !(text.contains("Error from server") || text.contains(" is invalid")) {
                failures.push(format!(
                    "{} ({mode}): not rejected by the API server:\n  {}",
                    case.name,
                    text.trim()
                ));
                continue;
            }
            let missing: Vec<_> = case.expect.iter().filter(|e| !text.contains(**e)).collect();
            if !missing.is_empty() {
                failures.push(format!(
                    "{} ({mode}): message lacks {missing:?}:\n  {}",
                    case.name,
                    text.trim()
                ));
            }
        }
    }

    // Nothing of it was stored.
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.namespace, &retry_policy_resource());
    let stored = api
        .list(&ListParams::default())
        .await
        .expect("list RetryPolicies");
    let names: Vec<_> = stored
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    if !names.is_empty() {
        failures.push(format!("stored despite errors: {names:?}"));
    }

    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
}
