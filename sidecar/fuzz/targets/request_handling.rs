//! Request handling: arbitrary bytes decoded as any of the three request messages (as the
//! server decodes them: text as bytes, so invalid UTF-8 reaches the checks), then
//! answered from a fixed generated table exactly as the gRPC service does. Nothing panics,
//! errors are only INVALID_ARGUMENT or NOT_FOUND, a batch answers every item in order, and
//! a delay never exceeds the answering policy's cap.
use std::sync::OnceLock;

use prost::Message;
use rebound_sidecar::{
    answer::{self, Snapshot},
    pb::{server as wire, v1 as pb},
    testkit,
};

fn table() -> &'static Snapshot {
    static TABLE: OnceLock<Snapshot> = OnceLock::new();
    TABLE.get_or_init(|| Snapshot::new(&testkit::document("fuzz", 40, 0)))
}

fn check(
    cfg: &Snapshot,
    req: &wire::DecideRequest,
    result: &Result<pb::DecideResponse, answer::RequestError>,
) {
    match result {
        Ok(r) => {
            let queue = std::str::from_utf8(&req.queue).expect("answered, so UTF-8");
            let entry = cfg.table.lookup(queue).expect("answered, so governed");
            assert!(r.delay_ms <= entry.resolved().cap_ms);
            assert_ne!(r.decision, pb::Decision::Unspecified as i32);
        }
        Err(e) => assert!(matches!(
            e.code(),
            tonic::Code::InvalidArgument | tonic::Code::NotFound
        )),
    }
}

/// One input: never panics; answers stay within the contract.
pub fn run(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let cfg = table();
    let now = 1_800_000_000_000;
    match selector % 3 {
        0 => {
            if let Ok(req) = wire::DecideRequest::decode(rest) {
                let result = answer::decide_one(cfg, &req, now).map(|(r, _)| r);
                check(cfg, &req, &result);
            }
        }
        1 => {
            if let Ok(batch) = wire::DecideBatchRequest::decode(rest)
                && let Ok(response) = answer::decide_batch(cfg, &batch, now, |_| ())
            {
                assert_eq!(response.results.len(), batch.requests.len());
                for (req, item) in batch.requests.iter().zip(&response.results) {
                    if let Some(pb::decide_result::Result::Decision(r)) = &item.result {
                        check(cfg, req, &Ok(r.clone()));
                    }
                }
            }
        }
        _ => {
            if let Ok(req) = wire::GetPolicyRequest::decode(rest) {
                let _ = answer::get_policy(cfg, &req);
            }
        }
    }
}
