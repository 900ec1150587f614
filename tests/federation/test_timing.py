"""PhaseTimer: phases add up, a raising block is still timed, `other` is the remainder."""

from __future__ import annotations

import time

import pytest

from federation.timing import PhaseTimer


def test_phases_add_up_and_other_is_the_rest() -> None:
    timer = PhaseTimer()
    with timer.phase("a"):
        time.sleep(0.01)
    with timer.phase("a"):
        time.sleep(0.01)
    timer.add("b", 0.005)
    time.sleep(0.01)
    assert timer.seconds["a"] >= 0.02 and timer.seconds["b"] == 0.005
    assert timer.other() == pytest.approx(timer.total - timer.seconds["a"] - 0.005, abs=1e-3)
    assert timer.other() >= 0.005


def test_a_raising_block_is_still_timed() -> None:
    timer = PhaseTimer()
    with pytest.raises(RuntimeError), timer.phase("boom"):
        raise RuntimeError("x")
    assert "boom" in timer.seconds
