"""Fixtures shared by every test package."""

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _own_node_and_flower_homes(tmp_path_factory):
    """Each test session (each xdist worker) keeps node directories and Flower homes of its
    own: runs of two sessions at once must not meet in ``~/.fedkv/nodes`` or ``~/.flwr``, and
    the suite never writes into the user's."""
    saved = {k: os.environ.get(k) for k in ("FEDKV_NODE_DIR", "FLWR_HOME")}
    os.environ["FEDKV_NODE_DIR"] = str(tmp_path_factory.mktemp("fedkv-nodes"))
    os.environ["FLWR_HOME"] = str(tmp_path_factory.mktemp("flwr-home"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on 2 cores: a second torch thread only contends (measured ~80x slower
    while another process keeps a core busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
