'use strict';
// The producer: enqueues webhook events. The adapter gives each event its idempotency key
// (a UUID, the BullMQ job id) once, here; every attempt and the dead letter carry it.
//
//   REDIS_URL=redis://127.0.0.1:6379 RECEIVER_URL=http://127.0.0.1:8080/hooks node producer.js 20

const { Queue } = require('bullmq');
const { Rebound } = require('@rebound-dev/node');
const { QUEUE, connection } = require('./worker');

/** Enqueues `count` events for `url`; resolves to [{key, eventId}]. */
async function enqueue({ queue, rebound, url, count, firstId = 1 }) {
  const out = [];
  for (let id = firstId; id < firstId + count; id++) {
    const event = { id: `evt-${id}`, type: 'invoice.paid', invoice: `INV-${1000 + id}`, amountCents: 100 * id };
    const { key } = await rebound.bullmq.add(queue, 'deliver', { url, event });
    out.push({ key, eventId: event.id });
  }
  return out;
}

module.exports = { enqueue };

if (require.main === module) {
  (async () => {
    const rebound = new Rebound();
    const queue = new Queue(QUEUE, { connection: connection(process.env.REDIS_URL || 'redis://127.0.0.1:6379') });
    const sent = await enqueue({ queue, rebound, url: process.env.RECEIVER_URL, count: Number(process.argv[2] || 10) });
    for (const s of sent) console.log(`${s.eventId} key ${s.key}`);
    await queue.close();
    await rebound.close();
  })();
}
