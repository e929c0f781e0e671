//! RetryPolicy YAML manifests, as `--policies-file` reads them: any text either fails with
//! an error or compiles to a document that re-reads to the same hash and answers every
//! queue it names within the answering policy's cap.

use rebound_policy::CompiledDocument;
use rebound_sidecar::{answer, pb::server as wire, store};

/// One input: never panics; an accepted set of manifests behaves.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let files = [(std::path::PathBuf::from("fuzz.yaml"), text.to_owned())];
    let Ok(doc) = store::compile_manifests(&files, "fuzz") else {
        return;
    };
    let again = CompiledDocument::from_json(doc.to_json().as_bytes())
        .expect("a compiled document re-reads");
    assert_eq!(again.hash, doc.hash);
    let snapshot = answer::Snapshot::new(&doc);
    for policy in &doc.policies {
        for queue in &policy.queues {
            let name = queue.replace('*', "x");
            let req = wire::DecideRequest {
                queue: name.clone().into(),
                attempt: 1,
                job_id: prost::bytes::Bytes::from_static(b"job"),
                ..Default::default()
            };
            if let Ok((response, _)) = answer::decide_one(&snapshot, &req, 0) {
                let entry = snapshot.table.lookup(&name).expect("answered, so governed");
                assert!(response.delay_ms <= entry.resolved().cap_ms);
            }
        }
    }
}
