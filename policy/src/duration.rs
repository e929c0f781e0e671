//! Kubernetes-style duration strings (`250ms`, `30s`, `1h30m`).
//!
//! The grammar is Go's `time.ParseDuration` restricted to the units that make sense for
//! retry delays (`ms`, `s`, `m`, `h`) and to at most nine fraction digits per number, so
//! the API server's CEL `duration()` and this parser read every accepted string the same
//! way: Go computes a fraction in floating point, which for ten or more digits can land
//! 1 ns off the exact value (`0.9999999999999999ms` is 1 ms to Go); up to nine it is exact
//! (`policy/tests/go_duration.rs` compares the two on 200,000 strings). Bounds and comparisons use nanoseconds, as CEL
//! does; delays are then used at millisecond precision (a fractional millisecond is
//! truncated, which never changes the order of two durations).

use std::{borrow::Cow, fmt, str::FromStr};

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The regular expression the CRD schema uses for every duration field.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]{1,9})?(ms|s|m|h))+$";
/// Most fraction digits in one number of a duration.
pub const MAX_FRACTION_DIGITS: usize = 9;

/// Smallest accepted duration in milliseconds.
pub const MIN_DURATION_MS: u64 = 1;
/// Largest accepted duration in milliseconds (365 days, `8760h`).
pub const MAX_DURATION_MS: u64 = 8760 * 3_600_000;
const NANOS_PER_MS: u64 = 1_000_000;
/// Longest accepted duration string; bounds the cost of CEL rules on the API server.
pub const MAX_DURATION_LEN: usize = 32;

/// A duration written as a Kubernetes-style string, kept with the text the user wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeDuration {
    text: String,
    /// `None` when the text is not a duration (kept so validation can name the field).
    nanos: Option<u64>,
}

/// Why a duration string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error(
        "must be a duration such as 250ms, 30s or 1h30m (units ms, s, m, h; at most 9 fraction digits)"
    )]
    Malformed,
    #[error("must be at least 1ms")]
    TooSmall,
    #[error("must be at most 8760h")]
    TooLarge,
}

impl KubeDuration {
    /// Parses and bounds-checks a duration string.
    pub fn parse(text: &str) -> Result<Self, DurationError> {
        let nanos = bounded_nanos(text)?;
        Ok(Self {
            text: text.to_owned(),
            nanos: Some(nanos),
        })
    }

    /// Whole milliseconds (truncated); 0 for text that is not a duration — validate first.
    pub fn as_millis(&self) -> u64 {
        self.nanos.unwrap_or(0) / NANOS_PER_MS
    }

    /// Re-checks the grammar and bounds (a deserialized value keeps bad text) and returns
    /// the exact value in nanoseconds, for comparisons that must agree with CEL.
    pub fn check(&self) -> Result<u64, DurationError> {
        bounded_nanos(&self.text)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for KubeDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for KubeDuration {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

fn bounded_nanos(text: &str) -> Result<u64, DurationError> {
    let nanos = parse_nanos(text)?;
    if nanos < MIN_DURATION_MS * NANOS_PER_MS {
        return Err(DurationError::TooSmall);
    }
    if nanos > MAX_DURATION_MS * NANOS_PER_MS {
        return Err(DurationError::TooLarge);
    }
    Ok(nanos)
}

/// Parses the duration grammar into nanoseconds without applying the bounds.
/// Saturates instead of overflowing so absurd inputs fail the bound check, not the process.
fn parse_nanos(text: &str) -> Result<u64, DurationError> {
    if text.is_empty() || text.len() > MAX_DURATION_LEN {
        return Err(DurationError::Malformed);
    }
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut total: u128 = 0;
    while i < bytes.len() {
        let int_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i == int_start {
            return Err(DurationError::Malformed);
        }
        let int_part: u128 = text[int_start..i]
            .parse()
            .map_err(|_| DurationError::Malformed)?;
        let mut frac_digits = "";
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let frac_start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if i == frac_start || i - frac_start > MAX_FRACTION_DIGITS {
                return Err(DurationError::Malformed);
            }
            frac_digits = &text[frac_start..i];
        }
        let rest = &text[i..];
        let (unit, unit_len): (u128, usize) = if rest.starts_with("ms") {
            (1_000_000, 2)
        } else if rest.starts_with('s') {
            (1_000_000_000, 1)
        } else if rest.starts_with('m') {
            (60_000_000_000, 1)
        } else if rest.starts_with('h') {
            (3_600_000_000_000, 1)
        } else {
            return Err(DurationError::Malformed);
        };
        i += unit_len;
        let frac = frac_digits;
        let frac_value: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().map_err(|_| DurationError::Malformed)?
        };
        let frac_scale = 10u128.pow(frac.len() as u32);
        total = total
            .saturating_add(int_part.saturating_mul(unit))
            .saturating_add(frac_value.saturating_mul(unit) / frac_scale);
    }
    Ok(u64::try_from(total).unwrap_or(u64::MAX))
}

/// Renders milliseconds the way Go prints durations, without fractional units: `1h30m`, `1.5s`
/// is written as `1s500ms`.
pub fn format_millis(millis: u64) -> String {
    if millis == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    let mut rest = millis;
    for (unit, size) in [("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
        let n = rest / size;
        if n > 0 {
            out.push_str(&n.to_string());
            out.push_str(unit);
            rest -= n * size;
        }
    }
    out
}

/// Renders milliseconds for people, to about three significant figures: `374ms`, `1.13s`,
/// `3m45s`, `4h25m`. Not parseable back exactly; use [`format_millis`] for that.
pub fn format_approx(millis: u64) -> String {
    // Round first (half up, in integers, without an addition that could overflow near
    // u64::MAX), then pick the unit from the rounded value, so 59,999 ms reads `1m0s`,
    // never `60.0s`, and 3,599,999 ms `1h0m`, never `60m0s`.
    let round = |unit: u64| millis / unit + u64::from(millis % unit >= unit / 2);
    if millis < 1_000 {
        return format!("{millis}ms");
    }
    let centis = round(10);
    if centis < 1_000 {
        return format!("{}.{:02}s", centis / 100, centis % 100);
    }
    let decis = round(100);
    if decis < 600 {
        return format!("{}.{}s", decis / 10, decis % 10);
    }
    let secs = round(1_000);
    if secs < 3_600 {
        return format!("{}m{}s", secs / 60, secs % 60);
    }
    let mins = round(60_000);
    format!("{}h{}m", mins / 60, mins % 60)
}

impl Serialize for KubeDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for KubeDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        // Keep malformed text so validation can report it with its field path.
        let nanos = bounded_nanos(&text).ok();
        Ok(Self { text, nanos })
    }
}

