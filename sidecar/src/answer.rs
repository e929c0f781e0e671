//! Request handling without I/O: check a request, look the queue up, call
//! `rebound_policy::decide`, and translate the answer to the wire types. The tonic service
//! and the fuzz target both go through here, so whatever a client sends is handled by this
//! one piece of code. A policy's retry budget is applied here, after `decide`, to its
//! RETRY answers.

use rebound_policy::{
    CompiledDocument, Context, Decision, Disposition, GiveUpReason, PolicyTable, ResolvedPolicy,
    compiled::{RolloutEntry, Selected, TableEntry},
    retry_budget::Ask,
    spec::{JitterKind, Strategy},
};

use crate::{
    fleet_share::BudgetScope,
    metrics::{Decisions, Reason, Rejection},
    pb::{EncodedBound, count_field, server as wire, v1 as pb},
    retry_budgets::Budgets,
    rollout_evidence::{Answered, RolloutEvidence},
};

/// What answering needs from a configuration: the queue table (which names its namespace
/// and content hash) and the series kept per policy. Where it came from and when it was
/// loaded is `config`'s business.
#[derive(Debug)]
pub struct Snapshot {
    pub table: PolicyTable,
    /// Retry-budget schedulers of the budgeted policies.
    pub budgets: Budgets,
    /// Each policy's decision counters, by table entry position.
    pub decisions: Decisions,
}

impl Snapshot {
    /// With fresh schedulers and counters whose metrics are registered nowhere.
    pub fn new(doc: &CompiledDocument) -> Self {
        let table = PolicyTable::new(doc);
        let (budgets, decisions) = (Budgets::detached(&table), Decisions::detached(&table));
        Self::with_series(table, budgets, decisions)
    }

    /// `budgets` and `decisions` must be built from `table`: they are found by the table
    /// entry's position.
    pub fn with_series(table: PolicyTable, budgets: Budgets, decisions: Decisions) -> Self {
        debug_assert_eq!(decisions.len(), table.len(), "decisions of another table");
        Self {
            table,
            budgets,
            decisions,
        }
    }

    pub fn namespace(&self) -> &str {
        self.table.namespace()
    }

    /// The document's content hash, `sha256:<hex>`.
    pub fn hash(&self) -> &str {
        self.table.hash()
    }
}

/// Longest queue name accepted; the same bound as the CRD's names.
pub const MAX_QUEUE_LEN: usize = 253;
/// Longest error class accepted.
pub const MAX_ERROR_CLASS_LEN: usize = 253;
/// Longest job id accepted; ids are usually UUIDs or integers, so this is generous.
pub const MAX_JOB_ID_LEN: usize = 512;
/// Most requests in one batch; with the field bounds this keeps a batch under 300 KiB.
pub const MAX_BATCH: usize = 256;
/// Largest `Decide` or `GetPolicy` message: a valid one needs at most 1,055 bytes; the
/// rest leaves room for fields newer clients may add.
pub const MAX_DECIDE_BYTES: usize = 2 * 1024;
/// Largest request message the server buffers (a `DecideBatch`): `MAX_BATCH` items of
/// `MAX_DECIDE_BYTES`.
pub const MAX_REQUEST_BYTES: usize = 512 * 1024;

fn too_large(rpc: &str, len: usize, max: usize) -> tonic::Status {
    tonic::Status::resource_exhausted(format!(
        "{rpc} request is {len} bytes; at most {max} are allowed"
    ))
}

impl EncodedBound for wire::DecideRequest {
    fn check_encoded(bytes: &[u8]) -> Result<(), tonic::Status> {
        if bytes.len() > MAX_DECIDE_BYTES {
            return Err(too_large("Decide", bytes.len(), MAX_DECIDE_BYTES));
        }
        Ok(())
    }
}

impl EncodedBound for wire::GetPolicyRequest {
    fn check_encoded(bytes: &[u8]) -> Result<(), tonic::Status> {
        if bytes.len() > MAX_DECIDE_BYTES {
            return Err(too_large("GetPolicy", bytes.len(), MAX_DECIDE_BYTES));
        }
        Ok(())
    }
}

