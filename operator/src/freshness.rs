//! Which is newer: the watch cache or the answer to our own last write?
//!
//! Right after a write the watch cache still holds the old object. Comparing against it
//! would write the same thing again (and move `lastTransitionTime`), so the reconcile
//! remembers what it wrote and uses whichever view is newer. An etcd-backed API server
//! issues resourceVersions as increasing integers, which is what makes them comparable.

use std::cmp::Ordering;

/// Orders two resourceVersions; `None` if either is not an integer.
pub fn compare(a: &str, b: &str) -> Option<Ordering> {
    let a: u64 = a.parse().ok()?;
    let b: u64 = b.parse().ok()?;
    Some(a.cmp(&b))
}

/// What we last wrote to one object and the resourceVersion the server answered with.
#[derive(Clone, Debug, PartialEq)]
pub struct Written<T> {
    pub resource_version: String,
    pub value: T,
}

/// The newest known state of one object. `cached` is the watch cache's view: the
/// object's resourceVersion and the part we compare (`None` inside when the object has no
/// such part), or `None` when the cache does not have the object at all.
pub fn newest<'a, T>(
    cached: Option<(&'a str, Option<&'a T>)>,
    written: Option<&'a Written<T>>,
) -> Option<&'a T> {
    let Some(w) = written else {
        return cached.and_then(|(_, v)| v);
    };
    let Some((rv, value)) = cached else {
        return Some(&w.value);
    };
    match compare(rv, &w.resource_version) {
        // The cache still shows what was there before our write.
        Some(Ordering::Less) => Some(&w.value),
        // The cache holds our write or something after it.
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(rv: &str, v: i32) -> Written<i32> {
        Written {
            resource_version: rv.to_owned(),
            value: v,
        }
    }

    #[test]
    fn compares_numerically() {
        assert_eq!(compare("9", "10"), Some(Ordering::Less));
        assert_eq!(compare("x", "10"), None);
    }

    #[test]
    fn stale_cache_loses_to_our_write() {
        let w = written("10", 2);
        assert_eq!(newest(Some(("9", Some(&1))), Some(&w)), Some(&2));
        assert_eq!(newest(Some(("10", Some(&2))), Some(&w)), Some(&2));
        assert_eq!(newest(Some(("11", Some(&3))), Some(&w)), Some(&3));
        // Changed by someone else after our write, and that change removed the part.
        assert_eq!(newest(Some(("11", None)), Some(&w)), None);
        assert_eq!(newest(None, Some(&w)), Some(&2));
        assert_eq!(newest(Some(("9", Some(&1))), None), Some(&1));
    }
}