impl JsonSchema for KubeDuration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "maxLength": MAX_DURATION_LEN,
            "pattern": DURATION_PATTERN,
            "x-kubernetes-validations": [
                {"rule": "duration(self) >= duration('1ms')", "message": "must be at least 1ms"},
                {"rule": "duration(self) <= duration('8760h')", "message": "must be at most 8760h"}
            ]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_style_durations() {
        let cases = [
            ("250ms", 250),
            ("30s", 30_000),
            ("1h30m", 5_400_000),
            ("1.5s", 1_500),
            ("2m0.5s", 120_500),
            ("1ms", 1),
            ("8760h", MAX_DURATION_MS),
        ];
        for (text, millis) in cases {
            assert_eq!(
                KubeDuration::parse(text).map(|d| d.as_millis()),
                Ok(millis),
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_bad_durations() {
        for text in [
            "",
            "10",
            "s",
            "-1s",
            "1d",
            "1 s",
            "1.s",
            "1us",
            "1ns",
            "1.5",
            // Ten fraction digits: Go would read this one as exactly 1s.
            "0.9999999999s",
            "0.9999999999999999ms",
        ] {
            assert_eq!(
                KubeDuration::parse(text),
                Err(DurationError::Malformed),
                "{text}"
            );
        }
        assert_eq!(KubeDuration::parse("0s"), Err(DurationError::TooSmall));
        assert_eq!(KubeDuration::parse("0.5ms"), Err(DurationError::TooSmall));
        assert_eq!(
            KubeDuration::parse("8760h0.5ms"),
            Err(DurationError::TooLarge)
        );
        assert_eq!(KubeDuration::parse("1.5ms").map(|d| d.as_millis()), Ok(1));
        assert_eq!(
            KubeDuration::parse("1.000000001s").and_then(|d| d.check()),
            Ok(1_000_000_001)
        );
        assert_eq!(KubeDuration::parse("8761h"), Err(DurationError::TooLarge));
        assert_eq!(
            KubeDuration::parse("99999999999999999999h"),
            Err(DurationError::TooLarge)
        );
    }

    #[test]
    fn formats_round_trip() {
        for millis in [1, 999, 1_000, 1_500, 60_000, 5_400_000, 90_061_001] {
            let text = format_millis(millis);
            assert_eq!(
                KubeDuration::parse(&text).map(|d| d.as_millis()),
                Ok(millis)
            );
        }
        assert_eq!(format_millis(5_400_000), "1h30m");
    }

    #[test]
    fn approximate_format_for_people() {
        assert_eq!(format_approx(374), "374ms");
        assert_eq!(format_approx(1_126), "1.13s");
        assert_eq!(format_approx(30_124), "30.1s");
        assert_eq!(format_approx(225_177), "3m45s");
        assert_eq!(format_approx(15_903_123), "4h25m");
        // Rounding never leaves a unit at its upper bound.
        for (millis, text) in [
            (9_994, "9.99s"),
            (9_995, "10.0s"),
            (59_949, "59.9s"),
            (59_950, "1m0s"),
            (59_999, "1m0s"),
            (3_599_499, "59m59s"),
            (3_599_500, "1h0m"),
            (3_599_999, "1h0m"),
        ] {
            assert_eq!(format_approx(millis), text, "{millis} ms");
        }
    }

    /// Rounding near the largest value neither overflows nor loses the carry.
    #[test]
    fn approximate_format_saturates_nothing_near_the_top() {
        assert_eq!(format_approx(u64::MAX), "5124095576030h26m");
        assert_eq!(format_approx(u64::MAX - 51_615), "5124095576030h25m");
        assert_eq!(format_approx(u64::MAX - 4), "5124095576030h26m");
    }
}
