//! Refused writes and the figures around them, for the tests of write errors.

use std::collections::BTreeMap;

use anyhow::Result;
use kube::Api;
use kube::api::{DynamicObject, ListParams};
use rebound_policy::RetryPolicy;
use rebound_tests::{TestEnv, retry_policy_resource};

use super::{CM, Operator, http_get, ready_condition};

const WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The samples of `name` with exactly `labels` (e.g. `{result="error"}`), or 0.
pub fn sample(op: &Operator, name: &str, labels: &str) -> Result<f64> {
    let text = http_get(op.metrics, "/metrics")?.ok()?;
    let series = format!("{name}{labels} ");
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0))
}

/// A ValidatingAdmissionPolicy refusing every ConfigMap write in one namespace; removed
/// when dropped (it is cluster-scoped: a failed test must not leave it behind).
pub struct Refusal<'a> {
    env: &'a TestEnv,
    name: String,
}

impl<'a> Refusal<'a> {
    pub fn start(env: &'a TestEnv) -> Result<Refusal<'a>> {
        let name = rebound_tests::unique_name("refuse-cm");
        let ns = &env.namespace;
        let manifest = format!(
            "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n\
             metadata: {{name: {name}}}\nspec:\n  failurePolicy: Fail\n  matchConstraints:\n    \
             resourceRules:\n    - apiGroups: [\"\"]\n      apiVersions: [v1]\n      \
             operations: [CREATE, UPDATE]\n      resources: [configmaps]\n  validations:\n  \
             - expression: \"false\"\n    message: refused for the test\n---\n\
             apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicyBinding\n\
             metadata: {{name: {name}}}\nspec:\n  policyName: {name}\n  validationActions: [Deny]\n  \
             matchResources:\n    namespaceSelector:\n      matchLabels: {{kubernetes.io/metadata.name: {ns}}}\n"
        );
        let refusal = Refusal { env, name };
        env.cluster
            .kubectl_stdin(["apply", "-f", "-"], &manifest)?
            .ok()?;
        // In force once a dry-run write is refused.
        rebound_test_support::eventually_blocking("the refusal to be in force", WAIT, || {
            let probe =
                env.kubectl(["annotate", "configmap", CM, "probe=1", "--dry-run=server"])?;
            Ok((!probe.success()).then_some(()))
        })?;
        Ok(refusal)
    }
}

impl Drop for Refusal<'_> {
    fn drop(&mut self) {
        let _ = self.env.cluster.kubectl([
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            &self.name,
            "--ignore-not-found",
        ]);
    }
}

pub async fn versions(client: &kube::Client, ns: &str) -> Result<BTreeMap<String, String>> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &retry_policy_resource());
    Ok(api
        .list_metadata(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.name.unwrap_or_default(),
                p.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect())
}

pub async fn ready_reasons(client: &kube::Client, ns: &str) -> Result<Vec<String>> {
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|p| {
            let status = p.status.unwrap_or_default();
            ready_condition(&status.conditions).map(|c| c.reason.clone())
        })
        .collect())
}
