"""experiments.cuckoo_index: CuckooIndex behaves exactly like a dict (hypothesis state machine, with growth,
kicks and the stash forced by colliding keys); the 8-slot compare finds keys anywhere;
load_factor; key errors; make_index."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from experiments.cuckoo_index import DEFAULT_KIND, SLOTS, CuckooIndex, DictIndex, make_index


def key(lo: int, hi: int) -> bytes:
    """A key whose two 64-bit words (the bucket functions' inputs) are ``lo`` and ``hi``."""
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")


def digest(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


# Keys with few distinct low bits collide in both buckets at every small table size (kicks,
# growth, stash); a few uniform digests; the all-zero key (equal to an empty slot's b"").
COLLIDING = [key(lo, hi) for lo in range(4) for hi in range(4)]
COLLIDING += [key(lo << 40, hi << 40) for lo in range(3) for hi in range(3) if lo or hi]
KEYS = st.one_of(st.sampled_from(COLLIDING), st.sampled_from([digest(i) for i in range(40)]),
                 st.binary(min_size=16, max_size=16))


class DictModel(RuleBasedStateMachine):
    """Random inserts/overwrites/deletes/lookups on a small table against a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.index: CuckooIndex[int] = CuckooIndex(8)
        self.model: dict[bytes, int] = {}

    @rule(k=KEYS, v=st.integers())
    def set(self, k: bytes, v: int) -> None:
        self.index[k] = v
        self.model[k] = v

    @precondition(lambda self: self.model)
    @rule(data=st.data(), v=st.integers())
    def overwrite(self, data: st.DataObject, v: int) -> None:
        k = data.draw(st.sampled_from(sorted(self.model)))
        self.index[k] = v
        self.model[k] = v

    @rule(k=KEYS)
    def delete(self, k: bytes) -> None:
        if k in self.model:
            del self.index[k]
            del self.model[k]
        else:
            with pytest.raises(KeyError):
                del self.index[k]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_present(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.model)))
        del self.index[k]
        del self.model[k]

    @rule(k=KEYS)
    def lookup(self, k: bytes) -> None:
        assert self.index.get(k) == self.model.get(k)
        assert self.index.get(k, -1) == self.model.get(k, -1)
        assert (k in self.index) == (k in self.model)
        if k in self.model:
            assert self.index[k] == self.model[k]
        else:
            with pytest.raises(KeyError):
                self.index[k]

    @invariant()
    def same_contents(self) -> None:
        assert len(self.index) == len(self.model)
        assert dict(self.index.items()) == self.model
        assert sorted(self.index) == sorted(self.model)
        assert sorted(self.index.values()) == sorted(self.model.values())
        assert self.index == self.model
        assert self.index.load_factor == len(self.model) / self.index.capacity


DictModel.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestDictModel = DictModel.TestCase


def test_many_digests_grow_past_capacity_like_a_dict():
    index: CuckooIndex[int] = CuckooIndex(16)
    model = {}
    for i in range(3000):
        index[digest(i)] = model[digest(i)] = i
        if i % 3 == 0:
            del index[digest(i // 2)]
            model.pop(digest(i // 2))
    assert index.capacity > 16 and index.stash_size == 0
    assert dict(index.items()) == model
    assert all(index[k] == v for k, v in model.items())


def test_fill_to_90_percent_without_growth():
    index: CuckooIndex[int] = CuckooIndex(4096)
    n = index.capacity * 9 // 10
    for i in range(n):
        index[digest(i)] = i
    assert index.capacity == 4096 and index.stash_size == 0
    assert index.load_factor == pytest.approx(0.9, abs=1e-3)
    assert all(index[digest(i)] == i for i in range(n))


def test_kicks_move_keys_to_their_other_bucket():
    index: CuckooIndex[int] = CuckooIndex(4 * SLOTS)  # 4 buckets
    # 4 keys fill bucket 0 (their other buckets are 1..3); a 5th wanting only bucket 0 kicks one
    first = [key(4 * j, 4 * j + 1 + j % 3) for j in range(SLOTS)]
    for i, k in enumerate(first):
        index[k] = i
    assert {index.locate(k)[0] for k in first} == {0}
    late = key(4 * 99, 4 * 99)  # both words -> bucket 0
    index[late] = 99
    assert index.locate(late) == (0, index.locate(late)[1])
    moved = [k for k in first if index.locate(k)[0] != 0]
    assert len(moved) == 1 and index.locate(moved[0])[0] == index.bucket_pair(moved[0])[1]
    assert index.capacity == 4 * SLOTS and index.stash_size == 0
    assert all(index[k] == i for i, k in enumerate(first)) and index[late] == 99


def test_keys_colliding_in_both_buckets_use_the_stash_then_grow():
    index: CuckooIndex[int] = CuckooIndex(8)
    same = [key(j << 60, j << 60) for j in range(12)]  # bucket 0 in both words, any size
    for i, k in enumerate(same):
        index[k] = i
    assert index.stash_size > 0 and index.load_factor <= 1
    assert [index[k] for k in same] == list(range(12))
    for k in same[::2]:
        del index[k]
    assert sorted(index.values()) == list(range(1, 12, 2))


@pytest.mark.parametrize("bucket_choice", [0, 1])
@pytest.mark.parametrize("slot", range(SLOTS))
def test_compare_finds_a_key_in_either_bucket_and_any_slot(bucket_choice, slot):
    index: CuckooIndex[str] = CuckooIndex(8 * SLOTS)  # 8 buckets
    b1, b2 = 2, 5
    target = key(8 * 7 + b1, 8 * 7 + b2)
    # fill the chosen bucket's earlier slots with keys that live only there
    home = (b1, b2)[bucket_choice]
    for s in range(slot):
        index[key(8 * (10 + s) + home, 8 * (10 + s) + home)] = f"pad{s}"
    if bucket_choice == 1:  # first bucket full of keys that only fit there
        for s in range(SLOTS):
            index[key(8 * (20 + s) + b1, 8 * (20 + s) + b1)] = f"full{s}"
    index[target] = "t"
    assert index.locate(target) == (home, slot)
    assert index[target] == "t" and index.get(target) == "t" and target in index
    near = key(8 * 7 + b1, 8 * 8 + b2)  # same buckets, another key
    assert near not in index and index.get(near, "none") == "none"


def test_all_zero_key_is_not_confused_with_empty_slots():
    index: CuckooIndex[int] = CuckooIndex(8)
    zero = bytes(16)
    assert zero not in index and index.get(zero) is None
    index[key(0, 0)[:15] + b"\x01"] = 1  # shares bucket 0
    assert zero not in index
    index[zero] = 0
    assert index[zero] == 0 and len(index) == 2
    del index[zero]
    assert zero not in index and len(index) == 1


def test_load_factor_and_capacity():
    index: CuckooIndex[int] = CuckooIndex(100)
    assert index.buckets == 32 and index.capacity == 128 and index.load_factor == 0
    for i in range(64):
        index[digest(i)] = i
    assert index.load_factor == 0.5
    index[digest(0)] = -1  # overwrite: no change
    assert index.load_factor == 0.5 and len(index) == 64
    index.clear()
    assert len(index) == 0 and index.capacity == 128 and index.get(digest(1)) is None


def test_missing_keys_raise_key_error():
    index: CuckooIndex[int] = CuckooIndex()
    with pytest.raises(KeyError):
        index[digest(1)]
    with pytest.raises(KeyError):
        del index[digest(1)]
    with pytest.raises(KeyError):
        index.pop(digest(1))
    assert index.pop(digest(1), None) is None


@pytest.mark.parametrize("bad", [b"short", bytes(17), b""])
def test_wrong_length_keys_raise_value_error(bad):
    index: CuckooIndex[int] = CuckooIndex()
    for op in (lambda: index.__setitem__(bad, 1), lambda: index[bad], lambda: index.get(bad),
               lambda: bad in index, lambda: index.__delitem__(bad)):
        with pytest.raises(ValueError, match="16-byte digests, got"):
            op()


@pytest.mark.parametrize("bad", ["0123456789abcdef", bytearray(16), 7, None])
def test_non_bytes_keys_raise_type_error(bad):
    index: CuckooIndex[int] = CuckooIndex()
    for op in (lambda: index.__setitem__(bad, 1), lambda: index.get(bad), lambda: bad in index):
        with pytest.raises(TypeError, match="16-byte bytes digests"):
            op()


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity"):
        CuckooIndex(0)


def test_make_index():
    assert isinstance(make_index("dict"), DictIndex)
    c = make_index("cuckoo", capacity=64)
    assert isinstance(c, CuckooIndex) and c.capacity == 64
    auto = make_index()
    assert isinstance(auto, DictIndex if DEFAULT_KIND == "dict" else CuckooIndex)
    with pytest.raises(ValueError, match="kind"):
        make_index("btree")  # type: ignore[arg-type]


def test_dict_index_is_a_plain_dict():
    d: DictIndex[int] = DictIndex()
    d[digest(1)] = 1
    assert d == {digest(1): 1} and d.get(digest(2)) is None and isinstance(d, dict)
