"""The optional contenders of ``experiments.serve_load``, started once per model: vLLM's CPU
build (``experiments.vllm_contender``) and llama.cpp's ``llama-server`` on the F32 GGUF of the
same weights (``experiments.llamacpp_contender``). A contender that cannot run is skipped with
its reason in the JSON, never an error."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

VLLM = "vllm_cpu"
LLAMACPP = "llamacpp_f32"


def start(name: str, args: argparse.Namespace, clients: int, out: Path
          ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """({system: running server}, {system: its settings and start-up seconds, or
    ``{"skipped": why}``}) for model ``name``."""
    servers, infos = {}, {}
    try:
        for system, begin in ((VLLM, _vllm), (LLAMACPP, _llamacpp)):
            try:
                server = begin(name, args, clients, out)
            except (RuntimeError, TimeoutError, OSError, ValueError) as e:
                infos[system] = {"skipped": str(e)[:300]}
                print(f"serve_load: {system} skipped for {name}: {e}")
                continue
            servers[system], infos[system] = server, server.report()
            print(f"serve_load: {system} serving {name} after {server.start_s:.0f} s")
    except BaseException:  # an interrupt while the next one starts: stop those running
        for server in servers.values():
            server.close()
        raise
    return servers, infos


def _model_dir(args: argparse.Namespace) -> Path:
    from node.models import smollm2
    return Path(args.model_dir).expanduser() if args.model_dir else smollm2.default_dir()


def _vllm(name: str, args: argparse.Namespace, clients: int, out: Path) -> Any:
    from experiments import vllm_contender as vc
    why = vc.unavailable(args.vllm_python)
    if why is None and name != "smollm2":
        why = f"vLLM serves a model directory; {name!r} exists only in memory"
    if why is not None:
        raise ValueError(why)
    settings = vc.VllmSettings(omp_threads=args.threads)
    return vc.VllmServer(args.vllm_python, _model_dir(args), out / f"vllm-{name}.log", name,
                         settings)


def _llamacpp(name: str, args: argparse.Namespace, clients: int, out: Path) -> Any:
    from experiments import llamacpp_contender as lc
    why = lc.unavailable(args.llama_server)
    if why is None and name != "smollm2":
        why = f"llama.cpp serves a GGUF file; {name!r} exists only in memory"
    if why is not None:
        raise ValueError(why)
    gguf = lc.smollm2_f32_gguf(_model_dir(args).parent / f"{_model_dir(args).name}-f32.gguf")
    settings = lc.LlamaCppSettings(threads=args.threads, parallel=max(clients, 1))
    return lc.LlamaCppServer(args.llama_server, gguf, out / f"llamacpp-{name}.log", name, settings)


def note(model: dict, infos: dict[str, dict[str, Any]]) -> None:
    """Each contender's settings under the model's; a skip also in every cell and in
    ``single_fresh``, where its figures would be."""
    for system, info in infos.items():
        model["settings"][system] = info
        if "skipped" in info:
            for cell in model["by_clients"].values():
                cell[system] = dict(info)
            model.get("single_fresh", {})[system] = dict(info)
