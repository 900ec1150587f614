"""The Redis cold tier (``cache.redis_store``) on a real ``redis-server``: blocks one cache
computed are prefix hits in another, one batched read per lookup, nothing readable or
confirmable without the node's key, and every fault a miss (the block recomputed), counted."""

from __future__ import annotations

import hashlib
from array import array

import pytest
import torch

from cache import KVCache
from cache.prefix import ROOT, block_hash
from tests.cache.conftest import feed, small_config
from tests.redis_server import running_redis

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
NS = b"node-a|fedkv-byte|weights-0"
PROMPT = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6, 0, 2, 8, 7, 4, 7, 1, 3,
          5, 2, 6, 6, 2, 4, 9, 7, 7, 5, 7, 2, 4, 7, 0]  # 43 tokens: 5 full blocks of 8 before the last


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


@pytest.fixture
def saving_redis(tmp_path):
    yield from running_redis(tmp_path, save=True)


def cache(url: str, *, key: bytes = KEY, namespace: bytes = NS, head_dim: int = 8,
          **opts) -> KVCache:
    from cache.redis_store import RedisOptions, RedisStore
    store = RedisStore(RedisOptions(url=url, namespace=namespace, **opts), key)
    return KVCache(small_config(block_size=8, head_dim=head_dim), store=store)


def compute(kv: KVCache, prompt=PROMPT, seed: int = 0, namespace: str = "") -> list:
    """Prefill ``prompt`` (what a served request does), close it, wait for the uploads."""
    s = kv.open_session(namespace=namespace)
    kv.match_prefix(s, prompt)
    ks, _ = feed(kv, s, prompt[kv.length(s):], seed=seed)
    kv.close_session(s)
    kv.store.commit()
    return ks


def hit(kv: KVCache, prompt=PROMPT, namespace: str = "") -> tuple[int, int]:
    s = kv.open_session(namespace=namespace)
    return s, kv.match_prefix(s, prompt)


def commands(server) -> dict[str, int]:
    info = server.client().info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items()}


def test_a_prefix_one_cache_computed_is_a_hit_in_another_bit_exact(redis_server):
    a, b = cache(redis_server.url), cache(redis_server.url)
    written = compute(a)
    s, n = hit(b)
    assert n == 40
    assert torch.equal(b.read(s, 1)[0][:, :40], written[1][:, :40])
    st = b.stats()
    assert st["tier_hits"]["redis"] == 5 and st["remote"]["hits"] == 5
    assert st["prefix_hit_blocks"] == 5


def test_a_prefix_lookup_is_one_batched_read_not_one_round_trip_per_block(redis_server):
    a, b = cache(redis_server.url), cache(redis_server.url)
    compute(a)
    before = commands(redis_server)
    assert hit(b)[1] == 40
    after = commands(redis_server)
    reads = {c: after.get(c, 0) - before.get(c, 0) for c in ("mget", "get", "exists")}
    assert reads == {"mget": 1, "get": 0, "exists": 0}


def test_a_miss_costs_one_batched_read_too(redis_server):
    b = cache(redis_server.url)
    before = commands(redis_server)
    assert hit(b)[1] == 0
    after = commands(redis_server)
    assert after.get("mget", 0) - before.get("mget", 0) == 1
    assert after.get("get", 0) == before.get("get", 0) and after.get("exists", 0) == before.get("exists", 0)


