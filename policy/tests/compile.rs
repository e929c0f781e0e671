//! Compiling a namespace: conflicts, precedence, hashing and reading the document back.

use rebound_policy::{
    PolicyOutcome, PolicySource, PolicyTable, PreparedPolicy, compile,
    compiled::{CompiledDocument, DocumentError, LostQueue},
    manifest::parse_manifests,
    simulate,
};

fn source(name: &str, created: i64, queues: &[&str]) -> PolicySource {
    let yaml = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {name}}}\nspec: {{queues: [{}]}}\n",
        queues
            .iter()
            .map(|q| format!("{q:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let doc = parse_manifests(&yaml).expect("YAML").remove(0);
    let (policy, _) = doc.result.expect("valid");
    PolicySource {
        name: name.into(),
        namespace: "shop".into(),
        uid: format!("uid-{name}"),
        generation: 1,
        created: Some(created),
        spec: policy.spec,
    }
}

#[test]
fn same_pattern_goes_to_the_older_policy_and_the_loser_is_told() {
    let c = compile(
        "shop",
        vec![
            source("young", 200, &["emails", "sms"]),
            source("old", 100, &["emails"]),
        ],
    );
    assert_eq!(
        c.outcome("young"),
        Some(&PolicyOutcome::Compiled {
            serving: vec!["sms".into()],
            lost: vec![LostQueue {
                pattern: "emails".into(),
                winner: "old".into()
            }],
        })
    );
    let table = PolicyTable::new(&c.document);
    assert_eq!(table.lookup("emails").map(|e| e.name()), Some("old"));
    assert_eq!(table.lookup("sms").map(|e| e.name()), Some("young"));
}

#[test]
fn ties_on_age_go_to_the_name_that_sorts_first() {
    let c = compile(
        "shop",
        vec![source("b", 100, &["q"]), source("a", 100, &["q"])],
    );
    assert_eq!(
        PolicyTable::new(&c.document).lookup("q").map(|e| e.name()),
        Some("a")
    );
}

#[test]
fn exact_beats_glob_and_longer_prefix_beats_shorter() {
    let c = compile(
        "shop",
        vec![
            source("catch-all", 1, &["*"]),
            source("emails", 5, &["email*"]),
            source("eu-emails", 9, &["email.eu*"]),
            source("receipts", 9, &["email.eu.receipts"]),
        ],
    );
    let t = PolicyTable::new(&c.document);
    let who = |q: &str| t.lookup(q).map(|e| e.name().to_owned());
    assert_eq!(who("email.eu.receipts").as_deref(), Some("receipts"));
    assert_eq!(who("email.eu.promo").as_deref(), Some("eu-emails"));
    assert_eq!(who("email.us").as_deref(), Some("emails"));
    assert_eq!(who("video").as_deref(), Some("catch-all"));
}

#[test]
fn unknown_queue_without_catch_all_has_no_policy() {
    let c = compile("shop", vec![source("a", 1, &["emails"])]);
    assert!(PolicyTable::new(&c.document).lookup("sms").is_none());
}

#[test]
fn invalid_policies_are_left_out_and_the_rest_compiles() {
    let mut bad = source("bad", 1, &["x"]);
    bad.spec.max_attempts = Some(0);
    let c = compile("shop", vec![bad, source("good", 2, &["y"])]);
    assert!(
        matches!(c.outcome("bad"), Some(PolicyOutcome::Invalid(e)) if e[0].field == "spec.maxAttempts")
    );
    assert_eq!(c.document.policies.len(), 1);
}

#[test]
fn hash_is_deterministic_and_independent_of_input_order() {
    let a = compile("shop", vec![source("a", 1, &["x"]), source("b", 2, &["y"])]);
    let b = compile("shop", vec![source("b", 2, &["y"]), source("a", 1, &["x"])]);
    assert_eq!(a.document.hash, b.document.hash);
    let mut changed = source("b", 2, &["y"]);
    changed.generation = 2;
    let c = compile("shop", vec![source("a", 1, &["x"]), changed]);
    assert_ne!(a.document.hash, c.document.hash);
}

#[test]
fn document_round_trips_and_rejects_tampering() {
    let doc = compile("shop", vec![source("a", 1, &["x"])]).document;
    let json = doc.to_json();
    assert_eq!(
        CompiledDocument::from_json(json.as_bytes()).expect("reads back"),
        doc
    );

    let tampered = json.replace("\"maxAttempts\":10", "\"maxAttempts\":11");
    assert!(matches!(
        CompiledDocument::from_json(tampered.as_bytes()),
        Err(DocumentError::Hash { .. })
    ));
    let future = json.replace("compiled-policies/v1", "compiled-policies/v9");
    assert!(matches!(
        CompiledDocument::from_json(future.as_bytes()),
        Err(DocumentError::Format { .. })
    ));
    assert!(matches!(
        CompiledDocument::from_json(&json.as_bytes()[..json.len() / 2]),
        Err(DocumentError::Parse(_))
    ));
}

#[test]
fn document_with_impossible_parameters_is_rejected_even_with_a_valid_hash() {
    let mut doc = compile("shop", vec![source("a", 1, &["x"])]).document;
    doc.policies[0].params.cap_ms = 1;
    doc.policies[0].params.base_ms = 10;
    let resealed = CompiledDocument::new("shop", doc.policies);
    let err = CompiledDocument::from_json(resealed.to_json().as_bytes()).expect_err("rejected");
    assert!(err.to_string().contains("capMs"), "{err}");
}

#[test]
fn simulation_gives_up_after_max_attempts_with_the_sum_of_delays() {
    let c = compile("shop", vec![source("a", 1, &["x"])]);
    let t = PolicyTable::new(&c.document);
    let entry = t.lookup("x").expect("policy");
    let policy = PreparedPolicy::new(entry.identity(), entry.resolved());
    let s = simulate(&policy, 2_000, 7, true);
    assert_eq!(s.retries.len(), 9, "10 attempts = 9 retries");
    assert_eq!(s.give_up_reasons.max_attempts, 2_000);
    // Full jitter on 1s,2s,…,256s: each retry's mean is half its capped delay.
    for r in &s.retries {
        let nominal = 1_000.0 * 2f64.powi(r.retry as i32 - 1);
        assert!(
            (r.mean_ms / (nominal / 2.0) - 1.0).abs() < 0.1,
            "retry {}: mean {}",
            r.retry,
            r.mean_ms
        );
        assert!(r.max_ms as f64 <= nominal);
    }
    let total_nominal = 511_000.0;
    assert!(s.give_up_after_ms.max as f64 <= total_nominal);
    assert!((s.give_up_after_ms.p50 as f64 / (total_nominal / 2.0) - 1.0).abs() < 0.1);
    assert_eq!(
        simulate(&policy, 2_000, 7, true),
        s,
        "same seed, same figures"
    );
}

/// A newer writer may add fields this build does not know: readers ignore them (see
/// docs/compiled-format.md), and the hash still covers the bytes as written.
#[test]
fn documents_with_fields_from_a_newer_writer_are_read() {
    use rebound_policy::CompiledDocument;
    let policies = r#"[{"name":"p","namespace":"ns","uid":"u","generation":2,"queues":["q"],"priority":7,"params":{"strategy":"constant","baseMs":1000,"multiplier":1.0,"capMs":1000,"jitter":"none","jitterRatio":0.0,"maxAttempts":3,"terminal":{"action":"deadLetter","deadLetterQueue":"dlq","retainFor":"7d"},"spreadAcrossZones":true}}]"#;
    let hash = {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(policies.as_bytes());
        format!(
            "sha256:{}",
            digest
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )
    };
    let doc = format!(
        r#"{{"format":"rebound.dev/compiled-policies/v1","namespace":"ns","hash":"{hash}","writtenBy":"rebound-operator 9.9","policies":{policies}}}"#
    );
    let read = CompiledDocument::from_json(doc.as_bytes()).expect("tolerant read");
    assert_eq!(read.policies.len(), 1);
    assert_eq!(read.policies[0].params.max_attempts, 3);
    assert_eq!(read.hash, hash);
}

/// Delays the user wrote out exactly stay exact unless a jitter is asked for.
#[test]
fn schedule_and_constant_default_to_no_jitter() {
    use rebound_policy::{
        resolve,
        spec::{Backoff, JitterKind, RetryPolicySpec, Strategy},
    };
    let resolved = |strategy: Strategy, schedule: Option<Vec<&str>>| {
        let spec = RetryPolicySpec {
            queues: vec!["q".into()],
            backoff: Some(Backoff {
                strategy: Some(strategy),
                schedule: schedule.map(|s| {
                    s.iter()
                        .map(|d| rebound_policy::KubeDuration::parse(d).expect("duration"))
                        .collect()
                }),
                ..Default::default()
            }),
            max_attempts: None,
            max_retry_duration: None,
            non_retryable_errors: vec![],
            terminal: None,
            retry_budget: None,
            rollout: None,
        };
        resolve(&spec).expect("valid").jitter
    };
    assert_eq!(
        resolved(Strategy::Schedule, Some(vec!["1m", "5m", "30m"])),
        JitterKind::None
    );
    assert_eq!(resolved(Strategy::Constant, None), JitterKind::None);
    assert_eq!(resolved(Strategy::Exponential, None), JitterKind::Full);
    assert_eq!(resolved(Strategy::Linear, None), JitterKind::Full);
}

/// `webhooks-**` means `webhooks-*`: a newer policy declaring it conflicts with the older
/// one instead of silently serving nothing while reporting Ready.
#[test]
fn equivalent_patterns_conflict() {
    use rebound_policy::{
        PolicyOutcome, PolicySource, compile, compiled::LostQueue, spec::RetryPolicySpec,
    };
    let source = |name: &str, created: i64, queue: &str| PolicySource {
        name: name.to_owned(),
        namespace: "ns".to_owned(),
        uid: String::new(),
        generation: 1,
        created: Some(created),
        spec: RetryPolicySpec {
            queues: vec![queue.to_owned(), format!("{name}-own")],
            backoff: None,
            max_attempts: None,
            max_retry_duration: None,
            non_retryable_errors: vec![],
            terminal: None,
            retry_budget: None,
            rollout: None,
        },
    };
    let compilation = compile(
        "ns",
        vec![
            source("old", 1, "webhooks-*"),
            source("new", 2, "webhooks-**"),
        ],
    );
    assert_eq!(
        compilation.outcome("new"),
        Some(&PolicyOutcome::Compiled {
            serving: vec!["new-own".to_owned()],
            lost: vec![LostQueue {
                pattern: "webhooks-**".to_owned(),
                winner: "old".to_owned(),
            }],
        })
    );
    // Within one policy they are one pattern written twice, as the API server accepts
    // them: valid, served once, lost to nobody.
    let mut one = source("x", 1, "a*");
    one.spec.queues = vec!["a*".into(), "a**".into()];
    let compilation = compile("ns", vec![one]);
    assert_eq!(
        compilation.outcome("x"),
        Some(&PolicyOutcome::Compiled {
            serving: vec!["a*".to_owned()],
            lost: vec![],
        })
    );
    assert_eq!(compilation.document.policies[0].queues, ["a*"]);
}

/// A retry budget travels in the compiled document as `retryBudget` with its default
/// burst applied; a policy without one writes exactly what it wrote before (no key), and a
/// document with an out-of-range budget is refused naming the field.
#[test]
fn retry_budgets_are_compiled_and_checked_on_read() {
    use rebound_policy::resolve::RetryBudget;
    let yaml = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: b}\nspec: {queues: [q], retryBudget: {ratePerSecond: 10}}\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: plain}\nspec: {queues: [p]}\n";
    let sources: Vec<PolicySource> = parse_manifests(yaml)
        .expect("YAML")
        .into_iter()
        .map(|d| PolicySource::from_object(&d.result.expect("valid").0, "ns"))
        .collect();
    let doc = compile("ns", sources).document;
    let json = doc.to_json();
    let value: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(
        value["policies"][0]["params"]["retryBudget"],
        serde_json::json!({"ratePerSecond": 10, "burst": 1})
    );
    assert!(value["policies"][1]["params"].get("retryBudget").is_none());
    let read = CompiledDocument::from_json(json.as_bytes()).expect("reads back");
    assert_eq!(
        read.policies[0].params.retry_budget,
        Some(RetryBudget {
            rate_per_second: 10,
            burst: 1
        })
    );

    let bad = json.replace(r#""burst":1"#, r#""burst":0"#);
    let mut bad_value: serde_json::Value = serde_json::from_str(&bad).expect("JSON");
    let policies = bad_value["policies"].to_string();
    let hash = {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(policies.as_bytes());
        format!(
            "sha256:{}",
            digest
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )
    };
    bad_value["hash"] = serde_json::Value::String(hash);
    let err = CompiledDocument::from_json(bad_value.to_string().as_bytes()).unwrap_err();
    match err {
        DocumentError::Policy { error, .. } => assert_eq!(error.field, "retryBudget.burst"),
        other => panic!("expected a policy error, got {other}"),
    }
}

