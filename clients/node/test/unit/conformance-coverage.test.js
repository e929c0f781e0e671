'use strict';
// Every scenario of clients/conformance/scenarios.json, and every scenario of faults.json that
// lists `bullmq`, has a Node test (the end-to-end tests in test/e2e/ are titled
// `<id> [<lib>]: …`, declared with `scenario('<id>', …)`), and no test names an id that is
// in neither file.
const { test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { REPO } = require('./helpers');

const read = (file) => JSON.parse(fs.readFileSync(path.join(REPO, 'clients', 'conformance', file), 'utf8')).scenarios;

/** id → libraries, from every `scenario('<id>', lib, …)` in test/e2e/*.test.js. */
function declared() {
  const dir = path.join(__dirname, '..', 'e2e');
  const out = new Map();
  for (const file of fs.readdirSync(dir).filter((f) => f.endsWith('.test.js'))) {
    const text = fs.readFileSync(path.join(dir, file), 'utf8');
    // `for (const lib of ['bullmq', 'bull'])` loops declare both libraries.
    const loopLibs = /for \(const lib of (\[[^\]]*\])\)/.exec(text);
    for (const m of text.matchAll(/^\s*scenario\('([a-z0-9-]+)', ('([a-z]+)'|lib),/gm)) {
      const libs = m[3] ? [m[3]] : JSON.parse(loopLibs[1].replace(/'/g, '"'));
      out.set(m[1], [...(out.get(m[1]) || []), ...libs]);
    }
  }
  return out;
}

test('every conformance scenario id has a Node end-to-end test, BullMQ at least', () => {
  const ids = read('scenarios.json').map((s) => s.id);
  const faultIds = read('faults.json').map((s) => s.id);
  assert.ok(ids.length > 0);
  const tests = declared();
  const missing = ids.filter((id) => !(tests.get(id) || []).includes('bullmq'));
  assert.deepEqual(missing, [], 'scenarios without a BullMQ test');
  const unknown = [...tests.keys()].filter((id) => !ids.includes(id) && !faultIds.includes(id));
  assert.deepEqual(unknown, [], 'tests naming ids that neither scenarios.json nor faults.json has');
});

test('every fault scenario listing bullmq has a BullMQ test, and none listing it not', () => {
  const faults = read('faults.json');
  const mine = faults.filter((s) => s.libraries.includes('bullmq')).map((s) => s.id);
  assert.ok(mine.length > 0);
  const tests = declared();
  const missing = mine.filter((id) => !(tests.get(id) || []).includes('bullmq'));
  assert.deepEqual(missing, [], 'faults.json scenarios listing bullmq without a BullMQ test');
  const notMine = faults.filter((s) => !s.libraries.includes('bullmq')).map((s) => s.id);
  const stray = notMine.filter((id) => (tests.get(id) || []).includes('bullmq'));
  assert.deepEqual(stray, [], 'BullMQ tests of faults.json scenarios that do not list bullmq');
});
