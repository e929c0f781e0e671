//! Queue and error-class patterns: exact names or `*` globs.
//!
//! One matcher serves queue routing and non-retryable error classes, and one ordering
//! (`Specificity`) decides which of several matching patterns wins, so the operator's
//! conflict report and the sidecar's lookup can never disagree.

use std::cmp::Ordering;

/// The regular expression the CRD schema uses for queue names, patterns and error classes.
pub const NAME_PATTERN: &str = r"^[A-Za-z0-9*][A-Za-z0-9._:/@*-]*$";
/// The same grammar without `*`, for names that must not be patterns (dead-letter queues).
pub const PLAIN_NAME_PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9._:/@-]*$";
/// Longest accepted queue name, pattern or error class.
pub const MAX_NAME_LEN: usize = 253;

/// Why a name or pattern was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("must not be empty")]
    Empty,
    #[error("must be at most {MAX_NAME_LEN} characters")]
    TooLong,
    #[error(
        "must start with a letter, digit or '*' and use only letters, digits, '.', '_', ':', '/', '@', '-' and '*'"
    )]
    BadCharacter,
    #[error("must be a plain name without '*'")]
    WildcardNotAllowed,
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'/' | b'@' | b'-' | b'*')
}

/// Checks a pattern (globs allowed) against the grammar the CRD enforces.
pub fn check_pattern(text: &str) -> Result<(), PatternError> {
    let bytes = text.as_bytes();
    let Some(&first) = bytes.first() else {
        return Err(PatternError::Empty);
    };
    if bytes.len() > MAX_NAME_LEN {
        return Err(PatternError::TooLong);
    }
    if !(first.is_ascii_alphanumeric() || first == b'*') || !bytes.iter().all(|&b| is_name_byte(b))
    {
        return Err(PatternError::BadCharacter);
    }
    Ok(())
}

/// Checks a plain name (no globs), e.g. a dead-letter queue.
pub fn check_name(text: &str) -> Result<(), PatternError> {
    check_pattern(text)?;
    if text.contains('*') {
        return Err(PatternError::WildcardNotAllowed);
    }
    Ok(())
}

