// Compiled by test/unit/types.test.js (tsc --noEmit --strict): the README's uses of the
// API type-check against index.d.ts, and wrong uses do not.
import { Queue, Worker, type Job } from 'bullmq';
import Bull from 'bull';
import { Registry } from 'prom-client';
import { Rebound, createRebound, keyOf, decideLocal, arm, DEFAULT_POLICY, LIBRARY_ATTEMPTS, type Answer, type DeadLetter } from '@rebound-dev/node';

async function main(): Promise<void> {
  const rebound = createRebound({
    target: 'unix:///run/rebound/rebound.sock',
    deadlineMs: 250,
    errorClass: (err) => (err instanceof Error ? err.name : undefined),
    retryAfterMs: () => undefined,
    refreshIntervalMs: 30000,
    defaultPolicy: DEFAULT_POLICY,
    dropRemoves: true,
    logger: false,
  });
  const metered = createRebound({ registry: new Registry() });
  await metered.close();
  const connection = { host: '127.0.0.1', port: 6379 };
  const queue = new Queue('webhooks', { connection });
  const worker = new Worker('webhooks', async (job) => keyOf(job), { connection, settings: rebound.bullmq.settings('webhooks') });
  new Worker('wrapped', rebound.bullmq.processor(async (job: Job) => keyOf(job)), { connection, settings: rebound.bullmq.settings('wrapped') });
  new Worker('other', async () => undefined, { connection, settings: rebound.bullmq.settings() });
  const { job, key } = await rebound.bullmq.add(queue, 'deliver', { url: 'http://x' }, { key: 'k-1', priority: 1 });
  // The job `add` returns is BullMQ's Job, typed: not `any`.
  const typed: Job = job;
  const state: string = await job.getState();
  const id: string | undefined = job.id;
  // @ts-expect-error no such method on a BullMQ Job
  job.noSuchMethod();
  const typedQueue = new Queue<{ url: string }>('typed', { connection });
  const { job: tj } = await rebound.bullmq.add(typedQueue, 'deliver', { url: 'http://x' });
  const url: string = tj.data.url;
  // @ts-expect-error the data must fit the queue's data type
  await rebound.bullmq.add(typedQueue, 'deliver', { url: 1 });
  const direct = new Rebound({ logger: false });
  await direct.prefetch(['webhooks']);
  void [typed, state, id, url];
  const opts = await rebound.bullmq.jobOptions('webhooks');
  const attempts: number = opts.attempts + LIBRARY_ATTEMPTS;
  await queue.add('deliver', {}, opts);
  const dlq = new Queue<DeadLetter>('webhooks-dead', { connection });
  const dead = await dlq.getJob('webhooks/k-1');
  if (dead) {
    const replayed = await rebound.bullmq.replay(dead, queue);
    const attemptsRun: number = dead.data.attempts;
    const again: Job = replayed.job;
    void [attemptsRun, again];
  }
  const bull = rebound.bull.attach(new Bull<{ a: number }>('legacy'));
  const { job: bullJob } = await rebound.bull.add(bull, 'x', { a: 1 });
  const a: number = bullJob.data.a;
  const bullState: string = await bullJob.getState();
  // @ts-expect-error no such method on a Bull Job
  bullJob.noSuchMethod();
  void [a, bullState];
  const answer: Answer = await rebound.decide({ queue: 'webhooks', attempt: 2, jobId: key });
  const local = decideLocal(DEFAULT_POLICY, 'ns/name', 3, { jobId: 'j', nowUnixMs: 1n });
  const assigned: 'STABLE' | 'CANARY' = arm('sha256:0', [{ weight: 10, startUnixMs: '1' }], 'j', undefined, 2n).arm;
  // @ts-expect-error a step's weight is a number
  arm('sha256:0', [{ weight: '10', startUnixMs: 1 }], 'j', 1, 2);
  const delay: number = await rebound.bullmq.backoffStrategy(1, 'rebound', new Error('x'), job);
  rebound.on('decision', (d) => d.delayMs + d.attempt);
  rebound.on('fallback', (f) => f.cause === 'unavailable');
  rebound.on('deadLetter', (d) => d.deadLetterJobId);
  rebound.on('drop', (d) => d.removed);
  const m = rebound.metrics();
  const n: number = m.decisions.retry + m.fallback.total + m.deadLettered + m.dropped;
  const dl: DeadLetter<{ url: string }> | null = null;
  void [attempts, answer, local, assigned, delay, n, dl, worker];
  // @ts-expect-error the target is a string
  createRebound({ target: 7411 });
  // @ts-expect-error no such event
  rebound.on('decisions', () => undefined);
  await rebound.close();
}
void main;
