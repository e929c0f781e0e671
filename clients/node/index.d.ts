// Type definitions for @rebound-dev/node. The implementation is plain CommonJS (index.js,
// lib/); this file is the public API and is kept by hand.

import { EventEmitter } from 'node:events';

/** `rebound.v1.ResolvedPolicy` in proto3 JSON names (as in policy/testdata/decide-vectors.json). */
export interface ResolvedPolicy {
  strategy:
    | 'STRATEGY_EXPONENTIAL'
    | 'STRATEGY_LINEAR'
    | 'STRATEGY_CONSTANT'
    | 'STRATEGY_DECORRELATED'
    | 'STRATEGY_SCHEDULE';
  baseMs: number;
  multiplier: number;
  capMs: number;
  jitter: 'JITTER_NONE' | 'JITTER_FULL' | 'JITTER_EQUAL' | 'JITTER_PROPORTIONAL';
  jitterRatio: number;
  scheduleMs: number[];
  maxAttempts: number;
  /** 0 = no limit. */
  maxRetryDurationMs: number;
  nonRetryableErrors: string[];
  terminal: 'DISPOSITION_DROP' | 'DISPOSITION_DEAD_LETTER';
  deadLetterQueue: string;
}

export type DecisionName = 'DECISION_RETRY' | 'DECISION_GIVE_UP';
export type DispositionName =
  | 'DISPOSITION_UNSPECIFIED'
  | 'DISPOSITION_DROP'
  | 'DISPOSITION_DEAD_LETTER';
export type GiveUpReasonName =
  | 'GIVE_UP_REASON_UNSPECIFIED'
  | 'GIVE_UP_REASON_MAX_ATTEMPTS'
  | 'GIVE_UP_REASON_DEADLINE'
  | 'GIVE_UP_REASON_NON_RETRYABLE';

/** `rebound.v1.PolicyRef`. `generation` is a decimal string (int64). */
export interface PolicyRef {
  name: string;
  namespace: string;
  generation: string;
  configHash: string;
}

/** One answer, from the sidecar or from the local fallback. */
export interface Answer {
  decision: DecisionName;
  delayMs: number;
  disposition: DispositionName;
  deadLetterQueue: string;
  reason: GiveUpReasonName;
  reasonMessage: string;
  /** The policy's retryBudget moved this retry later; `delayMs` includes `budgetDelayMs`. Always false from the fallback. */
  budgetStretched: boolean;
  budgetDelayMs: number;
  /** Empty strings for the built-in default policy. */
  policy: PolicyRef;
  /** `sidecar`, or `fallback` when computed locally. */
  source: 'sidecar' | 'fallback';
  /** Which policy answered: the sidecar's, the cached GetPolicy answer, or the default policy. */
  policySource: 'sidecar' | 'cached' | 'default';
  /** While the policy rolls out, the id of the revision that answered (the fallback picks it as the sidecar does); '' otherwise. */
  revision: string;
}

/** What the adapter knows about one failure; the input of `rebound.decide`. */
export interface Failure {
  queue: string;
  /** 1-based number of the run that just failed. */
  attempt: number;
  jobId?: string;
  errorClass?: string;
  firstFailureUnixMs?: number;
  retryAfterMs?: number;
}

export interface Logger {
  info(fields: Record<string, unknown>, msg: string): void;
  warn(fields: Record<string, unknown>, msg: string): void;
  error(fields: Record<string, unknown>, msg: string): void;
}

export interface ReboundOptions {
  /** `unix:///path/to.sock` or `127.0.0.1:PORT`. Default: env REBOUND_TARGET, else `127.0.0.1:7411`. */
  target?: string;
  /** Deadline of one Decide / GetPolicy call, in ms. Default 250. */
  deadlineMs?: number;
  /** Maps a job's error to its error class. Default: `err.code` if a string, else `err.name`. */
  errorClass?: (err: unknown) => string | undefined | null;
  /** Maps a job's error to a pushback in ms. Default: `err.retryAfterMs`, else `err.retryAfter` (seconds or an HTTP date). */
  retryAfterMs?: (err: unknown) => number | undefined | null;
  /** How often cached policies are fetched again with GetPolicy, in ms. Default 30000. */
  refreshIntervalMs?: number;
  /** The policy used when the sidecar cannot answer and no policy was ever fetched for the queue. */
  defaultPolicy?: ResolvedPolicy;
  /**
   * On a `drop` give-up, also remove the job from the failed set (default false: drop
   * leaves the job in the library's failed set, as the contract says). Opt-in, like `removeOnFail`.
   */
  dropRemoves?: boolean;
  /** Structured logger (pino-style); `false` silences. Default: JSON lines on stderr. */
  logger?: Logger | false;
  /**
   * The application's prom-client `Registry`: the hooks count `rebound_adapter_*` into it
   * (README "Metrics"). Default none: nothing is registered.
   */
  registry?: PromRegistry;
}