/// The canonical form of a pattern: every run of `*` collapsed into one, so patterns
/// that match the same names compare equal (`webhooks-**` is `webhooks-*`).
pub fn normalize(pattern: &str) -> std::borrow::Cow<'_, str> {
    if !pattern.contains("**") {
        return std::borrow::Cow::Borrowed(pattern);
    }
    let mut out = String::with_capacity(pattern.len());
    for c in pattern.chars() {
        if !(c == '*' && out.ends_with('*')) {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (also none).
/// Prepares the pattern on every call; hot paths keep a [`Glob`].
pub fn matches(pattern: &str, name: &str) -> bool {
    Glob::new(pattern).matches(name)
}

/// A pattern prepared for matching in time linear in the name and the pattern, whatever
/// both contain: the literal prefix (before the first `*`) and suffix (after the last)
/// are compared in place, the suffix from its end; the literal runs between stars are
/// found leftmost-first with Knuth–Morris–Pratt, which is exact for `*`-only globs. At
/// most `|prefix| + |suffix| + 2·|name| + Σ|run|` byte steps, never a backtrack.
///
/// The parts are `u32` offsets into the pattern's own text: one allocation per glob, plus
/// one for the runs of a pattern with a star in the middle (tables hold thousands of
/// globs). A pattern longer than `u32::MAX` bytes is kept as text that matches nothing
/// but itself compared whole; no input reaches that (documents are at most 8 MiB).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glob {
    text: Box<str>,
    /// `None` for an exact name.
    stars: Option<Stars>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stars {
    /// `text[..prefix_end]` comes before the first `*`.
    prefix_end: u32,
    /// `text[suffix_start..]` comes after the last `*`.
    suffix_start: u32,
    runs: Box<[Run]>,
}

/// A literal run between two stars, `text[start..start + failure.len()]`, with its KMP
/// failure table.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Run {
    start: u32,
    /// `failure[i]`: length of the longest proper border of the run's first `i + 1` bytes.
    failure: Box<[u32]>,
}

impl Run {
    /// `bytes` and `start` fit in `u32` (checked by [`Stars::of`]).
    fn new(bytes: &[u8], start: u32) -> Self {
        let mut failure = vec![0u32; bytes.len()];
        let mut k = 0usize;
        for i in 1..bytes.len() {
            while k > 0 && bytes[i] != bytes[k] {
                k = failure[k - 1] as usize;
            }
            if bytes[i] == bytes[k] {
                k += 1;
            }
            failure[i] = k as u32;
        }
        Self {
            start,
            failure: failure.into(),
        }
    }

    /// End of the leftmost occurrence in `text` of this run of `pattern`. Each step either
    /// advances in `text` or shrinks the partial match, so steps ≤ 2·|text|.
    fn find_end(&self, pattern: &[u8], text: &[u8], steps: &mut u64) -> Option<usize> {
        let start = self.start as usize;
        let bytes = &pattern[start..start + self.failure.len()];
        let mut k = 0;
        for (i, &b) in text.iter().enumerate() {
            *steps += 1;
            while k > 0 && b != bytes[k] {
                *steps += 1;
                k = self.failure[k - 1] as usize;
            }
            if b == bytes[k] {
                k += 1;
                if k == bytes.len() {
                    return Some(i + 1);
                }
            }
        }
        None
    }
}

impl Glob {
    pub fn new(pattern: &str) -> Self {
        Self {
            stars: Stars::of(pattern),
            text: pattern.into(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The literal text before the first `*` (all of it for an exact name).
    pub fn literal_prefix(&self) -> &[u8] {
        Stars::literal_prefix(self.stars.as_ref(), self.text.as_bytes())
    }

    pub fn matches(&self, name: &str) -> bool {
        self.matches_counting(name, &mut 0)
    }

    /// [`Glob::matches`], adding the byte steps taken to `steps` (for cost tests).
    pub fn matches_counting(&self, name: &str, steps: &mut u64) -> bool {
        Stars::matches(
            self.stars.as_ref(),
            self.text.as_bytes(),
            name.as_bytes(),
            steps,
        )
    }
}

impl Stars {
    /// The parts of `pattern`; `None` for an exact name (or a pattern too long for `u32`
    /// offsets, which then only matches itself).
    pub(crate) fn of(pattern: &str) -> Option<Self> {
        let bytes = pattern.as_bytes();
        let first = pattern.find('*')?;
        u32::try_from(bytes.len()).ok()?;
        let last = pattern.rfind('*').unwrap_or(first);
        let mut runs = Vec::new();
        let mut start = first + 1;
        for at in first + 1..=last {
            if bytes[at] == b'*' {
                if at > start {
                    runs.push(Run::new(&bytes[start..at], start as u32));
                }
                start = at + 1;
            }
        }
        Some(Stars {
            prefix_end: first as u32,
            suffix_start: last as u32 + 1,
            runs: runs.into(),
        })
    }

    /// The literal text of `pattern` before the first `*` (all of it for an exact name).
    pub(crate) fn literal_prefix<'a>(stars: Option<&Self>, pattern: &'a [u8]) -> &'a [u8] {
        match stars {
            Some(stars) => &pattern[..stars.prefix_end as usize],
            None => pattern,
        }
    }

    /// Whether `name` matches `pattern`, whose parts are `stars` (from [`Stars::of`]):
    /// the one matcher of [`Glob`] and of the policy table's packed globs.
    pub(crate) fn matches(
        stars: Option<&Self>,
        pattern: &[u8],
        name: &[u8],
        steps: &mut u64,
    ) -> bool {
        let Some(stars) = stars else {
            *steps += 1;
            return name == pattern;
        };
        let (prefix, suffix) = (
            &pattern[..stars.prefix_end as usize],
            &pattern[stars.suffix_start as usize..],
        );
        if name.len() < prefix.len() + suffix.len() {
            *steps += 1;
            return false;
        }
        // The suffix from its last byte: names differing at the end fail at once.
        for (a, b) in name.iter().rev().zip(suffix.iter().rev()) {
            *steps += 1;
            if a != b {
                return false;
            }
        }
        for (a, b) in name.iter().zip(prefix) {
            *steps += 1;
            if a != b {
                return false;
            }
        }
        let mut rest = &name[prefix.len()..name.len() - suffix.len()];
        for run in &stars.runs {
            match run.find_end(pattern, rest, steps) {
                Some(end) => rest = &rest[end..],
                None => return false,
            }
        }
        true
    }
}

/// How specific a pattern is; greater is more specific.
/// An exact name beats any glob; among globs a longer literal prefix wins, then more
/// literal characters overall.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Specificity {
    exact: bool,
    literal_prefix: usize,
    literal_chars: usize,
}

impl Specificity {
    pub fn of(pattern: &str) -> Self {
        let literal_prefix = pattern.find('*').unwrap_or(pattern.len());
        Self {
            exact: literal_prefix == pattern.len(),
            literal_prefix,
            literal_chars: pattern.bytes().filter(|&b| b != b'*').count(),
        }
    }
}

/// Orders policies for precedence between equally specific patterns: the older policy
/// first, then the name that sorts first. `Ordering::Less` means `a` wins.
pub fn policy_order(a: (Option<i64>, &str), b: (Option<i64>, &str)) -> Ordering {
    created_order(a.0, b.0).then_with(|| a.1.cmp(b.1))
}

/// Older first; a policy without a creation time (not yet stored) sorts after stored ones.
fn created_order(a: Option<i64>, b: Option<i64>) -> Ordering {
    match (a, b) {
        (Some(a), Some(b)) => a.cmp(&b),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn glob_matching() {
        assert!(matches("webhooks", "webhooks"));
        assert!(!matches("webhooks", "webhook"));
        assert!(matches("*", ""));
        assert!(matches("*", "anything"));
        assert!(matches("web*", "webhooks"));
        assert!(matches("*hooks", "webhooks"));
        assert!(matches("w*h*s", "webhooks"));
        assert!(!matches("w*x*s", "webhooks"));
        assert!(matches("a*b*c", "aXbYbZc"));
        assert!(!matches("a*b", "aXbYc"));
        assert!(matches("**", "x"));
    }

    #[test]
    fn grammar() {
        assert_eq!(check_pattern(""), Err(PatternError::Empty));
        assert_eq!(check_pattern("web hooks"), Err(PatternError::BadCharacter));
        assert_eq!(check_pattern("-x"), Err(PatternError::BadCharacter));
        assert_eq!(check_pattern("q?"), Err(PatternError::BadCharacter));
        assert_eq!(check_pattern(&"a".repeat(254)), Err(PatternError::TooLong));
        assert_eq!(check_pattern("emails:high/priority@eu-1.*"), Ok(()));
        assert_eq!(check_name("dlq.*"), Err(PatternError::WildcardNotAllowed));
    }

    #[test]
    fn specificity_orders_exact_then_prefix() {
        let more_specific = |a: &str, b: &str| Specificity::of(a) > Specificity::of(b);
        assert!(more_specific("emails", "email*"));
        assert!(more_specific("email*", "e*"));
        assert!(more_specific("e*", "*"));
        assert!(more_specific("a*b*c", "a*b"));
    }

    #[test]
    fn older_policy_wins_then_name() {
        assert_eq!(policy_order((Some(5), "z"), (Some(9), "a")), Ordering::Less);
        assert_eq!(policy_order((Some(5), "a"), (Some(5), "b")), Ordering::Less);
        assert_eq!(policy_order((None, "a"), (Some(9), "b")), Ordering::Greater);
    }

    proptest! {
        #[test]
        fn literal_pattern_matches_only_itself(a in "[a-z.]{0,12}", b in "[a-z.]{0,12}") {
            prop_assert_eq!(matches(&a, &b), a == b);
        }

        #[test]
        fn glob_agrees_with_a_dynamic_programming_oracle(pattern in "[ab*]{0,10}", name in "[ab]{0,12}") {
            // table[i][j]: pattern[..i] matches name[..j].
            let (p, n) = (pattern.as_bytes(), name.as_bytes());
            let mut table = vec![vec![false; n.len() + 1]; p.len() + 1];
            table[0][0] = true;
            for i in 1..=p.len() {
                for j in 0..=n.len() {
                    table[i][j] = if p[i - 1] == b'*' {
                        table[i - 1][j] || (j > 0 && table[i][j - 1])
                    } else {
                        j > 0 && p[i - 1] == n[j - 1] && table[i - 1][j - 1]
                    };
                }
            }
            prop_assert_eq!(matches(&pattern, &name), table[p.len()][n.len()]);
        }

        #[test]
        fn star_splits_match_any_infix(prefix in "[a-z]{0,6}", mid in "[a-z]{0,6}", suffix in "[a-z]{0,6}") {
            let pattern = format!("{prefix}*{suffix}");
            let name = format!("{prefix}{mid}{suffix}");
            prop_assert!(matches(&pattern, &name));
        }
    }
}
