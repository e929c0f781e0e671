//! The `rebound` binary as GitOps CI and people run it: offline, on files and stdin.
//! Assertions are on the parsed JSON/YAML output and on exit codes; the expected values
//! come from the policy crate itself.

mod common;

use std::process::{Command, Output, Stdio};

use common::{ROOT, read, rebound, rebound_stdin, run_with};
use rebound_policy::{
    Context, Decision, PolicySource, PolicyTable, compile,
    manifest::{self, ManifestDocument},
};
use serde_json::Value;

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn documents(path: &str) -> Vec<ManifestDocument> {
    manifest::parse_manifests(&read(path)).expect("YAML")
}

const EXAMPLES: [&str; 4] = [
    "examples/policies/webhooks.yaml",
    "examples/policies/email.yaml",
    "examples/policies/payments.yaml",
    "examples/policies/default.yaml",
];
const INVALID: &str = "policy/tests/fixtures/invalid-policies.yaml";

#[test]
fn validate_accepts_the_examples_with_exit_0() {
    let mut args = vec!["validate", "-o", "json", "-f"];
    args.extend(EXAMPLES);
    let out = rebound(&args);
    assert_eq!(out.status.code(), Some(0));
    let report = json(&out);
    let expected: usize = EXAMPLES.iter().map(|f| documents(f).len()).sum();
    assert_eq!(report["valid"], expected);
    assert_eq!(report["invalid"], 0);
    assert_eq!(report["documents"].as_array().map(Vec::len), Some(expected));
    assert!(
        report["documents"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|d| d["valid"] == true && d["errors"] == serde_json::json!([]))
    );
}

