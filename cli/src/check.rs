//! `check`: is Rebound healthy in this cluster, and is every injected Pod current? As
//! `linkerd check`: one verdict per line (or `-o json`), exit 1 when anything failed.
//!
//! Control plane: the CRD served, the operator Ready and leading, the admission policies
//! and their bindings, the injection parameters. Each injected Pod in scope (label
//! `rebound.dev/injected=true`): its sidecar image against the parameters' image, the
//! RoleBinding of its namespace, its fleet Lease fresh, and the configuration hash its
//! sidecar loaded (annotation `rebound.dev/config-hash` of the Lease) against the
//! operator's latest (annotation `rebound.dev/hash` of the ConfigMap).

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Result;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::rbac::v1::RoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::GroupVersionKind;
use serde::Serialize;
use serde_json::{Value, json};

use crate::{args::Output, load, load::ClusterArgs, output};

/// Name of the parameters ConfigMap of the injection policy, in the release namespace.
pub const PARAMETERS: &str = "rebound-injection";
/// Name of the sidecar container the injection adds.
pub const SIDECAR: &str = "rebound-sidecar";
/// Lease annotation: the hash of the configuration the sidecar serves.
pub const CONFIG_HASH: &str = "rebound.dev/config-hash";
/// ConfigMap annotation: the hash of the document the operator wrote.
pub const HASH: &str = "rebound.dev/hash";

/// `check`.
#[derive(clap::Args)]
pub struct Args {
    /// Namespace whose injected Pods are checked. Default: the kubeconfig context's.
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    /// Check the injected Pods of every namespace.
    #[arg(long, short = 'A', conflicts_with = "namespace")]
    all_namespaces: bool,
    /// The Helm release: the operator is `<release>-operator`, the injection policies
    /// `<release>-sidecar-inject*`.
    #[arg(long, default_value = "rebound")]
    release: String,
    /// Namespace of the release (operator, Lease, injection parameters).
    #[arg(long, default_value = "rebound-system", value_name = "NAMESPACE")]
    release_namespace: String,
    #[command(flatten)]
    output: Output,
}

/// How one check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Status {
    Ok,
    Warn,
    Fail,
}

/// One line of the report; the JSON form is documented in docs/cli.md.
#[derive(Debug, Serialize)]
struct Verdict {
    check: &'static str,
    status: Status,
    /// The object looked at, `kind/name` or `kind/namespace/name`.
    object: String,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    expected: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    actual: Option<String>,
}

impl Verdict {
    fn new(check: &'static str, status: Status, object: String, message: String) -> Self {
        Self {
            check,
            status,
            object,
            message,
            expected: None,
            actual: None,
        }
    }

    fn compared(mut self, expected: Option<&str>, actual: Option<&str>) -> Self {
        self.expected = expected.map(str::to_owned);
        self.actual = actual.map(str::to_owned);
        self
    }
}

pub fn run(cluster: &ClusterArgs, args: &Args) -> Result<ExitCode> {
    let verdicts = load::block_on(async {
        let (client, namespace) = load::connect(cluster, args.namespace.clone()).await?;
        let scope = (!args.all_namespaces).then_some(namespace);
        let mut checker = Checker {
            client,
            args,
            default_configmap: cluster.configmap.clone(),
            now: Timestamp::now(),
            params: BTreeMap::new(),
            verdicts: Vec::new(),
        };
        checker.control_plane().await?;
        checker.pods(scope.as_deref()).await?;
        Ok(checker.verdicts)
    })?;
    let count = |s: Status| verdicts.iter().filter(|v| v.status == s).count();
    let (ok, warn, fail) = (count(Status::Ok), count(Status::Warn), count(Status::Fail));
    let report = json!({
        "ok": fail == 0,
        "summary": {"ok": ok, "warn": warn, "fail": fail},
        "checks": verdicts,
    });
    output::emit_as(args.output.output, &report, || {
        text(&verdicts, ok, warn, fail)
    })?;
    Ok(if fail == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn text(verdicts: &[Verdict], ok: usize, warn: usize, fail: usize) -> String {
    let mut out = String::new();
    for v in verdicts {
        let mark = match v.status {
            Status::Ok => "[ok]  ",
            Status::Warn => "[warn]",
            Status::Fail => "[FAIL]",
        };
        out.push_str(&format!(
            "{mark} {:<22} {}: {}\n",
            v.check, v.object, v.message
        ));
    }
    let verdict = if fail == 0 { "healthy" } else { "NOT healthy" };
    out.push_str(&format!(
        "\n{verdict}: {ok} ok, {warn} warnings, {fail} failed\n"
    ));
    out
}

struct Checker<'a> {
    client: kube::Client,
    args: &'a Args,
    default_configmap: String,
    now: Timestamp,
    /// The injection parameters' data, once read.
    params: BTreeMap<String, String>,
    verdicts: Vec<Verdict>,
}

/// `Ok(None)` for 404; another API refusal (403, ...) as `Err(message)` for a verdict;
/// a failure to reach the API at all as the outer error (exit code 2).
async fn get<K>(api: &Api<K>, name: &str) -> Result<Result<Option<K>, String>>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Ok(found) => Ok(Ok(found)),
        Err(kube::Error::Api(status)) => Ok(Err(format!(
            "cannot read it: {} ({})",
            status.message, status.code
        ))),
        Err(e) => Err(e.into()),
    }
}

