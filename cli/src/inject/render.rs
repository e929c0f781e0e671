//! Injection as a pure function: a Pod template and the parameters in, the injected Pod
//! template out. No I/O; the admission policy compiled from the same `spec` does the same
//! in the API server.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::spec::{self, Cond, SETTINGS, T, Var};

/// Why a Pod was not injected, or could not be.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    /// A `rebound.dev/*` annotation is unknown or malformed; the message starts with its
    /// name, as the admission policy's does.
    #[error("{annotation}: {message}")]
    Annotation { annotation: String, message: String },
    #[error("{0}")]
    Shape(String),
}

/// What happened to a Pod template.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Injected(Value),
    /// Not asked for (no annotation, opted out) or already injected: left as it was.
    Unchanged,
}

/// The settings of one Pod: annotation, else parameter, else default.
pub struct Resolved(BTreeMap<&'static str, String>);

impl Resolved {
    fn get(&self, var: Var) -> &str {
        self.0
            .get(spec::setting(var).name)
            .map(String::as_str)
            .unwrap_or("")
    }

    fn holds(&self, cond: Cond) -> bool {
        match cond {
            Cond::Watch => self.get(Var::Mode) == "watch",
            Cond::File => self.get(Var::Mode) == "file",
            Cond::Unix => self.get(Var::Transport) == "unix",
            Cond::Metrics => self.get(Var::Metrics) == "true",
        }
    }
}

fn annotations(pod: &Value) -> Map<String, Value> {
    pod.pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

/// Whether this Pod is asked to be injected (by its annotation or its namespace), before
/// the override checks.
pub fn candidate(pod: &Value, namespace_enabled: bool) -> bool {
    let inject = annotations(pod)
        .get(spec::INJECT)
        .and_then(Value::as_str)
        .map(str::to_owned);
    match inject.as_deref() {
        Some("false") => false,
        Some(_) => true,
        None => namespace_enabled,
    }
}

/// Whether the sidecar is already there (rendered by the CLI, or injected before).
pub fn already_injected(pod: &Value) -> bool {
    let labelled = pod
        .pointer("/metadata/labels")
        .and_then(|l| l.get(spec::INJECTED_LABEL))
        .and_then(Value::as_str)
        == Some("true");
    let has_sidecar = pod
        .pointer("/spec/initContainers")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.get("name").and_then(Value::as_str) == Some(spec::SIDECAR))
        });
    labelled || has_sidecar
}

fn refuse(annotation: &str, message: String) -> InjectError {
    InjectError::Annotation {
        annotation: annotation.to_owned(),
        message,
    }
}

fn matches(pattern: &str, value: &str) -> bool {
    regex::Regex::new(pattern).is_ok_and(|re| re.is_match(value))
}

/// The override checks, in the admission policy's order: `rebound.dev/inject`, unknown
/// `rebound.dev/*` keys, then each override's value.
pub fn check_annotations(pod: &Value) -> Result<(), InjectError> {
    let ann = annotations(pod);
    let text = |key: &str| {
        ann.get(key)
            .map(|v| v.as_str().unwrap_or_default().to_owned())
    };
    if let Some(v) = text(spec::INJECT)
        && !matches(spec::INJECT_PATTERN, &v)
    {
        return Err(refuse(
            spec::INJECT,
            format!("must be {}, not {v:?}", spec::INJECT_EXPECTED),
        ));
    }
    let known = spec::known_annotations();
    if let Some(key) = ann
        .keys()
        .find(|k| k.starts_with("rebound.dev/") && !known.contains(&k.as_str()))
    {
        return Err(refuse(
            key,
            format!("unknown annotation; known: {}", known.join(", ")),
        ));
    }
    for setting in &SETTINGS {
        if let Some(key) = setting.annotation
            && let Some(v) = text(key)
            && !matches(setting.pattern, &v)
        {
            return Err(refuse(
                key,
                format!("must be {}, not {v:?}", setting.expected),
            ));
        }
    }
    Ok(())
}

