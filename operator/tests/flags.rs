//! Flags are validated before the operator touches the cluster: a namespace given twice is
//! watched once, a bad value is a usage error (exit code 2) instead of a silent default.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use common::*;
use rebound_tests::TestEnv;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_given_twice_is_compiled_once() -> Result<()> {
    let env = TestEnv::new("op-flags-dup").await?;
    let (client, ns) = (&env.client, env.namespace.as_str());
    let args = vec![
        format!("--namespaces={ns},{ns}, {ns}"),
        format!("--lease-namespace={ns}"),
    ];
    let _op = Operator::start(env.cluster.kubeconfig(), args)?;
    env.kubectl_stdin(["apply", "-f", "-"], &policy("p", &["jobs"], 4))?
        .ok()?;
    // `converged` compares with compile() of the API's policies, hash included.
    let doc = converged(client, ns, WAIT).await?;
    ensure!(doc.policies.len() == 1, "{doc:?}");
    Ok(())
}

/// Runs the operator with `args` and returns its exit code; fails if it keeps running.
fn exit_code(kubeconfig: &std::path::Path, args: &[&str]) -> Result<Option<i32>> {
    let mut child = Command::new(operator_bin())
        .env("KUBECONFIG", kubeconfig)
        .args(["--metrics-addr=127.0.0.1:0", "--leader-elect=false"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            return Ok(status.code());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    bail!("rebound-operator {args:?} kept running")
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_flag_values_are_usage_errors() -> Result<()> {
    let env = TestEnv::new("op-flags-bad").await?;
    let kubeconfig = env.cluster.kubeconfig();
    let ns = format!("--namespaces={}", env.namespace);
    for args in [
        vec![ns.as_str(), "--log-format=jsn"],
        vec![ns.as_str(), "--log-format=JSON"],
        vec!["--namespaces=ok,Not_A_Namespace"],
    ] {
        ensure!(
            exit_code(kubeconfig, &args)? == Some(2),
            "{args:?} was not refused as a usage error"
        );
    }
    Ok(())
}
