"""N-gram stores: the memory and Redis backends agree exactly, namespaces isolate, Redis
being stopped mid-run falls back to memory without an error. Real redis-server on a free port."""

from __future__ import annotations

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_helpers import RedisServer

from drafter_service.ngram_store import (
    FallbackNGramStore,
    MemoryNGramStore,
    RedisNGramStore,
    StoreConfig,
    ngram_entries,
    pack,
    tokenizer_fingerprint,
    unpack,
)


@pytest.fixture(scope="module")
def server():
    srv = RedisServer()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url, socket_timeout=2)
    c.flushall()
    return c


SMALL = StoreConfig(min_n=1, max_n=3, span=2, top_n=3)  # tiny bounds: trimming happens all the time

sequences = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=30), min_size=1, max_size=6)
queries = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=5), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, qs=queries, k=st.integers(1, 5))
def test_backends_agree_on_random_updates_and_queries(server, seqs, qs, k):
    client = redis.Redis.from_url(server.url, socket_timeout=2)
    client.flushall()
    mem = MemoryNGramStore(SMALL, "ns")
    red = RedisNGramStore(client, SMALL, "ns")
    for seq in seqs:
        mem.add(seq)
        red.add(seq)
        for q in qs:
            assert red.lookup(q, k) == mem.lookup(q, k), (seq, q)


def test_lookup_prefers_the_longest_suffix_and_the_most_frequent(client):
    cfg = StoreConfig(min_n=1, max_n=2, span=2, top_n=4)
    for store in (MemoryNGramStore(cfg), RedisNGramStore(client, cfg)):
        store.add([1, 2, 3, 4, 1, 2, 3, 4, 9, 2, 7, 7])
        assert store.lookup([1, 2], 5) == [((3, 4), 2)]  # context "1 2" only ever went on with 3 4
        assert store.lookup([9, 2], 5) == [((7, 7), 1)]  # longest suffix "9 2" beats the shorter "2"
        assert store.lookup([5, 2], 5) == [((3, 4), 2), ((7, 7), 1)]  # falls back to "2": most frequent first
        assert store.lookup([5, 6], 5) == []


def test_top_n_bounds_every_context(client):
    cfg = StoreConfig(min_n=1, max_n=1, span=1, top_n=2)
    red = RedisNGramStore(client, cfg)
    red.add([0, 1, 0, 2, 0, 3, 0, 3, 0, 4])
    assert client.zcard(red.key([0])) == 2
    assert [c for c, _ in red.lookup([0], 5)][0] == (3,)


def test_namespaces_isolate_models(client):
    a = RedisNGramStore(client, SMALL, tokenizer_fingerprint({"a": 0, "b": 1}))
    b = RedisNGramStore(client, SMALL, tokenizer_fingerprint({"a": 0, "c": 1}))
    assert a.namespace != b.namespace
    a.add([1, 2, 3, 4])
    assert a.lookup([1, 2], 3) and not b.lookup([1, 2], 3)


def test_keys_are_cluster_hash_tagged_and_expire(client):
    cfg = StoreConfig(min_n=1, max_n=2, span=1, top_n=4, ttl_s=60)
    red = RedisNGramStore(client, cfg, "fp")
    red.add([1, 2, 3])
    keys = sorted(k.decode() for k in client.keys("specmesh:fp:*"))
    assert keys and all(k.count("{") == 1 and k.endswith("}") for k in keys)
    grams = [k for k in keys if ":ng:" in k]
    assert grams and all(0 < client.ttl(k) <= 60 for k in grams)
    assert keys == sorted(grams + ["specmesh:fp:config:{config}"])  # the options, kept forever
    with pytest.raises(ValueError):
        RedisNGramStore(client, cfg, "bad{ns}")


def test_redis_store_refuses_ngrams_made_with_other_options(client):
    RedisNGramStore(client, StoreConfig(span=4), "fp").add([1, 2, 3, 4, 5, 6, 7])
    RedisNGramStore(client, StoreConfig(span=4, ttl_s=9), "fp").add([1, 2, 3, 4, 5, 6, 7])  # TTL may differ
    with pytest.raises(ValueError, match="other n-gram options"):
        RedisNGramStore(client, StoreConfig(span=8), "fp").add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])


def test_redis_stopped_mid_run_falls_back_to_memory():
    srv = RedisServer()
    try:
        store = FallbackNGramStore(RedisNGramStore.from_url(srv.url, SMALL, "ns", timeout_s=0.5),
                                   MemoryNGramStore(SMALL, "ns"), retry_after_s=60)
        store.add([1, 2, 3, 1, 2, 4])
        before = store.lookup([1, 2], 3)
        assert before and store.failures == 0
    finally:
        srv.stop()
    store.add([1, 2, 3, 7])  # Redis is gone: no exception, memory keeps learning
    local = MemoryNGramStore(SMALL)
    local.add([1, 2, 3, 1, 2, 4])
    local.add([1, 2, 3, 7])
    assert store.lookup([1, 2], 3) == local.lookup([1, 2], 3) != before
    assert store.failures == 1  # then Redis is left alone until retry_after_s


def test_entries_and_packing():
    cfg = StoreConfig(min_n=1, max_n=2, span=2, top_n=4)
    assert list(ngram_entries([1, 2, 3, 4], cfg)) == [((1,), (2, 3)), ((2,), (3, 4)), ((1, 2), (3, 4))]
    assert unpack(pack([0, 7, 2**32 - 1])) == (0, 7, 2**32 - 1)
    with pytest.raises(ValueError):
        MemoryNGramStore(cfg).add([-1, 2, 3, 4])


def test_memory_store_is_bounded_least_recently_updated_out():
    store = MemoryNGramStore(StoreConfig(min_n=1, max_n=1, span=1), max_contexts=2)
    store.add([1, 2])
    store.add([3, 4])
    store.add([1, 5])  # updates context (1,): (3,) is now the oldest
    store.add([6, 7])
    assert len(store) == 2
    assert store.lookup([3], 4) == [] and store.lookup([1], 4) and store.lookup([6], 4) == [((7,), 1)]


def test_snapshot_round_trip(tmp_path):
    store = MemoryNGramStore(SMALL, "ns")
    store.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    store.save(tmp_path / "s.ngrams")
    loaded = MemoryNGramStore.load(tmp_path / "s.ngrams")
    assert loaded.namespace == "ns" and loaded.config == SMALL and loaded._table == store._table
    (tmp_path / "bad").write_text("nope")
    with pytest.raises(ValueError, match="not an n-gram store snapshot"):
        MemoryNGramStore.load(tmp_path / "bad")
