'use strict';
// The first-failure memory: per (queue, job id), bounded over all queues.
const test = require('node:test');
const assert = require('node:assert/strict');
const { FirstFailures, MEMORY_LIMIT } = require('../../lib/first-failures');

test('entries are per queue and job id; delete forgets one', () => {
  const m = new FirstFailures();
  m.set('a', 'j1', { attempt: 1, ms: 10 });
  m.set('b', 'j1', { attempt: 2, ms: 20 });
  m.set('a', 'j1', { attempt: 3, ms: 30 }); // replaces, does not add
  assert.deepEqual(m.get('a', 'j1'), { attempt: 3, ms: 30 });
  assert.deepEqual(m.get('b', 'j1'), { attempt: 2, ms: 20 });
  assert.equal(m.get('a', 'j2'), undefined);
  assert.equal(m.get('c', 'j1'), undefined);
  assert.equal(m.size, 2);
  m.delete('a', 'j1');
  m.delete('a', 'j1'); // twice: still one less
  m.delete('zz', 'j1');
  assert.equal(m.size, 1);
  assert.equal(m.get('a', 'j1'), undefined);
  assert.equal(m.queues.has('a'), false, 'an emptied queue leaves no map behind');
});

test('bounded: past the limit the oldest entry of the first queue is forgotten', () => {
  assert.equal(MEMORY_LIMIT, 10000);
  const m = new FirstFailures(3);
  m.set('a', '1', { attempt: 1, ms: 1 });
  m.set('b', '1', { attempt: 1, ms: 2 });
  m.set('a', '2', { attempt: 1, ms: 3 });
  m.set('b', '2', { attempt: 1, ms: 4 });
  assert.equal(m.size, 3);
  assert.equal(m.get('a', '1'), undefined);
  m.set('b', '3', { attempt: 1, ms: 5 });
  m.set('b', '4', { attempt: 1, ms: 6 });
  // Queue a emptied by eviction, then b's oldest.
  assert.equal(m.size, 3);
  assert.deepEqual([...m.queues.keys()], ['b']);
  assert.deepEqual([...m.queues.get('b').keys()], ['2', '3', '4']);
  for (let i = 0; i < 1000; i++) m.set(`q${i % 7}`, String(i), { attempt: 1, ms: i });
  assert.equal(m.size, 3);
  assert.equal([...m.queues.values()].reduce((n, jobs) => n + jobs.size, 0), 3);
});
