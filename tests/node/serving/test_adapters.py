"""node.serving.adapters: fedkv's LoRA adapters out to PEFT's format and back in."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from node.serving import adapters, param_channel
from node.serving.adapters import Adapter, AdapterError
from node.models.llama import LlamaModel
from node.models.lora import LoraConfig, adapt, public_a
from node.tasks.tasks import TINY_CHAT

SEED = 42


def _published(config: LoraConfig, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """What a node publishes (its B; A too under train_a), random and non-zero."""
    with torch.device("meta"):
        names = adapt(LlamaModel(TINY_CHAT), config).parameter_layout()
    g = torch.Generator().manual_seed(seed)
    return {e.name: torch.randn(e.shape, generator=g) * scale for e in names.entries}


def _tiny_adapter(train_a: bool = False) -> Adapter:
    config = LoraConfig(seed=SEED, train_a=train_a)
    return Adapter(config, adapters.materialise(_published(config), TINY_CHAT, config), "tiny", 3)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# -- round trip --------------------------------------------------------------------------------

@pytest.mark.parametrize("train_a", [False, True])
def test_export_then_import_gives_identical_tensors(tmp_path, train_a):
    a = _tiny_adapter(train_a)
    out = adapters.write_adapter(a, tmp_path / "ad")
    b = adapters.read_adapter(out, TINY_CHAT)
    assert b.state.keys() == a.state.keys() and len(a.state) == 2 * 2 * TINY_CHAT.num_layers
    assert all(torch.equal(a.state[n], b.state[n]) for n in a.state)
    assert (b.config.rank, b.config.alpha, b.config.targets) == (8, 32.0, ("q_proj", "v_proj"))
    assert (b.config.seed, b.config.train_a, b.version, b.base_model) == (SEED, train_a, 3, "tiny")


def test_ffa_a_is_the_public_seed_a():
    a = _tiny_adapter()
    name = "model.layers.1.self_attn.v_proj"
    assert torch.equal(a.state[name + ".lora_A"],
                       public_a(name, 8, TINY_CHAT.hidden_size, SEED))


def test_files_are_peft_named_private_and_scaled_as_fedkv(tmp_path):
    out = adapters.write_adapter(_tiny_adapter(), tmp_path / "a" / "b" / "ad")
    assert {_mode(out), _mode(out.parent), _mode(out.parent.parent)} == {0o700}  # and what it made
    assert {p.name: _mode(p) for p in out.iterdir()} == {
        "adapter_config.json": 0o600, "adapter_model.safetensors": 0o600, "fedkv-adapter.json": 0o600}
    keys = load_file(out / "adapter_model.safetensors").keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in keys
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["lora_alpha"] / cfg["r"] == LoraConfig().scale and not cfg["use_rslora"]
    assert (cfg["bias"], cfg["lora_dropout"], cfg["fan_in_fan_out"]) == ("none", 0.0, False)
    assert [p.name for p in out.parent.iterdir()] == ["ad"]  # no temporary left


def test_load_into_sets_the_model_exactly(tmp_path):
    a = _tiny_adapter(train_a=True)
    base = LlamaModel(TINY_CHAT).eval()
    model = adapters.load_into(base, adapters.read_adapter(adapters.write_adapter(a, tmp_path / "a")))
    sd = model.state_dict()
    assert all(torch.equal(sd[n], a.state[n]) for n in a.state)
    idx = torch.tensor([[1, 5, 9, 40]])
    with torch.no_grad():
        assert not torch.allclose(model(idx), base(idx))  # not a no-op adapter


# -- from a node's cache directory, through the command line ---------------------------------

def test_cli_exports_what_the_node_published(tmp_path, capsys, monkeypatch):
    config = LoraConfig(seed=SEED)
    pub = _published(config)
    (tmp_path / "kv").mkdir()
    param_channel.publish(tmp_path / "kv", None, pub, 7)
    monkeypatch.setattr(adapters, "base_config", lambda _d: (TINY_CHAT, tmp_path))
    argv = ["export", "--cache-dir", str(tmp_path / "kv"), "--no-key", "--out", str(tmp_path / "o")]
    assert adapters.main(argv + ["--version", "6"]) == 2
    assert "holds model version 7, not 6" in capsys.readouterr().err
    assert adapters.main(argv) == 0
    got = adapters.read_adapter(tmp_path / "o", TINY_CHAT)
    assert got.version == 7 and all(torch.equal(got.state[n], pub[n]) for n in pub)
    assert adapters.main(argv) == 2  # a second export does not overwrite the first
    assert "refusing to overwrite" in capsys.readouterr().err
    assert adapters.main(argv + ["--force", "--version", "7"]) == 0


def test_export_from_a_sealed_cache_needs_the_key(tmp_path):
    config = LoraConfig(seed=SEED)
    key = bytes(range(32))
    param_channel.publish(tmp_path, key, _published(config), 2)
    a = adapters.from_cache(tmp_path, key, TINY_CHAT, config)
    assert a.version == 2 and len(a.state) == 8
    with pytest.raises(param_channel.PublishedParamsError, match="does not open"):
        adapters.from_cache(tmp_path, bytes(32), TINY_CHAT, config)


# -- refusals --------------------------------------------------------------------------------

def test_refuses_to_overwrite_a_non_empty_dir_and_keeps_it(tmp_path):
    out = tmp_path / "ad"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(AdapterError, match="refusing to overwrite"):
        adapters.write_adapter(_tiny_adapter(), out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    adapters.write_adapter(_tiny_adapter(), out, force=True)
    assert not (out / "notes.txt").exists() and (out / "adapter_config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ad"]


def test_an_empty_out_dir_is_used(tmp_path):
    (tmp_path / "ad").mkdir()
    adapters.write_adapter(_tiny_adapter(), tmp_path / "ad")
    assert _mode(tmp_path / "ad") == 0o700


def _written(tmp_path) -> Path:
    return adapters.write_adapter(_tiny_adapter(), tmp_path / "ad")


def test_truncated_weights_are_a_clear_error(tmp_path):
    w = _written(tmp_path) / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(AdapterError, match="truncated or corrupt"):
        adapters.read_adapter(tmp_path / "ad", TINY_CHAT)


def _rewrite(d: Path, edit) -> None:
    w = d / "adapter_model.safetensors"
    t = load_file(w)
    edit(t)
    save_file(t, w)


def test_missing_key_is_named(tmp_path):
    d = _written(tmp_path)
    _rewrite(d, lambda t: t.pop("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"))
    with pytest.raises(AdapterError, match="missing, e.g. 'model.layers.1.self_attn.q_proj.lora_B'"):
        adapters.read_adapter(d, TINY_CHAT)


def test_wrong_rank_is_refused(tmp_path):
    d = _written(tmp_path)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    with pytest.raises(AdapterError, match=r"has shape \[8, 64\], expected \[4, 64\]"):
        adapters.read_adapter(d, TINY_CHAT)
    with pytest.raises(AdapterError, match="another rank"):
        adapters.read_adapter(d)  # no base given: checked against its own r


def test_wrong_shape_against_the_base_is_refused(tmp_path):
    d = _written(tmp_path)
    _rewrite(d, lambda t: t.update({"base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight":
                                    torch.zeros(16, 8)}))
    with pytest.raises(AdapterError, match=r"v_proj.lora_B' has shape \[16, 8\], expected \[32, 8\]"):
        adapters.read_adapter(d, TINY_CHAT)


def test_nan_values_are_refused(tmp_path):
    d = _written(tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _rewrite(d, lambda t: t[key].__setitem__((0, 0), float("nan")))
    with pytest.raises(AdapterError, match="NaN or Inf"):
        adapters.read_adapter(d, TINY_CHAT)


@pytest.mark.parametrize("edit, match", [
    ({"use_rslora": True}, "use_rslora=True is not supported"),
    ({"use_dora": True}, "use_dora"),
    ({"peft_type": "IA3"}, "not 'LORA'"),
    ({"target_modules": "q_proj|v_proj"}, "regular expression"),
    ({"r": 0}, "not a positive integer"),
])
def test_configs_fedkv_cannot_compute_are_refused(tmp_path, edit, match):
    d = _written(tmp_path)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(AdapterError, match=match):
        adapters.read_adapter(d, TINY_CHAT)


def test_not_an_adapter_dir(tmp_path):
    with pytest.raises(AdapterError, match="is not a directory"):
        adapters.read_adapter(tmp_path / "none")
    with pytest.raises(AdapterError, match="adapter_config.json does not exist"):
        adapters.read_adapter(tmp_path)


def test_import_cli_writes_fedkv_state_and_never_overwrites(tmp_path, capsys, monkeypatch):
    d = _written(tmp_path)
    monkeypatch.setattr(adapters, "base_config", lambda _d: (TINY_CHAT, tmp_path))
    argv = ["import", "--adapter", str(d), "--out", str(tmp_path / "s" / "state.safetensors")]
    assert adapters.main(argv) == 0
    assert "r=8, lora_alpha=32" in capsys.readouterr().out
    state = load_file(tmp_path / "s" / "state.safetensors")
    assert _mode(tmp_path / "s" / "state.safetensors") == 0o600
    assert all(torch.equal(state[n], t) for n, t in _tiny_adapter().state.items())
    assert adapters.main(argv) == 2 and "exists" in capsys.readouterr().err


# -- the real check: PEFT on transformers computes what fedkv computes ------------------------

def _smollm2() -> Path:
    from node.models.smollm2 import default_dir
    d = default_dir()
    if not (d / "model.safetensors").is_file() or not (d / "config.json").is_file():
        pytest.skip("SmolLM2 not fetched: python -m node.models.smollm2 fetch")
    return d


@pytest.fixture(scope="module")
def smollm2():
    """(fedkv's base, transformers' LlamaForCausalLM, the model dir): loaded once."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    d = _smollm2()
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return LlamaModel.from_pretrained(d, verify_hashes=False).eval(), hf, d


