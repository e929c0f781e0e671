//! `rebound inject`: manifests in, the same manifests with the sidecar injected out, as
//! the admission policy would inject them (`--admission-policy` prints that policy).

mod policy;

pub use policy::policy_names;
pub mod render;
pub mod spec;

use std::{collections::BTreeMap, path::PathBuf, process::ExitCode};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::{args::Inputs, input, output};
use render::Outcome;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    inputs: Inputs,
    /// Inject every Pod template not opted out (rebound.dev/inject: "false"), as a namespace
    /// labelled rebound.dev/inject=enabled does.
    #[arg(long, alias = "all")]
    enable: bool,
    /// The parameters: a ConfigMap manifest like the chart's rebound-injection
    /// (`kubectl -n rebound-system get cm rebound-injection -o yaml`). Default: the chart's
    /// default values.
    #[arg(long, value_name = "FILE")]
    params: Option<PathBuf>,
    /// The sidecar image (wins over --params).
    #[arg(long)]
    image: Option<String>,
    /// Print the admission policies instead (the chart's templates/injection-policy.yaml).
    #[arg(long, conflicts_with_all = ["files", "enable", "params", "image"])]
    admission_policy: bool,
    /// With --admission-policy: plain manifests for Rebound installed in this namespace,
    /// instead of the Helm template.
    #[arg(long, requires = "admission_policy", value_name = "NAMESPACE")]
    policy_namespace: Option<String>,
}

/// The parameters of the chart's default values.
pub fn default_params() -> BTreeMap<String, String> {
    let mut params: BTreeMap<String, String> = spec::SETTINGS
        .iter()
        .filter_map(|s| s.param.map(|p| (p.to_owned(), s.default.to_owned())))
        .collect();
    params.insert(
        "image".to_owned(),
        format!(
            "ghcr.io/rebound-dev/rebound-sidecar:{}",
            env!("CARGO_PKG_VERSION")
        ),
    );
    params
}

fn load_params(args: &Args) -> Result<BTreeMap<String, String>> {
    let mut params = default_params();
    if let Some(path) = &args.params {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let cm: Value = serde_saphyr::from_str(&text)
            .with_context(|| format!("{} is not YAML", path.display()))?;
        if cm.get("kind").and_then(Value::as_str) != Some("ConfigMap") {
            bail!("{}: --params must be a ConfigMap", path.display());
        }
        if let Some(data) = cm.get("data").and_then(Value::as_object) {
            for (k, v) in data {
                let v = v
                    .as_str()
                    .with_context(|| format!("{}: data.{k} is not a string", path.display()))?;
                params.insert(k.clone(), v.to_owned());
            }
        }
    }
    if let Some(image) = &args.image {
        params.insert("image".to_owned(), image.clone());
    }
    Ok(params)
}

