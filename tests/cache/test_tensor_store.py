import pytest
import torch

from cache import KVCache, UnknownTensorError
from cache.tensor_store import NonFiniteTensorError
from tests.cache.conftest import small_config


def test_versions_and_copies():
    kv = KVCache(small_config())
    w = torch.ones(3)
    assert kv.put_tensor("param/w", w) == 0
    w += 1  # the caller's tensor is not the stored one
    assert torch.equal(kv.get_tensor("param/w"), torch.ones(3))
    assert kv.put_tensor("param/w", w) == 1 and kv.tensor_version("param/w") == 1
    assert kv.put_tensor("grad/w", w, version=7) == 7
    assert kv.tensors.names("param") == ["param/w"]
    assert kv.stats()["tensor_bytes"]["param"] == 12


@pytest.mark.parametrize("name", ["w", "weights/w", "param/", "/x"])
def test_bad_names(name):
    kv = KVCache(small_config())
    with pytest.raises(UnknownTensorError, match="namespace"):
        kv.put_tensor(name, torch.ones(1))


def test_non_finite_refused_and_old_value_kept():
    kv = KVCache(small_config())
    kv.put_tensor("grad/g", torch.zeros(2))
    with pytest.raises(NonFiniteTensorError, match="NaN or Inf"):
        kv.put_tensor("grad/g", torch.tensor([1.0, float("nan")]))
    assert torch.equal(kv.get_tensor("grad/g"), torch.zeros(2)) and kv.tensor_version("grad/g") == 0
    with pytest.raises(UnknownTensorError, match="no tensor"):
        kv.get_tensor("param/missing")