PROMPTS = [[1, 9690, 198, 2683, 359, 253, 3358, 30], [504, 3458, 282, 4649, 314, 1122, 28, 2273, 11, 17]]


@pytest.mark.parametrize("train_a", [False, pytest.param(True, marks=pytest.mark.slow)])  # ~15 s each
def test_peft_on_transformers_matches_fedkv_logits(tmp_path, smollm2, train_a):
    import peft
    base, hf, d = smollm2
    ours = adapt(base, LoraConfig(seed=SEED, train_a=train_a))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B (and A under train_a): a no-op adapter cannot pass
        for name, p in ours.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    published = {n: ours.state_dict()[n] for n in ours.adapter_names()}
    assert any(n.endswith("lora_A") for n in published) == train_a  # FFA: A from the seed
    cfg, _ = adapters.base_config(d)
    exported = adapters.write_adapter(
        Adapter(ours.lora_config, adapters.materialise(published, cfg, ours.lora_config), str(d)),
        tmp_path / "ad")
    served = adapters.load_into(base, adapters.read_adapter(exported, cfg))
    with torch.no_grad():
        before = [hf(input_ids=torch.tensor([p])).logits for p in PROMPTS]
        peft_model = peft.PeftModel.from_pretrained(hf, str(exported)).eval()
        try:
            for prompt, base_logits in zip(PROMPTS, before):
                ids = torch.tensor([prompt])
                theirs, mine = peft_model(input_ids=ids).logits, ours(ids)
                diff = float((theirs - mine).abs().max())
                assert diff <= 1e-4, f"PEFT and fedkv differ by {diff}"
                assert torch.equal(served(ids), mine)
                assert float((theirs - base_logits).abs().max()) > 1e-2  # the adapter acts
        finally:
            peft_model.unload()  # the module's transformers model back to its base
