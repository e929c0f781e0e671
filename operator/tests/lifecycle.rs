//! The operator against a real API server, driven with kubectl as users drive it: apply,
//! update, delete, conflicts, a foreign ConfigMap, a namespace served compressed, one
//! past even that, and silence at rest.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Result, ensure};
use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rebound_policy::compiled::{CONFIGMAP_KEY, MAX_DOCUMENT_BYTES};
use rebound_policy::pattern::policy_order;
use rebound_policy::{CompiledDocument, PolicySource, RetryPolicy, compile};
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

/// A policy `name` with 64 queue names and 64 error classes from `text(kind, j)`.
fn wide_policy(name: &str, mut text: impl FnMut(&str, usize) -> String) -> String {
    let queues: Vec<String> = (0..64).map(|j| format!("{:?}", text("q", j))).collect();
    let errors: Vec<String> = (0..64).map(|j| format!("{:?}", text("e", j))).collect();
    format!(
        "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: {name}\nspec:\n  \
         queues: [{}]\n  nonRetryableErrors: [{}]\n---\n",
        queues.join(", "),
        errors.join(", ")
    )
}

/// A policy with 64 queue names and 64 error classes of ~250 characters: ~32 KiB compiled.
fn big_policy(i: usize) -> String {
    wide_policy(&format!("big-{i}"), |kind, j| {
        format!("{kind}-{i}-{j}-{}", "x".repeat(230))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn large_document_is_served_compressed() -> Result<()> {
    let env = TestEnv::new("op-large").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let mut op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("small", &["small"], 3))?
        .ok()?;
    converged(client, ns, WAIT).await?;

    // Applied while the operator is stopped, so it sees all of them at once.
    ensure!(op.terminate(Duration::from_secs(10))?, "unclean exit");
    let big: String = (0..30).map(big_policy).collect();
    env.kubectl_stdin(["apply", "--server-side", "-f", "-"], &big)?
        .ok()?;
    let _op = op.restart()?;
    // About 1 MiB of JSON: every policy served, from binaryData.
    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.len() == 31);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms.get("rebound-policies").await?;
    let (json, compressed) = stored_document(&cm)?;
    ensure!(compressed && json.len() > MAX_DOCUMENT_BYTES);
    ensure!(
        cm.data
            .as_ref()
            .is_none_or(|d| !d.contains_key(CONFIGMAP_KEY))
    );

    // Back under the limit: plain again, the compressed key gone.
    let names: Vec<String> = (0..30).map(|i| format!("big-{i}")).collect();
    let mut args = vec!["delete".to_owned(), "retrypolicy".to_owned()];
    args.extend(names);
    env.kubectl(args)?.ok()?;
    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.len() == 1);
    let cm = cms.get("rebound-policies").await?;
    ensure!(!stored_document(&cm)?.1);
    ensure!(
        cm.binary_data
            .as_ref()
            .is_none_or(|d| !d.contains_key(CONFIGMAP_KEY))
    );
    Ok(())
}

/// A policy whose queues and error classes are pseudo-random text (fixed seed), which
/// gzip cannot shrink much: about 30 KiB of JSON, 19 KiB compressed.
fn noisy_policy(i: usize) -> String {
    let mut x = i as u64;
    wide_policy(&format!("noisy-{i:02}"), |kind, j| {
        format!("{kind}-{i}-{j}-{}", incompressible(&mut x, 230))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_policy_that_does_not_fit_reports_only_itself() -> Result<()> {
    let env = TestEnv::new("op-oversize").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let mut op = Operator::start(env.cluster.kubeconfig(), scoped(ns, &[]))?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("small", &["small"], 3))?
        .ok()?;
    converged(client, ns, WAIT).await?;

    // 70 policies of ~19 KiB compressed each: about 1.3 MiB even compressed.
    ensure!(op.terminate(Duration::from_secs(10))?, "unclean exit");
    let noisy: String = (0..70).map(noisy_policy).collect();
    env.kubectl_stdin(["apply", "--server-side", "-f", "-"], &noisy)?
        .ok()?;
    let _op = op.restart()?;
    wait_for_reason(client, ns, "noisy-69", "DocumentTooLarge", WAIT).await?;

    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), ns);
    let (served, left_out) = eventually("every policy to settle", WAIT, || async {
        let mut served = Vec::new();
        let mut left_out = Vec::new();
        for p in api.list(&Default::default()).await?.items {
            let status = p.status.clone().unwrap_or_default();
            let Some(ready) = ready_condition(&status.conditions) else {
                return Ok(None);
            };
            if ready.observed_generation != p.metadata.generation {
                return Ok(None);
            }
            match (ready.status.as_str(), ready.reason.as_str()) {
                ("True", "Compiled") => served.push(p),
                ("False", "DocumentTooLarge") => left_out.push(p),
                _ => return Ok(None),
            }
        }
        Ok(Some((served, left_out)))
    })
    .await?;
    ensure!(
        !left_out.is_empty() && served.len() > 1,
        "{} served",
        served.len()
    );
    // The older ones are served: every policy left out comes after every one served.
    let order = |p: &RetryPolicy| {
        let created = p
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second());
        (created, p.metadata.name.clone().unwrap_or_default())
    };
    let last_served = served.iter().map(order).max().expect("served");
    let first_left = left_out.iter().map(order).min().expect("left out");
    ensure!(
        policy_order(
            (first_left.0, &first_left.1),
            (last_served.0, &last_served.1)
        ) == std::cmp::Ordering::Greater
    );
    ensure!(
        served
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some("small"))
    );
    // The ConfigMap holds exactly the compilation of the served ones, compressed.
    let sources = served
        .iter()
        .map(|p| PolicySource::from_object(p, ns))
        .collect();
    let expected = compile(ns, sources).document;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms.get("rebound-policies").await?;
    let (json, compressed) = stored_document(&cm)?;
    ensure!(compressed);
    ensure!(CompiledDocument::from_json(&json)? == expected);
    let stored = cm.binary_data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY));
    ensure!(stored.is_some_and(|gz| gz.0.len() <= MAX_DOCUMENT_BYTES));

    let mut args = vec!["delete".to_owned(), "retrypolicy".to_owned()];
    args.extend((0..70).map(|i| format!("noisy-{i:02}")));
    env.kubectl(args)?.ok()?;
    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.len() == 1);
    Ok(())
}
