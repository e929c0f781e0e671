'use strict';
// A Redis of the test's own, started and stopped by dev/redis.sh.
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');
const crypto = require('node:crypto');
const { REPO } = require('./helpers');

function redisScript(args) {
  return execFileSync(path.join(REPO, 'dev', 'redis.sh'), args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
}

/** Starts Redis in .state/node-unit/<id>; resolves to { url, connection, stop() }. */
function startRedis() {
  const dir = path.join(REPO, '.state', 'node-unit', `redis-${process.pid}-${crypto.randomBytes(3).toString('hex')}`);
  fs.mkdirSync(dir, { recursive: true });
  const url = redisScript(['up', dir]).trim().split('\n').pop().trim();
  const u = new URL(url);
  return {
    url,
    connection: { host: u.hostname, port: Number(u.port), maxRetriesPerRequest: null },
    stop() {
      redisScript(['down', dir]);
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Polls `check` until it returns a truthy value (or throws after `ms`). */
async function eventually(check, ms = 20000, what = 'condition') {
  const end = Date.now() + ms;
  for (;;) {
    const v = await check();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

module.exports = { startRedis, eventually };