fn admission(kind: &str, plural: &str) -> ApiResource {
    let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
    ApiResource::from_gvk_with_plural(&gvk, plural)
}

impl Checker<'_> {
    fn push(&mut self, verdict: Verdict) {
        self.verdicts.push(verdict);
    }

    async fn control_plane(&mut self) -> Result<()> {
        self.crd().await?;
        self.operator().await?;
        let release = self.args.release.clone();
        let operator = format!("{release}-operator");
        let mut policies: Vec<(&'static str, &'static str, String, Status)> =
            crate::inject::policy_names(&format!("{release}-sidecar"))
                .into_iter()
                .map(|(kind, name)| ("admission.inject", kind, name, Status::Fail))
                .collect();
        policies.extend([
            (
                "admission.configmaps",
                "ValidatingAdmissionPolicy",
                format!("{operator}-configmaps"),
                Status::Fail,
            ),
            (
                "admission.leases",
                "ValidatingAdmissionPolicy",
                format!("{release}-sidecar-leases"),
                Status::Fail,
            ),
            // Only with the chart's sidecarBindings (the operator keeps RoleBindings).
            (
                "admission.rolebindings",
                "ValidatingAdmissionPolicy",
                format!("{operator}-rolebindings"),
                Status::Warn,
            ),
        ]);
        for (check, kind, name, missing) in policies {
            self.policy(check, kind, &name, missing).await?;
        }
        self.params = self.parameters().await?.unwrap_or_default();
        Ok(())
    }

    async fn crd(&mut self) -> Result<()> {
        let name = "retrypolicies.rebound.dev";
        let object = format!("customresourcedefinition/{name}");
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        let verdict = match get(&api, name).await? {
            Err(message) => Verdict::new("crd", Status::Fail, object, message),
            Ok(None) => Verdict::new(
                "crd",
                Status::Fail,
                object,
                "not installed (helm install rebound-crds)".into(),
            ),
            Ok(Some(crd)) => {
                let established = crd
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                let served = crd
                    .spec
                    .versions
                    .iter()
                    .any(|v| v.name == "v1alpha1" && v.served);
                match (established, served) {
                    (true, true) => Verdict::new(
                        "crd",
                        Status::Ok,
                        object,
                        "established, v1alpha1 served".into(),
                    ),
                    (false, _) => {
                        Verdict::new("crd", Status::Fail, object, "not Established".into())
                    }
                    (true, false) => {
                        Verdict::new("crd", Status::Fail, object, "v1alpha1 is not served".into())
                    }
                }
            }
        };
        self.push(verdict);
        Ok(())
    }

    async fn operator(&mut self) -> Result<()> {
        let ns = self.args.release_namespace.clone();
        let name = format!("{}-operator", self.args.release);
        let object = format!("deployment/{ns}/{name}");
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &ns);
        let verdict = match get(&api, &name).await? {
            Err(message) => Verdict::new("operator.ready", Status::Fail, object, message),
            Ok(None) => Verdict::new("operator.ready", Status::Fail, object, "not found".into()),
            Ok(Some(d)) => {
                let want = d.spec.replicas.unwrap_or(1);
                let ready = d
                    .status
                    .as_ref()
                    .and_then(|s| s.ready_replicas)
                    .unwrap_or(0);
                let message = format!("{ready} of {want} replicas Ready");
                let status = match ready {
                    0 => Status::Fail,
                    r if r < want => Status::Warn,
                    _ => Status::Ok,
                };
                Verdict::new("operator.ready", status, object, message)
            }
        };
        self.push(verdict);

        let object = format!("lease/{ns}/{name}");
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &ns);
        let verdict = match get(&api, &name).await? {
            Err(message) => Verdict::new("operator.leader", Status::Fail, object, message),
            Ok(None) => Verdict::new(
                "operator.leader",
                Status::Fail,
                object,
                "no leader Lease".into(),
            ),
            Ok(Some(lease)) => {
                let holder = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.clone())
                    .unwrap_or_default();
                match (holder.is_empty(), freshness(&lease, self.now)) {
                    (false, Fresh::Live(_)) => Verdict::new(
                        "operator.leader",
                        Status::Ok,
                        object,
                        format!("led by {holder}"),
                    ),
                    (_, fresh) => Verdict::new(
                        "operator.leader",
                        Status::Fail,
                        object,
                        format!("no live leader ({})", fresh.describe()),
                    ),
                }
            }
        };
        self.push(verdict);
        Ok(())
    }

    /// An admission policy and its binding (same name) present, the binding naming the
    /// policy and enforcing it; the injection binding's parameters the ConfigMap's.
    async fn policy(
        &mut self,
        check: &'static str,
        kind: &str,
        name: &str,
        missing: Status,
    ) -> Result<()> {
        let lower = kind.to_ascii_lowercase();
        let policies: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &admission(kind, &format!("{}ies", lower.trim_end_matches('y'))),
        );
        let binding_kind = format!("{kind}Binding");
        let bindings: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &admission(
                &binding_kind,
                &format!("{}s", binding_kind.to_ascii_lowercase()),
            ),
        );
        let object = format!("{lower}/{name}");
        let verdict = match (get(&policies, name).await?, get(&bindings, name).await?) {
            (Err(message), _) | (_, Err(message)) => {
                Verdict::new(check, Status::Fail, object, message)
            }
            (Ok(None), _) => Verdict::new(check, missing, object, "not found".into()),
            (Ok(Some(_)), Ok(None)) => Verdict::new(
                check,
                Status::Fail,
                object,
                format!("no {binding_kind} {name}: not enforced"),
            ),
            (Ok(Some(policy)), Ok(Some(binding))) => binding_problem(
                &policy.data,
                &binding.data,
                name,
                &self.args.release_namespace,
            )
            .map_or_else(
                || {
                    Verdict::new(
                        check,
                        Status::Ok,
                        object.clone(),
                        "present and bound".into(),
                    )
                },
                |problem| Verdict::new(check, Status::Fail, object.clone(), problem),
            ),
        };
        self.push(verdict);
        Ok(())
    }

    /// The injection parameters: present, with an image.
    async fn parameters(&mut self) -> Result<Option<BTreeMap<String, String>>> {
        let ns = self.args.release_namespace.clone();
        let object = format!("configmap/{ns}/{PARAMETERS}");
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
        let (verdict, data) = match get(&api, PARAMETERS).await? {
            Err(message) => (
                Verdict::new("parameters", Status::Fail, object, message),
                None,
            ),
            Ok(None) => (
                Verdict::new(
                    "parameters",
                    Status::Fail,
                    object,
                    "not found: annotated Pods are refused".into(),
                ),
                None,
            ),
            Ok(Some(cm)) => {
                let data = cm.data.unwrap_or_default();
                match data.get("image").filter(|i| !i.is_empty()) {
                    Some(image) => (
                        Verdict::new(
                            "parameters",
                            Status::Ok,
                            object,
                            format!("sidecar image {image}"),
                        ),
                        Some(data),
                    ),
                    None => (
                        Verdict::new("parameters", Status::Fail, object, "no `image`".into()),
                        Some(data),
                    ),
                }
            }
        };
        self.push(verdict);
        Ok(data)
    }

    async fn pods(&mut self, scope: Option<&str>) -> Result<()> {
        let data = &self.params;
        let image = data.get("image").cloned().filter(|i| !i.is_empty());
        let configmap = data
            .get("configMapName")
            .cloned()
            .unwrap_or_else(|| self.default_configmap.clone());
        let api: Api<Pod> = match scope {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        };
        let pods = api
            .list(&ListParams::default().labels("rebound.dev/injected=true"))
            .await?;
        let mut bound: BTreeMap<String, bool> = BTreeMap::new();
        for pod in pods.items {
            let (Some(ns), Some(name)) =
                (pod.metadata.namespace.clone(), pod.metadata.name.clone())
            else {
                continue;
            };
            let phase = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if pod.metadata.deletion_timestamp.is_some()
                || phase == "Succeeded"
                || phase == "Failed"
            {
                continue; // its sidecar has stopped: nothing to hold current
            }
            let object = format!("pod/{ns}/{name}");
            self.push(sidecar_image(&pod, image.as_deref(), object.clone()));
            if !bound.contains_key(&ns) {
                let rb: Api<RoleBinding> = Api::namespaced(self.client.clone(), &ns);
                bound.insert(ns.clone(), matches!(get(&rb, SIDECAR).await?, Ok(Some(_))));
            }
            if bound.get(&ns) == Some(&false) {
                self.push(Verdict::new(
                    "pod.rbac",
                    Status::Fail,
                    object.clone(),
                    format!("no RoleBinding {SIDECAR} in {ns}: the sidecar cannot watch"),
                ));
            }
            self.lease_and_hash(&ns, &name, &phase, &configmap, object)
                .await?;
        }
        Ok(())
    }

    async fn lease_and_hash(
        &mut self,
        ns: &str,
        pod: &str,
        phase: &str,
        configmap: &str,
        object: String,
    ) -> Result<()> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), ns);
        let lease_name = format!("{SIDECAR}-{pod}");
        let lease = match get(&leases, &lease_name).await? {
            Err(message) => {
                self.push(Verdict::new("pod.lease", Status::Fail, object, message));
                return Ok(());
            }
            Ok(None) => {
                // A Pod not started yet has no sidecar to hold one.
                let status = if phase == "Pending" {
                    Status::Warn
                } else {
                    Status::Fail
                };
                self.push(Verdict::new(
                    "pod.lease",
                    status,
                    object,
                    format!("no fleet Lease {lease_name} ({phase})"),
                ));
                return Ok(());
            }
            Ok(Some(lease)) => lease,
        };
        let verdict = match freshness(&lease, self.now) {
            Fresh::Live(age) => Verdict::new(
                "pod.lease",
                Status::Ok,
                object.clone(),
                format!("Lease renewed {age}s ago"),
            ),
            stale => Verdict::new(
                "pod.lease",
                Status::Fail,
                object.clone(),
                format!("Lease {lease_name} {}", stale.describe()),
            ),
        };
        self.push(verdict);

        let served = lease
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("rebound.dev/configmap"))
            .cloned();
        let cm_name = served.unwrap_or_else(|| configmap.to_owned());
        let loaded = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(CONFIG_HASH))
            .cloned();
        let cms: Api<ConfigMap> = Api::namespaced(self.client.clone(), ns);
        let latest = match get(&cms, &cm_name).await? {
            Ok(found) => found
                .and_then(|c| c.metadata.annotations)
                .and_then(|a| a.get(HASH).cloned()),
            Err(message) => {
                self.push(Verdict::new("pod.config", Status::Fail, object, message));
                return Ok(());
            }
        };
        let verdict = match (latest.as_deref(), loaded.as_deref()) {
            (None, _) => Verdict::new(
                "pod.config",
                Status::Warn,
                object,
                format!("no compiled ConfigMap {cm_name} (no policies yet?)"),
            ),
            (Some(_), None) => Verdict::new(
                "pod.config",
                Status::Warn,
                object,
                "the sidecar publishes no configuration hash (none loaded, or an older sidecar)"
                    .into(),
            ),
            (Some(want), Some(got)) if want == got => Verdict::new(
                "pod.config",
                Status::Ok,
                object,
                format!("serves the latest {cm_name}"),
            ),
            (Some(_), Some(_)) => Verdict::new(
                "pod.config",
                Status::Fail,
                object,
                format!("serves an older {cm_name} than the operator's latest"),
            ),
        };
        self.push(verdict.compared(latest.as_deref(), loaded.as_deref()));
        Ok(())
    }
}

