"""fedkv's LoRA adapters in and out, in PEFT's format.

    python -m node.serving.adapters export --cache-dir DIR [--key-file F | --no-key] [--version N|latest]
        --out OUTDIR [--model-dir DIR] [--lora-seed 42] [--base-model NAME] [--force]
    python -m node.serving.adapters import --adapter DIR [--model-dir DIR] [--out STATE.safetensors]

Why: a node's fine-tuned adapters live only in its cache directory, sealed with the node's key
(``node.serving.param_channel``), as the B matrices whose A every node regenerates from the run's public
seed (FFA-LoRA, ``node.models.lora``). No other tool can load that. Exported as a PEFT LoRA adapter
(``adapter_config.json`` + ``adapter_model.safetensors``, A materialised) they load with
``peft.PeftModel.from_pretrained`` onto transformers' ``LlamaForCausalLM`` and in vLLM
(``--lora-modules name=DIR``); ``import`` reads such a directory back (``read_adapter``,
``load_into``) so ``node.serving.openai_api --adapter DIR`` can serve it.

Same numbers on both sides: fedkv's state-dict names are Hugging Face's
(``model.layers.0.self_attn.q_proj.lora_B`` is PEFT's
``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``), both compute
``W x + s * B (A x)`` with ``A [r, in]``, ``B [out, r]``, and fedkv's ``s = alpha / rank`` is
PEFT's ``lora_alpha / r`` without rsLoRA, so ``r = rank`` and ``lora_alpha = alpha`` are written
and anything else (rsLoRA, DoRA, per-module ranks, biases) is refused on import.

Privacy: the values are derived from the nodes' users' data and leave the sealed cache in
plain text, so the directory is 0700 and its files 0600, built in a temporary sibling and
renamed into place (a reader sees no half adapter), and a non-empty directory is replaced only
with ``force`` (``--force``). Error texts name keys and shapes, never values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load, save as st_save

from cache.segments.directory import fsync_dir
from crypto.errors import CryptoError
from node.models.llama import LlamaConfig, LlamaModel
from node.models.lora import LoraConfig, LoraLinear, LoraLlamaModel, adapt, public_a

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FEDKV_FILE = "fedkv-adapter.json"
"""fedkv's own facts (public seed, train_a, model version): PEFT and vLLM ignore the file."""
PEFT_PREFIX = "base_model.model."
_ENDS = ("lora_A", "lora_B")


class AdapterError(ValueError):
    """An adapter that cannot be written or read: the text says which file, key or shape."""


@dataclass(frozen=True)
class Adapter:
    """Adapters in fedkv's layout: every adapted module's A and B under fedkv's names."""

    config: LoraConfig
    state: dict[str, torch.Tensor]
    base_model: str = ""
    """PEFT's ``base_model_name_or_path``: the base the adapters were trained on."""
    version: int | None = None
    """The node's model version the adapters come from (None: not known)."""


# -- names and shapes ---------------------------------------------------------------------------

def peft_name(name: str) -> str:
    """fedkv's ``...q_proj.lora_B`` as PEFT names it: ``base_model.model....q_proj.lora_B.weight``."""
    return f"{PEFT_PREFIX}{name}.weight"


def fedkv_name(key: str) -> str:
    """The inverse of :func:`peft_name`; AdapterError for a key that is not a LoRA matrix."""
    body = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
    if not key.startswith(PEFT_PREFIX) or not key.endswith(".weight") or not body.endswith(_ENDS):
        raise AdapterError(f"{WEIGHTS_FILE}: key {key!r} is not a PEFT LoRA matrix "
                           f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    return body


def adapter_shapes(cfg: LlamaConfig, config: LoraConfig) -> dict[str, tuple[int, int]]:
    """fedkv name -> shape of every A and B that ``adapt(LlamaModel(cfg), config)`` holds,
    from a model on the ``meta`` device (no weights read or allocated)."""
    with torch.device("meta"):
        model = adapt(LlamaModel(cfg), config)
    shapes: dict[str, tuple[int, int]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLinear):
            shapes[f"{name}.lora_A"] = (config.rank, mod.in_features)
            shapes[f"{name}.lora_B"] = (mod.out_features, config.rank)
    return shapes


def check_state(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]],
                where: str) -> None:
    """Exactly the expected keys, shapes and finite values, or an AdapterError naming the first
    problem (``where``: the file or source, for the message)."""
    missing = [n for n in shapes if n not in state]
    if missing:
        raise AdapterError(f"{where}: {len(missing)} adapter matrices missing, e.g. {missing[0]!r} "
                           "(another base model or target modules?)")
    extra = [n for n in state if n not in shapes]
    if extra:
        raise AdapterError(f"{where}: {len(extra)} unexpected matrices, e.g. {extra[0]!r} "
                           "(another base model or target modules?)")
    for name, want in shapes.items():
        got = tuple(state[name].shape)
        if got != want:
            raise AdapterError(f"{where}: {name!r} has shape {list(got)}, expected {list(want)} "
                               "(another rank or base model?)")
        if not torch.isfinite(state[name]).all():
            raise AdapterError(f"{where}: {name!r} holds NaN or Inf values")


