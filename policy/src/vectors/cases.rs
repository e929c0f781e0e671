//! The cases of the committed file: which policies and questions it holds, and why.

use super::format::{
    Case, FORMAT, NAMESPACE, NOW_UNIX_MS, REGENERATE, VectorFile, WireAnswer, WireContext,
    WirePolicy,
};
use crate::{
    decide::{Context, Decision, Draws, GiveUpReason, PreparedPolicy, Replay, decide, decide_with},
    resolve::{Disposition, ResolvedPolicy},
    spec::{JitterKind, Strategy},
};

const ONE_YEAR_MS: u64 = crate::duration::MAX_DURATION_MS;
const ERROR_PATTERNS: [&str; 4] = ["CardDeclined", "http.4*", "*.fatal", "smtp.5*.perm*"];
const JOB_IDS: [&str; 3] = [
    "job-1",
    "4f1c2a9e-6b0d-4e3a-9c1e-2b7d5f8a0c31",
    "j\u{fc}rgen/\u{2713}-\u{1F680}",
];

struct Named {
    name: String,
    params: ResolvedPolicy,
}

#[allow(clippy::too_many_arguments)]
fn params(
    strategy: Strategy,
    base_ms: u64,
    multiplier: f64,
    cap_ms: u64,
    jitter: JitterKind,
    max_attempts: u32,
    max_retry_duration_ms: Option<u64>,
    terminal: Disposition,
) -> ResolvedPolicy {
    ResolvedPolicy {
        strategy,
        base_ms,
        multiplier,
        cap_ms,
        jitter,
        jitter_ratio: if jitter == JitterKind::Proportional {
            0.35
        } else {
            0.0
        },
        schedule_ms: if strategy == Strategy::Schedule {
            vec![1_000, 5_000, 30_000, 90_000]
        } else {
            Vec::new()
        },
        max_attempts,
        max_retry_duration_ms,
        non_retryable_errors: ERROR_PATTERNS.iter().map(|p| (*p).to_owned()).collect(),
        terminal,
        retry_budget: None,
    }
}

fn strategy_name(s: Strategy) -> &'static str {
    match s {
        Strategy::Exponential => "exponential",
        Strategy::Linear => "linear",
        Strategy::Constant => "constant",
        Strategy::Decorrelated => "decorrelated",
        Strategy::Schedule => "schedule",
    }
}

fn jitter_name(j: JitterKind) -> &'static str {
    match j {
        JitterKind::None => "none",
        JitterKind::Full => "full",
        JitterKind::Equal => "equal",
        JitterKind::Proportional => "proportional",
    }
}

/// Every strategy × jitter kind with short schedules, plus long-running policies whose
/// attempts reach the thousands.
fn basic_policies() -> Vec<Named> {
    let mut out = Vec::new();
    let jitters = [
        JitterKind::None,
        JitterKind::Full,
        JitterKind::Equal,
        JitterKind::Proportional,
    ];
    for strategy in [
        Strategy::Exponential,
        Strategy::Linear,
        Strategy::Constant,
        Strategy::Schedule,
    ] {
        for jitter in jitters {
            let (base, multiplier, cap) = match strategy {
                Strategy::Exponential => (500, 1.7, 120_000),
                Strategy::Linear => (1_500, 1.0, 20_000),
                Strategy::Constant => (2_500, 1.0, 2_500),
                _ => (1_000, 1.0, 120_000),
            };
            let terminal = if jitter == JitterKind::Equal {
                Disposition::DeadLetter {
                    dead_letter_queue: format!("dlq.{}", strategy_name(strategy)),
                }
            } else {
                Disposition::Drop
            };
            out.push(Named {
                name: format!("{}-{}", strategy_name(strategy), jitter_name(jitter)),
                params: params(strategy, base, multiplier, cap, jitter, 12, None, terminal),
            });
        }
    }
    out.push(Named {
        name: "decorrelated".to_owned(),
        params: params(
            Strategy::Decorrelated,
            100,
            1.0,
            60_000,
            JitterKind::None,
            12,
            None,
            Disposition::DeadLetter {
                dead_letter_queue: "dlq.decorrelated".to_owned(),
            },
        ),
    });
    out
}