impl EncodedBound for wire::DecideBatchRequest {
    /// Counts the items before any is decoded.
    fn check_encoded(bytes: &[u8]) -> Result<(), tonic::Status> {
        let items = count_field(bytes, 1, MAX_BATCH);
        if items > MAX_BATCH {
            return Err(tonic::Status::invalid_argument(format!(
                "requests holds more than {MAX_BATCH} items; at most {MAX_BATCH} are allowed"
            )));
        }
        Ok(())
    }
}

/// Why a request got no decision.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
}

impl RequestError {
    pub fn code(&self) -> tonic::Code {
        match self {
            RequestError::InvalidArgument(_) => tonic::Code::InvalidArgument,
            RequestError::NotFound(_) => tonic::Code::NotFound,
        }
    }
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

impl RequestError {
    /// How the metrics count a request that failed this way.
    pub fn rejection(&self) -> Rejection {
        match self {
            RequestError::InvalidArgument(_) => Rejection::InvalidArgument,
            RequestError::NotFound(_) => Rejection::NotFound,
        }
    }
}

fn invalid(message: String) -> RequestError {
    RequestError::InvalidArgument(message)
}

/// Earliest `first_failure_unix_ms` taken as milliseconds (2001-09-09T01:46:40Z): any
/// time in seconds since the epoch is far below it, so a unit mix-up cannot pass as a
/// very old first failure (which would give up at once with DEADLINE).
pub const MIN_FIRST_FAILURE_MS: u64 = 1_000_000_000_000;
/// How far in the future `first_failure_unix_ms` may lie (clock skew between the worker's
/// host and the sidecar's); such a time counts as "now". Later ones are refused: they
/// would silently switch maxRetryDuration off.
pub const MAX_CLOCK_SKEW_MS: u64 = 5 * 60 * 1000;

/// A request whose fields have been checked: text is UTF-8 within bounds, unset fields are
/// `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Question<'a> {
    pub queue: &'a str,
    pub attempt: u32,
    pub job_id: Option<&'a str>,
    pub error_class: Option<&'a str>,
    pub first_failure_ms: Option<u64>,
    pub retry_after_ms: Option<u64>,
}

/// A text field as the server decoded it (bytes), checked for UTF-8 and length.
fn text<'a>(field: &str, value: &'a [u8], max: usize) -> Result<&'a str, RequestError> {
    if value.len() > max {
        return Err(invalid(format!(
            "{field} is {} bytes long; at most {max} are allowed",
            value.len()
        )));
    }
    std::str::from_utf8(value).map_err(|e| {
        invalid(format!(
            "{field} is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })
}

fn check_queue(queue: &[u8]) -> Result<&str, RequestError> {
    if queue.is_empty() {
        return Err(invalid("queue must not be empty".to_owned()));
    }
    text("queue", queue, MAX_QUEUE_LEN)
}

fn check_first_failure(ms: u64, now_ms: u64) -> Result<Option<u64>, RequestError> {
    if ms == 0 {
        return Ok(None);
    }
    if ms < MIN_FIRST_FAILURE_MS {
        return Err(invalid(format!(
            "first_failure_unix_ms is {ms}, before 2001-09-09 in milliseconds: it looks like \
             seconds; send milliseconds since the Unix epoch (or 0 if unknown)"
        )));
    }
    if ms > now_ms.saturating_add(MAX_CLOCK_SKEW_MS) {
        return Err(invalid(format!(
            "first_failure_unix_ms is {ms}, {} ms after the sidecar's clock ({now_ms}); at \
             most {MAX_CLOCK_SKEW_MS} ms of clock skew is accepted",
            ms - now_ms
        )));
    }
    Ok(Some(ms.min(now_ms)))
}

/// Checks the fields of a request against the sidecar's clock; the message names the first
/// bad field.
pub fn check_request(req: &wire::DecideRequest, now_ms: u64) -> Result<Question<'_>, RequestError> {
    let queue = check_queue(&req.queue)?;
    if req.attempt == 0 {
        return Err(invalid(
            "attempt must be at least 1: it is the 1-based number of the run that just failed \
             (libraries counting retries from 0 send their count + 1)"
                .to_owned(),
        ));
    }
    let job_id = text("job_id", &req.job_id, MAX_JOB_ID_LEN)?;
    let error_class = text("error_class", &req.error_class, MAX_ERROR_CLASS_LEN)?;
    Ok(Question {
        queue,
        attempt: req.attempt,
        job_id: non_empty(job_id),
        error_class: non_empty(error_class),
        first_failure_ms: check_first_failure(req.first_failure_unix_ms, now_ms)?,
        retry_after_ms: non_zero(req.retry_after_ms),
    })
}

/// The policy that governs `queue`, found once.
struct Found<'a> {
    entry: &'a TableEntry,
    /// The entry's position in the document: its decision series' index.
    position: usize,
}

fn lookup<'a>(cfg: &'a Snapshot, queue: &str) -> Result<Found<'a>, RequestError> {
    let found = cfg.table.position(queue).and_then(|position| {
        let entry = cfg.table.entries().get(position)?;
        Some(Found { entry, position })
    });
    found.ok_or_else(|| {
        if cfg.table.is_empty() {
            return RequestError::NotFound(format!(
                "namespace {:?} has no RetryPolicies (configuration {} is empty), so none \
                 governs queue {queue:?}",
                cfg.namespace(),
                cfg.hash()
            ));
        }
        RequestError::NotFound(format!(
            "no RetryPolicy in namespace {:?} governs queue {queue:?}, and there is no \
             catch-all \"*\" policy",
            cfg.namespace()
        ))
    })
}

