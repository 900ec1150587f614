"""What a node's server serves: the model (``--model byte|smollm2``) with its codec and
default KV pool, and the node's cache key for a server that follows the node. Shared by the
session agent (``node.serving.serve``) and the OpenAI-compatible server (``node.serving.openai_api``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from crypto import passphrase_from_env, read_secret_file
from node.models.interface import CachedLM
from node.models.smollm2 import ModelError
from node.models.precision import DEFAULT as DEFAULT_DTYPE
from node.models.precision import DTYPES
from node.models.precision import check as check_dtype
from node.tasks.tasks import lm_model

MODELS = ("byte", "smollm2")
"""``--model``: the node's byte-level model (default, its parameters published by the
trainer) or SmolLM2-135M-Instruct from ``--model-dir`` with its chat template."""
SMOLLM2_POOL_MIB = 64.0
POOL_MIB = 8.0
"""The byte model's default pool; SmolLM2 (46 KiB of K/V per token) gets ``SMOLLM2_POOL_MIB``."""
DTYPE_HELP = (f"the weights' format (one of {', '.join(DTYPES)}; default {DEFAULT_DTYPE}, the "
              "reference): bfloat16 runs prefill on the CPU's bf16 units, int8 is weight-only "
              "int8 with bf16 activations (smollm2 only)")
DTYPE_ARGUMENT = dict(choices=DTYPES, default=DEFAULT_DTYPE, help=DTYPE_HELP)
"""``parser.add_argument("--dtype", **DTYPE_ARGUMENT)``: the servers' one ``--dtype``."""


def load_model(name: str, model_dir: str | os.PathLike | None = None,
               dtype: str = DEFAULT_DTYPE) -> tuple[CachedLM, Any]:
    """(model, codec) for ``--model``: ``byte`` is ``(node.tasks.tasks.lm_model(), None)``;
    ``smollm2`` is ``LlamaModel`` + ``ChatCodec`` read from ``model_dir`` (default
    ``node.models.smollm2.default_dir()``) in the format ``dtype`` (``--dtype``,
    ``node.models.precision.DTYPES``), a ``ModelMissingError`` naming the fetch command when
    the directory holds no converted model. The byte model (trained and published by the
    node in fp32) is served in fp32 only."""
    check_dtype(dtype)
    if name == "byte":
        if dtype != DEFAULT_DTYPE:
            raise ModelError(f"--dtype {dtype} applies to --model smollm2; the byte model "
                             f"is served in {DEFAULT_DTYPE}")
        return lm_model(), None
    if name != "smollm2":
        raise ValueError(f"unknown model {name!r}; use one of {list(MODELS)}")
    from node.models import smollm2 as models
    from node.models.chat import ChatCodec
    from node.models.llama import LlamaModel
    d = Path(model_dir).expanduser() if model_dir is not None else models.default_dir()
    return LlamaModel.from_pretrained(d, dtype=dtype).eval(), ChatCodec.from_dir(d)


def node_key(cache_dir: Path, key_file: Path | None, wait_s: float) -> bytes:
    """The node's cache key (``key_file``, default ``kv-cache.key`` beside ``cache_dir``);
    waits for it (the node's first ClientApp message makes it). Shared by every server that
    follows a node (``node.serving.serve``, ``node.serving.openai_api``)."""
    path = key_file or cache_dir.parent / "kv-cache.key"
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"key file {path} did not appear within {wait_s} s "
                             "(is the node running? --no-key for an unencrypted cache)")
        time.sleep(0.2)
    return read_secret_file(path, passphrase_from_env())
