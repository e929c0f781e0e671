//! The `rebound` binary as GitOps CI and people use it.

use std::process::{Command, Output};

use serde_json::Value;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn rebound(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(args)
        .current_dir(ROOT)
        .output()
        .expect("rebound runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

const EXAMPLES: [&str; 4] = [
    "examples/policies/webhooks.yaml",
    "examples/policies/email.yaml",
    "examples/policies/payments.yaml",
    "examples/policies/default.yaml",
];

#[test]
fn validate_accepts_the_examples() {
    let mut args = vec!["validate", "-f"];
    args.extend(EXAMPLES);
    let out = rebound(&args);
    assert!(out.status.success(), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("5 valid, 0 invalid"));
}

#[test]
fn validate_reports_file_document_field_and_message() {
    let out = rebound(&[
        "validate",
        "-f",
        "policy/tests/fixtures/invalid-policies.yaml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("policy/tests/fixtures/invalid-policies.yaml:1:spec.backoff.cap: cap must be at least base"),
        "{stdout}"
    );
    assert!(
        stdout.contains(":9:spec.terminal.deadLetterQueue: deadLetterQueue is required"),
        "{stdout}"
    );
    let documents: std::collections::BTreeSet<&str> =
        stdout.lines().filter_map(|l| l.split(':').nth(1)).collect();
    assert!(
        documents.len() >= 20,
        "every invalid document reported: {documents:?}"
    );
}

#[test]
fn errors_are_one_line_without_a_backtrace() {
    for args in [
        vec![
            "simulate",
            "-f",
            "policy/tests/fixtures/invalid-policies.yaml",
        ],
        vec![
            "simulate",
            "-f",
            "examples/policies/email.yaml",
            "--policy",
            "nope",
        ],
        vec![
            "ask",
            "-f",
            "examples/policies/payments.yaml",
            "--queue",
            "video",
            "--attempt",
            "1",
        ],
    ] {
        let out = rebound(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("rebound: ") && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
}

fn simulate_payments_json() -> Output {
    rebound(&[
        "simulate",
        "-f",
        "examples/policies/payments.yaml",
        "--samples",
        "2000",
        "--seed",
        "3",
        "-o",
        "json",
    ])
}

#[test]
fn simulate_json_keeps_its_contract() {
    let out = simulate_payments_json();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let policy = &json["policies"][0];
    assert_eq!(policy["name"], "payments");
    let retries = policy["retries"].as_array().expect("retries");
    assert_eq!(retries.len(), 7, "maxAttempts 8 → 7 retries");
    for (i, r) in retries.iter().enumerate() {
        assert_eq!(r["retry"], i + 1);
        for key in ["min_ms", "p50_ms", "p99_ms", "max_ms"] {
            assert!(r[key].is_u64(), "{key} in {r}");
        }
        assert!(r["mean_ms"].is_number());
        assert!(
            r["min_ms"].as_u64() <= r["p50_ms"].as_u64()
                && r["p99_ms"].as_u64() <= r["max_ms"].as_u64()
        );
    }
    let g = &policy["give_up_after_ms"];
    assert!(g["p50"].as_u64() <= g["p99"].as_u64() && g["p99"].as_u64() <= g["max"].as_u64());
    assert_eq!(policy["terminal"], "deadLetter:payments-review");

    let again = simulate_payments_json();
    assert_eq!(out.stdout, again.stdout, "same seed, same output");
}

#[test]
fn simulate_table_names_each_policy() {
    let out = rebound(&[
        "simulate",
        "-f",
        "examples/policies/email.yaml",
        "--samples",
        "500",
    ]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("RetryPolicy default/email")
            && stdout.contains("RetryPolicy default/newsletter")
    );
    assert!(stdout.contains("gives up after"));
}

#[test]
fn crd_prints_the_committed_definition() {
    let out = rebound(&["crd"]);
    let committed = std::fs::read(format!("{ROOT}/crds/retrypolicies.rebound.dev.yaml"))
        .expect("committed CRD");
    assert_eq!(out.stdout, committed);
}

#[test]
fn ask_answers_like_the_sidecar() {
    let out = rebound(&[
        "ask",
        "-f",
        "examples/policies/payments.yaml",
        "--queue",
        "payments.charge",
        "--attempt",
        "2",
        "--error-class",
        "CardDeclined",
    ]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("GIVE_UP → deadLetter:payments-review"),
        "{stdout}"
    );
    let ask_twice_asked_question = || {
        rebound(&[
            "ask",
            "-f",
            "examples/policies/webhooks.yaml",
            "--queue",
            "webhooks-eu",
            "--attempt",
            "3",
            "--job-id",
            "42",
        ])
    };
    let (a, b) = (ask_twice_asked_question(), ask_twice_asked_question());
    assert!(text(&a.stdout).starts_with("RETRY in"));
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn namespace_seeds_the_jitter_like_the_cluster_does() {
    let ask = |ns: &str| {
        let out = rebound(&[
            "ask",
            "-f",
            "examples/policies/webhooks.yaml",
            "-n",
            ns,
            "--queue",
            "webhooks",
            "--attempt",
            "6",
            "--job-id",
            "42",
        ]);
        text(&out.stdout)
    };
    assert!(
        ask("shop").ends_with("policy shop/webhooks\n"),
        "{}",
        ask("shop")
    );
    assert_ne!(
        ask("shop").split("  ").next(),
        ask("billing").split("  ").next()
    );
}

#[test]
fn a_closed_pipe_is_not_a_crash() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args([
            "simulate",
            "-f",
            "examples/policies/webhooks.yaml",
            "--samples",
            "100",
            "-o",
            "json",
        ])
        .current_dir(ROOT)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rebound runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("exits");
    assert!(
        !text(&out.stderr).contains("panicked"),
        "{}",
        text(&out.stderr)
    );
    assert_ne!(out.status.code(), Some(101));
}

#[test]
fn validate_keeps_going_past_an_unreadable_file() {
    let out = rebound(&[
        "validate",
        "-f",
        "does/not/exist.yaml",
        "examples/policies/payments.yaml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).starts_with("does/not/exist.yaml:0::"));
    assert!(text(&out.stderr).contains("1 valid, 1 invalid"));
}

/// `schedule: [1m, 5m, 30m]` without a jitter retries at exactly 1m, 5m and 30m.
#[test]
fn simulate_keeps_a_schedule_without_jitter_exact() {
    let out = rebound(&[
        "simulate",
        "-f",
        "cli/tests/fixtures/schedule-without-jitter.yaml",
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let retries = json["policies"][0]["retries"].as_array().expect("retries");
    let exact: Vec<(u64, u64)> = retries
        .iter()
        .map(|r| {
            (
                r["min_ms"].as_u64().unwrap_or(0),
                r["max_ms"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        exact,
        [(60_000, 60_000), (300_000, 300_000), (1_800_000, 1_800_000)]
    );
}
