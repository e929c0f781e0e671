//! The chart's API Priority and Fairness objects on the real API server: it accepts the
//! FlowSchemas and the PriorityLevelConfiguration (none dangling), and classifies a
//! worker ServiceAccount's ConfigMap request into the sidecars' level and the operator's
//! into workload-high (the `X-Kubernetes-PF-*` headers every response carries).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::config::{KubeConfigOptions, Kubeconfig};
use rebound_test_support::eventually;
use rebound_tests::helm::{Helm, chart_dir};
use rebound_tests::{Cluster, TestEnv, unique_name};
use serde_json::Value;

/// Deletes what the test applied, whatever happens.
struct Applied<'a> {
    cluster: &'a Cluster,
    yaml: String,
}

impl Drop for Applied<'_> {
    fn drop(&mut self) {
        let _ = self
            .cluster
            .kubectl_stdin(["delete", "--ignore-not-found", "-f", "-"], &self.yaml);
    }
}

fn get_json(env: &TestEnv, kind: &str, name: &str) -> Result<Value> {
    let out = env.kubectl(["get", kind, name, "-o", "json"])?.ok()?;
    Ok(serde_json::from_str(&out.stdout)?)
}

/// The UIDs of the FlowSchema and priority level a request as `user` is classified into.
async fn classified_as(env: &TestEnv, user: &str, groups: &[&str]) -> Result<(String, String)> {
    let mut kubeconfig = Kubeconfig::read_from(env.cluster.kubeconfig())?;
    for named in &mut kubeconfig.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.to_owned());
            auth.impersonate_groups = Some(groups.iter().map(|g| (*g).to_owned()).collect());
        }
    }
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let client = kube::Client::try_from(config)?;
    let request = http::Request::get(format!("/api/v1/namespaces/{}/configmaps", env.namespace))
        .body(Vec::new())?;
    // Classification precedes authorization: a 403 carries the headers too.
    let response = client.send(request.map(Into::into)).await?;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .with_context(|| format!("no {name} header"))
    };
    Ok((
        header("X-Kubernetes-PF-FlowSchema-UID")?,
        header("X-Kubernetes-PF-PriorityLevel-UID")?,
    ))
}

fn uid(object: &Value) -> String {
    object["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecars_queue_in_their_own_priority_level() -> Result<()> {
    let env = TestEnv::new("apf").await?;
    // A release of its own (the objects are cluster-scoped) matching this namespace only.
    let release = unique_name("apf");
    let out = Helm::get()?
        .run([
            "template".to_owned(),
            release.clone(),
            chart_dir("rebound").display().to_string(),
            "--namespace".to_owned(),
            env.namespace.clone(),
            "--show-only".to_owned(),
            "templates/flowcontrol.yaml".to_owned(),
            "--set".to_owned(),
            format!("apiPriority.sidecarNamespaces={{{}}}", env.namespace),
        ])?
        .ok()?;
    env.kubectl_stdin(["apply", "--server-side", "-f", "-"], &out.stdout)?
        .ok()?;
    let _applied = Applied {
        cluster: env.cluster,
        yaml: out.stdout.clone(),
    };
    let sidecars = format!("{release}-sidecar");
    let operator = format!("{release}-operator");

    // Accepted, and the FlowSchemas' priority levels exist (Dangling=False).
    for name in [&sidecars, &operator] {
        eventually("not dangling", Duration::from_secs(30), || async {
            let fs = get_json(&env, "flowschema", name)?;
            let dangling = fs["status"]["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Dangling"))
                .and_then(|c| c["status"].as_str())
                .map(str::to_owned);
            Ok((dangling.as_deref() == Some("False")).then_some(()))
        })
        .await?;
    }
    let sidecar_fs = get_json(&env, "flowschema", &sidecars)?;
    let sidecar_level = get_json(&env, "prioritylevelconfiguration", &sidecars)?;
    let operator_fs = get_json(&env, "flowschema", &operator)?;
    let workload_high = get_json(&env, "prioritylevelconfiguration", "workload-high")?;

    let ns = &env.namespace;
    let worker = format!("system:serviceaccount:{ns}:worker");
    let worker_groups = [
        "system:serviceaccounts",
        &format!("system:serviceaccounts:{ns}"),
        "system:authenticated",
    ];
    let got = classified_as(&env, &worker, &worker_groups).await?;
    ensure!(
        got == (uid(&sidecar_fs), uid(&sidecar_level)),
        "a worker's ConfigMap request went to {got:?}"
    );
    let operator_sa = format!("system:serviceaccount:{ns}:{operator}");
    let got = classified_as(&env, &operator_sa, &worker_groups).await?;
    ensure!(
        got == (uid(&operator_fs), uid(&workload_high)),
        "the operator's request went to {got:?}"
    );
    Ok(())
}
