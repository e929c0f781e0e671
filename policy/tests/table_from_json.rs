//! The table read straight from a document's JSON: it indexes what the document reader
//! reads, with escapes read as their characters, and refuses every document the document
//! reader refuses with the same error.

mod support;

use rebound_policy::{
    CompiledDocument, CompiledPolicy, Context, PolicyTable, PreparedPolicy,
    compiled::{CompiledRollout, DocumentError, FORMAT},
    decide,
    digest::sha256_id,
    rollout::assign::{Step, revision_id},
    spec::{JitterKind, Strategy},
};
use support::params_with_errors;

/// A document around `policies` (JSON text) whose hash matches it.
fn sealed(policies: &str) -> String {
    format!(
        r#"{{"format":"{FORMAT}","namespace":"bench","hash":"{}","policies":{policies}}}"#,
        sha256_id(policies.as_bytes())
    )
}

fn mixed() -> CompiledDocument {
    let rollout = CompiledRollout {
        revision: revision_id(&params_with_errors(vec![])),
        stable_revision: revision_id(&params_with_errors(vec!["E".into()])),
        canary: params_with_errors(vec![]),
        steps: vec![Step {
            weight: 10,
            start_unix_ms: 1_800_000_000_000,
        }],
    };
    let policies = (0..40)
        .map(|i| CompiledPolicy {
            name: format!("p{i}"),
            namespace: "bench".to_owned(),
            uid: format!("u{i}"),
            generation: i,
            queues: vec![format!("q{i}"), format!("g{}.*", i % 7), "*".to_owned()],
            params: params_with_errors(vec![format!("E{i}"), "Timeout.*".to_owned()]),
            rollout: (i % 5 == 0).then(|| rollout.clone()),
        })
        .collect();
    CompiledDocument::new("bench", policies)
}

/// What a table answers with, entry by entry and for a few queues.
fn answers(table: &PolicyTable) -> Vec<String> {
    let mut seen = vec![format!(
        "{} {} {}",
        table.namespace(),
        table.hash(),
        table.len()
    )];
    for e in table.entries() {
        let rollout = e.rollout.as_ref().map(|r| {
            (
                r.canary.clone(),
                r.exposure.clone(),
                r.stable_revision.clone(),
            )
        });
        seen.push(format!(
            "{} {} {} {} {:?} {rollout:?}",
            e.namespace(),
            e.name(),
            e.generation,
            e.identity(),
            e.resolved()
        ));
    }
    for q in ["q3", "g3.x", "g4.", "nothing", "q39", "A-q", "gx"] {
        seen.push(format!("{q} {:?}", table.position(q)));
    }
    seen
}

#[test]
fn the_table_holds_what_the_document_reader_reads() {
    let json = mixed().to_json();
    let table = PolicyTable::from_json(json.as_bytes()).expect("valid");
    let doc = CompiledDocument::from_json(json.as_bytes()).expect("valid");
    assert_eq!(table.namespace(), "bench");
    assert_eq!(table.hash(), doc.hash);
    assert_eq!(answers(&table), answers(&PolicyTable::from_document(doc)));
}

#[test]
fn escaped_names_and_patterns_are_read_as_their_characters() {
    let params = serde_json::to_string(&params_with_errors(vec![])).expect("json");
    let json = sealed(&format!(
        r#"[{{"name":"p\u0031","namespace":"b\u0065nch","queues":["\u0041-q","g\u002a"],"params":{params}}}]"#
    ));
    let table = PolicyTable::from_json(json.as_bytes()).expect("valid");
    let entry = table.lookup("A-q").expect("the escaped queue");
    assert_eq!((entry.namespace(), entry.name()), ("bench", "p1"));
    assert_eq!(entry.identity(), "bench/p1");
    assert_eq!(table.position("gx"), Some(0), "\\u002a is a star");
    let doc = CompiledDocument::from_json(json.as_bytes()).expect("valid");
    assert_eq!(answers(&table), answers(&PolicyTable::from_document(doc)));
}