fn policy_ref(cfg: &Snapshot, entry: &TableEntry) -> pb::PolicyRef {
    pb::PolicyRef {
        name: entry.name().to_owned(),
        namespace: entry.namespace().to_owned(),
        generation: entry.generation,
        config_hash: cfg.hash().to_owned(),
    }
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn non_zero(n: u64) -> Option<u64> {
    (n != 0).then_some(n)
}

/// The `decide` context for a checked request.
pub fn context<'a>(q: &Question<'a>, now_ms: u64) -> Context<'a> {
    Context {
        job_id: q.job_id,
        error_class: q.error_class,
        first_failure_ms: q.first_failure_ms,
        now_ms: Some(now_ms),
        retry_after_ms: q.retry_after_ms,
    }
}

/// Answers one request with the policy that governs its queue — with the revision that
/// answers the job while the policy rolls out — and counts the decision in the policy's
/// series.
pub fn decide_one(
    cfg: &Snapshot,
    req: &wire::DecideRequest,
    now_ms: u64,
) -> Result<(pb::DecideResponse, Reason), RequestError> {
    decide_counted(cfg, req, now_ms, None)
}

/// [`decide_one`], also counting a rollout's jobs in `evidence` (the server's).
pub fn decide_counted(
    cfg: &Snapshot,
    req: &wire::DecideRequest,
    now_ms: u64,
    evidence: Option<&RolloutEvidence>,
) -> Result<(pb::DecideResponse, Reason), RequestError> {
    let q = check_request(req, now_ms)?;
    let found = lookup(cfg, q.queue)?;
    let entry = found.entry;
    let (decision, selected) = entry.decide(q.attempt, &context(&q, now_ms));
    let arm = selected.arm;
    let answered = answer_with(cfg, &found, &q, decision, selected, now_ms);
    if let (Some(evidence), Some(rollout)) = (evidence, entry.rollout.as_deref()) {
        let seen = Answered {
            job_id: q.job_id,
            attempt: q.attempt,
            first_failure_ms: q.first_failure_ms,
            gives_up: answered.0.decision == i32::from(pb::Decision::GiveUp),
        };
        evidence.observe(entry, rollout, arm, &seen, now_ms);
    }
    Ok(answered)
}