/** What the adapter uses of a prom-client `Registry` (prom-client is an optional peer). */
export interface PromRegistry {
  getSingleMetric(name: string): unknown;
  registerMetric(metric: any): void;
}

export interface Metrics {
  decisions: {
    retry: number;
    give_up_max_attempts: number;
    give_up_deadline: number;
    give_up_non_retryable: number;
  };
  /** Answers computed locally, by cause. */
  fallback: {
    total: number;
    unavailable: number;
    deadline_exceeded: number;
    not_found: number;
    other: number;
    /** Of those, how many used the built-in/configured default policy (no fetched policy). */
    default_policy: number;
  };
  /** Dead letters written (each exists; a refused write is not counted). */
  deadLettered: number;
  dropped: number;
  /** Internal problems the hook absorbed (e.g. a dead-letter write that failed). */
  hookErrors: number;
}

export interface DecisionEvent extends Answer {
  queue: string;
  jobId: string;
  attempt: number;
}
export interface FallbackEvent {
  queue: string;
  jobId: string;
  attempt: number;
  cause: 'unavailable' | 'deadline_exceeded' | 'not_found' | 'other';
  code: number | null;
  /** The gRPC status message (or the error's message). */
  details: string;
  policySource: 'cached' | 'default';
}
export interface DeadLetterEvent {
  queue: string;
  jobId: string;
  key: string;
  deadLetterQueue: string;
  deadLetterJobId: string;
  reason: GiveUpReasonName;
}
export interface DropEvent {
  queue: string;
  jobId: string;
  key: string;
  reason: GiveUpReasonName;
  removed: boolean;
}
export interface HookErrorEvent {
  queue: string;
  jobId: string;
  error: Error;
  where: string;
}

/** The data of a job in a dead-letter queue. */
export interface DeadLetter<T = unknown> {
  format: 'rebound.dev/dead-letter/v1';
  sourceQueue: string;
  sourceJobId: string;
  name: string;
  data: T;
  key: string;
  /** The attempt that gave up (1-based). */
  attempt: number;
  /** The runs actually made (the same number; runs cut short by a dead worker included). */
  attempts: number;
  reason: GiveUpReasonName;
  reasonMessage: string;
  error: { name: string; message: string; class: string };
  firstFailureUnixMs: number;
  deadLetteredAtUnixMs: number;
  policy: PolicyRef;
  source: 'sidecar' | 'fallback';
}

export interface EnqueueOptions {
  /** The idempotency key; default `crypto.randomUUID()`. Becomes the job id. Must not contain ':'. */
  key?: string;
  [option: string]: unknown;
}

export interface ReboundJobOptions {
  jobId: string;
  attempts: number;
  backoff: { type: 'rebound'; options?: { jobId: string } };
  [option: string]: unknown;
}

/** A queue `add` can enqueue on (BullMQ's `Queue`, Bull's `Queue`); `job` is what its `add` resolves to. */
export interface AddableQueue {
  name: string;
  add(name: string, data: any, opts?: any): Promise<unknown>;
}
/** The job `queue.add` resolves to: BullMQ's `Job<T>`, Bull's `Job<T>`. */
export type JobOf<Q extends AddableQueue> = Awaited<ReturnType<Q['add']>>;

/** A queue `replay` puts a dead letter back on. */
export interface ReplayQueue extends AddableQueue {
  getJob(id: string): Promise<unknown>;
}

export interface BullMQAdapter {
  /**
   * `{ backoffStrategy }`: pass as (or spread into) the Worker's `settings`. Given the
   * Worker's queue name(s), their policies are fetched now, as the Worker is created.
   */
  settings(queues?: string | string[]): { backoffStrategy: BullMQBackoffStrategy };
  /** The hook itself. Never rejects. */
  backoffStrategy: BullMQBackoffStrategy;
  /** Job options for `queue.add(name, data, opts)`: jobId = key, attempts, backoff. */
  jobOptions(queueName: string, opts?: EnqueueOptions): Promise<ReboundJobOptions>;
  /** Enqueues with `jobOptions`; resolves to the job (as `queue.add` returns it) and its key. */
  add<Q extends AddableQueue>(
    queue: Q,
    name: Parameters<Q['add']>[0],
    data: Parameters<Q['add']>[1],
    opts?: EnqueueOptions,
  ): Promise<{ job: JobOf<Q>; key: string }>;
  /** Puts a dead-lettered job back on its source queue with the same key; removes the dead-letter job last. */
  replay<Q extends ReplayQueue>(
    deadLetterJob: { data: DeadLetter; remove(): Promise<unknown> },
    queue: Q,
    opts?: Omit<EnqueueOptions, 'key'>,
  ): Promise<{ job: JobOf<Q>; key: string }>;
  /**
   * Wraps the Worker's processor function: runs that died with their worker count, and a job
   * whose unanswered runs used up the policy's attempts gives up without running again; a
   * give-up whose dead-letter write failed writes it before the job runs.
   */
  processor<P extends (job: any, token?: string, signal?: AbortSignal) => Promise<any>>(fn: P): P;
}