def materialise(published: dict[str, torch.Tensor], cfg: LlamaConfig,
                config: LoraConfig) -> dict[str, torch.Tensor]:
    """Every A and B from what a node publishes: its B (and A under ``train_a``); a missing A
    is drawn from the public seed exactly as ``adapt`` draws it (FFA-LoRA)."""
    shapes = adapter_shapes(cfg, config)
    state = {n: t.detach().to(torch.float32).contiguous() for n, t in published.items()}
    for name, (rank, fan_in) in shapes.items():
        if name.endswith(".lora_A") and name not in state:
            state[name] = public_a(name.removesuffix(".lora_A"), rank, fan_in, config.seed)
    check_state(state, shapes, "the published adapters")
    return {n: state[n] for n in shapes}


# -- writing ------------------------------------------------------------------------------------

def peft_config(config: LoraConfig, base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters: scaling lora_alpha / r = fedkv's
    alpha / rank (no rsLoRA), no dropout, no bias, no DoRA, A/B as ``nn.Linear`` weights."""
    alpha = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": config.rank, "lora_alpha": alpha, "target_modules": sorted(config.targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_dir(files: dict[str, bytes], out: str | os.PathLike, force: bool = False) -> Path:
    """``files`` as the directory ``out`` (0700, files 0600), atomically: built in a temporary
    sibling, renamed into place. An existing non-empty ``out`` is replaced only with ``force``
    (its old content removed after the new one is in place)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AdapterError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise AdapterError(f"{out} is not empty; refusing to overwrite it (--force replaces it)")
    for parent in reversed(out.absolute().parents):  # every folder it makes: 0700
        parent.mkdir(exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # 0700
    old = None
    try:
        for name, data in files.items():
            _write_file(tmp / name, data)
        fsync_dir(str(tmp))
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old)  # an empty directory is replaced by a rename
        os.replace(tmp, out)
        fsync_dir(str(out.parent))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def write_adapter(adapter: Adapter, out: str | os.PathLike, force: bool = False) -> Path:
    """``adapter`` as a PEFT LoRA adapter directory (see the module docstring)."""
    for name, t in adapter.state.items():
        if not name.endswith(_ENDS) or not torch.isfinite(t).all():
            raise AdapterError(f"refusing to export {name!r}: not a LoRA matrix or not finite")
    tensors = {peft_name(n): t.detach().to(torch.float32).contiguous()
               for n, t in adapter.state.items()}
    ours = {"format": 1, "seed": adapter.config.seed, "train_a": adapter.config.train_a,
            "version": adapter.version, "scale": adapter.config.scale}
    return write_dir({
        CONFIG_FILE: (json.dumps(peft_config(adapter.config, adapter.base_model), indent=2) + "\n").encode(),
        WEIGHTS_FILE: st_save(tensors, metadata={"format": "pt"}),
        FEDKV_FILE: (json.dumps(ours, indent=2) + "\n").encode(),
    }, out, force)


# -- reading ------------------------------------------------------------------------------------

_REFUSED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none",
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
            "layers_to_transform": None}
"""PEFT options fedkv's ``LoraLinear`` does not compute: any other value is refused."""


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} does not exist (not a PEFT adapter directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path} holds no JSON object")
    return data


