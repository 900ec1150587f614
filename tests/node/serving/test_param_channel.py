"""Published parameters: sealed with the cache key, bound to their version, atomic."""

import os

import pytest
import torch

from node.serving import param_channel as pc

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


# --- issue 20: no rollback to an older parameter version ------------------------------------------


def test_an_older_parameter_file_is_refused_by_a_reader_that_served_a_newer_one(tmp_path):
    path = pc.publish(tmp_path, KEY, {"w": torch.ones(3)}, 2)
    old = path.read_bytes()
    pc.publish(tmp_path, KEY, {"w": torch.full((3,), 3.0)}, 3)
    assert pc.load(tmp_path, KEY, at_least=3)[1] == 3
    path.write_bytes(old)  # the sealed file of version 2, put back
    assert pc.load(tmp_path, KEY)[1] == 2  # it is intact: only a reader's floor refuses it
    with pytest.raises(pc.ParamRollbackError, match=r"version 2, older than version 3"):
        pc.load(tmp_path, KEY, at_least=3)


def test_a_cache_key_of_the_wrong_length_is_a_specific_error(tmp_path):
    with pytest.raises(pc.PublishedParamsError, match="31 bytes"):
        pc.publish(tmp_path, KEY[:31], {"w": torch.ones(3)}, 1)
    pc.publish(tmp_path, KEY, {"w": torch.ones(3)}, 1)
    with pytest.raises(pc.PublishedParamsError, match="31 bytes"):
        pc.load(tmp_path, KEY[:31])


def test_the_serving_agent_refuses_an_older_parameter_file_and_keeps_the_newer(tmp_path):
    """Issue 20: the serving agent used to load whatever sealed file it found, an older one too."""
    from cache.coherence import Mode
    from node.serving.param_channel import exclusive_params
    from node.models.byte_model import TinyTransformer
    from node.serving.serve import ServingAgent
    from node.tasks.tasks import LM_MODEL

    state = TinyTransformer(LM_MODEL).state_dict()
    newer = {n: t + 0.5 for n, t in state.items()}
    path = pc.publish(tmp_path, KEY, state, 2)
    old = path.read_bytes()
    pc.publish(tmp_path, KEY, newer, 3)
    agent = ServingAgent(tmp_path, KEY, mode=Mode.RELAXED, wait_s=5)
    try:
        assert agent.version == 3
        with exclusive_params(tmp_path, Mode.RELAXED):  # a "write-back" that puts version 2 back
            path.write_bytes(old)
        agent.idle()
        assert agent.version == 3 and agent.counters.versions_seen == [3]
        assert all(torch.equal(agent.model.state_dict()[n], newer[n]) for n in newer)
        pc.publish(tmp_path, KEY, state, 4)  # the next real write-back is taken
        with exclusive_params(tmp_path, Mode.RELAXED):
            pass
        agent.idle()
        assert agent.version == 4
    finally:
        agent.close()
