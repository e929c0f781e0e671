//! The operator against a real API server, driven with kubectl as users drive it: apply,
//! update, delete, conflicts, a foreign ConfigMap, an oversize namespace, and silence at
//! rest.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rebound_policy::RetryPolicy;
use rebound_tests::TestEnv;

const WAIT: Duration = Duration::from_secs(60);

fn names(doc: &rebound_policy::CompiledDocument) -> BTreeSet<String> {
    doc.policies.iter().map(|p| p.name.clone()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn apply_update_delete() -> Result<()> {
    let env = TestEnv::new("op-lifecycle").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &["--resync=1s"]))?;

    let manifests =
        policy("emails", &["emails", "emails-*"], 5) + &policy("webhooks", &["webhooks"], 8);
    env.kubectl_stdin(["apply", "-f", "-"], &manifests)?.ok()?;
    env.kubectl([
        "wait",
        "--for=condition=Ready",
        "retrypolicy",
        "--all",
        "--timeout=60s",
    ])?
    .ok()?;
    let doc = converged(client, ns, WAIT).await?;
    ensure!(names(&doc) == BTreeSet::from(["emails".into(), "webhooks".into()]));
    ensure!(doc.policies.iter().all(|p| p.generation == 1));

    // What `kubectl get` shows: the summary columns and Ready.
    let table = env.kubectl(["get", "retrypolicies"])?.ok()?.stdout;
    ensure!(
        table.contains("GIVE-UP-AFTER") && table.contains("True"),
        "{table}"
    );
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let emails = api.get("emails").await?;
    let summary = emails.status.and_then(|s| s.summary).expect("summary");
    ensure!(summary.max_attempts == 5 && summary.cap == "5m");
    ensure!(summary.serving_queues == ["emails", "emails-*"]);
    ensure!(summary.queues == "emails, emails-*");

    // Update: a new generation reaches the ConfigMap.
    env.kubectl_stdin(
        ["apply", "-f", "-"],
        &policy("emails", &["emails", "emails-*"], 7),
    )?
    .ok()?;
    let doc = converged(client, ns, WAIT).await?;
    let emails = doc
        .policies
        .iter()
        .find(|p| p.name == "emails")
        .expect("emails");
    ensure!(emails.generation == 2 && emails.params.max_attempts == 7);

    // Events: one Compiled per generation (repeats are folded into an event series). They
    // are published in the background, so the second may trail the status by a moment.
    let compiled_events = || async {
        let compiled: i32 = events(client, ns)
            .await?
            .into_iter()
            .filter(|e| e.reason == "Compiled" && e.regarding == "emails")
            .map(|e| e.count)
            .sum();
        anyhow::Ok(compiled)
    };
    eventually("2 Compiled events for emails", WAIT, || async {
        Ok((compiled_events().await? >= 2).then_some(()))
    })
    .await?;

    // Someone edits the ConfigMap by hand: the operator puts the document back.
    env.kubectl([
        "patch",
        "configmap",
        CM,
        "--type=merge",
        "-p",
        r#"{"data":{"policies.json":"{}"}}"#,
    ])?
    .ok()?;
    converged(client, ns, WAIT).await?;

    // At rest (resync every second): no writes at all.
    let before = op.writes()?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let reconciles = op.metric("rebound_operator_reconciles_total")?;
    ensure!(op.writes()? == before, "writes at rest:\n{}", op.log_tail());
    ensure!(
        reconciles >= 3.0,
        "resync did not run ({reconciles} reconciles)"
    );
    let compiled = compiled_events().await?;
    ensure!(
        compiled == 2,
        "expected 2 Compiled events for emails, got {compiled}"
    );

    // Delete one: gone from the document.
    env.kubectl(["delete", "retrypolicy", "emails"])?.ok()?;
    let doc = converged(client, ns, WAIT).await?;
    ensure!(names(&doc) == BTreeSet::from(["webhooks".into()]));
    // Delete the last: the ConfigMap stays, holding the empty, hash-stamped document the
    // compiler makes of no policies (sidecars then answer NOT_FOUND, not the old policy).
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let uid = cms.get(CM).await?.metadata.uid;
    env.kubectl(["delete", "retrypolicy", "webhooks"])?.ok()?;
    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.is_empty(), "{doc:?}");
    ensure!(doc == rebound_policy::compile(ns, Vec::new()).document);
    // ...and keeps it through resyncs.
    let reconciles = op.metric("rebound_operator_reconciles_total")?;
    eventually("two more resyncs", WAIT, || async {
        Ok((op.metric("rebound_operator_reconciles_total")? >= reconciles + 2.0).then_some(()))
    })
    .await?;
    let cm = cms.get_opt(CM).await?;
    ensure!(
        cm.and_then(|c| c.metadata.uid) == uid,
        "the ConfigMap was replaced or deleted"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn conflict_names_the_winner() -> Result<()> {
    let env = TestEnv::new("op-conflict").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;

    env.kubectl_stdin(
        ["apply", "-f", "-"],
        &policy("a-older", &["orders", "invoices"], 5),
    )?
    .ok()?;
    wait_for_reason(client, ns, "a-older", "Compiled", WAIT).await?;
    // A glob overlapping an exact name is not a conflict: the exact name wins at lookup.
    let later =
        policy("b-newer", &["invoices", "refunds"], 3) + &policy("c-glob", &["orders-*"], 3);
    env.kubectl_stdin(["apply", "-f", "-"], &later)?.ok()?;

    let loser = wait_for_reason(client, ns, "b-newer", "Conflict", WAIT).await?;
    let status = loser.status.unwrap_or_default();
    let ready = ready_condition(&status.conditions).expect("Ready");
    ensure!(
        ready.status == "False" && ready.message.contains("\"a-older\""),
        "{ready:?}"
    );
    ensure!(condition(&status.conditions, "Stalled").is_some_and(|c| c.status == "True"));
    ensure!(status.summary.map(|s| s.serving_queues) == Some(vec!["refunds".to_owned()]));
    wait_for_reason(client, ns, "c-glob", "Compiled", WAIT).await?;
    wait_for_reason(client, ns, "a-older", "Compiled", WAIT).await?;

    let (doc, _) = configmap_document(client, ns).await?.expect("ConfigMap");
    let queues = |name: &str| {
        doc.policies
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.queues.clone())
    };
    ensure!(queues("a-older") == Some(vec!["orders".into(), "invoices".into()]));
    ensure!(queues("b-newer") == Some(vec!["refunds".into()]));
    let warned = events(client, ns)
        .await?
        .into_iter()
        .any(|e| e.reason == "Conflict" && e.regarding == "b-newer" && e.note.contains("a-older"));
    ensure!(warned, "no Conflict event for b-newer");

    // The winner goes away: the loser takes the queue and becomes Ready.
    env.kubectl(["delete", "retrypolicy", "a-older"])?.ok()?;
    converged(client, ns, WAIT).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn foreign_configmap_is_never_adopted() -> Result<()> {
    let env = TestEnv::new("op-foreign").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    // Large, like the ones that filled the operator's watch cache: only their identity is
    // kept there now (objects::slim_configmap), and that is enough to tell them apart.
    let blob = "x".repeat(512 * 1024);
    let foreign = ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(CM.to_owned()),
            ..Default::default()
        },
        data: Some(
            [
                ("blob".to_owned(), blob.clone()),
                ("owner".to_owned(), "someone-else".to_owned()),
            ]
            .into(),
        ),
        ..ConfigMap::default()
    };
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    cms.create(&Default::default(), &foreign).await?;
    let _op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;
    // A policy with a large annotation (dropped from the cache) compiles as usual.
    let annotated = policy("p", &["jobs"], 4).replace(
        "metadata:\n  name: p\n",
        &format!(
            "metadata:\n  name: p\n  annotations:\n    note: {}\n",
            "y".repeat(200 * 1024)
        ),
    );
    env.kubectl_stdin(["apply", "--server-side", "-f", "-"], &annotated)?
        .ok()?;

    let p = wait_for_reason(client, ns, "p", "ConfigMapNotOwned", WAIT).await?;
    let status = p.status.unwrap_or_default();
    ensure!(condition(&status.conditions, "Stalled").is_some_and(|c| c.status == "True"));
    let cm = cms.get(CM).await?;
    ensure!(
        cm.data.unwrap_or_default()
            == [
                ("blob".to_owned(), blob),
                ("owner".to_owned(), "someone-else".to_owned())
            ]
            .into(),
        "the foreign ConfigMap was modified"
    );
    ensure!(cm.metadata.labels.unwrap_or_default().is_empty());
    let warned = events(client, ns)
        .await?
        .into_iter()
        .any(|e| e.reason == "ConfigMapNotOwned" && e.regarding == "p");
    ensure!(warned, "no ConfigMapNotOwned event");

    // Once it is gone the operator writes its own.
    env.kubectl(["delete", "configmap", CM])?.ok()?;
    converged(client, ns, WAIT).await?;
    Ok(())
}

