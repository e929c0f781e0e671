//! `rebound plot` and `rebound diff` as processes: the SVG parsed as XML, its bands and
//! curve checked against the policy crate; the diff's exit code and JSON fields.

use std::process::Command;

use rebound_policy::{Policy, contention::simulate_contention, manifest, simulate};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const PAYMENTS: &str = "examples/policies/payments.yaml";
const WEBHOOKS: &str = "examples/policies/webhooks.yaml";

/// The policy of the first manifest in `file`, as the CLI builds it for the default namespace.
fn policy_in(file: &str) -> Policy {
    let text = std::fs::read_to_string(format!("{ROOT}/{file}")).expect("file");
    let m = manifest::parse_manifests(&text).expect("manifests");
    let (_, params) = m[0].result.as_ref().expect("valid");
    let name = m[0].name.clone().expect("metadata.name");
    Policy::new(format!("default/{name}"), params.clone())
}

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
    let sim = simulate(&policy_in(PAYMENTS), 10_000, 3, true);
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
fn storm_svg_has_one_series_per_policy_with_the_simulated_figures() {
    let out = rebound(&[
        "plot",
        "storm",
        "-f",
        PAYMENTS,
        "-f",
        WEBHOOKS,
        "--clients",
        "5,20,40",
        "--write",
        "10ms",
        "--seed",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let doc = roxmltree::Document::parse(&text).expect("XML");
    let figure = |kind: &str| {
        doc.descendants()
            .find(|n| n.attribute("data-figure") == Some(kind))
            .expect("figure group")
    };
    for (kind, attr) in [
        ("calls", "data-calls"),
        ("completion", "data-completion-ms"),
    ] {
        let series: Vec<_> = figure(kind)
            .children()
            .filter(|n| n.attribute("class") == Some("series"))
            .collect();
        let names: Vec<_> = series.iter().map(|s| s.attribute("data-policy")).collect();
        assert_eq!(names, [Some("payments"), Some("webhooks")]);
        for (node, file) in series.iter().zip([PAYMENTS, WEBHOOKS]) {
            let policy = policy_in(file);
            let points: Vec<(u32, u64)> = node
                .children()
                .filter(|n| n.has_tag_name("circle"))
                .map(|c| {
                    let n = c
                        .attribute("data-clients")
                        .expect("clients")
                        .parse()
                        .expect("u32");
                    let v = c.attribute(attr).expect("figure").parse().expect("u64");
                    (n, v)
                })
                .collect();
            let want: Vec<(u32, u64)> = [5, 20, 40]
                .into_iter()
                .map(|n| {
                    let run = simulate_contention(&policy, n, 10, 3);
                    (
                        n,
                        if kind == "calls" {
                            run.calls
                        } else {
                            run.completion_ms
                        },
                    )
                })
                .collect();
            assert_eq!(points, want, "{kind} of {file}");
        }
    }
}

#[test]
fn diff_of_a_file_with_itself_is_exit_0_and_unchanged() {
    let out = rebound(&["diff", PAYMENTS, PAYMENTS, "-o", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(doc["changed"], false);
    assert_eq!(doc["policies"][0]["status"], "unchanged");
}

const OLD: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: a}\nspec:\n  queues: [a]\n  backoff: {strategy: exponential, base: 1s, cap: 1m}\n  maxAttempts: 4\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: gone}\nspec:\n  queues: [g]\n";
const NEW: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: a}\nspec:\n  queues: [a]\n  backoff: {strategy: exponential, base: 2s, cap: 1m}\n  maxAttempts: 4\n---\napiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: fresh}\nspec:\n  queues: [f]\n";