/// Resolves every setting for this Pod from its annotations and the parameters.
pub fn resolve(pod: &Value, params: &BTreeMap<String, String>) -> Resolved {
    let ann = annotations(pod);
    let mut out = BTreeMap::new();
    for setting in &SETTINGS {
        let value = setting
            .annotation
            .and_then(|k| ann.get(k))
            .and_then(Value::as_str)
            .or_else(|| {
                setting
                    .param
                    .and_then(|k| params.get(k))
                    .map(String::as_str)
            })
            .unwrap_or(setting.default);
        out.insert(setting.name, value.to_owned());
    }
    Resolved(out)
}

/// Evaluates a piece of `spec` for these settings.
pub fn eval(t: &T, r: &Resolved) -> Value {
    match t {
        T::Str(s) => json!(s),
        T::Int(i) => json!(i),
        T::Bool(b) => json!(b),
        T::Var(v) => json!(r.get(*v)),
        T::Cat(parts) => {
            let text: String = parts
                .iter()
                .map(|p| match eval(p, r) {
                    Value::String(s) => s,
                    other => other.to_string(),
                })
                .collect();
            json!(text)
        }
        T::Map(fields) | T::Dict(fields) => Value::Object(
            fields
                .iter()
                .map(|(k, v)| ((*k).to_owned(), eval(v, r)))
                .collect(),
        ),
        T::List(items) => Value::Array(
            items
                .iter()
                .filter(|(c, _)| c.is_none_or(|c| r.holds(c)))
                .map(|(_, v)| eval(v, r))
                .collect(),
        ),
    }
}

fn object_at<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<&'a mut Map<String, Value>, InjectError> {
    parent
        .entry(key)
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
        .ok_or_else(|| InjectError::Shape(format!("{what} is not an object")))
}

fn array_at<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<&'a mut Vec<Value>, InjectError> {
    parent
        .entry(key)
        .or_insert_with(|| Value::Array(Vec::new()))
        .as_array_mut()
        .ok_or_else(|| InjectError::Shape(format!("{what} is not a list")))
}