def _lora_config(path: Path) -> tuple[LoraConfig, str]:
    """(LoraConfig, base model) from ``adapter_config.json``, refusing what fedkv cannot compute."""
    raw = _json_file(path / CONFIG_FILE)
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"{path / CONFIG_FILE}: peft_type {raw.get('peft_type')!r}, not 'LORA'")
    for key, want in _REFUSED.items():
        if raw.get(key) not in (want, None):
            raise AdapterError(f"{path / CONFIG_FILE}: {key}={raw[key]!r} is not supported "
                               f"(fedkv computes {key}={want!r})")
    r, alpha, targets = raw.get("r"), raw.get("lora_alpha"), raw.get("target_modules")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{path / CONFIG_FILE}: r={r!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise AdapterError(f"{path / CONFIG_FILE}: lora_alpha={alpha!r} is not a positive number")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path / CONFIG_FILE}: target_modules={targets!r} is not a list of "
                           "module names (a regular expression is not supported)")
    ours = _json_file(path / FEDKV_FILE) if (path / FEDKV_FILE).exists() else {}
    config = LoraConfig(rank=r, alpha=float(alpha), targets=tuple(sorted(targets)),
                        seed=int(ours.get("seed", 0)), train_a=bool(ours.get("train_a", False)))
    return config, str(raw.get("base_model_name_or_path") or "")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """The weights file's tensors under fedkv's names (float32)."""
    file = path / WEIGHTS_FILE
    try:
        raw = st_load(file.read_bytes())
    except FileNotFoundError:
        raise AdapterError(f"{file} does not exist (only safetensors adapters are read)") from None
    except Exception as e:  # safetensors raises its own error types for garbage / cut files
        raise AdapterError(f"{file} is not a readable safetensors file, truncated or corrupt "
                           f"({type(e).__name__})") from None
    state: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        name = fedkv_name(key.replace("_A.default.", "_A.").replace("_B.default.", "_B."))  # a live PeftModel's
        if not t.is_floating_point():
            raise AdapterError(f"{file}: {key!r} is {t.dtype}, not floating point")
        state[name] = t.to(torch.float32)
    return state


def read_adapter(path: str | os.PathLike, cfg: LlamaConfig | None = None) -> Adapter:
    """A PEFT LoRA adapter directory in fedkv's layout, checked (keys, shapes, finite values)
    against the base ``cfg`` when given, else for consistency with its own rank."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"{path} is not a directory (a PEFT adapter is a directory)")
    config, base = _lora_config(path)
    state = _tensors(path)
    where = str(path / WEIGHTS_FILE)
    if cfg is not None:
        check_state(state, adapter_shapes(cfg, config), where)
    else:
        shapes = {n: ((config.rank, t.shape[-1]) if n.endswith("lora_A") else (t.shape[0], config.rank))
                  for n, t in state.items()}
        check_state(state, shapes, where)
    version = _json_file(path / FEDKV_FILE).get("version") if (path / FEDKV_FILE).exists() else None
    return Adapter(config, state, base, version if isinstance(version, int) else None)


def load_into(base: LlamaModel, adapter: Adapter) -> LoraLlamaModel:
    """``adapt(base, adapter.config)`` with every A and B set from ``adapter`` (checked against
    the model first: nothing is changed on a mismatch); ``base`` stays unchanged."""
    model = adapt(base, adapter.config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n.endswith(_ENDS)}
    check_state(adapter.state, shapes, "the adapter")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(_ENDS):
                t.copy_(adapter.state[name])
    return model


def from_model(model: LoraLlamaModel, version: int | None = None, base_model: str = "") -> Adapter:
    """The adapters a live adapted model holds (every A and B, copied off the model)."""
    state = {n: t.detach().to(torch.float32).clone() for n, t in model.state_dict().items()
             if n.endswith(_ENDS)}
    return Adapter(model.lora_config, state, base_model, version)


# -- from a node's cache directory --------------------------------------------------------------

def from_cache(cache_dir: str | os.PathLike, key: bytes | None, cfg: LlamaConfig,
               config: LoraConfig, *, version: int | None = None, base_model: str = "") -> Adapter:
    """The adapters a node last published in ``cache_dir`` (``node.serving.param_channel``), with A
    materialised. Only the latest version is kept there: ``version`` must be it when given."""
    from node.serving.param_channel import load

    published, at = load(cache_dir, key)
    if version is not None and at != version:
        raise AdapterError(f"{cache_dir} holds model version {at}, not {version} (a node keeps "
                           "only its latest adapters; --version latest takes it)")
    has_a = any(n.endswith(".lora_A") for n in published)
    config = LoraConfig(config.rank, config.alpha, config.targets, config.seed, train_a=has_a)
    return Adapter(config, materialise(published, cfg, config), base_model, at)


def base_config(model_dir: str | os.PathLike | None) -> tuple[LlamaConfig, Path]:
    """The base's geometry from ``config.json`` in ``model_dir`` (default the converted SmolLM2)."""
    from node.models.smollm2 import FETCH_COMMAND, default_dir
    d = Path(model_dir).expanduser() if model_dir is not None else default_dir()
    path = d / "config.json"
    if not path.is_file():
        raise AdapterError(f"no model config at {path}: pass --model-dir, or run {FETCH_COMMAND}")
    return LlamaConfig.from_hf(_json_file(path)), d.resolve()


