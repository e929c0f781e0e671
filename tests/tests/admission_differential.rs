//! One verdict for every input: policies generated near every edge from a fixed seed
//! (patterns equal after normalisation, each limit at and just past it, durations, globs,
//! budgets, rules between fields, rollouts), each sent to the real kube-apiserver as a server-side
//! dry-run create and to the validator `rebound validate` runs
//! (`rebound_policy::manifest::parse_manifests`). Both must accept, or both refuse naming
//! the same field path.

use std::collections::BTreeSet;

use kube::{
    Api,
    api::{DynamicObject, PostParams},
    core::{ApiResource, GroupVersionKind},
};
use rebound_policy::manifest::parse_manifests;
use rebound_tests::TestEnv;
use serde_json::{Value, json};

/// A fixed seed: the same cases on every run.
type Rng = rebound_policy::decide::SplitMix64;

const NAME_CHARS: &[u8] = b"abcXYZ019._:/@-*";

/// A name or pattern of `len` characters from the grammar (first not `.`, `_` ...).
fn name(rng: &mut Rng, len: usize) -> String {
    let mut s = String::new();
    s.push(char::from(*rng.pick(b"aZ9*")));
    while s.len() < len {
        s.push(char::from(*rng.pick(NAME_CHARS)));
    }
    s
}

/// Lists near their limits: length, entry length, characters, duplicates exact and after
/// normalisation.
fn lists(rng: &mut Rng, max: usize) -> Vec<Value> {
    let mut out: Vec<Value> = [
        json!(["jobs-*", "jobs-**"]),
        json!(["*", "**"]),
        json!(["a**b", "a*b", "a***b"]),
        json!(["a", "a"]),
        json!(["a", "b", "a", "a"]),
        json!(["-a"]),
        json!([".a"]),
        json!(["a b"]),
        json!(["a!"]),
        json!([""]),
        json!(["é"]),
        json!([]),
    ]
    .to_vec();
    for len in [252, 253, 254] {
        out.push(json!([name(rng, len)]));
    }
    for count in [max, max + 1] {
        let items: BTreeSet<String> = (0..count)
            .map(|i| format!("n{i}-{}", rng.below(9)))
            .collect();
        out.push(json!(items));
    }
    for _ in 0..6 {
        let len = 1 + rng.below(6) as usize;
        let a = name(rng, len);
        out.push(json!([a.clone(), a.replace('*', "**")]));
    }
    out
}

/// Durations near both bounds, the length limit, fraction digits, and bad grammar.
fn durations(rng: &mut Rng) -> Vec<String> {
    let mut out: Vec<String> = [
        "1ms",
        "0.999999999ms",
        "1.000000001ms",
        "0.9999999999ms",
        "8760h",
        "8760h1ms",
        "8759h59m59.999999999s",
        "8760h0.000000001s",
        "525600m",
        "0s",
        "1d",
        "-1s",
        "1us",
        "1.s",
        ".5s",
        "1",
        "0.9999999999999999s",
        "1h30m",
        "01.10s",
    ]
    .map(String::from)
    .to_vec();
    out.push(format!("{}ms", "1".repeat(30))); // 32 characters
    out.push(format!("{}ms", "0".repeat(30) + "1")); // 33
    for _ in 0..8 {
        let digits = 1 + rng.below(12) as usize;
        let frac: String = (0..digits)
            .map(|_| char::from(b'0' + rng.below(10) as u8))
            .collect();
        let unit = *rng.pick(&["ms", "s", "m", "h"]);
        out.push(format!("{}.{frac}{unit}", rng.below(3)));
    }
    out
}