/// Where a kind keeps its Pod template.
fn template_path(kind: &str) -> Option<&'static str> {
    match kind {
        "Pod" => Some(""),
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => Some("/spec/template"),
        "CronJob" => Some("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

/// Injects one object (or every item of a List) in place.
fn inject_object(
    object: &mut Value,
    params: &BTreeMap<String, String>,
    enable: bool,
    at: &str,
) -> Result<()> {
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("(no name)")
        .to_owned();
    if kind == "List" {
        if let Some(items) = object.get_mut("items").and_then(Value::as_array_mut) {
            for (i, item) in items.iter_mut().enumerate() {
                inject_object(item, params, enable, &format!("{at}: items[{i}]"))?;
            }
        }
        return Ok(());
    }
    let Some(path) = template_path(&kind) else {
        return Ok(());
    };
    if object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        == Some("kube-system")
    {
        return Ok(());
    }
    if !path.is_empty()
        && object
            .pointer(&format!("/metadata/annotations/{}", "rebound.dev~1inject"))
            .is_some()
        && object
            .pointer(&format!("{path}/metadata/annotations/rebound.dev~1inject"))
            .is_none()
    {
        eprintln!(
            "warning: {at}: {kind} {name}: rebound.dev/inject is on the {kind}, not on its Pod \
             template (spec.template.metadata.annotations), so its Pods are not injected"
        );
    }
    let Some(template) = object.pointer_mut(path) else {
        return Ok(());
    };
    match render::inject(template, params, enable) {
        Ok(Outcome::Injected(injected)) => *template = injected,
        Ok(Outcome::Unchanged) => {}
        Err(e) => bail!("{at}: {kind} {name}: {e}"),
    }
    Ok(())
}

pub fn run(args: &Args) -> Result<ExitCode> {
    if args.admission_policy {
        let flavor = match &args.policy_namespace {
            Some(namespace) => policy::Flavor::Plain { namespace },
            None => policy::Flavor::Chart,
        };
        output::emit(&policy::manifests(&flavor))?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.inputs.files.is_empty() {
        bail!("no input: give manifests with -f FILE (or -f - for stdin)");
    }
    let params = load_params(args)?;
    let mut out = String::new();
    for source in input::sources(&args.inputs)? {
        let text = source.text?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("{}: not YAML", source.name))?;
        for (i, mut doc) in docs.into_iter().enumerate() {
            if doc.is_null() {
                continue;
            }
            inject_object(
                &mut doc,
                &params,
                args.enable,
                &format!("{}: document {}", source.name, i + 1),
            )?;
            out.push_str("---\n");
            out.push_str(&serde_saphyr::to_string(&doc)?);
        }
    }
    output::emit(&out)?;
    Ok(ExitCode::SUCCESS)
}

/// The chart's template, for the drift check.
pub fn chart_template() -> String {
    policy::manifests(&policy::Flavor::Chart)
}

/// Plain manifests for a namespace (tests install them without Helm).
pub fn plain_manifests(namespace: &str) -> String {
    policy::manifests(&policy::Flavor::Plain { namespace })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(annotated: bool) -> Value {
        let annotations = if annotated {
            json!({"rebound.dev/inject": "true"})
        } else {
            json!({})
        };
        json!({
            "metadata": {"annotations": annotations},
            "spec": {"containers": [{"name": "w", "image": "w:1"}]}
        })
    }

    fn injected(v: Option<&Value>) -> bool {
        v.and_then(|t| t.pointer("/spec/initContainers/0/name")) == Some(&json!(spec::SIDECAR))
    }

    #[test]
    fn every_workload_kind_and_lists_are_injected_where_their_pods_are() -> Result<()> {
        let params = default_params();
        let mut list = json!({"apiVersion": "v1", "kind": "List", "items": [
            {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": template(true)}},
            {"kind": "StatefulSet", "metadata": {"name": "s"}, "spec": {"template": template(true)}},
            {"kind": "DaemonSet", "metadata": {"name": "ds"}, "spec": {"template": template(true)}},
            {"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": template(true)}},
            {"kind": "CronJob", "metadata": {"name": "c"},
             "spec": {"jobTemplate": {"spec": {"template": template(true)}}}},
            {"kind": "Deployment", "metadata": {"name": "off"}, "spec": {"template": template(false)}},
            {"kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "b"}},
        ]});
        let before = list.clone();
        inject_object(&mut list, &params, false, "test")?;
        for i in 0..4 {
            assert!(
                injected(list.pointer(&format!("/items/{i}/spec/template"))),
                "item {i}"
            );
        }
        assert!(injected(
            list.pointer("/items/4/spec/jobTemplate/spec/template")
        ));
        assert_eq!(list["items"][5], before["items"][5]);
        assert_eq!(list["items"][6], before["items"][6]);
        Ok(())
    }

    #[test]
    fn a_pod_and_the_enable_flag() -> Result<()> {
        let params = default_params();
        let mut pod = template(false);
        pod["kind"] = json!("Pod");
        let mut forced = pod.clone();
        inject_object(&mut pod, &params, false, "test")?;
        assert!(!injected(Some(&pod)));
        inject_object(&mut forced, &params, true, "test")?;
        assert!(injected(Some(&forced)));
        Ok(())
    }

    #[test]
    fn errors_name_the_object_and_the_annotation() {
        let mut pod = template(true);
        pod["kind"] = json!("Pod");
        pod["metadata"]["name"] = json!("w");
        pod["metadata"]["annotations"]["rebound.dev/mode"] = json!("push");
        let err = inject_object(&mut pod, &default_params(), false, "f.yaml: document 1")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            "f.yaml: document 1: Pod w: rebound.dev/mode: must be file or watch, not \"push\""
        );
    }
}