/// The answer of the selected revision, with the policy's budget applied, counted in the
/// policy's decision series.
fn answer_with(
    cfg: &Snapshot,
    found: &Found<'_>,
    q: &Question<'_>,
    decision: Decision,
    selected: Selected<'_>,
    now_ms: u64,
) -> (pb::DecideResponse, Reason) {
    let entry = found.entry;
    let params = selected.policy.core();
    // Whether the caller's Retry-After decided the delay, as `decide` applies it.
    let pushed_back = match (&decision, q.retry_after_ms) {
        (Decision::Retry { delay_ms }, Some(pushback)) => {
            *delay_ms == pushback.min(params.pushback_limit_ms())
        }
        _ => false,
    };
    // A policy's budget paces what its queue calls, whichever revision answers: the
    // scheduler is the stable revision's, and a changed budget applies on promotion.
    let budgeted = match (entry.retry_budget(), &decision) {
        (Some(_), Decision::Retry { .. }) => cfg.budgets.get(found.position),
        _ => None,
    };
    let Some(budget) = budgeted else {
        let (mut response, reason) = to_response(decision, policy_ref(cfg, entry), pushed_back);
        response.revision = selected.revision.to_owned();
        cfg.decisions
            .count(found.position, entry, reason, response.delay_ms);
        return (response, reason);
    };
    let ask = Ask {
        queue: q.queue,
        job_id: q.job_id,
        attempt: q.attempt,
        now_ms,
        first_failure_ms: q.first_failure_ms,
    };
    let answer = budget.apply(params, decision, &ask);
    let (mut response, mut reason) =
        to_response(answer.decision, policy_ref(cfg, entry), pushed_back);
    response.revision = selected.revision.to_owned();
    response.budget_stretched = answer.stretched;
    response.budget_delay_ms = answer.added_ms;
    if response.decision == i32::from(pb::Decision::Retry) {
        response.budget_retry_at_unix_ms = now_ms.saturating_add(response.delay_ms);
        if answer.stretched {
            reason = Reason::BudgetStretched;
        }
    }
    cfg.decisions
        .count(found.position, entry, reason, response.delay_ms);
    (response, reason)
}

/// Translates a decision to the wire, with its metrics reason; `pushed_back` says the
/// caller's Retry-After decided a retry's delay.
pub fn to_response(
    decision: Decision,
    policy: pb::PolicyRef,
    pushed_back: bool,
) -> (pb::DecideResponse, Reason) {
    match decision {
        Decision::Retry { delay_ms } => (
            pb::DecideResponse {
                decision: pb::Decision::Retry.into(),
                delay_ms,
                policy: Some(policy),
                ..Default::default()
            },
            if pushed_back {
                Reason::RetryAfter
            } else {
                Reason::Backoff
            },
        ),
        Decision::GiveUp {
            disposition,
            reason,
        } => {
            let (reason_code, counted) = match reason {
                GiveUpReason::MaxAttempts { .. } => {
                    (pb::GiveUpReason::MaxAttempts, Reason::MaxAttempts)
                }
                GiveUpReason::Deadline { .. } => (pb::GiveUpReason::Deadline, Reason::Deadline),
                GiveUpReason::NonRetryable { .. } => {
                    (pb::GiveUpReason::NonRetryable, Reason::NonRetryable)
                }
            };
            let (disposition, dead_letter_queue) = disposition_to_wire(disposition);
            (
                pb::DecideResponse {
                    decision: pb::Decision::GiveUp.into(),
                    delay_ms: 0,
                    disposition: disposition.into(),
                    dead_letter_queue,
                    reason: reason_code.into(),
                    reason_message: message(&reason),
                    policy: Some(policy),
                    ..Default::default()
                },
                counted,
            )
        }
    }
}

/// Bytes reserved for a give-up's message: its longest fixed wording with its figures
/// fits, so formatting allocates once instead of growing the string four or five times.
const REASON_MESSAGE_BYTES: usize = 128;

fn message(reason: &GiveUpReason) -> String {
    use std::fmt::Write as _;
    let mut message = String::with_capacity(REASON_MESSAGE_BYTES);
    // Writing to a String cannot fail.
    let _ = write!(message, "{reason}");
    message
}