/// Injects one Pod template (an object with `metadata` and `spec`), or says why not.
/// `namespace_enabled`: its namespace has the label `rebound.dev/inject=enabled`.
pub fn inject(
    pod: &Value,
    params: &BTreeMap<String, String>,
    namespace_enabled: bool,
) -> Result<Outcome, InjectError> {
    if !candidate(pod, namespace_enabled) || already_injected(pod) {
        return Ok(Outcome::Unchanged);
    }
    check_annotations(pod)?;
    let r = resolve(pod, params);
    let mut out = pod.clone();
    let root = out
        .as_object_mut()
        .ok_or_else(|| InjectError::Shape("the Pod template is not an object".to_owned()))?;
    let metadata = object_at(root, "metadata", "metadata")?;
    object_at(metadata, "labels", "metadata.labels")?
        .insert(spec::INJECTED_LABEL.to_owned(), json!("true"));
    object_at(metadata, "annotations", "metadata.annotations")?
        .insert(spec::IMAGE_ANNOTATION.to_owned(), json!(r.get(Var::Image)));
    let pod_spec = object_at(root, "spec", "spec")?;
    array_at(pod_spec, "initContainers", "spec.initContainers")?
        .insert(0, eval(&spec::sidecar(), &r));
    if let Value::Array(volumes) = eval(&spec::volumes(), &r) {
        array_at(pod_spec, "volumes", "spec.volumes")?.extend(volumes);
    }
    let unix = r.holds(Cond::Unix);
    let target = if unix {
        spec::UNIX_TARGET
    } else {
        spec::TCP_TARGET
    };
    for container in array_at(pod_spec, "containers", "spec.containers")? {
        let c = container
            .as_object_mut()
            .ok_or_else(|| InjectError::Shape("a container is not an object".to_owned()))?;
        let env = array_at(c, "env", "a container's env")?;
        if !env
            .iter()
            .any(|e| e.get("name").and_then(Value::as_str) == Some(spec::TARGET_ENV))
        {
            env.push(json!({"name": spec::TARGET_ENV, "value": target}));
        }
        if env.is_empty() {
            c.remove("env");
        }
        let mounts = array_at(c, "volumeMounts", "a container's volumeMounts")?;
        if unix
            && !mounts
                .iter()
                .any(|m| m.get("mountPath").and_then(Value::as_str) == Some(spec::SOCKET_DIR))
        {
            mounts.push(json!({"name": spec::SOCKET_VOLUME, "mountPath": spec::SOCKET_DIR}));
        }
        if mounts.is_empty() {
            c.remove("volumeMounts");
        }
    }
    Ok(Outcome::Injected(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> BTreeMap<String, String> {
        super::super::default_params()
    }

    fn pod(annotations: Value) -> Value {
        json!({
            "metadata": {"name": "w", "annotations": annotations},
            "spec": {"containers": [{"name": "worker", "image": "worker:1"}]}
        })
    }

    fn injected(pod: &Value) -> Value {
        match inject(pod, &params(), false) {
            Ok(Outcome::Injected(v)) => v,
            other => panic!("not injected: {other:?}"),
        }
    }

    fn args(pod: &Value) -> Vec<String> {
        serde_json::from_value(pod["spec"]["initContainers"][0]["args"].clone()).unwrap()
    }

    #[test]
    fn a_plain_pod_gets_the_sidecar_first_the_socket_and_the_target() {
        let out = injected(&pod(json!({"rebound.dev/inject": "true"})));
        let sidecar = &out["spec"]["initContainers"][0];
        assert_eq!(sidecar["name"], "rebound-sidecar");
        assert_eq!(sidecar["restartPolicy"], "Always");
        assert_eq!(sidecar["startupProbe"]["grpc"]["port"], 7412);
        assert_eq!(out["metadata"]["labels"]["rebound.dev/injected"], "true");
        assert_eq!(
            out["metadata"]["annotations"]["rebound.dev/sidecar-image"],
            params()["image"]
        );
        let worker = &out["spec"]["containers"][0];
        assert_eq!(
            worker["env"],
            json!([{"name": "REBOUND_TARGET", "value": spec::UNIX_TARGET}])
        );
        assert_eq!(worker["volumeMounts"][0]["mountPath"], "/run/rebound");
        // The token is the sidecar's only: the worker mounts the socket and nothing else.
        assert_eq!(worker["volumeMounts"].as_array().map(Vec::len), Some(1));
        let volumes: Vec<&str> = out["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["name"].as_str())
            .collect();
        assert_eq!(volumes, ["rebound-socket", "rebound-sidecar-token"]);
        assert!(args(&out).contains(&"--configmap=$(POD_NAMESPACE)/rebound-policies".to_owned()));
        assert!(args(&out).contains(&"--pod-name=$(POD_NAME)".to_owned()));
    }

    #[test]
    fn own_init_containers_volumes_and_target_are_kept() {
        let mut p = pod(json!({"rebound.dev/inject": "true"}));
        p["spec"]["initContainers"] = json!([{"name": "migrate", "image": "m"}]);
        p["spec"]["volumes"] = json!([{"name": "data", "emptyDir": {}}]);
        p["spec"]["containers"][0]["env"] = json!([{"name": "REBOUND_TARGET", "value": "x:1"}]);
        let out = injected(&p);
        assert_eq!(out["spec"]["initContainers"][0]["name"], "rebound-sidecar");
        assert_eq!(out["spec"]["initContainers"][1]["name"], "migrate");
        assert_eq!(out["spec"]["volumes"][0]["name"], "data");
        assert_eq!(
            out["spec"]["containers"][0]["env"],
            json!([{"name": "REBOUND_TARGET", "value": "x:1"}])
        );
    }

    #[test]
    fn not_asked_opted_out_or_already_injected_is_unchanged() {
        let cases = [
            (pod(json!({})), true, "opted in by the namespace"),
            (pod(json!({"rebound.dev/inject": "false"})), true, ""),
            (pod(json!({"other": "x"})), false, ""),
        ];
        assert!(matches!(
            inject(&cases[0].0, &params(), true),
            Ok(Outcome::Injected(_))
        ));
        for (p, ns, _) in &cases[1..] {
            assert_eq!(inject(p, &params(), *ns), Ok(Outcome::Unchanged));
        }
        let once = injected(&pod(json!({"rebound.dev/inject": "true"})));
        assert_eq!(inject(&once, &params(), true), Ok(Outcome::Unchanged));
    }

    #[test]
    fn overrides_reach_the_sidecar() {
        let out = injected(&pod(json!({
            "rebound.dev/inject": "true",
            "rebound.dev/mode": "file",
            "rebound.dev/configmap": "other",
            "rebound.dev/sidecar-cpu-request": "20m",
            "rebound.dev/sidecar-memory-request": "32Mi",
            "rebound.dev/sidecar-memory-limit": "128Mi",
            "rebound.dev/log-level": "debug",
            "rebound.dev/transport": "tcp",
        })));
        let sidecar = &out["spec"]["initContainers"][0];
        assert_eq!(
            sidecar["resources"]["requests"],
            json!({"cpu": "20m", "memory": "32Mi"})
        );
        assert_eq!(sidecar["resources"]["limits"], json!({"memory": "128Mi"}));
        assert_eq!(
            sidecar["env"][4],
            json!({"name": "RUST_LOG", "value": "debug"})
        );
        let a = args(&out);
        assert!(a.contains(&"--policies-dir=/etc/rebound".to_owned()));
        assert!(
            !a.iter()
                .any(|x| x.starts_with("--uds") || x.starts_with("--configmap"))
        );
        assert_eq!(
            out["spec"]["volumes"],
            json!([{"name": "rebound-policies", "configMap": {"name": "other"}}])
        );
        assert_eq!(
            out["spec"]["containers"][0]["env"][0]["value"],
            spec::TCP_TARGET
        );
        assert!(out["spec"]["containers"][0].get("volumeMounts").is_none());
    }

    /// Secure by default: `/metrics` leaves loopback only when the parameter or the
    /// Pod's annotation asks, and the annotation wins either way.
    #[test]
    fn metrics_beyond_loopback_follows_the_parameter_and_the_annotation() {
        let flag = "--metrics-beyond-loopback".to_owned();
        let mut on = params();
        on.insert("metrics".to_owned(), "true".to_owned());
        for (params, annotation, expected) in [
            (params(), None, false),
            (params(), Some("true"), true),
            (on.clone(), None, true),
            (on.clone(), Some("false"), false),
            (on, Some("true"), true),
        ] {
            let mut annotations = json!({"rebound.dev/inject": "true"});
            if let Some(v) = annotation {
                annotations["rebound.dev/metrics"] = json!(v);
            }
            let out = match inject(&pod(annotations), &params, false) {
                Ok(Outcome::Injected(v)) => v,
                other => panic!("not injected: {other:?}"),
            };
            assert_eq!(
                args(&out).contains(&flag),
                expected,
                "parameter {:?}, annotation {annotation:?}",
                params.get("metrics")
            );
        }
    }

    #[test]
    fn malformed_or_unknown_annotations_are_refused_by_name() {
        for (key, value) in [
            ("rebound.dev/mode", "push"),
            ("rebound.dev/configmap", "Bad_Name"),
            ("rebound.dev/sidecar-cpu-request", "lots"),
            ("rebound.dev/sidecar-memory-request", "-1Mi"),
            ("rebound.dev/sidecar-memory-limit", "64MB"),
            ("rebound.dev/log-level", "loud"),
            ("rebound.dev/transport", "udp"),
            ("rebound.dev/metrics", "yes"),
            ("rebound.dev/sidecar-cpu", "10m"),
        ] {
            let p = pod(json!({"rebound.dev/inject": "true", key: value}));
            match inject(&p, &params(), false) {
                Err(InjectError::Annotation { annotation, .. }) => assert_eq!(annotation, key),
                other => panic!("{key}={value}: {other:?}"),
            }
        }
        let typo = pod(json!({"rebound.dev/inject": "enabled"}));
        assert!(matches!(
            inject(&typo, &params(), false),
            Err(InjectError::Annotation { annotation, .. }) if annotation == spec::INJECT
        ));
    }

    #[test]
    fn the_chart_template_is_the_generated_policy() {
        let committed = include_str!("../../../charts/rebound/templates/injection-policy.yaml");
        assert!(
            committed == super::super::chart_template(),
            "charts/rebound/templates/injection-policy.yaml is stale: run \
             `rebound inject --admission-policy > charts/rebound/templates/injection-policy.yaml`"
        );
    }
}