def _forbidden(prompt: list[int], namespace: bytes = b"") -> list[bytes]:
    """What would let a Redis operator recover or confirm the prompt: its token ids packed as
    any engine packs them, any 4-token run of them, the unkeyed chained block hashes."""
    out = []
    for fmt in ("i", "q"):
        whole = array(fmt, prompt).tobytes()
        out += [whole[i: i + 4 * array(fmt).itemsize] for i in range(0, len(whole) - 16, 8)]
    parent = ROOT
    for i in range(len(prompt) // 8):
        parent = block_hash(parent, prompt[i * 8:(i + 1) * 8], 0)
        out += [parent, parent.hex().encode()]
    out.append(hashlib.blake2b(namespace or b"x", digest_size=16).digest())
    return out


def test_nothing_in_redis_or_its_dump_names_the_prompt(saving_redis):
    a = cache(saving_redis.url)
    compute(a)
    r = saving_redis.client()
    keys = list(r.scan_iter(count=1000))
    assert len(keys) == 5
    blobs = keys + [r.get(k) for k in keys]
    r.save()
    blobs.append((saving_redis.directory / "dump.rdb").read_bytes())
    text = ",".join(map(str, PROMPT)).encode()
    for blob in blobs:
        assert text not in blob and NS not in blob
        for bad in _forbidden(PROMPT):
            assert bad not in blob


def test_a_record_moved_to_another_key_is_rejected_and_recomputed(redis_server):
    a, b = cache(redis_server.url), cache(redis_server.url)
    compute(a)
    r = redis_server.client()
    keys = list(r.scan_iter())
    first, second = keys[0], keys[1]
    r.set(second, r.get(first))  # the operator swaps one record in for another
    s, n = hit(b)
    assert n < 40  # the swapped block (and what follows it) is recomputed, not served
    st = b.stats()["remote"]
    assert st["rejected"] == 1


def test_a_foreign_nodes_record_is_rejected(redis_server):
    """Another node's record (another key) put under this node's Redis key: its tag fails."""
    mine, theirs = cache(redis_server.url), cache(redis_server.url, key=OTHER_KEY)
    compute(mine)
    r = redis_server.client()
    ours = set(r.scan_iter())
    compute(theirs)
    foreign = [k for k in r.scan_iter() if k not in ours]
    assert len(foreign) == 5  # another key: other Redis keys for the same prompt
    for k, f in zip(sorted(ours), sorted(foreign)):
        r.set(k, r.get(f))
    b = cache(redis_server.url)
    assert hit(b)[1] == 0
    assert b.stats()["remote"]["rejected"] >= 1


def test_a_corrupted_record_is_a_miss_dropped_and_counted(redis_server):
    a, b = cache(redis_server.url), cache(redis_server.url)
    compute(a)
    r = redis_server.client()
    for k in r.scan_iter():
        v = bytearray(r.get(k))
        v[len(v) // 2] ^= 1
        r.set(k, bytes(v))
    s, n = hit(b)
    assert n == 0
    st = b.stats()
    assert st["remote"]["rejected"] == 1 and st["cold_corrupt_blocks"] == 1
    b.close_session(s)
    compute(b)  # recomputed and written back: the next cache hits again
    assert hit(cache(redis_server.url))[1] == 40


def test_a_new_version_never_reads_kv_of_an_older_one(redis_server):
    a, b = cache(redis_server.url), cache(redis_server.url)
    a.set_version(1)
    compute(a)
    b.set_version(2)  # the write-back's version
    assert hit(b)[1] == 0
    c = cache(redis_server.url)
    c.set_version(1)
    assert hit(c)[1] == 40


def test_another_model_or_adapter_namespace_shares_nothing(redis_server):
    compute(cache(redis_server.url))
    assert hit(cache(redis_server.url, namespace=NS + b"-adapter-2"))[1] == 0


def test_tenants_share_nothing_through_redis(redis_server):
    compute(cache(redis_server.url), namespace="alice")
    assert hit(cache(redis_server.url), namespace="bob")[1] == 0
    assert hit(cache(redis_server.url), namespace="alice")[1] == 40


def test_a_stopped_server_is_a_miss_and_a_restarted_one_serves_again(redis_server):
    a = cache(redis_server.url, socket_timeout_s=0.2, retry_after_s=0.0)
    compute(a)
    redis_server.kill()
    b = cache(redis_server.url, socket_timeout_s=0.2, retry_after_s=0.0)
    s, n = hit(b)
    assert n == 0
    b.close_session(s)
    compute(b)  # writes fail quietly: counted, the request goes on
    st = b.stats()["remote"]
    assert st["errors"] >= 1 and st["write_errors"] + st["writes_dropped"] >= 1
    redis_server.start()  # restarted empty (no dump): a miss, then shared again
    assert hit(b)[1] == 40  # still hot in b
    c = cache(redis_server.url)
    assert hit(c)[1] == 0
    compute(c)
    assert hit(cache(redis_server.url))[1] == 40


def test_after_a_failure_the_server_is_not_asked_again_for_a_while(redis_server):
    b = cache(redis_server.url, socket_timeout_s=0.2, retry_after_s=60.0)
    redis_server.kill()
    for _ in range(3):
        s, n = hit(b)
        assert n == 0
        b.close_session(s)
    st = b.stats()["remote"]
    assert st["errors"] == 1 and st["skipped"] >= 2


def test_a_slow_server_times_out_into_a_miss(redis_server):
    a = cache(redis_server.url)
    compute(a)
    b = cache(redis_server.url, socket_timeout_s=0.2, retry_after_s=0.0)
    redis_server.client().execute_command("CLIENT", "PAUSE", "1500", "ALL")
    s, n = hit(b)
    assert n == 0
    assert b.stats()["remote"]["timeouts"] == 1


def test_a_full_server_evicts_and_lookups_miss_without_failing(tmp_path):
    gen = running_redis(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    server = next(gen)
    try:
        a = cache(server.url, head_dim=64)  # 16 KiB a block: 300 blocks overflow 2 MB
        prompts = [[p] + PROMPT[1:] for p in range(100, 160)]
        for p in prompts:
            compute(a, p)
        info = server.client().info("stats")
        assert info["evicted_keys"] > 0
        b = cache(server.url, head_dim=64)
        hits = [hit(b, p)[1] for p in prompts[:5]]
        # the oldest were evicted and are recomputed; Redis' LRU is sampled (maxmemory-samples),
        # so most of them are gone, not necessarily every one
        assert hits.count(0) >= 3 and sum(hits) < 40 * len(hits), hits
        assert b.stats()["remote"]["errors"] == 0
        assert hit(b, prompts[-1])[1] == 40
    finally:
        gen.close()


def test_a_full_server_that_refuses_writes_counts_them(tmp_path):
    gen = running_redis(tmp_path, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    server = next(gen)
    try:
        a = cache(server.url, retry_after_s=0.0)
        for p in range(100, 140):
            compute(a, [p] + PROMPT[1:])
        assert a.stats()["remote"]["write_errors"] > 0
    finally:
        gen.close()


def test_records_only_kv_blocks_and_say_why_a_key_is_needed(redis_server):
    from cache.redis_store import RedisOptions, RedisStore
    with pytest.raises(ValueError, match="32-byte cache key"):
        RedisStore(RedisOptions(url=redis_server.url, namespace=NS), b"short")
    with pytest.raises(ValueError, match="namespace"):
        RedisStore(RedisOptions(url=redis_server.url, namespace=b""), KEY)
    store = RedisStore(RedisOptions(url=redis_server.url, namespace=NS), KEY)
    store.put(b"tensor:param/w", b"weights", {"kind": "tensor", "name": "param/w", "version": 0})
    store.commit()
    assert list(redis_server.client().scan_iter()) == []  # a shared tier holds K/V only
    store.close()


def test_the_nodes_disk_answers_first_and_redis_only_what_the_disk_lacks(tmp_path, redis_server):
    from cache.chained_store import ChainedStore
    from cache.persist import open_store
    from cache.redis_store import RedisOptions, RedisStore

    def chained(name):
        remote = RedisStore(RedisOptions(url=redis_server.url, namespace=NS,
                                         socket_timeout_s=0.2, retry_after_s=0.0), KEY)
        return KVCache(small_config(block_size=8),
                       store=ChainedStore(open_store(tmp_path / name, KEY, None), remote))

    a = chained("a")
    compute(a)
    assert a.offload("cold") == 5
    before = commands(redis_server)
    assert hit(a)[1] == 40
    assert commands(redis_server).get("mget", 0) == before.get("mget", 0)  # the disk had all
    assert a.stats()["tier_hits"]["cold"] == 5
    b = chained("b")  # another process: its own disk is empty, Redis has the blocks
    assert hit(b)[1] == 40 and b.stats()["tier_hits"]["redis"] == 5
    redis_server.kill()
    c = chained("a2")
    assert hit(c)[1] == 0  # Redis gone, nothing on this disk: recomputed, no error
    a.offload("cold")
    assert hit(a)[1] == 40  # a still serves (hot, or its own disk)


def test_a_unix_socket_url_works(tmp_path):
    sock = tmp_path / "r.sock"
    gen = running_redis(tmp_path, "--unixsocket", str(sock), "--unixsocketperm", "700")
    server = next(gen)
    try:
        url = f"unix://{sock}?db=0&password={server.password}"
        compute(cache(url))
        assert hit(cache(url))[1] == 40
    finally:
        gen.close()