fn disposition_to_wire(d: Disposition) -> (pb::Disposition, String) {
    match d {
        Disposition::Drop => (pb::Disposition::Drop, String::new()),
        Disposition::DeadLetter { dead_letter_queue } => {
            (pb::Disposition::DeadLetter, dead_letter_queue)
        }
    }
}

/// Answers a batch from one configuration; per-item failures stay per item. Decisions are
/// counted as [`decide_one`] counts them; `rejected` is called for each failed item.
pub fn decide_batch(
    cfg: &Snapshot,
    req: &wire::DecideBatchRequest,
    now_ms: u64,
    rejected: impl FnMut(Rejection),
) -> Result<pb::DecideBatchResponse, RequestError> {
    decide_batch_counted(cfg, req, now_ms, None, rejected)
}

/// [`decide_batch`], also counting a rollout's jobs in `evidence` (the server's).
pub fn decide_batch_counted(
    cfg: &Snapshot,
    req: &wire::DecideBatchRequest,
    now_ms: u64,
    evidence: Option<&RolloutEvidence>,
    mut rejected: impl FnMut(Rejection),
) -> Result<pb::DecideBatchResponse, RequestError> {
    if req.requests.len() > MAX_BATCH {
        return Err(invalid(format!(
            "batch holds {} requests; at most {MAX_BATCH} are allowed",
            req.requests.len()
        )));
    }
    let results = req
        .requests
        .iter()
        .map(|item| {
            let result = match decide_counted(cfg, item, now_ms, evidence) {
                Ok((response, _)) => pb::decide_result::Result::Decision(response),
                Err(e) => {
                    rejected(e.rejection());
                    pb::decide_result::Result::Error(pb::ItemError {
                        code: e.code() as u32,
                        message: e.to_string(),
                    })
                }
            };
            pb::DecideResult {
                result: Some(result),
            }
        })
        .collect();
    Ok(pb::DecideBatchResponse { results })
}

/// The resolved policy that governs a queue.
pub fn get_policy(
    cfg: &Snapshot,
    req: &wire::GetPolicyRequest,
) -> Result<pb::GetPolicyResponse, RequestError> {
    let queue = check_queue(&req.queue)?;
    let Found { entry, position } = lookup(cfg, queue)?;
    let budget_scope = entry
        .retry_budget()
        .and(cfg.budgets.get(position))
        .map(|b| budget_scope_to_wire(b.scope(), b.stale()));
    Ok(pb::GetPolicyResponse {
        policy: Some(policy_ref(cfg, entry)),
        resolved: Some(resolved_to_wire(&entry.resolved())),
        budget_scope,
        // Set by the service, which knows the source.
        config_source: None,
        rollout: entry.rollout.as_deref().map(rollout_to_wire),
    })
}

/// The wire form of a policy's rollout: the new revision and the steps started so far.
pub fn rollout_to_wire(r: &RolloutEntry) -> pb::Rollout {
    pb::Rollout {
        revision: r.exposure.revision().to_owned(),
        stable_revision: r.stable_revision.clone(),
        canary: Some(resolved_to_wire(r.canary.params())),
        steps: r
            .exposure
            .steps()
            .iter()
            .map(|s| pb::RolloutStep {
                weight: s.weight,
                start_unix_ms: s.start_unix_ms,
            })
            .collect(),
    }
}

/// The wire form of a budget's scope.
pub fn budget_scope_to_wire(scope: BudgetScope, stale: bool) -> pb::BudgetScope {
    let share = scope.share();
    pb::BudgetScope {
        per_pod: scope == BudgetScope::PerPod,
        members: share.members,
        member: share.member,
        stale: stale && scope != BudgetScope::PerPod,
    }
}

