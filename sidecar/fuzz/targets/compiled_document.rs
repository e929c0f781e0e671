//! The compiled-document parser, as the sidecar uses it on a mounted or watched ConfigMap:
//! any bytes either fail with an error or give a document that indexes, answers and
//! re-reads to the same hash. Mutated input almost never keeps a valid content hash, so
//! structurally valid input is also re-stamped with its hash and run through the full
//! checks, which reaches the per-policy invariants and `decide` on whatever passes them.
//! The sidecar's one-pass reader and the document reader accept exactly the same inputs.
use rebound_policy::CompiledDocument;
use rebound_sidecar::{answer, pb::server as wire, store};

/// One input: never panics; an accepted document behaves.
pub fn run(data: &[u8]) {
    read(data);
    if let Ok(raw) = serde_json::from_slice::<CompiledDocument>(data) {
        let stamped = CompiledDocument::new(raw.namespace, raw.policies).to_json();
        read(stamped.as_bytes());
    }
}

fn read(data: &[u8]) {
    let table = store::parse_compiled(data, "fuzz");
    let doc = CompiledDocument::from_json(data);
    assert_eq!(table.is_ok(), doc.is_ok(), "the two readers disagree");
    if let (Ok(table), Ok(doc)) = (table, doc) {
        assert_eq!(
            (table.hash(), table.len()),
            (doc.hash.as_str(), doc.policies.len())
        );
        exercise(&doc);
    }
}

fn exercise(doc: &CompiledDocument) {
    let again = CompiledDocument::from_json(doc.to_json().as_bytes())
        .expect("a document that passed the checks re-reads");
    assert_eq!(again.hash, doc.hash);
    let loaded = answer::Snapshot::new(doc);
    for policy in &doc.policies {
        for queue in &policy.queues {
            // At 0 no rollout step has started; a day past 2027-01-15 the seeds' have.
            for now in [0, 1_800_086_400_000] {
                for attempt in [1, 2, policy.params.max_attempts, u32::MAX] {
                    let name = queue.replace('*', "x");
                    let req = wire::DecideRequest {
                        queue: name.clone().into(),
                        attempt,
                        job_id: prost::bytes::Bytes::from_static(b"job"),
                        ..Default::default()
                    };
                    if let Ok((response, _)) = answer::decide_one(&loaded, &req, now) {
                        let entry = loaded.table.lookup(&name).expect("answered, so governed");
                        // Bounded by the cap of the revision that says it answered.
                        let cap_ms = match &entry.rollout {
                            Some(r) if response.revision == r.exposure.revision() => {
                                r.canary.params().cap_ms
                            }
                            _ => entry.resolved().cap_ms,
                        };
                        assert!(response.delay_ms <= cap_ms);
                    }
                }
            }
        }
    }
}