/// An error as both readers must agree on it, field by field.
#[derive(Debug, PartialEq)]
enum Refusal {
    Parse {
        category: serde_json::error::Category,
        line: usize,
        column: usize,
        message: String,
    },
    Format(String),
    Hash(String, String),
    Policy(String, String, String),
}

fn refusal(e: DocumentError) -> Refusal {
    match e {
        DocumentError::Parse(e) => Refusal::Parse {
            category: e.classify(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        },
        DocumentError::Format { found } => Refusal::Format(found),
        DocumentError::Hash { stated, actual } => Refusal::Hash(stated, actual),
        DocumentError::Policy { policy, error } => {
            Refusal::Policy(policy, error.field, error.message)
        }
    }
}

/// Both readers on `json`: both refuse it alike, or both accept it and index the same.
fn alike(json: &str) -> Option<Refusal> {
    let table = PolicyTable::from_json(json.as_bytes());
    let doc = CompiledDocument::from_json(json.as_bytes());
    match (table, doc) {
        (Ok(table), Ok(doc)) => {
            assert_eq!(answers(&table), answers(&PolicyTable::from_document(doc)));
            None
        }
        (Err(t), Err(d)) => {
            let (t, d) = (refusal(t), refusal(d));
            assert_eq!(t, d, "{json}");
            Some(t)
        }
        (t, d) => panic!("{json}: table {:?}, document {:?}", t.err(), d.err()),
    }
}

#[test]
fn malformed_documents_are_refused_with_the_document_readers_error() {
    let p = serde_json::to_string(&params_with_errors(vec!["E".into()])).expect("json");
    let bad = r#"{"strategy":"exponential","baseMs":0,"multiplier":2.0,"capMs":1000,"jitter":"full","jitterRatio":0.0,"maxAttempts":3,"terminal":{"action":"drop"}}"#;
    let obj = |fields: &str| format!(r#"{{"name":"a","namespace":"n","queues":["q"],{fields}}}"#);
    let ok = |fields: &str| format!("[{}]", obj(fields));
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    let cases: Vec<(String, bool)> = vec![
        // Wrong types.
        (
            format!(r#"[{{"name":5,"namespace":"n","queues":["q"],"params":{p}}}]"#),
            true,
        ),
        (
            format!(r#"[{{"name":"a","namespace":"n","queues":"q","params":{p}}}]"#),
            true,
        ),
        (
            format!(r#"[{{"name":"a","namespace":"n","queues":[1],"params":{p}}}]"#),
            true,
        ),
        (ok(r#""params":"x""#), true),
        (ok(&format!(r#""params":{p},"uid":null"#)), true),
        (ok(&format!(r#""params":{p},"uid":7"#)), true),
        (ok(&format!(r#""params":{p},"generation":"1""#)), true),
        (r#"{"a":1}"#.to_owned(), true),
        (r#"["a"]"#.to_owned(), true),
        // Duplicate keys.
        (
            format!(r#"[{{"name":"a","name":"b","namespace":"n","queues":["q"],"params":{p}}}]"#),
            true,
        ),
        (ok(&format!(r#""params":{p},"queues":["r"]"#)), true),
        (ok(&format!(r#""params":{p},"params":{p}"#)), true),
        (
            ok(&format!(r#""params":{p},"rollout":null,"rollout":null"#)),
            true,
        ),
        // Huge numbers.
        (
            ok(&format!(
                r#""params":{p},"generation":99999999999999999999"#
            )),
            true,
        ),
        (ok(&format!(r#""params":{p},"generation":1e400"#)), true),
        // Deep nesting: skipped in a field nobody reads, refused where read.
        (ok(&format!(r#""params":{p},"extra":{deep}"#)), false),
        (ok(&format!(r#""params":{p},"rollout":{deep}"#)), true),
        (deep.clone(), true),
        // Missing fields, and the derived form as an array.
        (
            format!(r#"[{{"name":"a","namespace":"n","params":{p}}}]"#),
            true,
        ),
        (
            r#"[{"name":"a","namespace":"n","queues":["q"]}]"#.to_owned(),
            true,
        ),
        (format!(r#"[["a","n","u",3,["q"],{p}]]"#), false),
        (r#"[["a","n"]]"#.to_owned(), true),
        (format!(r#"[["a","n","u",3,["q"],{p},null,1]]"#), true),
        // Escapes: a lone surrogate, an escaped key.
        (
            format!(r#"[{{"name":"\ud800","namespace":"n","queues":["q"],"params":{p}}}]"#),
            true,
        ),
        (
            format!(r#"[{{"n\u0061me":"a","namespace":"n","queues":["q"],"params":{p}}}]"#),
            false,
        ),
        // Checks: the first failing policy, named with its field; a parse error after a
        // failing policy still wins.
        (
            format!(
                "[{},{}]",
                obj(&format!(r#""params":{p}"#)),
                obj(&format!(r#""params":{bad}"#))
            ),
            true,
        ),
        (
            format!(r#"[{{"name":"a","namespace":"n","queues":["q","Q!"],"params":{p}}}]"#),
            true,
        ),
        (
            format!(r#"[{},{{"name":5}}]"#, obj(&format!(r#""params":{bad}"#))),
            true,
        ),
        (
            ok(&format!(
                r#""params":{p},"rollout":{{"revision":"x","stableRevision":"y","canary":{p}}}"#
            )),
            true,
        ),
        // Accepted: unknown fields, a null rollout, an empty document.
        (
            ok(&format!(
                r#""params":{p},"extra":{{"a":[1,2]}},"rollout":null"#
            )),
            false,
        ),
        ("[]".to_owned(), false),
    ];
    for (policies, refused) in cases {
        assert_eq!(alike(&sealed(&policies)).is_some(), refused, "{policies}");
    }
    // The envelope: format, hash, its own duplicate keys, bytes after it.
    let json = sealed(&ok(&format!(r#""params":{p}"#)));
    for envelope in [
        json.replace(FORMAT, "rebound.dev/compiled-policies/v9"),
        json.replace(r#""hash":"sha256:"#, r#""hash":"sha256:0"#),
        json.replacen(
            r#""namespace":"bench","#,
            r#""namespace":"bench","namespace":"x","#,
            1,
        ),
        format!("{json} x"),
        json[..json.len() / 2].to_owned(),
    ] {
        assert!(alike(&envelope).is_some(), "{envelope}");
    }
    assert!(matches!(
        alike(&json.replace(FORMAT, "v9")),
        Some(Refusal::Format(_))
    ));
}

/// A table entry keeps its texts and schedule in the table's shared blocks: it gives
/// back the parameters it was read from and decides as the policy prepared from them.
#[test]
fn an_entry_decides_as_its_prepared_policy() {
    let mut scheduled = params_with_errors(vec!["Fatal*".into(), "E.*.x".into()]);
    scheduled.strategy = Strategy::Schedule;
    scheduled.schedule_ms = vec![300, 50, 7_000];
    scheduled.jitter = JitterKind::None;
    let policies = [params_with_errors(vec![]), scheduled]
        .into_iter()
        .enumerate()
        .map(|(i, params)| CompiledPolicy {
            name: format!("p{i}"),
            namespace: "bench".to_owned(),
            uid: String::new(),
            generation: 1,
            queues: vec![format!("q{i}")],
            params,
            rollout: None,
        })
        .collect();
    let doc = CompiledDocument::new("bench", policies);
    let table = PolicyTable::from_json(doc.to_json().as_bytes()).expect("valid");
    for (entry, written) in table.entries().iter().zip(&doc.policies) {
        assert_eq!(entry.resolved(), written.params);
        let prepared = PreparedPolicy::new(written.identity(), written.params.clone());
        for (attempt, class) in (0..12).zip(["", "Fatal", "E.1.x", "E.1.y"].iter().cycle()) {
            let ctx = Context {
                job_id: Some("job-7"),
                error_class: (!class.is_empty()).then_some(*class),
                ..Context::default()
            };
            assert_eq!(
                decide(entry, attempt, &ctx),
                decide(&prepared, attempt, &ctx),
                "{} attempt {attempt} class {class:?}",
                entry.identity()
            );
        }
    }
}