/// The wire form of a resolved policy.
pub fn resolved_to_wire(p: &ResolvedPolicy) -> pb::ResolvedPolicy {
    let strategy = match p.strategy {
        Strategy::Exponential => pb::Strategy::Exponential,
        Strategy::Linear => pb::Strategy::Linear,
        Strategy::Constant => pb::Strategy::Constant,
        Strategy::Decorrelated => pb::Strategy::Decorrelated,
        Strategy::Schedule => pb::Strategy::Schedule,
    };
    let jitter = match p.jitter {
        JitterKind::None => pb::Jitter::None,
        JitterKind::Full => pb::Jitter::Full,
        JitterKind::Equal => pb::Jitter::Equal,
        JitterKind::Proportional => pb::Jitter::Proportional,
    };
    let (terminal, dead_letter_queue) = disposition_to_wire(p.terminal.clone());
    pb::ResolvedPolicy {
        strategy: strategy.into(),
        base_ms: p.base_ms,
        multiplier: p.multiplier,
        cap_ms: p.cap_ms,
        jitter: jitter.into(),
        jitter_ratio: p.jitter_ratio,
        schedule_ms: p.schedule_ms.clone(),
        max_attempts: p.max_attempts,
        max_retry_duration_ms: p.max_retry_duration_ms.unwrap_or(0),
        non_retryable_errors: p.non_retryable_errors.clone(),
        terminal: terminal.into(),
        dead_letter_queue,
    }
}

#[cfg(test)]
mod tests {
    use rebound_policy::{CompiledDocument, CompiledPolicy, resolve, spec::RetryPolicySpec};

    use super::*;

    /// A budgeted policy answers with its scheduled time and, in GetPolicy, its scope: per
    /// Pod without a fleet (the detached schedulers of a document answered on its own).
    #[test]
    fn a_budgeted_policy_names_its_retry_time_and_scope() {
        let spec = RetryPolicySpec {
            queues: vec!["orders".to_owned()],
            backoff: None,
            max_attempts: Some(3),
            max_retry_duration: None,
            non_retryable_errors: Vec::new(),
            terminal: None,
            retry_budget: Some(rebound_policy::spec::RetryBudgetSpec {
                rate_per_second: 10,
                burst: Some(1),
            }),
            rollout: None,
        };
        let params = resolve(&spec).expect("valid spec");
        let doc = CompiledDocument::new(
            "ns",
            vec![CompiledPolicy {
                name: "p".to_owned(),
                namespace: "ns".to_owned(),
                uid: String::new(),
                generation: 1,
                queues: spec.queues.clone(),
                params,
                rollout: None,
            }],
        );
        let cfg = Snapshot::new(&doc);
        let now = 1_700_000_000_000;
        let req = wire::DecideRequest {
            queue: "orders".into(),
            attempt: 1,
            job_id: "j".into(),
            ..Default::default()
        };
        let (r, _) = decide_one(&cfg, &req, now).expect("answered");
        assert_eq!(r.budget_retry_at_unix_ms, now + r.delay_ms);
        let policy = get_policy(
            &cfg,
            &wire::GetPolicyRequest {
                queue: "orders".into(),
            },
        )
        .expect("answered");
        assert_eq!(
            policy.budget_scope,
            Some(pb::BudgetScope {
                per_pod: true,
                members: 1,
                member: 0,
                stale: false,
            })
        );
        assert_eq!(
            get_policy(
                &loaded(&["plain"]),
                &wire::GetPolicyRequest {
                    queue: "plain".into()
                }
            )
            .expect("answered")
            .budget_scope,
            None
        );
    }

    fn loaded(queues: &[&str]) -> Snapshot {
        let spec = RetryPolicySpec {
            queues: queues.iter().map(|q| (*q).to_owned()).collect(),
            backoff: None,
            max_attempts: Some(3),
            max_retry_duration: None,
            non_retryable_errors: vec!["Fatal*".to_owned()],
            terminal: None,
            retry_budget: None,
            rollout: None,
        };
        let params = resolve(&spec).expect("valid spec");
        let doc = CompiledDocument::new(
            "ns",
            vec![CompiledPolicy {
                name: "p".to_owned(),
                namespace: "ns".to_owned(),
                uid: String::new(),
                generation: 4,
                queues: spec.queues.clone(),
                params,
                rollout: None,
            }],
        );
        Snapshot::new(&doc)
    }

    fn req(queue: &str, attempt: u32) -> wire::DecideRequest {
        wire::DecideRequest {
            queue: queue.to_owned().into(),
            attempt,
            ..Default::default()
        }
    }