/// Every invalid document is listed with the policy crate's own field errors; exit 1.
#[test]
fn validate_reports_every_finding_with_exit_1() {
    let out = rebound(&["validate", "-f", INVALID, "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let report = json(&out);
    let expected = documents(INVALID);
    let got = report["documents"].as_array().expect("documents");
    assert_eq!(got.len(), expected.len());
    for (doc, want) in got.iter().zip(&expected) {
        assert_eq!(doc["source"], INVALID);
        assert_eq!(doc["index"], want.index);
        let want_errors: Vec<Value> = match &want.result {
            Ok(_) => vec![],
            Err(errors) => errors
                .iter()
                .map(|e| serde_json::json!({"field": e.field, "message": e.message}))
                .collect(),
        };
        assert_eq!(
            doc["errors"],
            Value::Array(want_errors),
            "document {}",
            want.index
        );
        assert_eq!(doc["valid"], want.result.is_ok());
    }
    let invalid = expected.iter().filter(|d| d.result.is_err()).count();
    assert!(invalid >= 20);
    assert_eq!(report["invalid"], invalid);
}

/// The text format: one `file:document:field: message` line per field error.
#[test]
fn validate_text_lines_split_into_file_document_field_message() {
    let out = rebound(&["validate", "-f", INVALID]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<(String, usize, String, String)> = stdout
        .lines()
        .map(|l| {
            let mut parts = l.splitn(4, ':');
            let file = parts.next().unwrap_or_default().to_owned();
            let index = parts.next().and_then(|i| i.parse().ok()).expect("index");
            let field = parts.next().unwrap_or_default().to_owned();
            let message = parts.next().unwrap_or_default().trim_start().to_owned();
            (file, index, field, message)
        })
        .collect();
    let expected: Vec<(String, usize, String, String)> = documents(INVALID)
        .into_iter()
        .flat_map(|d| {
            let index = d.index;
            d.result.err().into_iter().flatten().map(move |e| {
                (
                    INVALID.to_owned(),
                    index,
                    e.field.clone(),
                    e.message.clone(),
                )
            })
        })
        .collect();
    assert_eq!(lines, expected);
}

#[test]
fn stdin_reads_like_the_file() {
    let from_file = json(&rebound(&["validate", "-f", INVALID, "-o", "json"]));
    let out = rebound_stdin(
        &["validate", "-f", "-", "-o", "json"],
        read(INVALID).as_bytes(),
    );
    assert_eq!(out.status.code(), Some(1));
    let mut from_stdin = json(&out);
    for doc in from_stdin["documents"].as_array_mut().expect("documents") {
        assert_eq!(doc["source"], "-");
        doc["source"] = INVALID.into();
    }
    assert_eq!(from_stdin, from_file);

    // simulate and ask read stdin too, with the same answers as from the file.
    let file = "examples/policies/payments.yaml";
    for args in [
        vec!["simulate", "--samples", "300", "-o", "json"],
        vec![
            "ask",
            "--queue",
            "payments.charge",
            "--attempt",
            "3",
            "--job-id",
            "7",
            "-o",
            "json",
        ],
    ] {
        let mut with_file = args.clone();
        with_file.extend(["-f", file]);
        let mut with_stdin = args.clone();
        with_stdin.extend(["-f", "-"]);
        let a = rebound(&with_file);
        let b = rebound_stdin(&with_stdin, read(file).as_bytes());
        assert_eq!(a.status.code(), Some(0), "{args:?}");
        assert_eq!(json(&a), json(&b), "{args:?}");
    }
}

#[test]
fn directories_are_read_and_recursion_needs_r() {
    let dir = tempfile::tempdir().expect("temp dir");
    let nested = dir.path().join("team/payments");
    std::fs::create_dir_all(&nested).expect("mkdir");
    std::fs::copy(format!("{ROOT}/{}", EXAMPLES[0]), dir.path().join("a.yaml")).expect("copy");
    std::fs::copy(format!("{ROOT}/{}", EXAMPLES[1]), nested.join("b.yml")).expect("copy");
    std::fs::write(dir.path().join("notes.txt"), "not: [a policy").expect("write");
    let top = dir.path().to_string_lossy().into_owned();

    let flat = json(&rebound(&["validate", "-f", &top, "-o", "json"]));
    let deep_out = rebound(&["validate", "-R", "-f", &top, "-o", "json"]);
    assert_eq!(deep_out.status.code(), Some(0));
    let deep = json(&deep_out);
    let count = |f: &str| documents(f).len();
    assert_eq!(
        flat["valid"],
        count(EXAMPLES[0]),
        "only a.yaml; notes.txt ignored"
    );
    assert_eq!(deep["valid"], count(EXAMPLES[0]) + count(EXAMPLES[1]));
    let sources: Vec<&str> = deep["documents"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["source"].as_str())
        .collect();
    assert!(
        sources
            .iter()
            .all(|s| s.ends_with("a.yaml") || s.ends_with("b.yml"))
    );

    // An invalid file deep down fails the recursive run only.
    std::fs::copy(format!("{ROOT}/{INVALID}"), nested.join("broken.yaml")).expect("copy");
    assert_eq!(rebound(&["validate", "-f", &top]).status.code(), Some(0));
    assert_eq!(
        rebound(&["validate", "-R", "-f", &top]).status.code(),
        Some(1)
    );
}

/// 0 ok, 1 findings, 2 usage or I/O errors: distinct, and I/O wins over findings.
#[test]
fn exit_codes_are_distinct() {
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["validate", "-f", EXAMPLES[0]], 0),
        (vec!["validate", "-f", INVALID], 1),
        (vec!["validate", "-f", "does/not/exist.yaml"], 2),
        (vec!["validate", "-f", "does/not/exist.yaml", INVALID], 2),
        (vec!["validate"], 2),
        (vec!["validate", "-f", EXAMPLES[0], "-o", "xml"], 2),
        (vec!["validate", "--no-such-flag"], 2),
        (vec!["frobnicate"], 2),
        (vec!["simulate", "-f", INVALID], 1),
        (vec!["explain", "q", "-f", INVALID], 1),
        (
            vec!["ask", "-f", INVALID, "--queue", "a", "--attempt", "1"],
            1,
        ),
        (vec!["simulate", "-f", "does/not/exist.yaml"], 2),
        (vec!["simulate", "-f", EXAMPLES[1], "--policy", "nope"], 2),
        (
            vec![
                "ask",
                "-f",
                EXAMPLES[2],
                "--queue",
                "video",
                "--attempt",
                "1",
            ],
            2,
        ),
        (
            vec![
                "ask",
                "-f",
                EXAMPLES[2],
                "--queue",
                "payments.charge",
                "--attempt",
                "0",
            ],
            2,
        ),
        (
            vec![
                "ask",
                "-f",
                EXAMPLES[2],
                "--queue",
                "payments.charge",
                "--attempt",
                "x",
            ],
            2,
        ),
        (vec!["validate", "-f", "-", "-f", "-"], 2),
        (vec!["--help"], 0),
        (vec!["completion", "tcsh"], 2),
    ];
    for (args, code) in cases {
        let out = rebound(&args);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if code == 2 && args[0] != "validate" {
            // Errors are one line on stderr, never a panic or a backtrace.
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
}

/// Not YAML at all is a finding about the file; a file over the size limit is refused
/// after bounded reading.
#[test]
fn broken_and_oversized_input() {
    let out = rebound_stdin(&["validate", "-f", "-", "-o", "json"], b"kind: [unclosed");
    assert_eq!(out.status.code(), Some(1));
    let report = json(&out);
    assert_eq!(report["sourceErrors"][0]["reason"], "NotYaml");
    assert_eq!(report["sourceErrors"][0]["source"], "-");

    let huge = vec![b'#'; manifest::MAX_MANIFEST_BYTES + 10];
    let out = rebound_stdin(&["validate", "-f", "-", "-o", "json"], &huge);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(json(&out)["sourceErrors"][0]["reason"], "Unreadable");
}

fn answer_of(
    file: &str,
    namespace: &str,
    queue: &str,
    attempt: u32,
    ctx: Context,
) -> (Decision, String) {
    let sources = documents(file)
        .into_iter()
        .map(|d| PolicySource::from_object(&d.result.expect("valid").0, namespace))
        .collect();
    let doc = compile(namespace, sources).document;
    let table = PolicyTable::new(&doc);
    let entry = table.lookup(queue).expect("governed");
    (
        rebound_policy::decide(entry, attempt, &ctx),
        entry.name().to_owned(),
    )
}

#[test]
fn ask_json_is_the_policy_crates_decision() {
    let file = EXAMPLES[0];
    for (ns, attempt) in [("shop", 3u32), ("billing", 3), ("shop", 6)] {
        let a = attempt.to_string();
        let out = rebound(&[
            "ask",
            "-f",
            file,
            "-n",
            ns,
            "--queue",
            "webhooks-eu",
            "--attempt",
            &a,
            "--job-id",
            "42",
            "-o",
            "json",
        ]);
        assert_eq!(out.status.code(), Some(0));
        let got = json(&out);
        let ctx = Context {
            job_id: Some("42"),
            ..Context::default()
        };
        let (want, name) = answer_of(file, ns, "webhooks-eu", attempt, ctx);
        assert_eq!(got["policy"]["name"], name.as_str());
        assert_eq!(got["policy"]["namespace"], ns);
        assert_eq!(got["source"], "files");
        match want {
            Decision::Retry { delay_ms } => {
                assert_eq!(got["decision"], "Retry");
                assert_eq!(got["delayMs"], delay_ms);
            }
            Decision::GiveUp { reason, .. } => {
                assert_eq!(got["decision"], "GiveUp");
                assert_eq!(got["reason"], reason.code());
            }
        }
    }

    let out = rebound(&[
        "ask",
        "-f",
        EXAMPLES[2],
        "--queue",
        "payments.charge",
        "--attempt",
        "2",
        "--error-class",
        "CardDeclined",
        "-o",
        "json",
    ]);
    let got = json(&out);
    assert_eq!(got["decision"], "GiveUp");
    assert_eq!(got["reason"], "NonRetryable");
    assert_eq!(got["disposition"], "deadLetter");
    assert_eq!(got["deadLetterQueue"], "payments-review");
}

/// `-o yaml` is the same document as `-o json`, on every command that has `-o`.
#[test]
fn yaml_output_is_the_json_document() {
    for args in [
        vec!["validate", "-f", INVALID],
        vec!["simulate", "-f", EXAMPLES[1], "--samples", "200"],
        vec![
            "ask",
            "-f",
            EXAMPLES[2],
            "--queue",
            "payments.charge",
            "--attempt",
            "2",
            "--job-id",
            "j",
        ],
        vec![
            "explain",
            "payments.charge",
            "-f",
            EXAMPLES[2],
            "-f",
            EXAMPLES[3],
            "--samples",
            "200",
        ],
    ] {
        let with = |format: &str| {
            let mut a = args.clone();
            a.extend(["-o", format]);
            rebound(&a)
        };
        let (j, y) = (with("json"), with("yaml"));
        assert_eq!(j.status.code(), y.status.code(), "{args:?}");
        let from_yaml: Value =
            serde_saphyr::from_slice(&y.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        assert_eq!(from_yaml, json(&j), "{args:?}");
    }
}

#[test]
fn simulate_json_keeps_its_contract() {
    let run = || {
        rebound(&[
            "simulate",
            "-f",
            EXAMPLES[2],
            "--samples",
            "2000",
            "--seed",
            "3",
            "-o",
            "json",
        ])
    };
    let out = run();
    assert_eq!(out.status.code(), Some(0));
    let report = json(&out);
    let policy = &report["policies"][0];
    assert_eq!(policy["name"], "payments");
    let retries = policy["retries"].as_array().expect("retries");
    assert_eq!(
        Some(retries.len() as u64 + 1),
        policy["maxAttempts"].as_u64()
    );
    for (i, r) in retries.iter().enumerate() {
        assert_eq!(r["retry"], i + 1);
        for key in ["minMs", "p50Ms", "p99Ms", "maxMs", "jobs"] {
            assert!(r[key].is_u64(), "{key} in {r}");
        }
        assert!(r["meanMs"].is_number());
        assert!(
            r["minMs"].as_u64() <= r["p50Ms"].as_u64()
                && r["p99Ms"].as_u64() <= r["maxMs"].as_u64()
        );
    }
    let g = &policy["giveUpAfterMs"];
    assert!(g["p50"].as_u64() <= g["p99"].as_u64() && g["p99"].as_u64() <= g["max"].as_u64());
    assert_eq!(policy["terminal"], "deadLetter:payments-review");
    assert!(policy["giveUpReasons"]["maxAttempts"].is_u64());
    assert!(policy["resolved"]["baseMs"].is_u64());
    assert_eq!(out.stdout, run().stdout, "same seed, same output");
}

/// A budgeted policy's `retryBudget` is the policy crate's storm simulation with the same
/// jobs and seed; a policy without a budget has no such key.
#[test]
fn simulate_reports_the_retry_budget_storm() {
    let file = "cli/tests/fixtures/retry-budget.yaml";
    let out = rebound(&[
        "simulate",
        "-f",
        file,
        "--samples",
        "500",
        "--seed",
        "9",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let report = json(&out);
    let (object, _) = documents(file).remove(0).result.expect("valid");
    let policy = rebound_policy::PreparedPolicy::new(
        "shop/webhooks",
        rebound_policy::resolve(&object.spec).expect("valid"),
    );
    let expected = rebound_policy::simulate_budget(&policy, 500, 9).expect("budgeted");
    assert_eq!(
        report["policies"][0]["retryBudget"],
        serde_json::to_value(&expected).expect("JSON")
    );
    assert_eq!(expected.retries + expected.gave_up_deadline, 2_000);
    assert_eq!(report["policies"][0]["resolved"]["retryBudget"]["burst"], 5);

    let plain = json(&rebound(&[
        "simulate",
        "-f",
        EXAMPLES[2],
        "--samples",
        "100",
        "-o",
        "json",
    ]));
    assert!(plain["policies"][0].get("retryBudget").is_none());
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
    assert_eq!(out.status.code(), Some(0));
    let report = json(&out);
    let exact: Vec<(u64, u64)> = report["policies"][0]["retries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["minMs"].as_u64().unwrap_or(0),
                r["maxMs"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        exact,
        [(60_000, 60_000), (300_000, 300_000), (1_800_000, 1_800_000)]
    );
}

/// An exact name beats a glob; the catch-all `*` of another policy is shadowed.
#[test]
fn explain_names_the_winner_and_why_others_lose() {
    let out = rebound(&[
        "explain",
        "payments.charge",
        "-f",
        EXAMPLES[2],
        "-f",
        EXAMPLES[3],
        "--samples",
        "500",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let v = json(&out);
    assert_eq!(v["servedBy"]["policy"], "payments");
    assert_eq!(v["servedBy"]["match"], "exact");
    let outcome = |policy: &str| -> Vec<Value> {
        v["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["policy"] == policy)
            .map(|c| c["outcome"].clone())
            .collect()
    };
    assert_eq!(outcome("payments"), ["serving"]);
    assert_eq!(outcome("default"), ["exactMatchWins"]);
    assert_eq!(v["schedule"]["name"], "payments");
    assert_eq!(v["configMap"], Value::Null, "files: no ConfigMap");
    // The schedule is simulate's report of the same policy.
    let sim = json(&rebound(&[
        "simulate",
        "-f",
        EXAMPLES[2],
        "--samples",
        "500",
        "-o",
        "json",
    ]));
    assert_eq!(v["schedule"], sim["policies"][0]);
}

#[test]
fn crd_prints_the_committed_definition() {
    let out = rebound(&["crd"]);
    let committed = std::fs::read(format!("{ROOT}/crds/retrypolicies.rebound.dev.yaml"))
        .expect("committed CRD");
    assert_eq!(out.stdout, committed);
}

/// `--version` on the program and on every subcommand, under both names.
#[test]
fn version_everywhere() {
    for (bin, name) in [
        (env!("CARGO_BIN_EXE_rebound"), "rebound"),
        (env!("CARGO_BIN_EXE_kubectl-rebound"), "kubectl rebound"),
    ] {
        for sub in [
            vec![],
            vec!["validate"],
            vec!["simulate"],
            vec!["explain"],
            vec!["ask"],
            vec!["crd"],
            vec!["completion"],
        ] {
            let mut args = sub.clone();
            args.push("--version");
            let out = run_with(bin, &args, None);
            assert_eq!(out.status.code(), Some(0), "{bin} {args:?}");
            let want = match sub.first() {
                None => format!("{name} {}\n", env!("CARGO_PKG_VERSION")),
                Some(s) => format!("{name}-{s} {}\n", env!("CARGO_PKG_VERSION")),
            };
            assert_eq!(String::from_utf8_lossy(&out.stdout), want, "{bin} {args:?}");
        }
    }
}

/// The bash script registers a completion function that offers the subcommands.
#[test]
fn completion_scripts_load_in_their_shells() {
    let script = rebound(&["completion", "bash"]);
    assert_eq!(script.status.code(), Some(0));
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("rebound.bash");
    std::fs::write(&path, &script.stdout).expect("write");
    // Ask the completion function itself what follows `rebound ` and `rebound validate -`.
    let probe = format!(
        "source {}; f=$(complete -p rebound | awk '{{print $(NF-1)}}'); \
         COMP_WORDS=(rebound ''); COMP_CWORD=1; COMP_LINE='rebound '; COMP_POINT=8; \
         $f rebound '' rebound; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        path.display()
    );
    let out = Command::new("bash")
        .args(["--norc", "-c", &probe])
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let offered: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    for sub in [
        "validate",
        "simulate",
        "explain",
        "ask",
        "crd",
        "completion",
    ] {
        assert!(offered.contains(sub), "{sub} not in {offered:?}");
    }
    for (shell, check) in [("zsh", ["zsh", "-n"]), ("fish", ["fish", "--no-execute"])] {
        let out = rebound(&["completion", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        let file = dir.path().join(format!("rebound.{shell}"));
        std::fs::write(&file, &out.stdout).expect("write");
        // Syntax-checked where the shell is installed (bash always is).
        if let Ok(status) = Command::new(check[0]).arg(check[1]).arg(&file).status() {
            assert!(status.success(), "{shell} rejects its completion script");
        }
    }
}

#[test]
fn a_closed_pipe_is_not_a_crash() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args([
            "simulate",
            "-f",
            EXAMPLES[0],
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
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A cluster that cannot be reached is an I/O error (2), for every cluster-backed command.
#[test]
fn an_unreachable_cluster_exits_2() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let dir = tempfile::tempdir().expect("temp dir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"http://127.0.0.1:{port}\"}}\n\
             users:\n- name: u\n  user: {{}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u, namespace: shop}}\n\
             current-context: x\n"
        ),
    )
    .expect("write");
    let path = kubeconfig.to_string_lossy().into_owned();
    for args in [
        vec!["explain", "q"],
        vec!["simulate"],
        vec!["ask", "--queue", "q", "--attempt", "1"],
    ] {
        let mut all = args.clone();
        all.extend(["--kubeconfig", &path, "-o", "json"]);
        let out = rebound(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
    }
    let missing = rebound(&["explain", "q", "--kubeconfig", "/does/not/exist"]);
    assert_eq!(missing.status.code(), Some(2));
}

/// Equally specific globs: the policy that sorts first wins (files carry no creation
/// time), and `explain` names the same winner `ask` answers with.
#[test]
fn explain_equal_globs_and_ask_agree() {
    let policy = |name: &str, pattern: &str| {
        format!(
            "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: {name}}}\n\
             spec: {{queues: [{pattern:?}], maxAttempts: 3}}\n---\n"
        )
    };
    let input = [policy("b-second", "pay*nts"), policy("a-first", "pay*ent*")].concat();
    let out = rebound_stdin(
        &[
            "explain",
            "payments",
            "-f",
            "-",
            "--samples",
            "100",
            "-o",
            "json",
        ],
        input.as_bytes(),
    );
    assert_eq!(out.status.code(), Some(0));
    let v = json(&out);
    assert_eq!(v["servedBy"]["policy"], "a-first");
    assert_eq!(v["servedBy"]["match"], "glob");
    let loser: Vec<&Value> = v["candidates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["policy"] == "b-second")
        .collect();
    assert_eq!(loser.len(), 1);
    assert_eq!(loser[0]["outcome"], "earlierPolicyWins");
    assert_eq!(loser[0]["beatenBy"], "a-first");

    let asked = rebound_stdin(
        &[
            "ask",
            "--queue",
            "payments",
            "--attempt",
            "1",
            "-f",
            "-",
            "-o",
            "json",
        ],
        input.as_bytes(),
    );
    assert_eq!(json(&asked)["policy"]["name"], "a-first");

    // A queue nothing matches: explained as unserved (exit 0), while ask cannot answer (2).
    let none = rebound_stdin(
        &["explain", "video", "-f", "-", "-o", "json"],
        input.as_bytes(),
    );
    assert_eq!(none.status.code(), Some(0));
    let v = json(&none);
    assert_eq!(v["servedBy"], Value::Null);
    assert_eq!(v["candidates"], serde_json::json!([]));
}
