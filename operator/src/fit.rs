//! What goes into a namespace's document when the whole does not fit a ConfigMap: the
//! order that keeps what is served and leaves out what changed. Pure: the reconcile
//! supplies what the live document serves.

use std::collections::{HashMap, HashSet};

use rebound_policy::pattern::policy_order;
use rebound_policy::{PolicyOutcome, PolicySource, compile};

use crate::configmap::{Compressed, Desired, Overflow};
use crate::rollout::Plans;
use crate::status::Blocked;

/// What a namespace's reconcile writes: the compilation of the policies that fit, its
/// document, and why each policy left out was left out.
pub struct Fitted {
    pub compilation: rebound_policy::Compilation,
    pub desired: Desired,
    /// By policy name.
    pub left_out: HashMap<String, Blocked>,
}

/// A namespace whose whole document passes a limit.
pub struct Over {
    sources: Vec<PolicySource>,
    overflow: Overflow,
    /// Names of the policies that fail validation: they take no room in the document.
    invalid: HashSet<String>,
}

/// The policies the live document serves: uid → generation.
pub type Served = HashMap<String, i64>;

/// Compiles a namespace's policies into one document, or says which limit it passes.
pub fn fit_all(
    namespace: &str,
    sources: Vec<PolicySource>,
    plans: &Plans,
    has_policies: bool,
    last: &mut Compressed,
) -> Result<Fitted, Over> {
    let (compilation, desired) = attempt(namespace, sources.clone(), plans, has_policies, last);
    match desired {
        Ok(desired) => Ok(Fitted {
            compilation,
            desired,
            left_out: HashMap::new(),
        }),
        Err(overflow) => Err(Over {
            invalid: compilation
                .outcomes
                .iter()
                .filter(|(_, o)| matches!(o, PolicyOutcome::Invalid(_)))
                .map(|(name, _)| name.clone())
                .collect(),
            sources,
            overflow,
        }),
    }
}

/// Fits a namespace whose whole document passes a limit, so that a change never takes
/// down what is served: the policies the live document serves at their current
/// generation come first, then every other valid one (new, edited, fixed, or left out
/// before), each group in policy order (older first, then by name); the longest prefix of
/// that order that fits is compiled, and the rest report `DocumentTooLarge` with the
/// limit the whole passed. Invalid policies take no room: they are compiled (to report
/// `InvalidSpec`) but never counted as left out.
pub fn fit_within(
    namespace: &str,
    over: Over,
    served: &Served,
    plans: &Plans,
    has_policies: bool,
    last: &mut Compressed,
) -> Fitted {
    let Over {
        sources,
        overflow,
        invalid,
    } = over;
    let (invalid, mut ordered): (Vec<PolicySource>, Vec<PolicySource>) =
        sources.into_iter().partition(|s| invalid.contains(&s.name));
    let fresh = |s: &PolicySource| served.get(&s.uid) != Some(&s.generation);
    ordered.sort_by(|a, b| {
        fresh(a)
            .cmp(&fresh(b))
            .then_with(|| policy_order((a.created, &a.name), (b.created, &b.name)))
    });
    let with_invalid = |prefix: &[PolicySource]| {
        let mut all = prefix.to_vec();
        all.extend(invalid.iter().cloned());
        all
    };
    // The longest prefix that fits: none always does (a document without policies).
    let (mut fits, mut too_many) = (0, ordered.len());
    while too_many - fits > 1 {
        let mid = fits + (too_many - fits) / 2;
        let (_, desired) = attempt(
            namespace,
            with_invalid(&ordered[..mid]),
            plans,
            has_policies,
            &mut None,
        );
        if desired.is_ok() {
            fits = mid;
        } else {
            too_many = mid;
        }
    }
    let rest = ordered.split_off(fits);
    let (compilation, desired) =
        attempt(namespace, with_invalid(&ordered), plans, has_policies, last);
    let (compilation, desired) = match desired {
        Ok(desired) => (compilation, desired),
        // Unreachable in practice (the prefix was just tried); the empty document fits.
        Err(_) => {
            let compilation = compile(namespace, Vec::new());
            let desired = Desired {
                json: compilation.document.to_json(),
                hash: compilation.document.hash.clone(),
                has_policies,
                compressed: None,
            };
            (compilation, desired)
        }
    };
    let too_large = Blocked::TooLarge {
        limit: overflow.limit.name(),
        bytes: overflow.bytes,
        max: overflow.limit.bytes(),
        served: compilation.document.policies.len(),
    };
    let left_out = rest
        .into_iter()
        .map(|s| (s.name, too_large.clone()))
        .collect();
    Fitted {
        compilation,
        desired,
        left_out,
    }
}