/// Every case: a spec with (mostly) one thing at an edge.
fn specs() -> Vec<Value> {
    let mut rng = Rng::new(0x0038_ad31);
    let mut out = Vec::new();
    for list in lists(&mut rng, 64) {
        out.push(json!({"queues": list}));
        out.push(json!({"queues": ["q"], "nonRetryableErrors": list}));
    }
    for d in durations(&mut rng) {
        out.push(json!({"queues": ["q"], "backoff": {"base": d, "cap": "8760h"}}));
        out.push(json!({"queues": ["q"], "backoff": {"base": "1ms", "cap": d}}));
        out.push(json!({"queues": ["q"], "maxRetryDuration": d}));
        out.push(
            json!({"queues": ["q"], "backoff": {"strategy": "schedule", "schedule": ["1ms", d]}}),
        );
    }
    // cap against base, schedule against cap, to the nanosecond.
    for (base, cap) in [
        ("1s", "1s"),
        ("1.000000001s", "1s"),
        ("1s", "0.999999999s"),
        ("60m", "1h"),
        ("1h0.000000001s", "1h"),
        ("1s", "0.9999999999999999s"),
    ] {
        out.push(json!({"queues": ["q"], "backoff": {"base": base, "cap": cap}}));
        out.push(json!({"queues": ["q"], "backoff": {"strategy": "schedule", "schedule": [base], "cap": cap}}));
    }
    for n in [0, 1, 10_000, 10_001, -1] {
        out.push(json!({"queues": ["q"], "maxAttempts": n}));
    }
    for m in [0.5, 1.0, 2.5, 100.0, 100.000_001] {
        out.push(json!({"queues": ["q"], "backoff": {"multiplier": m}}));
        out.push(json!({"queues": ["q"], "backoff": {"strategy": "linear", "multiplier": m}}));
    }
    for s in [101, 100] {
        let schedule: Vec<&str> = vec!["1ms"; s];
        out.push(
            json!({"queues": ["q"], "backoff": {"strategy": "schedule", "schedule": schedule}}),
        );
    }
    out.push(json!({"queues": ["q"], "backoff": {"strategy": "schedule"}}));
    out.push(json!({"queues": ["q"], "backoff": {"schedule": ["1s"]}}));
    out.push(json!({"queues": ["q"], "backoff": {"strategy": "schedule", "schedule": ["1s"], "base": "1s"}}));
    out.push(json!({"queues": ["q"], "backoff": {"strategy": "decorrelated", "jitter": {"kind": "full"}}}));
    for (kind, ratio) in [
        ("proportional", json!(0)),
        ("proportional", json!(1)),
        ("proportional", json!(1.0001)),
        ("proportional", json!(0.5)),
        ("full", json!(0.5)),
        ("proportional", Value::Null),
    ] {
        let mut jitter = json!({"kind": kind});
        if !ratio.is_null() {
            jitter["ratio"] = ratio;
        }
        out.push(json!({"queues": ["q"], "backoff": {"jitter": jitter}}));
    }
    for terminal in [
        json!({"action": "deadLetter"}),
        json!({"action": "deadLetter", "deadLetterQueue": "dead-*"}),
        json!({"action": "deadLetter", "deadLetterQueue": "dead"}),
        json!({"action": "drop", "deadLetterQueue": "dead"}),
        json!({"action": "explode"}),
    ] {
        out.push(json!({"queues": ["q"], "terminal": terminal}));
    }
    // Budgets: each bound, and the slot at 1 ms and 60 s, at and just past.
    let mut budgets = vec![
        json!({"ratePerSecond": 0}),
        json!({"ratePerSecond": 1}),
        json!({"ratePerSecond": 100_000, "burst": 100}),
        json!({"ratePerSecond": 100_001, "burst": 101}),
        json!({"ratePerSecond": 1_000, "burst": 0}),
        json!({"ratePerSecond": 100_000, "burst": 100_000}),
        json!({"ratePerSecond": 100_000, "burst": 100_001}),
        json!({"burst": 1}),
    ];
    for _ in 0..8 {
        let burst = 1 + rng.below(1_000);
        budgets.push(json!({"ratePerSecond": burst * 1_000, "burst": burst}));
        budgets.push(json!({"ratePerSecond": burst * 1_000 + 1, "burst": burst}));
        let rate = 1 + rng.below(1_000);
        budgets.push(json!({"ratePerSecond": rate, "burst": rate * 60}));
        budgets.push(json!({"ratePerSecond": rate, "burst": rate * 60 + 1}));
    }
    for b in budgets {
        out.push(json!({"queues": ["q"], "retryBudget": b}));
    }
    for rollout in rollouts(&mut rng) {
        out.push(json!({"queues": ["q"], "rollout": rollout}));
    }
    out
}

