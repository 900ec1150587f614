"""Fixtures shared by every test package."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on 2 cores: a second torch thread only contends (measured ~80x slower
    while another process keeps a core busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
