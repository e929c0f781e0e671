'use strict';
// Every scenario of clients/conformance/scenarios.json has a Node test (the end-to-end
// tests in test/e2e/conformance.test.js are titled `<id> [<lib>]: …`, declared with
// `scenario('<id>', …)`), and no test names an id that is not there.
const { test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { REPO } = require('./helpers');

test('every conformance scenario id has a Node end-to-end test, BullMQ at least', () => {
  const { scenarios } = JSON.parse(fs.readFileSync(path.join(REPO, 'clients', 'conformance', 'scenarios.json'), 'utf8'));
  const ids = scenarios.map((s) => s.id);
  assert.ok(ids.length > 0);
  const dir = path.join(__dirname, '..', 'e2e');
  const declared = new Map(); // id → libs
  for (const file of fs.readdirSync(dir).filter((f) => f.endsWith('.test.js'))) {
    const text = fs.readFileSync(path.join(dir, file), 'utf8');
    // `for (const lib of ['bullmq', 'bull'])` loops declare both libraries.
    const loopLibs = /for \(const lib of (\[[^\]]*\])\)/.exec(text);
    for (const m of text.matchAll(/^\s*scenario\('([a-z0-9-]+)', ('([a-z]+)'|lib),/gm)) {
      const libs = m[3] ? [m[3]] : JSON.parse(loopLibs[1].replace(/'/g, '"'));
      declared.set(m[1], [...(declared.get(m[1]) || []), ...libs]);
    }
  }
  const missing = ids.filter((id) => !(declared.get(id) || []).includes('bullmq'));
  assert.deepEqual(missing, [], 'scenarios without a BullMQ test');
  const unknown = [...declared.keys()].filter((id) => !ids.includes(id));
  assert.deepEqual(unknown, [], 'tests naming ids that scenarios.json does not have');
});
