"""How linears reading the same input are multiplied for inference (``node.models.projection``):
bf16 row stacks -- views, not copies; written through in place, stacked again on new storage,
trainable afterwards -- and the path each row count takes."""

from __future__ import annotations

import pytest
import torch

from node.models import kernels, packed, precision
from node.models.precision import DECODE_ROWS
from tests.tiny_models import tiny_llama


def _bf16():
    return precision.convert(tiny_llama(std=0.2), "bfloat16")


def test_a_bf16_models_parameters_are_row_blocks_of_one_stack_per_group():
    """q/k/v (and gate/up) are views of one contiguous [sum(out), in] matrix, each row-major
    and holding the converted values; o, down and the (tied) head are stacks of one."""
    base = tiny_llama(std=0.2)
    want = {n: p.detach().to(torch.bfloat16).clone() for n, p in base.named_parameters()}
    m = precision.convert(base, "bfloat16")
    attn = m.model.layers[0].self_attn
    with torch.no_grad():
        stack = attn.qkv.rows.matrix()
    assert stack.is_contiguous()
    names = ("q_proj", "k_proj", "v_proj")
    assert stack.shape == (sum(getattr(attn, n).weight.shape[0] for n in names), m.cfg.hidden_size)
    a = 0
    for n in names:
        w = getattr(attn, n).weight
        assert w.is_contiguous() and w.data_ptr() == stack[a].data_ptr()
        assert torch.equal(w, want[f"model.layers.0.self_attn.{n}.weight"])
        a += w.shape[0]
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied, one stack
    for name, p in m.named_parameters():
        assert torch.equal(p, want[name])


def test_a_stack_made_in_inference_mode_stays_trainable():
    """Stacking replaces the parameters' storage: made under ``inference_mode`` (a server's
    first decode step) it must not turn them into inference tensors."""
    m = _bf16()
    lin = m.model.layers[0].mlp.up_proj
    lin.weight.data = lin.weight.detach().clone()  # new storage: stacked again at next use
    with torch.inference_mode():
        assert m.model.layers[0].mlp.gate_up.rows.matrix() is not None
    assert not lin.weight.is_inference()
    x = torch.randn(2, m.cfg.hidden_size, dtype=torch.bfloat16)
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize("rows", [1, DECODE_ROWS, DECODE_ROWS + 1, 33])
def test_decode_rows_take_the_row_stack_and_more_take_the_packed_copy(rows, monkeypatch):
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"fused kernels not built here: {kernels.status()}")
    m = _bf16()
    proj = m.model.layers[0].mlp.gate_up
    calls = []
    real = ops.bf16_linear
    monkeypatch.setattr(ops, "bf16_linear", lambda *a: calls.append("rows") or real(*a))
    x = torch.randn(rows, m.cfg.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        y = proj(x)
        want = x.double() @ proj.rows.matrix().double().T
    assert calls == (["rows"] if rows <= DECODE_ROWS else [])
    assert (proj.packed.packed is not None) == (rows > DECODE_ROWS and packed.available())
    torch.testing.assert_close(y.double(), want, rtol=2 ** -7, atol=1e-2)


def test_a_stack_moves_only_into_its_own_shape():
    p = _bf16().model.layers[0].self_attn.qkv.rows
    with pytest.raises(ValueError, match="no bf16 weights of shape"):
        p.move(torch.zeros(3, 3, dtype=torch.bfloat16))


def test_bf16_rows_lie_end_to_end_in_step_order_in_one_buffer():
    """``lay_out`` of bf16 rows: every stack (the head included) a slot of one buffer in the order a
    decode step reads them; the parameters are views of it."""
    m = _bf16()
    with torch.no_grad():
        stacks = [p.matrix() for p in precision.step_projections(m, "rows")]
    ends = [w.data_ptr() + 2 * w.numel() for w in stacks]
    assert [w.data_ptr() for w in stacks[1:]] == ends[:-1]
    storage = stacks[0].untyped_storage().data_ptr()
    assert m.model.layers[1].mlp.down_proj.weight.untyped_storage().data_ptr() == storage
    assert m.model.embed_tokens.weight.untyped_storage().data_ptr() == storage
