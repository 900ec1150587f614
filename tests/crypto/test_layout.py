from __future__ import annotations

import numpy as np
import pytest
import torch

from crypto import Layout, LayoutMismatchError, NonFiniteUpdateError, flatten


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g).half(),
        "e": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(7, dtype=torch.int64),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
    }


def test_flatten_roundtrip_keeps_order_shapes_dtypes() -> None:
    state = _state()
    vec, layout = flatten(state)
    assert vec.dtype == np.float64 and vec.shape == (12 + 4 + 4 + 1 + 1,)
    assert layout.names == list(state)
    back = layout.unflatten(vec, as_torch=True)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t), name


def test_layout_serialization_and_digest() -> None:
    vec, layout = flatten({"a": np.zeros((2, 3), np.float32), "b": np.ones(5)})
    again = Layout.from_bytes(layout.to_bytes())
    assert again == layout and again.digest() == layout.digest()
    _, other = flatten({"a": np.zeros((3, 2), np.float32), "b": np.ones(5)})  # same size, other shape
    assert other.size == layout.size and other.digest() != layout.digest()
    np.testing.assert_array_equal(layout.unflatten(vec)["b"], np.ones(5))


def test_integer_tensors_come_back_rounded() -> None:
    vec, layout = flatten({"n": np.array([3, 4], dtype=np.int64)})
    out = layout.unflatten(vec + np.array([0.4, -0.4]))
    assert out["n"].dtype == np.int64 and out["n"].tolist() == [3, 4]


@pytest.mark.parametrize(
    "bad",
    [
        {"a": np.zeros((2, 3))},  # missing b
        {"a": np.zeros((2, 3)), "b": np.ones(5), "c": np.ones(1)},  # extra
        {"a": np.zeros((3, 2)), "b": np.ones(5)},  # wrong shape
    ],
)
def test_flatten_against_layout_rejects_mismatch(bad: dict) -> None:
    _, layout = flatten({"a": np.zeros((2, 3)), "b": np.ones(5)})
    with pytest.raises(LayoutMismatchError):
        layout.flatten(bad)


def test_unflatten_wrong_length_and_bad_json() -> None:
    _, layout = flatten({"a": np.zeros(4)})
    with pytest.raises(LayoutMismatchError):
        layout.unflatten(np.zeros(5))
    with pytest.raises(LayoutMismatchError):
        layout.unflatten(np.zeros((2, 2)))
    with pytest.raises(LayoutMismatchError):
        Layout.from_json(b"{not json")


def test_flatten_rejects_non_finite() -> None:
    with pytest.raises(NonFiniteUpdateError, match="b"):
        flatten({"a": np.zeros(2), "b": np.array([1.0, np.nan])})
    with pytest.raises(NonFiniteUpdateError):
        flatten({"a": torch.tensor([float("inf")])})
