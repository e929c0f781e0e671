//! No work at rest: once a configuration is loaded and nothing changes, the sidecar reads
//! nothing (the loader's own reads must not wake it up), and a non-regular file where the
//! configuration belongs is refused instead of blocking the loader or shutdown.

mod common;

use std::{
    path::Path,
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use common::eventually;
use rebound_sidecar::{source::files::FileSource, store::Store, testkit::AtomicWriter};

const WAIT: Duration = Duration::from_secs(10);
/// Long enough for dozens of polls and, before the fix, hundreds of self-inflicted reloads.
const QUIET: Duration = Duration::from_millis(1500);
const POLL: Duration = Duration::from_millis(50);

const POLICY: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: webhooks\nspec:\n  queues: [webhooks]\n  maxAttempts: 4\n";

async fn wait_loaded(store: &Arc<Store>, sequence: u64) {
    let store = Arc::clone(store);
    eventually("a configuration to load", WAIT, || {
        let n = store.current().map_or(0, |c| c.sequence);
        async move { n >= sequence }
    })
    .await;
}

/// Reads and reloads counted over a quiet interval.
async fn quiet_counts(store: &Arc<Store>) -> (u64, u64) {
    let reads = store.metrics().input_reads();
    let loaded = store.current().map_or(0, |c| c.sequence);
    tokio::time::sleep(QUIET).await;
    (
        store.metrics().input_reads() - reads,
        store.current().map_or(0, |c| c.sequence) - loaded,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_file_is_not_read_again_at_rest() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("policies.yaml");
    std::fs::write(&file, POLICY).expect("write");
    let store = common::store();
    let source = FileSource::manifests(vec![file.clone()], "demo".to_owned(), POLL)
        .spawn(Arc::clone(&store))
        .expect("watch");
    wait_loaded(&store, 1).await;
    assert_eq!(
        quiet_counts(&store).await,
        (0, 0),
        "(reads, reloads) at rest"
    );

    // Still live: an edit is read and loaded.
    std::fs::write(&file, POLICY.replace("maxAttempts: 4", "maxAttempts: 5")).expect("edit");
    wait_loaded(&store, 2).await;
    assert_eq!(
        quiet_counts(&store).await,
        (0, 0),
        "(reads, reloads) at rest"
    );
    drop(source);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mounted_configmap_is_not_read_again_at_rest() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("policies");
    let writer = AtomicWriter::new(&dir);
    let doc = |salt| rebound_sidecar::testkit::document("ns", 20, salt).to_json();
    writer
        .write(&[("policies.json", doc(0).as_bytes())])
        .expect("publish");
    let store = common::store();
    let source = FileSource::mounted_dir(dir.clone(), "policies.json", POLL)
        .spawn(Arc::clone(&store))
        .expect("watch");
    wait_loaded(&store, 1).await;
    assert_eq!(
        quiet_counts(&store).await,
        (0, 0),
        "(reads, reloads) at rest"
    );

    writer
        .write(&[("policies.json", doc(1).as_bytes())])
        .expect("publish");
    wait_loaded(&store, 2).await;
    assert_eq!(
        quiet_counts(&store).await,
        (0, 0),
        "(reads, reloads) at rest"
    );
    drop(source);
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a file.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_is_refused_and_the_source_still_stops() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("policies");
    std::fs::create_dir(&dir).expect("mkdir");
    mkfifo(&dir.join("policies.json"));
    let store = common::store();
    let source = FileSource::mounted_dir(dir.clone(), "policies.json", POLL)
        .spawn(Arc::clone(&store))
        .expect("watch");
    let s = Arc::clone(&store);
    eventually("the FIFO to be refused", WAIT, || {
        let n = s.metrics().reload_failures();
        async move { n >= 1 }
    })
    .await;
    assert!(store.current().is_none());
    // Dropping the handle stops the thread (it is not stuck in open()).
    tokio::task::spawn_blocking(move || drop(source))
        .await
        .expect("stopped");
}

#[tokio::test]
async fn the_binary_refuses_a_fifo_key_and_exits_on_sigterm() {
    use std::io::{Read, Write};
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("policies");
    std::fs::create_dir(&dir).expect("mkdir");
    mkfifo(&dir.join("policies.json"));
    let admin = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rebound-sidecar"))
        .arg("--policies-dir")
        .arg(&dir)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            &admin.to_string(),
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn");
    let scrape = move || {
        let mut s = std::net::TcpStream::connect(admin).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    };
    eventually("the FIFO to be reported as a reload failure", WAIT, || {
        let text = scrape();
        async move {
            text.and_then(|t| common::sample(&t, "rebound_sidecar_config_reload_failures_total"))
                .is_some_and(|n| n >= 1.0)
        }
    })
    .await;
    let text = scrape().expect("metrics");
    assert_eq!(
        common::sample(&text, "rebound_sidecar_config_state{state=\"none\"}"),
        Some(1.0)
    );

    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: signalling the child this test spawned.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("did not exit after SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
}
