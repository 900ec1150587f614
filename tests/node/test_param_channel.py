"""Published parameters: sealed with the cache key, bound to their version, atomic."""

import os

import pytest
import torch

from node import param_channel as pc

KEY = bytes(range(32))


def test_round_trip_and_mode(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    path = pc.publish(tmp_path, KEY, state, 7)
    got, version = pc.load(tmp_path, KEY)
    assert version == 7 and torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert b"\x00\x00\x80?" not in path.read_bytes()  # 1.0f is not in the clear


@pytest.mark.parametrize("damage", ["missing", "short", "magic", "flip", "version", "key"])
def test_damaged_or_foreign_files_are_refused(tmp_path, damage):
    path = pc.publish(tmp_path, KEY, {"w": torch.ones(3)}, 2)
    raw = bytearray(path.read_bytes())
    key = KEY
    if damage == "missing":
        path.unlink()
    elif damage == "short":
        path.write_bytes(raw[:10])
    elif damage == "magic":
        path.write_bytes(b"XXXXX" + raw[5:])
    elif damage == "flip":
        raw[-1] ^= 1
        path.write_bytes(raw)
    elif damage == "version":  # pass version 2's parameters off as version 3
        raw[5] = 3
        path.write_bytes(raw)
    else:
        key = bytes(32)
    with pytest.raises(pc.PublishedParamsError):
        pc.load(tmp_path, key)
