"""Counts a job's runs in Redis, because Celery's redelivery on Redis carries no count.

A run cut off by a killed pool child, a killed worker or a pause past the visibility
timeout comes back as the same message with the same ``retries``; without a count of
its own an adapter would run it forever. Each episode of a job (from an enqueue or a
replay to its end) has one hash, ``rebound:run:<key>:<episode>``:

- ``n``: the attempt number of the latest run started (lost runs included);
- ``cur``: the message that carries the job now, ``st`` whether it has started its run
  (``fresh`` | ``ran``), ``tok`` the delivery working on it (a delivery taken over by a
  redelivery is fenced off: its answer is not carried out);
- ``next``: the message the holder is about to publish (a retry); only that one may
  carry the job on, so a duplicate of an older message is skipped;
- ``end``: how the episode ended. The counters are deleted then, and the hash lives on
  for ``ended_ttl_s`` so a redelivery of the ended message is recognised.

The episode is the kombu delivery tag of its first message (a fresh one for every
publish, kept across redeliveries), carried by the adapter's retries in a header. Every
change is one Lua script, so it holds against a kill at any point; the dead letter is
pushed by the same script that ends the episode, so it is written once per give-up even
when a reply is lost and the script is sent again.
"""

import os
import uuid

from .core import _log

EPISODE_HEADER = "rebound_episode"
MESSAGE_HEADER = "rebound_message"
ATTEMPT_HEADER = "rebound_attempt"
DECIDE_HEADER = "rebound_decide"
"""Set on a message that carries a decision still to be made (a give-up whose write was
refused): the next delivery decides it again without running the body."""

RECORD_TTL_S = 30 * 86400
"""A live episode's record, renewed at every run: longer than any delay a policy answers."""
ENDED_TTL_S = 86400
"""An ended episode's record: longer than the visibility timeout, like result_expires."""

_ACQUIRE = """
local f = redis.call('HMGET', KEYS[1], 'end', 'cur', 'next', 'n', 'st', 'tok', 'v')
local mid, tok, decide = ARGV[1], ARGV[2], ARGV[5]
if f[1] then return {'ended', f[1]} end
local cur, st, n = f[2], f[5], tonumber(f[4])
if cur and cur == mid and f[6] == tok then return {f[7], n} end
if not cur then
  n = tonumber(ARGV[3])
  st = 'fresh'
  if decide == '1' then st = 'ran' end
  redis.call('HSET', KEYS[1], 'cur', mid, 'n', n, 'st', st)
elseif cur ~= mid then
  if f[3] ~= mid then return {'obsolete', cur} end
  st = 'fresh'
  if decide == '1' then st = 'ran' end
  redis.call('HSET', KEYS[1], 'cur', mid, 'st', st)
  redis.call('HDEL', KEYS[1], 'next')
end
redis.call('HSET', KEYS[1], 'tok', tok)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if st == 'fresh' then
  n = redis.call('HINCRBY', KEYS[1], 'n', 1)
  redis.call('HSET', KEYS[1], 'st', 'ran', 'v', 'run')
  return {'run', n}
end
redis.call('HSET', KEYS[1], 'v', 'decide')
return {'decide', n}
"""

_INTENT = """
local f = redis.call('HMGET', KEYS[1], 'end', 'cur', 'tok')
if f[1] then return 'ended' end
if f[2] ~= ARGV[1] or f[3] ~= ARGV[2] then return 'superseded' end
redis.call('HSET', KEYS[1], 'next', ARGV[3])
return 'ok'
"""

# KEYS[2], when given, is the dead-letter list: pushed before anything is written, so a
# refused push (ACL, maxmemory) leaves the episode as it was.
_END = """
local f = redis.call('HMGET', KEYS[1], 'end', 'cur', 'tok')
if f[1] then
  if f[3] == ARGV[2] then return 'ok' end
  return 'ended'
end
if ARGV[5] == '1' and (f[2] ~= ARGV[1] or f[3] ~= ARGV[2]) then return 'superseded' end
if KEYS[2] then redis.call('LPUSH', KEYS[2], ARGV[6]) end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'end', ARGV[3], 'tok', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 'ok'
"""


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