/// A policy with 64 queue names and 64 error classes of ~250 characters: ~32 KiB compiled.
fn big_policy(i: usize) -> String {
    let long = |kind: &str, j: usize| format!("{kind}-{i}-{j}-{}", "x".repeat(230));
    let queues: Vec<String> = (0..64).map(|j| format!("{:?}", long("q", j))).collect();
    let errors: Vec<String> = (0..64).map(|j| format!("{:?}", long("e", j))).collect();
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: big-{i}\nspec:\n  \
         queues: [{}]\n  nonRetryableErrors: [{}]\n---\n",
        queues.join(", "),
        errors.join(", ")
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn oversize_document_is_not_written() -> Result<()> {
    let env = TestEnv::new("op-oversize").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let mut op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("small", &["small"], 3))?
        .ok()?;
    let good = converged(client, ns, WAIT).await?;

    // Applied while the operator is stopped, so it sees all of them at once (a running one
    // would write the first few big ones while they still fit).
    ensure!(op.terminate(Duration::from_secs(10))?, "unclean exit");
    let big: String = (0..30).map(big_policy).collect();
    env.kubectl_stdin(["apply", "--server-side", "-f", "-"], &big)?
        .ok()?;
    let _op = op.restart()?;
    for name in ["small", "big-0", "big-29"] {
        let p = wait_for_reason(client, ns, name, "DocumentTooLarge", WAIT).await?;
        let status = p.status.unwrap_or_default();
        let message = &ready_condition(&status.conditions).expect("Ready").message;
        ensure!(message.contains("over the"), "{message}");
    }
    // The last good document stays for the sidecars.
    let (doc, annotation) = configmap_document(client, ns).await?.expect("ConfigMap");
    ensure!(doc == good && annotation == Some(good.hash.clone()));

    let names: Vec<String> = (0..30).map(|i| format!("big-{i}")).collect();
    let mut args = vec!["delete".to_owned(), "retrypolicy".to_owned()];
    args.extend(names);
    env.kubectl(args)?.ok()?;
    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.len() == 1);
    Ok(())
}