    #[test]
    fn answers_and_reports_the_policy() {
        let cfg = loaded(&["q"]);
        let (r, outcome) = decide_one(&cfg, &req("q", 1), 0).expect("answer");
        assert_eq!(outcome, Reason::Backoff);
        let policy = r.policy.expect("policy");
        assert_eq!((policy.name.as_str(), policy.generation), ("p", 4));
        assert_eq!(policy.config_hash, cfg.hash());
        assert_eq!(r.revision, "", "not in rollout: no revision");
        let got = get_policy(&cfg, &wire::GetPolicyRequest { queue: "q".into() }).expect("policy");
        assert_eq!(got.rollout, None);
        let (r, outcome) = decide_one(&cfg, &req("q", 3), 0).expect("answer");
        assert_eq!(outcome, Reason::MaxAttempts);
        assert_eq!(r.disposition(), pb::Disposition::Drop);
        assert_eq!(r.reason_message, "attempt 3 of 3 failed (maxAttempts)");
    }

    #[test]
    fn bad_input_is_invalid_argument_and_unknown_queue_not_found() {
        let cfg = loaded(&["q"]);
        let code =
            |r: wire::DecideRequest| decide_one(&cfg, &r, 0).map(|_| ()).map_err(|e| e.code());
        assert_eq!(code(req("", 1)), Err(tonic::Code::InvalidArgument));
        assert_eq!(code(req("q", 0)), Err(tonic::Code::InvalidArgument));
        assert_eq!(
            code(req(&"q".repeat(254), 1)),
            Err(tonic::Code::InvalidArgument)
        );
        assert_eq!(code(req("other", 1)), Err(tonic::Code::NotFound));
        let err = decide_one(&cfg, &req("other", 1), 0)
            .map(|_| ())
            .unwrap_err();
        assert!(err.to_string().contains("\"other\""), "{err}");
    }

    #[test]
    fn first_failure_must_be_milliseconds_and_not_in_the_future() {
        let now = 1_800_000_000_000;
        let at = |ms: u64| {
            check_request(
                &wire::DecideRequest {
                    first_failure_unix_ms: ms,
                    ..req("q", 1)
                },
                now,
            )
            .map(|q| q.first_failure_ms)
            .map_err(|e| e.code())
        };
        assert_eq!(at(0), Ok(None));
        assert_eq!(at(now - 1), Ok(Some(now - 1)));
        assert_eq!(
            at(now + MAX_CLOCK_SKEW_MS),
            Ok(Some(now)),
            "skew counts as now"
        );
        assert_eq!(at(now / 1000), Err(tonic::Code::InvalidArgument));
        assert_eq!(
            at(MIN_FIRST_FAILURE_MS - 1),
            Err(tonic::Code::InvalidArgument)
        );
        assert_eq!(
            at(now + MAX_CLOCK_SKEW_MS + 1),
            Err(tonic::Code::InvalidArgument)
        );
    }

    #[test]
    fn catch_all_serves_unknown_queues() {
        let cfg = loaded(&["*"]);
        assert!(decide_one(&cfg, &req("anything at all", 1), 0).is_ok());
    }

    #[test]
    fn batch_keeps_order_and_bounds_size() {
        let cfg = loaded(&["q"]);
        let batch = wire::DecideBatchRequest {
            requests: vec![req("q", 1), req("nope", 1), req("q", 0)],
        };
        let mut seen = Vec::new();
        let r = decide_batch(&cfg, &batch, 0, |o| seen.push(o)).expect("batch");
        let codes: Vec<_> = r
            .results
            .iter()
            .map(|r| match &r.result {
                Some(pb::decide_result::Result::Decision(_)) => 0,
                Some(pb::decide_result::Result::Error(e)) => e.code,
                None => 99,
            })
            .collect();
        assert_eq!(codes, [0, 5, 3]);
        assert_eq!(seen, [Rejection::NotFound, Rejection::InvalidArgument]);
        let big = wire::DecideBatchRequest {
            requests: vec![req("q", 1); MAX_BATCH + 1],
        };
        assert!(decide_batch(&cfg, &big, 0, |_| ()).is_err());
    }
}
