"""Fused CPU kernels for a bf16 decode step (``kernels.cpp``), built on first use.

A one-token step of SmolLM2 ran dozens of small eager ATen ops per layer besides its linears:
RMSNorm's pow/mean/rsqrt/mul chain, RoPE's slices and concatenations, the dtype casts, the
residual adds, attention's matmuls, mask and softmax. At a few rows each op is mostly call
overhead. ``kernels.cpp`` does each chain in one call: ``rms_norm``, ``add_rms_norm_`` (residual
add + the next norm), ``rope_split`` (RoPE of q and k and the split into heads),
``merge_heads``, ``silu_mul`` (SwiGLU); ``decode_attention`` (``decode_attention.cpp``) is a
decode step's attention over the cache's prefix runs and tail slots. They round to bf16 where
the eager chain rounds, so they give its results (tests compare the two). ``int8_linear`` is
weight-only int8 for a few rows that streams the codes with software prefetch;
``int8_linear_amx`` (``int8_amx.cpp``) widens them to bf16 tile by tile for AMX's matrix unit,
once per call for all the rows (``node.models.precision.Int8Linear`` picks by row count;
``experiments.int8_rows`` times them).
``store_step_kv`` (``kv_store.cpp``) writes a decode step's K/V into the cache's arena and tail
slots (``cache.batch.StepStore``), its destinations prefetched first.
``prefill_attention`` (``prefill_attention.cpp``) is a bf16 prefill's causal attention over the
cache's runs on AMX tiles, or AVX-512 BF16 registers without them, for head size 64
(``engine=`` names one of ``prefill_attention_engines()``, so that a machine with tiles tests
the registers too); ``prefill_attention_spans`` the same over (start, length) spans of the arena
(``cache.attention.Spans``: no view per run).
``node.models.byte_model.attend_session`` takes them where ``takes_prefill_kernel`` says;
elsewhere SDPA's flash kernel serves. ``bf16_linear`` is the bf16 product of a few rows,
each weight row read once front to back on AVX-512 BF16's pair dot products
(``node.models.projection.RowStack``). ``decode_layers_int8`` and ``decode_layers_bf16`` run a
session's one-token step through every layer of a weight-only int8 or a bf16 model and its
output head in one call, K/V written and attended in the arena in place
(``node.models.decode_step``).
The elementwise ones are vectorized for AVX-512 (with BF16), with a scalar path elsewhere;
at a prefill's hundreds of rows they are no slower than the eager ops. Their loops run on
torch's threads (``at::parallel_for`` over OpenMP, see :data:`FLAGS`; the one-call decode step
runs in one OpenMP region on them, its products split between barriers); a server keeps those
threads' OpenMP workers on its forward thread alone (``node.engine.openmp_pool``).
``experiments.bench_llm`` measures the decode they give (``decode_tokens_per_s.<ctx>.fedkv_bf16``
and ``.fedkv_int8_weights``; the same run with ``FEDKV_KERNELS=eager`` is the baseline).

Built with torch's own extension builder (``torch.utils.cpp_extension.load``: a C++ compiler
and ninja, cached under torch's extension directory, rebuilt when the source, torch or the
CPU changes) for this CPU's instruction set; a compiler without OpenMP builds them without it
(:data:`SERIAL_FLAGS`). Where they cannot be built -- no compiler, a failed build -- or
``FEDKV_KERNELS=eager`` is set, :func:`ops` is None and the model runs the eager ops;
:func:`status` says which and why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

SOURCES = tuple(Path(__file__).with_name(f) for f in
                ("kernels.cpp", "decode_attention.cpp", "int8_amx.cpp", "prefill_attention.cpp",
                 "kv_store.cpp"))
HEADERS = tuple(Path(__file__).with_name(f) for f in ("amx_tiles.h", "decode_attention.h",
                                                      "vec_math.h"))
"""Included by the sources: part of the build's identity, not compiled on their own."""
FLAGS = ("-O3", "-march=native", "-fopenmp")
"""Compiler flags, part of the build's identity. ``-fopenmp``: ATen's ``at::parallel_for`` is a
header whose ``#pragma omp parallel`` torch's extension builder compiles out, so without it
every kernel ran on one thread whatever ``torch.set_num_threads`` said; the built library shares
torch's own libgomp (one runtime)."""
SERIAL_FLAGS = ("-O3", "-march=native")
"""The build tried when :data:`FLAGS`' fails (a compiler without OpenMP, Apple's clang): the
same kernels, each on the calling thread."""
ENV = "FEDKV_KERNELS"
"""``eager`` turns the fused kernels off (a reference run, a machine without a compiler)."""

log = logging.getLogger(__name__)
_why_not: str | None = None


def _cpu_flags() -> str:
    """This CPU's feature flags (the build is ``-march=native``: another CPU builds its own)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_name(flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES + HEADERS), torch.__version__.encode(),
                 _cpu_flags().encode(), " ".join(flags).encode()):
        digest.update(part)
    return f"fedkv_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def ops() -> ModuleType | None:
    """The built kernels, or None (see :func:`status`). Built once per process; a build
    another process holds the lock of is waited for (torch's builder)."""
    global _why_not
    if os.environ.get(ENV, "").strip().lower() == "eager":
        _why_not = f"{ENV}=eager"
        return None
    try:
        return _build(FLAGS)
    except Exception as e:  # noqa: BLE001 -- no OpenMP here, perhaps: try without it
        log.info("fedkv: the OpenMP build of the kernels failed (%s); building without it",
                 _last_line(e))
    try:
        return _build(SERIAL_FLAGS)
    except Exception as e:  # no compiler or ninja, a failed build: the eager ops serve
        _why_not = f"build failed: {type(e).__name__}: {_last_line(e)}"
        log.warning("fedkv: fused CPU kernels unavailable (%s); the eager ops run", _why_not)
        return None


def _build(flags: tuple[str, ...]) -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(name=_build_name(flags), sources=[str(s) for s in SOURCES],
                              extra_cflags=list(flags),
                              extra_ldflags=[f for f in flags if f == "-fopenmp"], verbose=False)


def _last_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[-1][:200]


@functools.cache
def amx() -> bool:
    """The kernels are loaded and this CPU and kernel let the process use AMX bf16 tiles
    (``int8_linear_amx``; Linux grants the tile state on request)."""
    return ops() is not None and bool(ops().int8_amx_available())


@functools.cache
def prefill_kernel() -> bool:
    """The kernels are loaded and ``prefill_attention`` runs here (AMX tiles, else AVX-512
    BF16); elsewhere SDPA's flash kernel attends a prefill."""
    return ops() is not None and bool(ops().prefill_attention_available())


def serving(x: torch.Tensor, final_norm: torch.Tensor) -> ModuleType | None:
    """The kernels when they serve hidden states ``x`` of a model whose last norm's weight is
    ``final_norm``: bf16 activations and norms (``--dtype bfloat16`` or ``int8``), no
    autograd, built here; else None."""
    if (x.dtype != torch.bfloat16 or torch.is_grad_enabled()
            or final_norm.dtype != torch.bfloat16):
        return None
    return ops()


def status() -> str:
    """``fused`` (``fused+amx`` with AMX tiles) when the kernels are loaded, else
    ``eager (<why>)``."""
    if ops() is None:
        return f"eager ({_why_not})"
    return "fused+amx" if amx() else "fused"
