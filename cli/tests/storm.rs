//! `rebound storm`: the JSON contract and that its figures are the policy crate's model.

mod common;

use common::{read, rebound};

use rebound_policy::{PreparedPolicy, contention::simulate_contention, manifest};
use serde_json::Value;

const FIXTURE: &str = "cli/tests/fixtures/storm.yaml";

fn storm(args: &[&str]) -> std::process::Output {
    rebound(&[&["storm"], args].concat())
}

#[test]
fn json_figures_are_the_contention_model_of_each_policy() {
    let out = storm(&[
        "-f",
        FIXTURE,
        "--clients",
        "1,20..40:20",
        "--write",
        "5ms",
        "--seed",
        "3",
        "-o",
        "json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(doc["writeMs"], 5);
    assert_eq!(doc["seed"], 3);

    let text = read(FIXTURE);
    let manifests = manifest::parse_manifests(&text).expect("manifests");
    let policies = doc["policies"].as_array().expect("policies");
    assert_eq!(policies.len(), manifests.len());
    for (got, m) in policies.iter().zip(&manifests) {
        let name = m.name.clone().expect("named");
        assert_eq!(got["name"], name.as_str());
        assert_eq!(got["namespace"], "default");
        let (_, params) = m.result.as_ref().expect("valid");
        let policy = PreparedPolicy::new(format!("default/{name}"), params.clone());
        let runs = got["runs"].as_array().expect("runs");
        assert_eq!(runs.len(), 3);
        for (run, clients) in runs.iter().zip([1u32, 20, 40]) {
            let want = simulate_contention(&policy, clients, 5, 3);
            assert_eq!(run["clients"], clients);
            assert_eq!(run["calls"], want.calls, "{name} with {clients} clients");
            assert_eq!(run["completionMs"], want.completion_ms);
            assert_eq!(run["succeeded"], want.succeeded);
            assert_eq!(run["gaveUp"], want.gave_up);
            assert_eq!(run["truncated"], want.truncated);
        }
    }
}

#[test]
fn bad_client_counts_and_writes_are_usage_errors() {
    for args in [
        ["--clients", "0"],
        ["--clients", "9..3"],
        ["--write", "0s"],
        ["--write", "later"],
    ] {
        let mut all = vec!["-f", FIXTURE];
        all.extend(args);
        let out = storm(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?} printed a result");
    }
}

#[test]
fn a_budgeted_storm_holds_the_budget_per_slot_over_all_sidecars() {
    const BUDGETED: &str = "cli/tests/fixtures/retry-budget.yaml";
    for sidecars in ["1", "3"] {
        let out = storm(&[
            "-f",
            BUDGETED,
            "--clients",
            "50,400",
            "--sidecars",
            sidecars,
            "-o",
            "json",
        ]);
        assert_eq!(out.status.code(), Some(0));
        let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(doc["sidecars"].to_string(), sidecars);
        for run in doc["policies"][0]["runs"].as_array().expect("runs") {
            let budget = &run["budget"];
            assert_eq!(budget["burst"], 5);
            assert_eq!(budget["sidecars"].to_string(), sidecars);
            assert!(
                budget["busiestSlot"].as_u64() <= Some(5),
                "{sidecars} sidecars: {budget}"
            );
        }
        let big = &doc["policies"][0]["runs"][1]["budget"];
        assert!(
            big["stretched"].as_u64() > Some(0),
            "400 clients saturate it"
        );
    }
}