#[test]
fn diff_reports_fields_added_and_removed_policies_and_exits_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (dir.path().join("old.yaml"), dir.path().join("new.yaml"));
    std::fs::write(&old, OLD).expect("write");
    std::fs::write(&new, NEW).expect("write");
    let out = rebound(&[
        "diff",
        old.to_str().expect("path"),
        new.to_str().expect("path"),
        "-o",
        "json",
        "--clients",
        "10",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        doc["summary"],
        serde_json::json!({"added": 1, "removed": 1, "changed": 1, "unchanged": 0})
    );
    let a = doc["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .find(|p| p["name"] == "a")
        .expect("a");
    assert_eq!(
        a["fields"],
        serde_json::json!([{"path": "spec.backoff.base", "old": "1s", "new": "2s"}])
    );
    let retry1 = &a["schedule"][0];
    assert!(retry1["new"]["p50Ms"].as_u64() > retry1["old"]["p50Ms"].as_u64());
    assert_eq!(a["storm"][0]["clients"], 10);
}

#[test]
fn diff_says_when_a_changed_spec_compiles_to_the_same_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let head = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: a}\nspec:\n  queues: [a]\n";
    // The defaults written out (maxAttempts 10, full jitter for exponential), then a real change.
    let versions = [
        format!("{head}  backoff: {{base: 1s}}\n"),
        format!("{head}  backoff: {{base: 1s, jitter: {{kind: full}}}}\n  maxAttempts: 10\n"),
        format!("{head}  backoff: {{base: 1s}}\n  maxAttempts: 11\n"),
    ];
    let paths: Vec<_> = versions
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let path = dir.path().join(format!("v{i}.yaml"));
            std::fs::write(&path, text).expect("write");
            path.to_str().expect("path").to_owned()
        })
        .collect();
    let diff = |new: &str| {
        let out = rebound(&["diff", &paths[0], new, "-o", "json", "--clients", "10"]);
        assert_eq!(out.status.code(), Some(1));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        doc["policies"][0].clone()
    };
    let spelled_out = diff(&paths[1]);
    assert_eq!(spelled_out["status"], "changed");
    assert_eq!(spelled_out["sameBehaviour"], true);
    assert_eq!(
        spelled_out["schedule"][0]["old"],
        spelled_out["schedule"][0]["new"]
    );
    let real = diff(&paths[2]);
    assert_eq!(real["sameBehaviour"], false);
    assert_eq!(real["giveUpAfter"]["new"]["maxAttempts"], 11);
}

#[test]
fn svgs_render_with_rsvg_convert_at_their_size_and_not_blank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let svg = dir.path().join("s.svg");
    let png = dir.path().join("s.png");
    let out = rebound(&[
        "plot",
        "schedule",
        "-f",
        PAYMENTS,
        "--out",
        svg.to_str().expect("path"),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let status = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png)
        .arg(&svg)
        .status()
        .expect("rsvg-convert (librsvg2-bin) runs");
    assert!(status.success());
    let decoder = png::Decoder::new(std::fs::File::open(&png).expect("png"));
    let mut reader = decoder.read_info().expect("PNG header");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("pixels");
    let text = std::fs::read_to_string(&svg).expect("svg");
    let doc = roxmltree::Document::parse(&text).expect("XML");
    let root = doc.root_element();
    assert_eq!(
        info.width.to_string(),
        root.attribute("width").expect("width")
    );
    assert_eq!(
        info.height.to_string(),
        root.attribute("height").expect("height")
    );
    let px = &buf[..info.buffer_size()];
    let step = info.line_size / info.width as usize;
    let distinct: std::collections::HashSet<&[u8]> = px.chunks(step).collect();
    assert!(distinct.len() > 10, "only {} colours", distinct.len());
}

#[test]
fn the_committed_docs_svg_is_what_the_command_prints_now() {
    let out = rebound(&["plot", "schedule", "-f", PAYMENTS]);
    assert_eq!(out.status.code(), Some(0));
    let committed =
        std::fs::read(format!("{ROOT}/docs/img/payments-schedule.svg")).expect("docs/img");
    assert!(
        out.stdout == committed,
        "docs/img/payments-schedule.svg is stale; regenerate it (docs/cli.md)"
    );
}