# -- the command line ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    d = LoraConfig()
    p = argparse.ArgumentParser(prog="python -m node.serving.adapters", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="a node's published adapters -> a PEFT adapter directory")
    ex.add_argument("--cache-dir", type=Path, required=True, help="the node's cache directory")
    ex.add_argument("--key-file", type=Path, default=None,
                    help="the node's sealed cache key (default: kv-cache.key beside --cache-dir)")
    ex.add_argument("--no-key", action="store_true", help="the node's cache is not encrypted (tests)")
    ex.add_argument("--version", default="latest", help="the model version to export, or latest")
    ex.add_argument("--out", type=Path, required=True, help="the adapter directory to write")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ex.add_argument("--lora-seed", type=int, default=42,
                    help="the run's public seed A is drawn from (run-config seed, 42 by default)")
    ex.add_argument("--rank", type=int, default=d.rank)
    ex.add_argument("--alpha", type=float, default=d.alpha)
    ex.add_argument("--targets", default=",".join(d.targets), help="comma-separated module names")
    ex.add_argument("--base-model", default=None,
                    help="base_model_name_or_path written (default: --model-dir, absolute)")
    im = sub.add_parser("import", help="check a PEFT adapter directory against the base model")
    im.add_argument("--adapter", type=Path, required=True)
    im.add_argument("--out", type=Path, default=None,
                    help="also write its A and B under fedkv's names to this safetensors file")
    for sp in (ex, im):
        sp.add_argument("--model-dir", type=Path, default=None,
                        help="the converted base model (default: node.models.smollm2.default_dir())")
    return p


def _export(args: argparse.Namespace) -> str:
    from node.serving.served_model import node_key
    if args.version != "latest" and not args.version.isdigit():
        raise AdapterError(f"--version {args.version!r}: a model version number or 'latest'")
    cfg, model_dir = base_config(args.model_dir)
    config = LoraConfig(args.rank, args.alpha, tuple(t for t in args.targets.split(",") if t),
                        args.lora_seed)
    key = None if args.no_key else node_key(args.cache_dir, args.key_file, 0.0)
    adapter = from_cache(args.cache_dir, key, cfg, config,
                         version=None if args.version == "latest" else int(args.version),
                         base_model=args.base_model or str(model_dir))
    out = write_adapter(adapter, args.out, args.force)
    return (f"exported model version {adapter.version} ({len(adapter.state) // 2} adapted modules, "
            f"r={config.rank}, lora_alpha={config.alpha:g}) to {out}")


def _import(args: argparse.Namespace) -> str:
    cfg, model_dir = base_config(args.model_dir)
    adapter = read_adapter(args.adapter, cfg)
    if args.out is not None:
        out = Path(args.out)
        if out.exists():
            raise AdapterError(f"{out} exists; refusing to overwrite it")
        blob = st_save({n: t.contiguous() for n, t in adapter.state.items()})
        out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            _write_file(tmp, blob)
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    c = adapter.config
    return (f"{args.adapter}: LoRA r={c.rank}, lora_alpha={c.alpha:g} on {','.join(c.targets)}, "
            f"{len(adapter.state) // 2} modules; loads onto {model_dir}"
            + (f"; fedkv state written to {args.out}" if args.out else ""))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(_export(args) if args.command == "export" else _import(args), flush=True)
    except (AdapterError, ValueError, OSError, CryptoError) as e:  # a wrong passphrase too
        print(f"python -m node.serving.adapters {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
