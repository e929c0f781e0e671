//! `rebound diff`'s Markdown as a pull-request reader sees it: its tables parsed into cells
//! and checked against the same run's `-o json`.

mod common;

use common::rebound;

use serde_json::Value;

/// The Markdown tables of `text`: each a header row and body rows of trimmed cells.
fn tables(text: &str) -> Vec<(Vec<String>, Vec<Vec<String>>)> {
    let cells = |line: &str| -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        inner.split('|').map(|c| c.trim().to_owned()).collect()
    };
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let is_rule = |l: &str| l.starts_with("|-") || l.starts_with("|:") || l.starts_with("|--");
        if lines[i].starts_with('|') && lines.get(i + 1).is_some_and(|l| is_rule(l)) {
            let header = cells(lines[i]);
            let mut rows = Vec::new();
            i += 2;
            while i < lines.len() && lines[i].starts_with('|') {
                rows.push(cells(lines[i]));
                i += 1;
            }
            out.push((header, rows));
        } else {
            i += 1;
        }
    }
    out
}

/// `old → new (+12%)`, `old → new` or one value (no change) as (old, new).
fn sides(cell: &str) -> (String, String) {
    let cell = cell.split(" (").next().unwrap_or(cell);
    match cell.split_once(" → ") {
        Some((o, n)) => (o.to_owned(), n.to_owned()),
        None => (cell.to_owned(), cell.to_owned()),
    }
}

const POLICY: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata: {name: a}\nspec:\n  queues: [a]\n  maxAttempts: 30\n";

#[test]
fn the_storm_table_shows_who_gave_up_and_whether_a_run_was_cut_short() {
    // Dropping jitter with maxAttempts 30: most of 100 clients in lockstep give up.
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (dir.path().join("old.yaml"), dir.path().join("new.yaml"));
    std::fs::write(
        &old,
        format!("{POLICY}  backoff: {{strategy: exponential, base: 10ms, cap: 10m}}\n"),
    )
    .expect("write");
    std::fs::write(
        &new,
        format!("{POLICY}  backoff: {{strategy: exponential, base: 10ms, cap: 10m, jitter: {{kind: none}}}}\n"),
    )
    .expect("write");
    let (old, new) = (old.to_str().expect("path"), new.to_str().expect("path"));
    let args = ["diff", old, new, "--clients", "10,100"];
    let markdown = rebound(&args);
    assert_eq!(markdown.status.code(), Some(1));
    let json = rebound(&[&args[..], &["-o", "json"]].concat());
    let doc: Value = serde_json::from_slice(&json.stdout).expect("JSON");
    let storm = doc["policies"][0]["storm"].as_array().expect("storm rows");
    assert!(
        storm.iter().any(|r| r["new"]["gaveUp"].as_u64() > Some(0)),
        "the case shows clients giving up"
    );

    let text = String::from_utf8(markdown.stdout).expect("UTF-8");
    let (header, rows) = tables(&text)
        .into_iter()
        .find(|(h, _)| h.first().map(String::as_str) == Some("storm clients"))
        .expect("a storm table");
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no {name:?} column in {header:?}"))
    };
    let (gave_up, cut_short) = (column("gave up"), column("cut short"));
    assert_eq!(rows.len(), storm.len());
    for (row, want) in rows.iter().zip(storm) {
        assert_eq!(row[0], want["clients"].to_string());
        let (o, n) = sides(&row[gave_up]);
        assert_eq!(o, want["old"]["gaveUp"].to_string(), "{row:?}");
        assert_eq!(n, want["new"]["gaveUp"].to_string(), "{row:?}");
        let yes_no = |v: &Value| if v == true { "yes" } else { "no" }.to_owned();
        assert_eq!(
            sides(&row[cut_short]),
            (
                yes_no(&want["old"]["truncated"]),
                yes_no(&want["new"]["truncated"])
            )
        );
    }
}

#[test]
fn adding_a_budget_moves_the_storm_and_shows_a_budget_section() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (dir.path().join("old.yaml"), dir.path().join("new.yaml"));
    let backoff = "  backoff: {strategy: exponential, base: 10ms, cap: 10m}\n";
    std::fs::write(&old, format!("{POLICY}{backoff}")).expect("write");
    std::fs::write(
        &new,
        format!("{POLICY}{backoff}  retryBudget: {{ratePerSecond: 100, burst: 10}}\n"),
    )
    .expect("write");
    let (old, new) = (old.to_str().expect("path"), new.to_str().expect("path"));
    let args = ["diff", old, new, "--clients", "200", "--samples", "500"];
    let json = rebound(&[&args[..], &["-o", "json"]].concat());
    assert_eq!(json.status.code(), Some(1));
    let doc: Value = serde_json::from_slice(&json.stdout).expect("JSON");
    let policy = &doc["policies"][0];
    let budget = &policy["retryBudget"];
    assert_eq!(budget["old"], Value::Null);
    assert_eq!(budget["new"]["ratePerSecond"], 100);
    assert!(budget["new"]["stretched"].as_u64() > Some(0));
    let storm = &policy["storm"][0];
    assert_ne!(
        (&storm["old"]["calls"], &storm["old"]["completionMs"]),
        (&storm["new"]["calls"], &storm["new"]["completionMs"]),
        "the budget moves the storm's figures"
    );
    assert!(storm["new"]["busiestSlot"].as_u64() <= Some(10));
    assert_eq!(storm["old"].get("busiestSlot"), None);

    let markdown = rebound(&args);
    let text = String::from_utf8(markdown.stdout).expect("UTF-8");
    let (header, rows) = tables(&text)
        .into_iter()
        .find(|(h, _)| h.first().is_some_and(|c| c.starts_with("retry budget")))
        .expect("a budget section");
    assert_eq!(header.len(), 2);
    let row = |label: &str| {
        rows.iter()
            .find(|r| r[0] == label)
            .unwrap_or_else(|| panic!("no {label:?} row in {rows:?}"))
    };
    assert_eq!(
        sides(&row("budget")[1]),
        ("none".to_owned(), "100/s, burst 10".to_owned())
    );
    assert_eq!(
        sides(&row("moved later")[1]).1,
        budget["new"]["stretched"].to_string()
    );
}