/// Policies that keep retrying for thousands of attempts before reaching the cap.
fn long_policies() -> Vec<Named> {
    let long = |name: &str, strategy, multiplier, jitter| Named {
        name: name.to_owned(),
        params: params(
            strategy,
            1,
            multiplier,
            ONE_YEAR_MS,
            jitter,
            10_000,
            None,
            Disposition::Drop,
        ),
    };
    vec![
        long(
            "long-exponential-none",
            Strategy::Exponential,
            1.01,
            JitterKind::None,
        ),
        long(
            "long-exponential-full",
            Strategy::Exponential,
            1.003,
            JitterKind::Full,
        ),
        long(
            "long-exponential-proportional",
            Strategy::Exponential,
            1.1,
            JitterKind::Proportional,
        ),
        long(
            "long-linear-equal",
            Strategy::Linear,
            1.0,
            JitterKind::Equal,
        ),
        long(
            "long-decorrelated",
            Strategy::Decorrelated,
            1.0,
            JitterKind::None,
        ),
    ]
}

/// Policies with a `maxRetryDuration`.
fn deadline_policies() -> Vec<Named> {
    let with = |name: &str, strategy, base, cap, jitter, limit| Named {
        name: name.to_owned(),
        params: params(
            strategy,
            base,
            2.0,
            cap,
            jitter,
            50,
            Some(limit),
            Disposition::DeadLetter {
                dead_letter_queue: "dlq.deadline".to_owned(),
            },
        ),
    };
    let mut out = vec![
        with(
            "deadline-exponential-full",
            Strategy::Exponential,
            1_000,
            600_000,
            JitterKind::Full,
            1_800_000,
        ),
        with(
            "deadline-exponential-none",
            Strategy::Exponential,
            1_000,
            600_000,
            JitterKind::None,
            1_800_000,
        ),
        with(
            "deadline-constant-equal",
            Strategy::Constant,
            60_000,
            60_000,
            JitterKind::Equal,
            300_000,
        ),
        with(
            "deadline-schedule-proportional",
            Strategy::Schedule,
            1_000,
            120_000,
            JitterKind::Proportional,
            600_000,
        ),
        with(
            "deadline-decorrelated",
            Strategy::Decorrelated,
            1_000,
            600_000,
            JitterKind::None,
            3_600_000,
        ),
    ];
    for p in &mut out {
        if p.params.strategy != Strategy::Exponential {
            p.params.multiplier = 1.0;
        }
    }
    out
}

/// The answer does not depend on the random draw, so a case without a job id is exact.
/// Decided from the rules, then checked against many draws.
fn independent_of_draw(policy: &PreparedPolicy, attempt: u32, ctx: &Context<'_>) -> bool {
    let p = policy.params();
    let by_rule = match decide(policy, attempt, ctx) {
        Decision::GiveUp {
            reason: GiveUpReason::MaxAttempts { .. } | GiveUpReason::NonRetryable { .. },
            ..
        } => true,
        _ if p.strategy != Strategy::Decorrelated && p.jitter == JitterKind::None => true,
        _ => ctx.retry_after_ms.is_some_and(|r| r >= p.cap_ms),
    };
    if by_rule {
        let first = decide_with(
            policy,
            attempt,
            ctx,
            &Draws::from_seed(0),
            &mut Replay::default(),
        );
        let all_equal = (1..256u64).all(|seed| {
            let draws = Draws::from_seed(crate::decide::mix64(seed));
            decide_with(policy, attempt, ctx, &draws, &mut Replay::default()) == first
        });
        assert!(
            all_equal,
            "{}: attempt {attempt} depends on the draw",
            policy.identity()
        );
    }
    by_rule
}

struct Builder {
    cases: Vec<Case>,
}

impl Builder {
    fn push(&mut self, label: &str, named: &Named, attempt: u32, context: WireContext) {
        let identity = format!("{NAMESPACE}/{}", named.name);
        let policy = PreparedPolicy::new(identity.clone(), named.params.clone());
        let ctx = context.to_context();
        if ctx.job_id.is_none() && !independent_of_draw(&policy, attempt, &ctx) {
            return;
        }
        let expected = WireAnswer::of(&decide(&policy, attempt, &ctx));
        let job = match &context.job_id {
            None => "nojob".to_owned(),
            Some(id) => format!(
                "job{}",
                JOB_IDS
                    .iter()
                    .position(|j| j == id)
                    .unwrap_or(JOB_IDS.len())
            ),
        };
        self.cases.push(Case {
            name: format!(
                "{}/{label}/attempt-{attempt}/{job}/{}",
                named.name,
                self.cases.len()
            ),
            identity,
            policy: WirePolicy::from(&named.params),
            attempt,
            context,
            expected,
        });
    }
}

fn job(id: Option<&str>) -> WireContext {
    WireContext {
        job_id: id.map(str::to_owned),
        ..WireContext::default()
    }
}

