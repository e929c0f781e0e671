"""The run record's scripts (rebound_celery.runs) on a real Redis, step by step: what each
delivery of a job's messages is told, a script sent twice, a refused dead letter."""

import uuid

import pytest
import redis

from rebound_celery.runs import RunRecords, new_token


@pytest.fixture
def records(redis_url):
    rr = RunRecords(redis_url, prefix=f"test-runs-{uuid.uuid4().hex}:")
    yield rr
    for k in rr.client.scan_iter(f"{rr.prefix}*"):
        rr.client.delete(k)


def test_every_run_counted_and_one_holder(records):
    key, ep = "job", "tag-1"
    first = new_token()
    assert records.acquire(key, ep, ep, first, 0) == ("run", 1)
    assert records.acquire(key, ep, ep, first, 0) == ("run", 1)  # the same script again: the same answer
    again = new_token()  # the message redelivered: its run got no answer
    assert records.acquire(key, ep, ep, again, 0) == ("decide", 1)
    assert records.intent(key, ep, ep, first, "m2") == "superseded"  # the first delivery is fenced off
    assert records.intent(key, ep, ep, again, "m2") == "ok"
    third = new_token()
    assert records.acquire(key, ep, "m2", third, 1) == ("run", 2)  # the retry: one higher
    assert records.acquire(key, ep, "m-other", new_token(), 1)[0] == "obsolete"
    assert records.acquire(key, ep, ep, new_token(), 0)[0] == "obsolete"  # the first message, once more


def test_dead_letter_once_and_ended(records, redis_url):
    key, ep, dlq = "job", "tag-2", f"{records.prefix}dead"
    tok = new_token()
    assert records.acquire(key, ep, ep, tok, 2) == ("run", 3)
    assert records.end(key, ep, ep, tok, "dead_lettered", push=("dead", "letter")) == "ok"
    assert records.end(key, ep, ep, tok, "dead_lettered", push=("dead", "letter")) == "ok"  # reply lost, sent again
    assert records.client.lrange(dlq, 0, -1) == [b"letter"]
    assert records.acquire(key, ep, ep, new_token(), 2) == ("ended", "dead_lettered")
    assert records.client.hgetall(records._key(key, ep)).keys() == {b"end", b"tok"}  # the counters are gone
    assert 0 < records.client.pttl(records._key(key, ep)) <= records.ended_ttl_ms


def test_refused_dead_letter_leaves_the_job_undecided(records):
    key, ep = "job", "tag-3"
    records.client.set(f"{records.prefix}dead", "not a list")  # Redis refuses the push (WRONGTYPE)
    tok = new_token()
    assert records.acquire(key, ep, ep, tok, 2) == ("run", 3)
    with pytest.raises(redis.exceptions.ResponseError):
        records.end(key, ep, ep, tok, "dead_lettered", push=("dead", "letter"))
    assert records.client.hget(records._key(key, ep), "end") is None
    assert records.intent(key, ep, ep, tok, "m-decide") == "ok"  # decided again by the next message
    assert records.acquire(key, ep, "m-decide", new_token(), 3, decide=True) == ("decide", 3)
