//! Watch caches that hold only what reconciles read, grouped by namespace.
//!
//! kube-runtime's reflector stores every object as it was decoded (a RetryPolicy as an
//! untyped JSON tree, a ConfigMap with its whole document), and a reconcile of one
//! namespace had to scan the objects of all of them. These caches keep one small view per
//! object instead ([`crate::objects::PolicyView`], [`crate::objects::ConfigMapView`]),
//! made once when the watch event arrives, so memory grows by a few hundred bytes per
//! policy and a reconcile reads only its own namespace.
//!
//! A re-list replaces the cache in place: objects listed again are updated, and the ones
//! the list did not mention are removed when it ends, so a re-list never holds two copies.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use kube::runtime::watcher::Event;

/// One object's view and the re-list it was last seen in.
struct Entry<T> {
    epoch: u64,
    view: Arc<T>,
}

struct Inner<T> {
    /// namespace → name → view.
    namespaces: HashMap<String, HashMap<String, Entry<T>>>,
    /// Incremented at the start of each (re-)list.
    epoch: u64,
}

/// A shared cache of views `T` of the objects of one watch stream.
pub struct Cache<T> {
    inner: Arc<RwLock<Inner<T>>>,
}

impl<T> Clone for Cache<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Self {
            inner: Arc::new(RwLock::new(Inner {
                namespaces: HashMap::new(),
                epoch: 0,
            })),
        }
    }
}

/// Where an object lives and what is kept of it.
pub struct Keyed<T> {
    pub namespace: String,
    pub name: String,
    pub view: Option<T>,
}

impl<T> Cache<T> {
    /// Applies one watch event. `view` makes the key and view of an object; a `None` view
    /// (an object without the identity every stored object has) is not kept.
    pub fn apply<K>(&self, event: &Event<K>, view: impl Fn(&K) -> Keyed<T>) {
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let epoch = inner.epoch;
        match event {
            Event::Apply(obj) | Event::InitApply(obj) => {
                let Keyed {
                    namespace,
                    name,
                    view,
                } = view(obj);
                let names = inner.namespaces.entry(namespace).or_default();
                match view {
                    Some(view) => {
                        names.insert(
                            name,
                            Entry {
                                epoch,
                                view: Arc::new(view),
                            },
                        );
                    }
                    None => {
                        names.remove(&name);
                    }
                }
            }
            Event::Delete(obj) => {
                let Keyed {
                    namespace, name, ..
                } = view(obj);
                if let Some(names) = inner.namespaces.get_mut(&namespace) {
                    names.remove(&name);
                    if names.is_empty() {
                        inner.namespaces.remove(&namespace);
                    }
                }
            }
            Event::Init => inner.epoch += 1,
            Event::InitDone => {
                // What this list did not mention is gone.
                inner.namespaces.retain(|_, names| {
                    names.retain(|_, e| e.epoch == epoch);
                    !names.is_empty()
                });
            }
        }
    }

    /// Every view in `namespace`.
    pub fn in_namespace(&self, namespace: &str) -> Vec<Arc<T>> {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner
            .namespaces
            .get(namespace)
            .map(|names| names.values().map(|e| e.view.clone()).collect())
            .unwrap_or_default()
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<T>> {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner
            .namespaces
            .get(namespace)
            .and_then(|names| names.get(name))
            .map(|e| e.view.clone())
    }

    /// Objects held, all namespaces.
    pub fn len(&self) -> usize {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner.namespaces.values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (namespace, name, value)
    type Obj = (&'static str, &'static str, u32);

    fn keyed(o: &Obj) -> Keyed<u32> {
        Keyed {
            namespace: o.0.to_owned(),
            name: o.1.to_owned(),
            view: Some(o.2),
        }
    }

    fn values(cache: &Cache<u32>, ns: &str) -> Vec<u32> {
        let mut v: Vec<u32> = cache.in_namespace(ns).iter().map(|v| **v).collect();
        v.sort();
        v
    }

    #[test]
    fn applies_and_deletes_per_namespace() {
        let cache = Cache::default();
        cache.apply(&Event::Apply(("a", "x", 1)), keyed);
        cache.apply(&Event::Apply(("a", "y", 2)), keyed);
        cache.apply(&Event::Apply(("b", "x", 3)), keyed);
        cache.apply(&Event::Apply(("a", "x", 4)), keyed);
        assert_eq!(values(&cache, "a"), vec![2, 4]);
        assert_eq!(cache.get("b", "x").map(|v| *v), Some(3));
        cache.apply(&Event::Delete(("b", "x", 3)), keyed);
        assert_eq!(values(&cache, "b"), Vec::<u32>::new());
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn a_relist_removes_what_it_did_not_mention() {
        let cache = Cache::default();
        cache.apply(&Event::Init, keyed);
        cache.apply(&Event::InitApply(("a", "x", 1)), keyed);
        cache.apply(&Event::InitApply(("a", "y", 2)), keyed);
        cache.apply(&Event::InitApply(("b", "z", 3)), keyed);
        cache.apply(&Event::InitDone, keyed);
        assert_eq!(cache.len(), 3);
        // Re-list after a watch gap: y and z were deleted meanwhile, x changed.
        cache.apply(&Event::Init, keyed);
        cache.apply(&Event::InitApply(("a", "x", 5)), keyed);
        // Until the list ends, the old objects are still served.
        assert_eq!(values(&cache, "a"), vec![2, 5]);
        cache.apply(&Event::InitDone, keyed);
        assert_eq!(values(&cache, "a"), vec![5]);
        assert!(cache.get("b", "z").is_none());
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn an_object_without_identity_is_not_kept() {
        let cache = Cache::default();
        cache.apply(&Event::Apply(("a", "x", 1)), keyed);
        cache.apply(&Event::Apply(("a", "x", 2)), |o: &Obj| Keyed {
            view: None,
            ..keyed(o)
        });
        assert!(cache.get("a", "x").is_none());
    }
}
