//! `rebound plot` and `rebound diff` as processes: the SVG parsed as XML, its bands and
//! curve checked against the policy crate; the diff's exit code and JSON fields.

mod common;

use std::process::Command;

use common::{ROOT, rebound};

use rebound_policy::{PreparedPolicy, contention::simulate_contention, manifest, simulate};

const PAYMENTS: &str = "examples/policies/payments.yaml";
const WEBHOOKS: &str = "examples/policies/webhooks.yaml";

/// The policy of the first manifest in `file`, as the CLI builds it for the default namespace.
fn policy_in(file: &str) -> PreparedPolicy {
    let text = common::read(file);
    let m = manifest::parse_manifests(&text).expect("manifests");
    let (_, params) = m[0].result.as_ref().expect("valid");
    let name = m[0].name.clone().expect("metadata.name");
    PreparedPolicy::new(format!("default/{name}"), params.clone())
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
fn storm_svg_has_one_series_per_policy_with_the_mean_over_seeds() {
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
        "--seeds",
        "4",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let doc = roxmltree::Document::parse(&text).expect("XML");
    for (kind, attr) in [
        ("calls", "data-calls"),
        ("completion", "data-completion-ms"),
    ] {
        let series = series_of(&doc, kind);
        let names: Vec<_> = series.iter().map(|s| s.attribute("data-policy")).collect();
        assert_eq!(names, [Some("payments"), Some("webhooks")]);
        for (node, file) in series.iter().zip([PAYMENTS, WEBHOOKS]) {
            let policy = policy_in(file);
            assert!(
                node.children().any(|n| class(&n) == Some("spread")),
                "a band for the range over seeds"
            );
            for (point, n) in points(node).iter().zip([5u32, 20, 40]) {
                let runs: Vec<_> = (3..7)
                    .map(|s| simulate_contention(&policy, n, 10, s))
                    .collect();
                let figure = |r: &rebound_policy::contention::ContentionRun| {
                    if kind == "calls" {
                        r.calls
                    } else {
                        r.completion_ms
                    }
                };
                let mean = runs.iter().map(|r| figure(r) as f64).sum::<f64>() / 4.0;
                assert_eq!(number(point, "data-clients"), f64::from(n));
                assert!(
                    (number(point, attr) - mean).abs() < 0.051,
                    "{kind} of {file} at {n}"
                );
                let min = runs.iter().map(figure).min().expect("runs") as f64;
                let max = runs.iter().map(figure).max().expect("runs") as f64;
                assert_eq!(
                    (number(point, "data-min"), number(point, "data-max")),
                    (min, max)
                );
            }
        }
    }
}

fn class<'a>(n: &roxmltree::Node<'a, '_>) -> Option<&'a str> {
    n.attribute("class")
}

fn number(n: &roxmltree::Node<'_, '_>, attr: &str) -> f64 {
    n.attribute(attr)
        .unwrap_or_else(|| panic!("no {attr}"))
        .parse()
        .unwrap_or_else(|_| panic!("{attr} is not a number"))
}

/// The series groups of one figure (`calls`, `completion`) of a storm SVG.
fn series_of<'a, 'i>(doc: &'a roxmltree::Document<'i>, kind: &str) -> Vec<roxmltree::Node<'a, 'i>> {
    doc.descendants()
        .find(|n| n.attribute("data-figure") == Some(kind))
        .expect("figure group")
        .children()
        .filter(|n| class(n) == Some("series"))
        .collect()
}

fn points<'a, 'i>(series: &roxmltree::Node<'a, 'i>) -> Vec<roxmltree::Node<'a, 'i>> {
    series
        .children()
        .filter(|n| class(n) == Some("point"))
        .collect()
}

fn svg_of(args: &[&str]) -> String {
    let out = rebound(args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// A policy file in `dir`, named `name.yaml`.
fn policy_file(dir: &tempfile::TempDir, name: &str, spec: &str) -> String {
    let path = dir.path().join(format!("{name}.yaml"));
    let text = format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {{name: p}}\nspec:\n  queues: [q]\n{spec}"
    );
    std::fs::write(&path, text).expect("write");
    path.to_str().expect("path").to_owned()
}

#[test]
fn log_axes_tick_in_one_kind_of_step() {
    let schedule = svg_of(&["plot", "schedule", "-f", PAYMENTS]);
    let storm = svg_of(&[
        "plot",
        "storm",
        "-f",
        "cli/tests/fixtures/storm.yaml",
        "--clients",
        "10,50,100",
        "--seeds",
        "2",
    ]);
    let mut log_axes = 0;
    for text in [&schedule, &storm] {
        let doc = roxmltree::Document::parse(text).expect("XML");
        for axis in doc
            .descendants()
            .filter(|n| class(n) == Some("axis") && n.attribute("data-scale") == Some("log"))
        {
            log_axes += 1;
            let ticks: Vec<f64> = axis
                .children()
                .filter(|n| class(n) == Some("tick"))
                .map(|t| number(&t, "data-value"))
                .collect();
            let ratios: Vec<f64> = ticks.windows(2).map(|w| w[1] / w[0]).collect();
            let decades = ratios.iter().all(|&r| (r - 10.0).abs() < 1e-9);
            let one_two_five = ratios
                .iter()
                .enumerate()
                .all(|(i, &r)| (r - [2.0, 2.5, 2.0][i % 3]).abs() < 1e-9);
            assert!(
                ticks.len() >= 2 && (decades || one_two_five),
                "mixed steps: {ticks:?}"
            );
        }
    }
    assert!(log_axes >= 2, "both plots have log axes");
}

#[test]
fn full_jitter_minimums_below_the_axis_are_marked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = policy_file(
        &dir,
        "full",
        "  backoff: {strategy: exponential, base: 1s, cap: 10m, jitter: {kind: full}}\n  maxAttempts: 8\n",
    );
    let text = svg_of(&["plot", "schedule", "-f", &file]);
    let doc = roxmltree::Document::parse(&text).expect("XML");
    let panel = doc
        .descendants()
        .find(|n| n.attribute("data-panel") == Some("delays"))
        .expect("delays panel");
    let floor = panel
        .descendants()
        .find(|n| class(n) == Some("axis") && n.attribute("data-axis") == Some("y"))
        .map(|a| number(&a, "data-lo"))
        .expect("y axis");
    let bands: Vec<_> = panel
        .descendants()
        .filter(|n| class(n) == Some("band"))
        .collect();
    let mut clipped = 0;
    for band in &bands {
        let below = number(band, "data-min-ms") < floor;
        let marked = band.children().any(|n| class(&n) == Some("clipped"));
        assert_eq!(marked, below, "retry {:?}", band.attribute("data-retry"));
        clipped += usize::from(below);
    }
    assert!(clipped > 0, "full jitter draws minimums near zero");
}

#[test]
fn identical_series_differ_in_dash_and_marker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = "  backoff: {strategy: exponential, base: 10ms, cap: 10m}\n  maxAttempts: 50\n";
    let (a, b) = (policy_file(&dir, "a", spec), policy_file(&dir, "b", spec));
    let text = svg_of(&[
        "plot",
        "storm",
        "-f",
        &a,
        "-f",
        &b,
        "--clients",
        "5,10",
        "--seeds",
        "2",
    ]);
    let doc = roxmltree::Document::parse(&text).expect("XML");
    for kind in ["calls", "completion"] {
        let series = series_of(&doc, kind);
        assert_eq!(series.len(), 2);
        let style = |k: usize| {
            let s = &series[k];
            (
                s.attribute("data-dash").map(str::to_owned),
                s.attribute("data-marker").map(str::to_owned),
            )
        };
        assert_ne!(style(0).0, style(1).0, "dashes");
        assert_ne!(style(0).1, style(1).1, "markers");
        // The case: the same figures, drawn at the same places.
        let at = |s: &roxmltree::Node<'_, '_>| -> Vec<Option<String>> {
            points(s)
                .iter()
                .map(|p| p.attribute("data-max").map(str::to_owned))
                .collect()
        };
        assert_eq!(at(&series[0]), at(&series[1]));
    }
}

#[test]
fn points_where_clients_gave_up_are_ringed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = policy_file(
        &dir,
        "short",
        "  backoff: {strategy: exponential, base: 10ms, cap: 10m, jitter: {kind: none}}\n  maxAttempts: 5\n",
    );
    let text = svg_of(&[
        "plot",
        "storm",
        "-f",
        &file,
        "--clients",
        "1,3,30",
        "--seeds",
        "2",
    ]);
    let doc = roxmltree::Document::parse(&text).expect("XML");
    let series = series_of(&doc, "calls");
    let rings: Vec<f64> = series[0]
        .children()
        .filter(|n| class(n) == Some("gave-up"))
        .map(|r| number(&r, "data-clients"))
        .collect();
    let gave_up: Vec<f64> = points(&series[0])
        .iter()
        .filter(|p| number(p, "data-gave-up") > 0.0)
        .map(|p| number(p, "data-clients"))
        .collect();
    assert_eq!(rings, gave_up);
    assert_eq!(
        gave_up,
        [30.0],
        "one client always succeeds; 30 in lockstep for 5 attempts do not"
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
