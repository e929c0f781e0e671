'use strict';
// The package ships its own copy of the proto; it must be the repository's, byte for byte.
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { REPO_PROTO_DIR, PKG_PROTO_DIR } = require('./helpers');
const { loadPackage } = require('../../lib/client');

test('clients/node/proto is a copy of proto/rebound/v1', () => {
  const repo = fs.readdirSync(REPO_PROTO_DIR).filter((f) => f.endsWith('.proto')).sort();
  const pkg = fs.readdirSync(PKG_PROTO_DIR).filter((f) => f.endsWith('.proto')).sort();
  assert.deepEqual(pkg, repo);
  for (const f of repo) {
    const want = fs.readFileSync(path.join(REPO_PROTO_DIR, f));
    const got = fs.readFileSync(path.join(PKG_PROTO_DIR, f));
    assert.ok(got.equals(want), `clients/node/proto/rebound/v1/${f} differs from proto/rebound/v1/${f}: copy it again`);
  }
});

test('the loaded service keeps the proto field names and 64-bit fields as strings', () => {
  const pkg = loadPackage();
  const decide = pkg.RetryAdvisor.service.Decide;
  const req = decide.requestDeserialize(
    decide.requestSerialize({ queue: 'q', attempt: 3, job_id: 'j', first_failure_unix_ms: '18446744073709551615', retry_after_ms: 5 }),
  );
  assert.equal(req.job_id, 'j');
  assert.equal(req.first_failure_unix_ms, '18446744073709551615');
  assert.equal(req.retry_after_ms, '5');
  assert.equal(req.error_class, ''); // defaults: true
  const res = decide.responseDeserialize(decide.responseSerialize({ decision: 'DECISION_GIVE_UP', disposition: 'DISPOSITION_DEAD_LETTER' }));
  assert.equal(res.decision, 'DECISION_GIVE_UP');
  assert.equal(res.reason, 'GIVE_UP_REASON_UNSPECIFIED');
  assert.equal(res.delay_ms, '0');
});