/// `spec.rollout`: step counts, weights and their order, durations and the rule between
/// them, every analysis bound at and just past it.
fn rollouts(rng: &mut Rng) -> Vec<Value> {
    let steps = |weights: &[i64]| -> Value {
        weights
            .iter()
            .map(|w| json!({"weight": w}))
            .collect::<Vec<_>>()
            .into()
    };
    let mut out = vec![
        json!({"steps": [{"weight": 10, "pause": "10m"}, {"weight": 50, "pause": "30m"}],
               "analysis": {"minFailedJobs": 200, "maxRelativeIncrease": 0.2}}),
        json!({"steps": []}),
        json!({"analysis": {}}),
        json!({}),
        json!(null),
        json!({"steps": [{"pause": "1m"}]}),
        json!({"steps": [{"weight": "10"}]}),
        json!({"steps": [{"weight": 12.5}]}),
        json!({"steps": [{"weight": 10}], "analysis": null}),
        json!({"steps": [{"weight": 10, "pause": null, "maxDuration": null}]}),
    ];
    for weights in [
        &[0][..],
        &[1],
        &[99],
        &[100],
        &[-1],
        &[1, 99],
        &[10, 10],
        &[50, 10],
        &[0, 0],
        &[10, 20, 30, 40, 50, 60, 70, 80, 90, 99],
        &[10, 20, 30, 40, 50, 60, 70, 80, 99, 90],
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
        &[11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1],
    ] {
        out.push(json!({"steps": steps(weights)}));
    }
    // Random ladders: mostly increasing, some with a repeat or a step down anywhere.
    for _ in 0..24 {
        let n = 1 + rng.below(10) as usize;
        let mut weights: Vec<i64> = (0..n).map(|_| 1 + rng.below(99) as i64).collect();
        if rng.below(2) == 0 {
            weights.sort_unstable();
            weights.dedup();
        }
        out.push(json!({"steps": steps(&weights)}));
    }
    for d in durations(rng) {
        out.push(json!({"steps": [{"weight": 10, "pause": d}]}));
        out.push(json!({"steps": [{"weight": 10}, {"weight": 20, "maxDuration": d}]}));
        out.push(json!({"steps": [{"weight": 10, "pause": d, "maxDuration": "1h"}]}));
        out.push(json!({"steps": [{"weight": 10, "pause": "1h", "maxDuration": d}]}));
    }
    for analysis in [
        json!({"maxRelativeIncrease": -0.1}),
        json!({"maxRelativeIncrease": 0}),
        json!({"maxRelativeIncrease": 10}),
        json!({"maxRelativeIncrease": 10.000_001}),
        json!({"alpha": 0}),
        json!({"alpha": 0.000_999}),
        json!({"alpha": 0.001}),
        json!({"alpha": 0.2}),
        json!({"alpha": 0.200_001}),
        json!({"alpha": 1}),
        json!({"minFailedJobs": 0}),
        json!({"minFailedJobs": 1}),
        json!({"minFailedJobs": 10_000_000}),
        json!({"minFailedJobs": 10_000_001}),
        json!({"minFailedJobs": -5}),
        json!({"minFailedJobs": 2_147_483_648_i64}),
        json!({"onInconclusive": "Pause"}),
        json!({"onInconclusive": "Abort"}),
        json!({"onInconclusive": "pause"}),
        json!({"onInconclusive": "Retry"}),
        json!({"alpha": 0.5, "minFailedJobs": 0, "maxRelativeIncrease": 11}),
    ] {
        out.push(json!({"steps": [{"weight": 10}], "analysis": analysis}));
    }
    out
}

fn policy(i: usize, spec: &Value) -> Value {
    json!({
        "apiVersion": "rebound.dev/v1alpha1",
        "kind": "RetryPolicy",
        "metadata": {"name": format!("edge-{i}")},
        "spec": spec,
    })
}

/// The field paths the core names, or `None` when it accepts.
fn core_verdict(doc: &Value) -> Option<BTreeSet<String>> {
    let mut docs = parse_manifests(&doc.to_string()).expect("JSON is YAML");
    match docs.remove(0).result {
        Ok(_) => None,
        Err(errors) => Some(errors.into_iter().map(|e| e.field).collect()),
    }
}

/// The field paths the API server's causes name, or `None` when it admits.
async fn api_verdict(api: &Api<DynamicObject>, doc: &Value) -> Option<BTreeSet<String>> {
    let object: DynamicObject = serde_json::from_value(doc.clone()).expect("an object");
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&params, &object).await {
        Ok(_) => None,
        Err(kube::Error::Api(status)) => Some(
            status
                .details
                .map(|d| d.causes.into_iter().map(|c| c.field).collect())
                .unwrap_or_default(),
        ),
        Err(e) => panic!("dry-run create: {e}"),
    }
}

#[tokio::test]
async fn admission_and_the_validator_agree_on_every_edge() {
    let env = TestEnv::new("verdict").await.expect("test environment");
    let gvk = GroupVersionKind::gvk("rebound.dev", "v1alpha1", "RetryPolicy");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "retrypolicies");
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.namespace, &resource);
    let specs = specs();
    assert!(specs.len() > 300, "{} cases", specs.len());
    let (mut refused, mut disagree) = (0, Vec::new());
    for (i, spec) in specs.iter().enumerate() {
        let doc = policy(i, spec);
        let api = api_verdict(&api, &doc).await;
        let core = core_verdict(&doc);
        let agree = match (&api, &core) {
            (None, None) => true,
            (Some(a), Some(c)) => {
                refused += 1;
                !a.is_disjoint(c)
            }
            _ => false,
        };
        if !agree {
            disagree.push(format!("{spec}\n    API: {api:?}\n    core: {core:?}"));
        }
    }
    eprintln!(
        "{} cases, {refused} refused by both, {} disagreements",
        specs.len(),
        disagree.len()
    );
    assert!(refused > 50, "cases cover refusals");
    assert!(
        disagree.is_empty(),
        "{} disagreements:\n{}",
        disagree.len(),
        disagree.join("\n")
    );
}