/// Builds the vector file. Deterministic: the same build always gives the same bytes.
pub fn generate() -> VectorFile {
    let mut b = Builder { cases: Vec::new() };
    let jobs = [Some(JOB_IDS[0]), None];

    for named in basic_policies() {
        let max = named.params.max_attempts;
        for attempt in [0, 1, 2, 3, 4, 5, 7, 9, max - 1, max, max + 1, u32::MAX] {
            for id in jobs {
                b.push("plain", &named, attempt, job(id));
            }
        }
        for attempt in [1, 2, 6] {
            b.push("plain", &named, attempt, job(Some(JOB_IDS[1])));
        }
        b.push("plain", &named, 3, job(Some(JOB_IDS[2])));
    }

    for named in long_policies() {
        for attempt in [
            1, 2, 3, 4, 5, 8, 16, 17, 50, 100, 257, 1_000, 4_096, 4_097, 9_998, 9_999, 10_000,
        ] {
            for id in jobs {
                b.push("long", &named, attempt, job(id));
            }
        }
    }

    let classes = [
        "CardDeclined",
        "CardDeclinedAgain",
        "http.404",
        "http",
        "http.500",
        "payments.fatal",
        "fatal",
        "smtp.550.permanent",
        "smtp.550.temporary",
        "\u{fc}ber.fatal",
        // Quoting in the reason message: a quote, a backslash, control characters, a soft
        // hyphen and a line separator, all written as JSON writes them.
        "q\"uote\\back\n\u{7}\u{ad}\u{2028}.fatal",
    ];
    let basics = basic_policies();
    for name in [
        "exponential-full",
        "schedule-equal",
        "decorrelated",
        "constant-none",
    ] {
        let Some(named) = basics.iter().find(|n| n.name == name) else {
            continue;
        };
        for class in classes {
            for attempt in [1, 3, named.params.max_attempts] {
                for id in [Some("job-7"), None] {
                    let context = WireContext {
                        error_class: Some(class.to_owned()),
                        ..job(id)
                    };
                    b.push("error-class", named, attempt, context);
                }
            }
        }
    }

    let pushbacks = [
        200,
        10_000,
        60_000,
        120_000,
        3_600_000,
        90_000_000_000,
        u64::MAX,
    ];
    for named in basics.iter().filter(|n| {
        matches!(
            n.name.as_str(),
            "exponential-none"
                | "exponential-full"
                | "linear-equal"
                | "constant-proportional"
                | "schedule-full"
                | "decorrelated"
        )
    }) {
        for retry_after in pushbacks {
            for attempt in [1, 4] {
                for id in [Some("job-3"), None] {
                    let context = WireContext {
                        retry_after_ms: Some(retry_after),
                        ..job(id)
                    };
                    b.push("retry-after", named, attempt, context);
                }
            }
        }
    }

    for named in deadline_policies() {
        let limit = named.params.max_retry_duration_ms.unwrap_or(0);
        let elapsed = [
            0,
            1,
            60_000,
            limit / 2,
            limit - 120_000,
            limit - 30_000,
            limit - 1,
            limit,
            limit + 1,
            10 * limit,
        ];
        for e in elapsed {
            for attempt in [1, 5, 9] {
                for id in [Some("job-5"), None] {
                    let context = WireContext {
                        first_failure_unix_ms: Some(NOW_UNIX_MS - e),
                        now_unix_ms: Some(NOW_UNIX_MS),
                        ..job(id)
                    };
                    b.push("deadline", &named, attempt, context);
                }
            }
        }
        // Without a first-failure time the elapsed time counts as zero.
        for id in [Some("job-5"), None] {
            let context = WireContext {
                now_unix_ms: Some(NOW_UNIX_MS),
                ..job(id)
            };
            b.push("deadline-no-first-failure", &named, 9, context);
        }
        // A pushback near the deadline.
        for retry_after in [30_000, 300_000, 3_600_000] {
            for id in [Some("job-5"), None] {
                let context = WireContext {
                    first_failure_unix_ms: Some(NOW_UNIX_MS - (limit - 200_000)),
                    now_unix_ms: Some(NOW_UNIX_MS),
                    retry_after_ms: Some(retry_after),
                    ..job(id)
                };
                b.push("deadline-retry-after", &named, 3, context);
            }
        }
    }

    VectorFile {
        format: FORMAT.to_owned(),
        regenerate: REGENERATE.to_owned(),
        cases: b.cases,
    }
}