export type BullMQBackoffStrategy = (
  attemptsMade: number,
  type?: string,
  err?: Error,
  job?: any,
) => Promise<number>;

export interface BullAdapter {
  /** Registers the `rebound` backoff strategy on a Bull 4 queue (and the drop clean-up). Returns the queue. */
  attach<Q>(queue: Q): Q;
  jobOptions(queueName: string, opts?: EnqueueOptions): Promise<ReboundJobOptions>;
  /** Enqueues with `jobOptions` (Bull's `add(name, data, opts)`); resolves to the job and its key. */
  add<Q extends AddableQueue>(
    queue: Q,
    name: string,
    data: Parameters<Q['add']>[1],
    opts?: EnqueueOptions,
  ): Promise<{ job: JobOf<Q>; key: string }>;
  /** As BullMQ's `replay`. */
  replay<Q extends ReplayQueue>(
    deadLetterJob: { data: DeadLetter; remove(): Promise<unknown> },
    queue: Q,
    opts?: Omit<EnqueueOptions, 'key'>,
  ): Promise<{ job: JobOf<Q>; key: string }>;
}

/** The adapter (one per process): the sidecar client, the fallback, both libraries' hooks. */
export class Rebound extends EventEmitter {
  constructor(options?: ReboundOptions);
  readonly target: string;
  bullmq: BullMQAdapter;
  bull: BullAdapter;
  /**
   * Fetches the policies of the queues the worker consumes (done by `bullmq.settings(queues)`
   * and `bull.attach`). With the sidecar down: one warning naming the target, fetched again
   * once it is back. Never rejects.
   */
  prefetch(queues: string | string[]): Promise<void>;
  /** Asks the sidecar (falls back locally); never rejects. */
  /** `record: false`: a look ahead, neither counted nor emitted. */
  decide(failure: Failure, opts?: { record?: boolean; adapter?: 'bullmq' | 'bull' }): Promise<Answer>;
  /** The cached policy of a queue (fetching it when absent); null when none is known. */
  policy(queue: string): Promise<{ policy: PolicyRef; resolved: ResolvedPolicy } | null>;
  metrics(): Metrics;
  close(): Promise<void>;
  on(event: 'decision', listener: (e: DecisionEvent) => void): this;
  on(event: 'fallback', listener: (e: FallbackEvent) => void): this;
  on(event: 'deadLetter', listener: (e: DeadLetterEvent) => void): this;
  on(event: 'drop', listener: (e: DropEvent) => void): this;
  on(event: 'hookError', listener: (e: HookErrorEvent) => void): this;
}

export function createRebound(options?: ReboundOptions): Rebound;

/** The idempotency key of a job enqueued through Rebound (its id). */
export function keyOf(job: { id?: string | number | null }): string;

/** The job attempts limit Rebound sets: above every valid maxAttempts (10000). */
export const LIBRARY_ATTEMPTS: number;

/** The policy used without a fetched one. */
export const DEFAULT_POLICY: ResolvedPolicy;

/** The local port of the policy crate's decision function (exported for tests and tools). */
export function decideLocal(
  policy: ResolvedPolicy,
  identity: string,
  attempt: number,
  context: {
    jobId?: string;
    errorClass?: string;
    firstFailureUnixMs?: bigint | number;
    nowUnixMs?: bigint | number;
    retryAfterMs?: bigint | number;
  },
): {
  decision: DecisionName;
  delayMs: number;
  disposition: DispositionName;
  deadLetterQueue: string;
  reason: GiveUpReasonName;
  reasonMessage: string;
};

/** One started step of a rollout (`rebound.v1.RolloutStep`); times as BigInt, Number or decimal string. */
export interface RolloutStep {
  weight: number;
  startUnixMs: bigint | number | string;
}

/**
 * The local port of the rollout assignment: which revision answers a job of a policy in
 * rollout. `bucket` is present exactly when there is a job id; malformed input gives STABLE.
 */
export function arm(
  revision: string,
  steps: readonly RolloutStep[],
  jobId: string | undefined,
  firstFailureUnixMs: bigint | number | string | null | undefined,
  nowUnixMs: bigint | number | string,
): { arm: 'STABLE' | 'CANARY'; bucket?: number };