class RunRecords:
    """The run records of one app, on its Redis broker (or ``rebound_redis_url``)."""

    def __init__(self, url, prefix="", record_ttl_s=RECORD_TTL_S, ended_ttl_s=ENDED_TTL_S):
        self.url, self.prefix = url, prefix or ""
        self.record_ttl_ms = int(record_ttl_s * 1000)
        self.ended_ttl_ms = int(ended_ttl_s * 1000)
        self._pid, self._client = None, None

    @classmethod
    def for_app(cls, app):
        """None when the broker is not Redis: runs are then not counted (logged once)."""
        conf = app.conf
        url = conf.get("rebound_redis_url") or conf.get("broker_write_url") or conf.get("broker_url") or ""
        if isinstance(url, (list, tuple)):
            url = url[0] if url else ""
        url = str(url).split(";")[0].strip()
        if not url.startswith(("redis://", "rediss://", "unix://")):
            return None
        opts = conf.get("broker_transport_options") or {}
        return cls(url, prefix=opts.get("global_keyprefix", ""),
                   record_ttl_s=conf.get("rebound_record_ttl_s") or RECORD_TTL_S,
                   ended_ttl_s=conf.get("rebound_ended_ttl_s") or ENDED_TTL_S)

    @property
    def client(self):
        """One client per process (a forked pool child makes its own)."""
        if self._client is None or self._pid != os.getpid():
            import redis
            from redis.backoff import ExponentialBackoff
            from redis.retry import Retry

            # A command whose reply is lost is sent again on a new connection: every
            # script here gives the same answer the second time.
            self._client = redis.Redis.from_url(
                self.url, socket_timeout=5, socket_connect_timeout=5,
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])
            self._pid = os.getpid()
            self._scripts = {name: self._client.register_script(src)
                             for name, src in (("acquire", _ACQUIRE), ("intent", _INTENT), ("end", _END))}
        return self._client

    def _key(self, key, episode):
        return f"{self.prefix}rebound:run:{key}:{episode}"

    def _run(self, name, keys, args):
        self.client  # noqa: B018 - creates the scripts in this process
        return self._scripts[name](keys=keys, args=args)

    def acquire(self, key, episode, message, token, attempt_before, decide=False):
        """This delivery's verdict: ``('run', attempt)`` run the body as this attempt;
        ``('decide', attempt)`` the attempt ended without an answer (or its decision is
        still to be made): decide it without running the body; ``('ended', how)`` or
        ``('obsolete', _)``: a duplicate, nothing to do."""
        out = self._run("acquire", [self._key(key, episode)],
                        [message, token, int(attempt_before), self.record_ttl_ms, "1" if decide else "0"])
        verdict, value = _text(out[0]), out[1]
        return verdict, (int(value) if verdict in ("run", "decide") else _text(value))

    def intent(self, key, episode, message, token, next_message):
        """Names the retry about to be published; 'ok', or 'superseded' / 'ended' (do not publish)."""
        return _text(self._run("intent", [self._key(key, episode)], [message, token, next_message]))

    def end(self, key, episode, message, token, how, fenced=True, push=None):
        """Ends the episode (``how``: completed | dead_lettered | dropped); ``push`` =
        (list key, payload) is the dead letter, pushed by the same script. 'ok', or
        'superseded' / 'ended' (another delivery carried the job on). Raises when Redis
        refuses."""
        keys = [self._key(key, episode)]
        args = [message, token, how, self.ended_ttl_ms, "1" if fenced else "0"]
        if push is not None:
            keys.append(self.prefix + push[0])
            args.append(push[1])
        return _text(self._run("end", keys, args))


def new_token():
    return uuid.uuid4().hex


def dead_letter_payload(app, name, queue, kwargs, headers):
    """The Redis list and the payload kombu would push for ``send_task(name, queue=…)``,
    built by kombu and Celery themselves but not sent: the caller pushes it in the same
    script that ends the job's episode."""
    from kombu.utils.json import dumps

    captured = []
    with app.connection_for_write() as conn:
        channel = conn.default_channel

        def capture(q, message, **_):
            pri = channel._get_message_priority(message, reverse=False)
            captured.append((channel._q_for_pri(q, pri), dumps(message)))

        channel._put = capture  # this connection's own channel, closed below
        app.send_task(name, queue=queue, kwargs=kwargs, headers=headers, producer=app.amqp.Producer(channel))
    if len(captured) != 1:
        raise RuntimeError(f"the dead letter was routed to {len(captured)} queues")
    return captured[0]


def log_uncounted_once(app, _seen=set()):
    if id(app) not in _seen:
        _seen.add(id(app))
        _log("warn", "rebound.runs_not_counted", reason="the broker is not Redis: a lost run is not counted")