mod lookup_oracle {
    //! The table's lookup (exact names hashed, globs indexed by literal prefix) against a
    //! scan of every pattern of the compiled document, on random documents.

    use proptest::{prelude::*, test_runner::RngSeed};
    use rebound_policy::{
        PolicyTable, compile,
        pattern::{Specificity, matches, normalize},
    };

    /// The policy a scan picks: an exact name (the first policy listing it), else the
    /// most specific matching glob, the earlier policy on a tie.
    fn scan(doc: &rebound_policy::CompiledDocument, queue: &str) -> Option<String> {
        let listed = doc.policies.iter().enumerate().flat_map(|(i, p)| {
            p.queues
                .iter()
                .map(move |q| (q.as_str(), i, p.name.as_str()))
        });
        let exact = listed
            .clone()
            .find(|(q, ..)| !q.contains('*') && *q == queue);
        let best = exact.or_else(|| {
            listed
                .filter(|(q, ..)| q.contains('*') && matches(q, queue))
                .min_by_key(|&(q, i, _)| (std::cmp::Reverse(Specificity::of(q)), i))
        });
        best.map(|(.., name)| name.to_owned())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 512,
            rng_seed: RngSeed::Fixed(0x10_0c_ab),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]
        #[test]
        fn lookup_agrees_with_a_scan_of_every_pattern(
            policies in prop::collection::vec(
                prop::collection::vec("[ab*][ab.*]{0,5}", 1..4), 1..10),
            queues in prop::collection::vec("[ab.]{0,8}", 1..24),
        ) {
            let sources = policies
                .iter()
                .enumerate()
                .map(|(i, queues)| {
                    // Distinct after normalisation, as a valid policy's are.
                    let queues: std::collections::BTreeSet<String> =
                        queues.iter().map(|q| normalize(q).into_owned()).collect();
                    let queues: Vec<&str> = queues.iter().map(String::as_str).collect();
                    super::source(&format!("p{i}"), i as i64, &queues)
                })
                .collect();
            let doc = compile("ns", sources).document;
            let table = PolicyTable::new(&doc);
            for queue in &queues {
                let found = table.lookup(queue).map(|e| e.name().to_owned());
                prop_assert_eq!(found, scan(&doc, queue), "queue {:?}", queue);
            }
        }
    }
}
