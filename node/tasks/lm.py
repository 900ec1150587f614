"""Language-model helpers for the byte-level TinyTransformer: training, evaluation and a small
pretrained checkpoint cached on disk (no download: it is trained here, on the stdlib corpus).

Losses are mean cross-entropy in **nats per byte** (the model's tokens are bytes);
perplexity = exp(loss).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from node.tasks.corpus import random_windows, split_corpus
from node.models.byte_model import ModelConfig, TinyTransformer
from node.models.interface import CachedLM

CACHE_ENV = "FEDKV_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$FEDKV_CACHE_DIR`` if set, else ``~/.cache/fedkv``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedkv"


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, p))))


def train_lm(
    model: CachedLM,
    data: bytes,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    generator: torch.Generator | None = None,
    *,
    weight_decay: float = 0.01,
    warmup: int | None = None,
    grad_clip: float = 1.0,
) -> list[float]:
    """Next-token training with AdamW on random windows of ``data`` (the model's
    ``train_loss``: full causal attention) over its ``trainable_parameters``. Returns the
    training loss of every step (nats/token)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if seq_len > model.context_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context_len {model.context_len}")
    warmup = max(1, min(20, steps // 10)) if warmup is None else max(1, warmup)
    params = list(model.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, lr, warmup)
        batch = random_windows(data, seq_len, batch_size, generator)
        loss = model.train_loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def eval_loss(
    model: CachedLM,
    data: bytes,
    seq_len: int,
    n_windows: int,
    generator: torch.Generator | None = None,
    *,
    batch_size: int = 8,
) -> float:
    """Mean next-byte cross-entropy (nats/byte) over ``n_windows`` random windows of ``data``,
    every position of each window counted (full causal attention, no cache)."""
    if n_windows < 1:
        raise ValueError(f"n_windows must be >= 1, got {n_windows}")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    left = n_windows
    while left:
        b = min(batch_size, left)
        batch = random_windows(data, seq_len, b, generator)
        logits = model(batch[:, :-1])
        total += float(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
        )
        count += batch[:, 1:].numel()
        left -= b
    model.train(was_training)
    return total / count


def checkpoint_key(cfg: ModelConfig, **settings) -> str:
    """A short hash of the model config and every training setting: the checkpoint's name."""
    blob = json.dumps({"cfg": asdict(cfg), **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def pretrained_tiny(
    cfg: ModelConfig | None = None,
    cache_dir: str | os.PathLike | None = None,
    steps: int = 150,
    *,
    batch_size: int = 4,
    seq_len: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    max_bytes: int | None = None,
    retrain: bool = False,
    return_info: bool = False,
    log=None,
):
    """A TinyTransformer trained ``steps`` AdamW steps on the stdlib corpus minus its held-out
    modules (``split_corpus(1, seed).shares[0]``), cached as ``tiny-<key>.pt`` under
    ``cache_dir`` (default :func:`default_cache_dir`); the key hashes ``cfg`` and every
    training setting, so a different config or step count trains (once) a new checkpoint.

    A corrupt or unreadable checkpoint is retrained and replaced. The write is atomic (temp
    file + rename). Returns the model in eval mode, or ``(model, info)`` with
    ``return_info=True``; ``info`` has ``cached`` (loaded rather than trained), ``path``,
    ``train_seconds`` and the loss figures recorded at training time.
    """
    cfg = cfg or ModelConfig()
    settings = dict(
        steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
        max_bytes=max_bytes, corpus=f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}",
        recipe="adamw-wd0.01-cos-v1",
    )
    key = checkpoint_key(cfg, **settings)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = root / f"tiny-{key}.pt"
    info: dict = {"path": str(path), "key": key, **settings}
    model = None if retrain else _load_checkpoint(cfg, path, info, log)
    if model is None:
        model, meta = _train_tiny(cfg, steps, batch_size, seq_len, lr, seed, max_bytes)
        _save_checkpoint(model, meta, path)
        info.update(meta, cached=False)
        if log:
            log(f"trained {steps} steps in {meta['train_seconds']:.1f}s: held-out "
                f"{meta['heldout_loss']:.3f} nats/byte -> {path}")
    model.eval()
    return (model, info) if return_info else model


def _load_checkpoint(cfg: ModelConfig, path: Path, info: dict, log) -> TinyTransformer | None:  # noqa: ANN001
    """The cached model, its meta merged into ``info``; None when absent or unreadable."""
    if not path.exists():
        return None
    model = TinyTransformer(cfg)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(blob["state_dict"])
        info.update(json.loads(blob["meta"]), cached=True)
        return model
    except Exception as e:  # corrupt or foreign file: train again and overwrite
        if log:
            log(f"checkpoint {path} unreadable ({type(e).__name__}: {e}); retraining")
        return None


def _train_tiny(cfg: ModelConfig, steps: int, batch_size: int, seq_len: int, lr: float, seed: int,
                max_bytes: int | None) -> tuple[TinyTransformer, dict]:
    """Train from a seeded init on share 0 of the corpus; (model, the figures recorded)."""
    torch.manual_seed(seed)
    model = TinyTransformer(cfg)
    split = split_corpus(1, seed=seed, max_bytes=max_bytes)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    losses = train_lm(model, split.shares[0], steps, batch_size, seq_len, lr, g)
    train_s = time.perf_counter() - t0
    eg = torch.Generator().manual_seed(seed + 1)
    heldout = eval_loss(model, split.heldout, seq_len, 16, eg)
    return model, {
        "train_seconds": round(train_s, 3),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "heldout_loss": heldout,
        "heldout_ppl": math.exp(heldout),
        "torch_threads": torch.get_num_threads(),
    }


def _save_checkpoint(model: TinyTransformer, meta: dict, path: Path) -> None:
    """Atomic write (temp file + rename) of the weights and their meta."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save({"state_dict": model.state_dict(), "meta": json.dumps(meta)}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