/// The Pod's sidecar image against the parameters'.
fn sidecar_image(pod: &Pod, want: Option<&str>, object: String) -> Verdict {
    let spec = pod.spec.as_ref();
    let got = spec
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .chain(spec.map(|s| &s.containers).into_iter().flatten())
        .find(|c| c.name == SIDECAR)
        .and_then(|c| c.image.clone());
    let verdict = match (want, got.as_deref()) {
        (_, None) => Verdict::new(
            "pod.image",
            Status::Fail,
            object,
            format!("no {SIDECAR} container"),
        ),
        (None, Some(got)) => Verdict::new(
            "pod.image",
            Status::Warn,
            object,
            format!("{got}; no parameters to compare with"),
        ),
        (Some(want), Some(got)) if want == got => {
            Verdict::new("pod.image", Status::Ok, object, format!("sidecar {got}"))
        }
        (Some(want), Some(got)) => Verdict::new(
            "pod.image",
            Status::Fail,
            object,
            format!("sidecar {got}, the chart's is {want}: roll the workload"),
        ),
    };
    verdict.compared(want, got.as_deref())
}

/// What is wrong with an admission `binding` of the policy `name`, if anything.
fn binding_problem(policy: &Value, binding: &Value, name: &str, params_ns: &str) -> Option<String> {
    let spec = &binding["spec"];
    if spec["policyName"] != name {
        return Some(format!("its binding names policy {}", spec["policyName"]));
    }
    if let Some(actions) = spec["validationActions"].as_array()
        && !actions.iter().any(|a| a == "Deny")
    {
        return Some("its binding does not Deny".into());
    }
    if policy["spec"]["paramKind"].is_object() {
        let param = &spec["paramRef"];
        if param["name"] != PARAMETERS || param["namespace"] != params_ns {
            return Some(format!(
                "its binding's paramRef is not {params_ns}/{PARAMETERS}"
            ));
        }
    }
    None
}

