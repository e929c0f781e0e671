//! The part of an object that one field manager owns, read from its `managedFields`.
//!
//! The operator writes a policy's status with server-side apply, so its own fields are the
//! ones the API server lists under its field manager. Another tool may add a condition type
//! or a field of its own to the same status (`kubectl apply --server-side
//! --subresource=status --field-manager=other-tool`): comparing the whole status with
//! what the operator wants would then differ forever and write it again and again.
//! Comparing only the projection onto the operator's fields makes such additions
//! invisible, while a field of ours that someone else took or changed still differs.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use serde_json::{Map, Value};

/// The union of the field sets `manager` owns in `subresource` (`""` for the main
/// resource), in the `FieldsV1` form (`{"f:status": {"f:conditions": {...}}}`); `None` when
/// it owns none.
pub fn fields_of(
    entries: &[ManagedFieldsEntry],
    manager: &str,
    subresource: &str,
) -> Option<Value> {
    let mut union: Option<Value> = None;
    for entry in entries.iter().filter(|e| {
        e.manager.as_deref() == Some(manager)
            && e.subresource.as_deref().unwrap_or_default() == subresource
    }) {
        let Some(fields) = entry.fields_v1.as_ref() else {
            continue;
        };
        match union.as_mut() {
            None => union = Some(fields.0.clone()),
            Some(u) => merge(u, &fields.0),
        }
    }
    union
}

fn merge(into: &mut Value, from: &Value) {
    let (Value::Object(into), Value::Object(from)) = (into, from) else {
        return;
    };
    for (key, value) in from {
        match into.get_mut(key) {
            Some(existing) => merge(existing, value),
            None => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

/// The part of `value` that the field set `fields` covers: `f:<name>` selects a member of
/// an object, `k:<json>` the list items whose key fields match, `v:<json>` a set item.
/// A field set without children (`{}` or only `"."`) covers the whole value.
/// `None` when nothing is covered.
pub fn project(value: &Value, fields: &Value) -> Option<Value> {
    let Value::Object(children) = fields else {
        return Some(value.clone());
    };
    if children.keys().all(|k| k == ".") {
        return Some(value.clone());
    }
    match value {
        Value::Object(members) => {
            let mut out = Map::new();
            for (key, sub) in children {
                let Some(name) = key.strip_prefix("f:") else {
                    continue;
                };
                if let Some(v) = members.get(name).and_then(|m| project(m, sub)) {
                    out.insert(name.to_owned(), v);
                }
            }
            Some(Value::Object(out))
        }
        Value::Array(items) => {
            let selectors: Vec<(Selector, &Value)> = children
                .iter()
                .filter_map(|(k, sub)| Selector::parse(k).map(|s| (s, sub)))
                .collect();
            let out: Vec<Value> = items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| {
                    let (_, sub) = selectors.iter().find(|(s, _)| s.matches(i, item))?;
                    project(item, sub)
                })
                .collect();
            Some(Value::Array(out))
        }
        // A scalar with child field sets: the schema changed under it; nothing of ours.
        _ => None,
    }
}

/// How a field set names a list item.
enum Selector {
    /// `k:{"type":"Ready"}`: the item whose key fields have these values.
    Key(Map<String, Value>),
    /// `v:"x"`: the set item equal to this value.
    Value(Value),
    /// `i:3`: the item at this index.
    Index(usize),
}

impl Selector {
    fn parse(key: &str) -> Option<Self> {
        if let Some(json) = key.strip_prefix("k:") {
            match serde_json::from_str(json).ok()? {
                Value::Object(m) => Some(Self::Key(m)),
                _ => None,
            }
        } else if let Some(json) = key.strip_prefix("v:") {
            serde_json::from_str(json).ok().map(Self::Value)
        } else if let Some(i) = key.strip_prefix("i:") {
            i.parse().ok().map(Self::Index)
        } else {
            None
        }
    }

    fn matches(&self, index: usize, item: &Value) -> bool {
        match self {
            Self::Key(keys) => keys.iter().all(|(k, v)| item.get(k) == Some(v)),
            Self::Value(v) => item == v,
            Self::Index(i) => *i == index,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1;
    use serde_json::json;

    fn entry(manager: &str, subresource: &str, fields: Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.to_owned()),
            operation: Some("Apply".to_owned()),
            subresource: (!subresource.is_empty()).then(|| subresource.to_owned()),
            fields_v1: Some(FieldsV1(fields)),
            ..ManagedFieldsEntry::default()
        }
    }

    fn condition_fields() -> Value {
        json!({".": {}, "f:type": {}, "f:status": {}, "f:reason": {}})
    }

    #[test]
    fn keeps_only_the_managers_conditions_and_fields() {
        let status = json!({"status": {
            "observedGeneration": 2,
            "extra": "theirs",
            "conditions": [
                {"type": "Healthy", "status": "True", "reason": "Probe"},
                {"type": "Ready", "status": "True", "reason": "Compiled"},
            ],
            "summary": {"cap": "5m", "retryBudget": "theirs"},
        }});
        let entries = [
            entry(
                "ours",
                "status",
                json!({"f:status": {
                    "f:observedGeneration": {},
                    "f:conditions": {"k:{\"type\":\"Ready\"}": condition_fields()},
                    "f:summary": {".": {}, "f:cap": {}},
                }}),
            ),
            entry(
                "other",
                "status",
                json!({"f:status": {"f:extra": {},
                    "f:conditions": {"k:{\"type\":\"Healthy\"}": condition_fields()}}}),
            ),
            // Our fields in the main resource are not the status's.
            entry("ours", "", json!({"f:spec": {}})),
        ];
        let fields = fields_of(&entries, "ours", "status").expect("owned");
        assert_eq!(
            project(&status, &fields),
            Some(json!({"status": {
                "observedGeneration": 2,
                "conditions": [{"type": "Ready", "status": "True", "reason": "Compiled"}],
                "summary": {"cap": "5m"},
            }}))
        );
        assert_eq!(fields_of(&entries, "nobody", "status"), None);
    }

    #[test]
    fn unions_several_entries_and_reads_set_and_index_items() {
        let entries = [
            entry("ours", "status", json!({"f:a": {}})),
            entry("ours", "status", json!({"f:b": {"v:\"x\"": {}, "i:1": {}}})),
        ];
        let fields = fields_of(&entries, "ours", "status").expect("owned");
        let value = json!({"a": 1, "b": ["x", "y", "z"], "c": 3});
        assert_eq!(
            project(&value, &fields),
            Some(json!({"a": 1, "b": ["x", "y"]}))
        );
        // Children under a scalar: nothing of ours is there.
        assert_eq!(project(&json!(5), &json!({"f:a": {}})), None);
    }
}