/// Compiles `sources`, puts in the rollouts' revisions, and stores the document as it
/// would be written.
fn attempt(
    namespace: &str,
    sources: Vec<PolicySource>,
    plans: &Plans,
    has_policies: bool,
    last: &mut Compressed,
) -> (rebound_policy::Compilation, Result<Desired, Overflow>) {
    let mut compilation = compile(namespace, sources);
    if crate::rollout::apply(&mut compilation.document.policies, plans) {
        let policies = std::mem::take(&mut compilation.document.policies);
        compilation.document = rebound_policy::CompiledDocument::new(namespace, policies);
    }
    let desired = Desired::new(
        compilation.document.to_json(),
        compilation.document.hash.clone(),
        has_policies,
        last,
    );
    (compilation, desired)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rebound_policy::compiled::MAX_DOCUMENT_BYTES;

    /// A policy of pseudo-random queue names and error classes (fixed seed): about 19 KiB
    /// gzip'd, so about 47 fill the ConfigMap limit.
    fn noisy(i: usize, spec: serde_json::Value) -> PolicySource {
        let mut x = i as u64 + 1;
        let mut noise = |kind: &str, j: usize| {
            let text: String = (0..230)
                .map(|_| {
                    x = rebound_policy::decide::mix64(x);
                    char::from(b'a' + (x % 26) as u8)
                })
                .collect();
            format!("{kind}-{i}-{j}-{text}")
        };
        let mut spec = spec;
        spec["queues"] = (0..64).map(|j| noise("q", j)).collect();
        spec["nonRetryableErrors"] = (0..64).map(|j| noise("e", j)).collect();
        PolicySource {
            name: format!("p{i:02}"),
            namespace: "ns".to_owned(),
            uid: format!("uid-{i}"),
            generation: 1,
            created: Some(0),
            spec: serde_json::from_value(spec).expect("spec"),
        }
    }

    #[test]
    fn over_the_limit_what_is_served_stays_and_invalid_policies_are_not_left_out() {
        let invalid = serde_json::json!({"backoff": {"base": "10s", "cap": "1s"}});
        let sources: Vec<PolicySource> = (0..60)
            .map(|i| {
                noisy(
                    i,
                    if i == 10 {
                        invalid.clone()
                    } else {
                        serde_json::json!({})
                    },
                )
            })
            .collect();
        // The youngest forty are served; p00 was served at an older generation.
        let mut served: Served = (20..60).map(|i| (format!("uid-{i}"), 1)).collect();
        served.insert("uid-0".to_owned(), 0);
        let Err(over) = fit_all("ns", sources, &Plans::new(), true, &mut None) else {
            panic!("60 policies of 19 KiB fit in 900 KiB");
        };
        assert_eq!(over.overflow.limit, crate::configmap::Limit::Compressed);
        let fitted = fit_within("ns", over, &served, &Plans::new(), true, &mut None);
        let compiled: HashSet<&str> = fitted
            .compilation
            .document
            .policies
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        for i in 20..60 {
            assert!(
                compiled.contains(format!("p{i:02}").as_str()),
                "p{i:02} evicted"
            );
        }
        assert!(!fitted.left_out.is_empty());
        assert!(
            !fitted.left_out.contains_key("p10"),
            "an invalid policy takes no room"
        );
        let outcome = fitted.compilation.outcomes.iter().find(|(n, _)| n == "p10");
        assert!(matches!(outcome, Some((_, PolicyOutcome::Invalid(_)))));
        for (name, why) in &fitted.left_out {
            assert!(!compiled.contains(name.as_str()));
            let Blocked::TooLarge {
                limit,
                bytes,
                max,
                served,
                ..
            } = why
            else {
                panic!("{name}: {why:?}");
            };
            assert_eq!((*limit, *max), ("compressed", MAX_DOCUMENT_BYTES));
            assert!(*bytes > MAX_DOCUMENT_BYTES);
            assert_eq!(*served, compiled.len());
        }
        // Every policy is compiled, invalid, or left out.
        assert_eq!(compiled.len() + 1 + fitted.left_out.len(), 60);
    }
}
