//! Durations read identically by the API server and the core: grammar-valid strings from
//! a fixed seed (fraction digits up to 18, values near both bounds, up to the length
//! limit and past it), each judged as the API server judges it — the CRD's `maxLength`
//! and `pattern` (Go's regexp), then Go's `time.ParseDuration` (behind CEL's
//! `duration()`) and the two bound rules — and by [`KubeDuration::parse`]. Both must
//! accept with the same nanoseconds, or both refuse.
//!
//! Needs Go (`policy/testdata/goduration`); skipped with a message when `go` is absent.
//! `DURATION_CASES=2000000 cargo test -p rebound-policy --test go_duration -- --nocapture`
//! is the long run (200,000 by default).

use std::{
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use rebound_policy::duration::{DURATION_PATTERN, KubeDuration, MAX_DURATION_LEN, MAX_DURATION_MS};

/// A fixed seed: the same strings on every run.
type Rng = rebound_policy::decide::SplitMix64;

/// `n` digits onto `out`; runs of 9s and 0s reach the rounding edges far more often than
/// uniform digits.
fn digits(rng: &mut Rng, n: u64, out: &mut String) {
    let style = rng.below(4);
    for _ in 0..n {
        let d = match style {
            0 => 9,
            1 if out.is_empty() => 0,
            1 => [0, 0, 0, 1][rng.below(4) as usize],
            _ => rng.below(10),
        };
        out.push(char::from(b'0' + d as u8));
    }
}

/// One string of the grammar `([0-9]+(\.[0-9]+)?(ms|s|m|h))+`.
fn duration(rng: &mut Rng) -> String {
    let mut out = String::new();
    let parts = 1 + rng.below(3);
    for _ in 0..parts {
        let int_len = match rng.below(6) {
            0 => 0, // written as a single 0 below
            1 => 4,
            _ => 1 + rng.below(2),
        };
        if int_len == 0 {
            out.push('0');
        } else {
            let mut int = String::new();
            digits(rng, int_len, &mut int);
            out.push_str(&int);
        }
        if rng.below(3) > 0 {
            out.push('.');
            let frac_len = match rng.below(4) {
                0 => 10 + rng.below(9),
                1 => 9,
                _ => 1 + rng.below(9),
            };
            let mut frac = String::new();
            digits(rng, frac_len, &mut frac);
            out.push_str(&frac);
        }
        out.push_str(["ms", "s", "m", "h"][rng.below(4) as usize]);
    }
    out
}

/// Strings near the bounds and the examples of the issue, then the generated ones.
fn cases(n: usize) -> Vec<String> {
    let mut all: Vec<String> = [
        "0.9999999999999999ms",
        "0.999999999ms",
        "1ms",
        "1.000000001ms",
        "0.9999999999999999s",
        "8760h",
        "8759h59m59.999999999s",
        "8760h0.000000001s",
        "525600m",
        "525600.000000001m",
        "31536000s",
        "9223372036854775807ms",
        "0.000000001h",
    ]
    .map(String::from)
    .to_vec();
    let mut rng = Rng::new(0x0038_d0a7);
    while all.len() < n {
        all.push(duration(&mut rng));
    }
    all
}

/// Runs the Go program on `inputs`: per line, whether the pattern matches and the
/// nanoseconds (`None` for a parse error). `None` when Go is not installed.
fn go_verdicts(inputs: &[String]) -> Option<Vec<(bool, Option<i64>)>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/goduration");
    let child = Command::new("go")
        .args(["run", ".", DURATION_PATTERN])
        .current_dir(&dir)
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("starting go: {e}"),
    };
    let mut stdin = child.stdin.take().expect("piped stdin");
    let text = inputs.join("\n") + "\n";
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().expect("go runs");
    writer.join().expect("writer").expect("stdin written");
    assert!(out.status.success(), "goduration failed: {:?}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    let verdicts: Vec<_> = stdout
        .lines()
        .map(|line| {
            let (matched, value) = line.split_once(' ').expect("two fields");
            (matched == "1", value.parse::<i64>().ok())
        })
        .collect();
    assert_eq!(verdicts.len(), inputs.len(), "one line per input");
    Some(verdicts)
}

#[test]
fn the_api_server_and_the_core_read_every_duration_alike() {
    let n = std::env::var("DURATION_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let inputs = cases(n);
    let Some(go) = go_verdicts(&inputs) else {
        eprintln!("SKIPPED: `go` is not on PATH; install Go to compare with time.ParseDuration");
        return;
    };
    let (min, max) = (1_000_000i64, (MAX_DURATION_MS * 1_000_000) as i64);
    let mut disagree = Vec::new();
    let (mut accepted, mut long_fractions) = (0, 0);
    for (text, &(matched, go_nanos)) in inputs.iter().zip(&go) {
        // What admission does: maxLength, pattern, then the two CEL bound rules.
        let api = go_nanos
            .filter(|ns| text.len() <= MAX_DURATION_LEN && matched && (min..=max).contains(ns));
        let core = KubeDuration::parse(text)
            .and_then(|d| d.check())
            .ok()
            .map(|ns| ns as i64);
        if api != core {
            disagree.push(format!("{text}: API {api:?}, core {core:?}"));
        }
        accepted += usize::from(core.is_some());
        long_fractions += usize::from(
            text.split(['.'])
                .skip(1)
                .any(|f| f.bytes().take_while(u8::is_ascii_digit).count() > 9),
        );
    }
    eprintln!(
        "{n} strings: {accepted} accepted by both, {long_fractions} with over 9 fraction digits, {} disagreements",
        disagree.len()
    );
    assert!(
        accepted > n / 10 && long_fractions > n / 10,
        "cases cover both sides"
    );
    assert!(
        disagree.is_empty(),
        "{} of {n} differ, e.g.:\n{}",
        disagree.len(),
        disagree[..disagree.len().min(20)].join("\n")
    );
}
