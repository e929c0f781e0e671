//! `rebound plot` and `rebound diff` as processes: the SVG parsed as XML, its bands and
//! curve checked against the policy crate; the diff's exit code and JSON fields.

use std::process::Command;

use rebound_policy::{Policy, manifest, simulate};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const PAYMENTS: &str = "examples/policies/payments.yaml";

fn rebound(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(args)
        .current_dir(ROOT)
        .output()
        .expect("rebound runs")
}

#[test]
fn schedule_svg_has_one_band_per_retry_with_the_simulated_figures() {
    let out = rebound(&["plot", "schedule", "-f", PAYMENTS, "--seed", "3"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let doc = roxmltree::Document::parse(&text).expect("XML");
    let m = manifest::parse_manifests(
        &std::fs::read_to_string(format!("{ROOT}/{PAYMENTS}")).expect("file"),
    )
    .expect("manifests");
    let (_, params) = m[0].result.as_ref().expect("valid");
    let sim = simulate(
        &Policy::new("default/payments", params.clone()),
        10_000,
        3,
        true,
    );
    let bands: Vec<_> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("band"))
        .collect();
    assert_eq!(bands.len(), sim.retries.len());
    for (b, r) in bands.iter().zip(&sim.retries) {
        assert_eq!(
            b.attribute("data-p50-ms"),
            Some(r.p50_ms.to_string().as_str())
        );
        assert_eq!(
            b.attribute("data-p99-ms"),
            Some(r.p99_ms.to_string().as_str())
        );
    }
    let cdf = doc
        .descendants()
        .find(|n| n.attribute("class") == Some("cdf"))
        .expect("curve");
    let points: Vec<(f64, f64)> = cdf
        .attribute("points")
        .expect("points")
        .split(' ')
        .map(|p| {
            let (x, y) = p.split_once(',').expect("x,y");
            (x.parse().expect("x"), y.parse().expect("y"))
        })
        .collect();
    // Screen y grows downwards: a rising share means non-increasing y.
    assert!(
        points
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 >= w[1].1)
    );
}

#[test]
fn diff_of_a_file_with_itself_is_exit_0_and_unchanged() {
    let out = rebound(&["diff", PAYMENTS, PAYMENTS, "-o", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(doc["changed"], false);
    assert_eq!(doc["policies"][0]["status"], "unchanged");
}