/// A Lease's liveness: `renewTime + leaseDurationSeconds` against now.
enum Fresh {
    /// Live; renewed this many seconds ago.
    Live(i64),
    /// Expired; renewed this many seconds ago, with this duration.
    Stale(i64, i32),
    Never,
}

impl Fresh {
    fn describe(&self) -> String {
        match self {
            Fresh::Live(age) => format!("renewed {age}s ago"),
            Fresh::Stale(age, duration) => {
                format!("is stale: renewed {age}s ago, lease {duration}s")
            }
            Fresh::Never => "was never renewed".into(),
        }
    }
}

fn freshness(lease: &Lease, now: Timestamp) -> Fresh {
    let Some(spec) = lease.spec.as_ref() else {
        return Fresh::Never;
    };
    let (Some(renewed), Some(duration)) = (spec.renew_time.as_ref(), spec.lease_duration_seconds)
    else {
        return Fresh::Never;
    };
    let age = now.duration_since(renewed.0).as_secs();
    if now.duration_since(renewed.0) < SignedDuration::from_secs(i64::from(duration)) {
        Fresh::Live(age.max(0))
    } else {
        Fresh::Stale(age, duration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn lease(renewed_ago: i64, duration: i32) -> Lease {
        let now = Timestamp::now();
        Lease {
            spec: Some(LeaseSpec {
                renew_time: Some(MicroTime(now - SignedDuration::from_secs(renewed_ago))),
                lease_duration_seconds: Some(duration),
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        }
    }

    #[test]
    fn a_lease_is_fresh_until_its_duration_has_passed() {
        let now = Timestamp::now();
        assert!(matches!(freshness(&lease(2, 15), now), Fresh::Live(_)));
        assert!(matches!(
            freshness(&lease(60, 15), now),
            Fresh::Stale(_, 15)
        ));
        assert!(matches!(freshness(&Lease::default(), now), Fresh::Never));
    }

    #[test]
    fn a_binding_must_name_its_policy_deny_and_take_the_parameters() {
        let policy = json!({"spec": {"paramKind": {"kind": "ConfigMap"}}});
        let good = json!({"spec": {"policyName": "p", "paramRef": {"name": PARAMETERS, "namespace": "ns"}}});
        assert_eq!(binding_problem(&policy, &good, "p", "ns"), None);
        assert!(binding_problem(&policy, &good, "q", "ns").is_some());
        assert!(binding_problem(&policy, &good, "p", "other").is_some());
        let audit = json!({"spec": {"policyName": "p", "validationActions": ["Audit"]}});
        assert!(binding_problem(&json!({}), &audit, "p", "ns").is_some());
    }
}
