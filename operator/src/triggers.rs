//! Which namespaces a watch event makes stale.
//!
//! The operator reconciles namespaces, not objects. A RetryPolicy event matters only when
//! the policy appears, disappears or gets a new generation: status writes (ours included)
//! change neither, so they trigger nothing. Any event on a ConfigMap of ours' name matters
//! (drift, a foreign one appearing, a deletion). After a re-list, deletions missed during
//! the gap come as no event at all, so every namespace the re-list touches is reconciled.
//! The one status field that triggers is a person's rollout request
//! (`status.rollout.request.id`): only policies that carry one are remembered for it.

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::DynamicObject;
use kube::runtime::watcher::Event;
use kube::{Resource, ResourceExt};

/// Per policy uid: (namespace, generation) as last seen.
type Seen = HashMap<String, (String, i64)>;

/// Turns watch events into namespaces to reconcile.
#[derive(Default)]
pub struct Triggers {
    seen: Seen,
    /// Per policy uid, the id of the rollout request last seen (only policies with one).
    requests: HashMap<String, String>,
    /// Re-list in progress, per watch stream.
    relisting: HashMap<usize, Seen>,
    known: BTreeSet<String>,
}

impl Triggers {
    /// A RetryPolicy event from watch stream `stream`, which covers `scope` (a namespace,
    /// or all when `None`).
    pub fn policy(
        &mut self,
        stream: usize,
        scope: Option<&str>,
        event: &Event<DynamicObject>,
    ) -> Vec<String> {
        match event {
            Event::Apply(obj) => {
                let Some((uid, ns, generation)) = identity(obj) else {
                    return Vec::new();
                };
                let mut changed = self.seen.get(&uid) != Some(&(ns.clone(), generation));
                match request_id(obj) {
                    Some(id) if self.requests.get(&uid) != Some(&id) => {
                        changed = true;
                        self.requests.insert(uid.clone(), id);
                    }
                    Some(_) => {}
                    None => {
                        self.requests.remove(&uid);
                    }
                }
                self.seen.insert(uid, (ns.clone(), generation));
                self.known.insert(ns.clone());
                if changed { vec![ns] } else { Vec::new() }
            }
            Event::Delete(obj) => {
                let Some((uid, ns, _)) = identity(obj) else {
                    return Vec::new();
                };
                self.seen.remove(&uid);
                self.requests.remove(&uid);
                vec![ns]
            }
            Event::Init => {
                self.relisting.insert(stream, Seen::new());
                Vec::new()
            }
            Event::InitApply(obj) => {
                if let Some((uid, ns, generation)) = identity(obj) {
                    self.relisting
                        .entry(stream)
                        .or_default()
                        .insert(uid, (ns, generation));
                }
                Vec::new()
            }
            Event::InitDone => {
                let fresh = self.relisting.remove(&stream).unwrap_or_default();
                let in_scope = |ns: &str| scope.is_none_or(|s| s == ns);
                let mut touched: BTreeSet<String> = self
                    .seen
                    .values()
                    .map(|(ns, _)| ns.clone())
                    .filter(|ns| in_scope(ns))
                    .collect();
                touched.extend(self.known.iter().filter(|ns| in_scope(ns)).cloned());
                self.seen.retain(|_, (ns, _)| !in_scope(ns));
                for (uid, (ns, generation)) in fresh {
                    touched.insert(ns.clone());
                    self.seen.insert(uid, (ns, generation));
                }
                self.known.extend(touched.iter().cloned());
                touched.into_iter().collect()
            }
        }
    }

    /// An event on a ConfigMap with the operator's ConfigMap name.
    pub fn configmap(&mut self, event: &Event<ConfigMap>) -> Vec<String> {
        match event {
            Event::Apply(cm) | Event::Delete(cm) | Event::InitApply(cm) => match cm.namespace() {
                Some(ns) => {
                    self.known.insert(ns.clone());
                    vec![ns]
                }
                None => Vec::new(),
            },
            Event::Init | Event::InitDone => Vec::new(),
        }
    }
}

/// `status.rollout.request.id`, if the policy carries a request.
fn request_id(obj: &DynamicObject) -> Option<String> {
    obj.data
        .pointer("/status/rollout/request/id")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

fn identity(obj: &DynamicObject) -> Option<(String, String, i64)> {
    let meta = obj.meta();
    Some((
        meta.uid.clone()?,
        meta.namespace.clone()?,
        meta.generation.unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(ns: &str, uid: &str, generation: i64) -> DynamicObject {
        let mut obj = DynamicObject::new(uid, &crate::objects::policy_resource()).within(ns);
        obj.metadata.uid = Some(uid.to_owned());
        obj.metadata.generation = Some(generation);
        obj
    }

    #[test]
    fn status_only_changes_trigger_nothing() {
        let mut t = Triggers::default();
        assert_eq!(t.policy(0, None, &Event::Apply(policy("a", "1", 1))), ["a"]);
        // Same generation again: a status write.
        assert!(
            t.policy(0, None, &Event::Apply(policy("a", "1", 1)))
                .is_empty()
        );
        assert_eq!(t.policy(0, None, &Event::Apply(policy("a", "1", 2))), ["a"]);
        assert_eq!(
            t.policy(0, None, &Event::Delete(policy("a", "1", 2))),
            ["a"]
        );
    }

    #[test]
    fn a_new_rollout_request_triggers_once() {
        let mut t = Triggers::default();
        let with = |id: &str| {
            let mut p = policy("a", "1", 1);
            p.data["status"] = serde_json::json!({"rollout": {"request": {"id": id}}});
            Event::Apply(p)
        };
        assert_eq!(t.policy(0, None, &with("r1")), ["a"]);
        assert!(t.policy(0, None, &with("r1")).is_empty());
        assert_eq!(t.policy(0, None, &with("r2")), ["a"]);
    }

    #[test]
    fn relist_reconciles_namespaces_whose_policies_vanished() {
        let mut t = Triggers::default();
        t.policy(0, None, &Event::Apply(policy("gone", "1", 1)));
        t.policy(0, None, &Event::Apply(policy("kept", "2", 1)));
        t.policy(0, None, &Event::Init);
        t.policy(0, None, &Event::InitApply(policy("kept", "2", 1)));
        let touched = t.policy(0, None, &Event::InitDone);
        assert_eq!(touched, ["gone", "kept"]);
        // After the re-list the surviving policy is known: no trigger for the same generation.
        assert!(
            t.policy(0, None, &Event::Apply(policy("kept", "2", 1)))
                .is_empty()
        );
    }

    #[test]
    fn relist_of_one_namespace_leaves_others_alone() {
        let mut t = Triggers::default();
        t.policy(0, Some("a"), &Event::Apply(policy("a", "1", 1)));
        t.policy(1, Some("b"), &Event::Apply(policy("b", "2", 1)));
        t.policy(1, Some("b"), &Event::Init);
        assert_eq!(t.policy(1, Some("b"), &Event::InitDone), ["b"]);
        assert!(
            t.policy(0, Some("a"), &Event::Apply(policy("a", "1", 1)))
                .is_empty()
        );
    }

    #[test]
    fn any_configmap_event_triggers_its_namespace() {
        let mut t = Triggers::default();
        let mut cm = ConfigMap::default();
        cm.metadata.namespace = Some("x".to_owned());
        assert_eq!(t.configmap(&Event::Delete(cm)), ["x"]);
    }
}
