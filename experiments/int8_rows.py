"""Which int8 linear is fastest at each row count: the times behind ``node.models.precision``'s
``DECODE_ROWS`` and ``TILE_ROWS``.

    python -m experiments.int8_rows [--quick] [--json] [--rows 1,2,4,8,16,32,64] [--threads 1]

One pass multiplies ``rows`` bf16 rows through every linear of a SmolLM2-135M-shaped model (30
layers of q/k/v, o, gate/up and down, then the 49,152-row head; random weights of the same shapes,
int8 codes as ``Int8Linear`` makes them), so the weights stream from memory as in a decode step
rather than sitting in cache. Three ways, alternated within each repeat, the median reported:

* ``vector`` -- ``int8_linear``: the codes on the AVX-512 vector units (up to 8 rows here);
* ``tiles`` -- ``int8_linear_amx``: the codes widened to bf16 tile by tile on AMX, once per call
  for all the rows (up to ``TILES_TIMED_ROWS`` here; skipped without AMX);
* ``bf16_packed`` -- oneDNN's bf16 GEMM on the packed bf16 copy of the dequantized weights, the
  baseline (the path without the fused kernels, and every path's past ``TILE_ROWS``);
* ``read`` -- no product: ``read_stream`` of the codes, the fastest a pass could read them.

The codes lie end to end in one buffer on huge pages, in pass order, as a converted model's do
(``node.models.precision.lay_out``). JSON: ``ms_per_pass.<rows>.<way>``,
``vs_bf16_packed.<rows>.<way>`` (the baseline's time divided by the way's: above 1 is faster),
``vs_read.<rows>.<way>`` (``read``'s time divided by the way's: the fraction of the read rate a
pass reaches), ``weight_bytes`` of each way's matrices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from experiments.output import add_common_args, make_run_dir, print_results_dir, write_json
from node.models import kernels, packed
from node.models.precision import DECODE_ROWS, TILE_ROWS, Int8Linear, end_to_end

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""[out, in] of SmolLM2-135M's q/k/v (stacked), o, gate/up (stacked) and down."""
HEAD = (49152, 576)
VECTOR_ROWS = 8
"""The vector kernel is timed up to here (past it, it only gets slower)."""
TILES_TIMED_ROWS = 1024
"""The tiled kernel is timed up to here: past ``TILE_ROWS`` to show where the GEMM overtakes it."""


def model_linears(layers: int, seed: int) -> list[Int8Linear]:
    """The model's linears, their codes end to end in one huge-page buffer in pass order."""
    g = torch.Generator().manual_seed(seed)
    shapes = [s for _ in range(layers) for s in SHAPES] + [HEAD]
    made = [Int8Linear(torch.randn(*s, generator=g) * 0.05) for s in shapes]
    _, slots = end_to_end([lin.q for lin in made])
    return [Int8Linear.from_codes(q, lin.scale) for q, lin in zip(slots, made)]


def ways(linears: list[Int8Linear], rows: int) -> dict[str, Callable[[], None]]:
    """The passes to time at ``rows`` rows, each over every linear, and the codes' read."""
    ops = kernels.ops()
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {lin.in_features for lin in linears}}
    bf16 = [packed.pack(lin.dequantized(torch.bfloat16)) for lin in linears]
    out: dict[str, Callable[[], None]] = {
        "bf16_packed": lambda: [packed.linear(xs[lin.in_features], w) for lin, w in zip(linears, bf16)]}
    if ops is not None and rows <= VECTOR_ROWS:
        out["vector"] = lambda: [ops.int8_linear(xs[lin.in_features], lin.q, lin.scale)
                                 for lin in linears]
    if ops is not None:
        start, n = linears[0].q, sum(lin.q.numel() for lin in linears)
        codes = torch.empty(0, dtype=torch.int8).set_(start.untyped_storage(),
                                                      start.storage_offset(), (n,))
        out["read"] = lambda: ops.read_stream(codes)
    if kernels.amx() and rows <= TILES_TIMED_ROWS:
        tiled = [ops.int8_pack_amx(lin.q) for lin in linears]
        out["tiles"] = lambda: [ops.int8_linear_amx(xs[lin.in_features], t, lin.scale)
                                for lin, t in zip(linears, tiled)]
    return out


def time_rows(linears: list[Int8Linear], rows: int, repeats: int) -> dict[str, float]:
    """Median ms per pass of each way, the ways alternated within each repeat."""
    runs = ways(linears, rows)
    for run in runs.values():
        run()  # first calls: oneDNN's kernel for this shape, pages touched
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, quick_help="4 layers, 3 repeats (seconds)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    linears = model_linears(4 if args.quick else LAYERS, args.seed)
    repeats = 3 if args.quick else 9
    ms = {str(r): time_rows(linears, r, repeats) for r in (int(x) for x in args.rows.split(","))}
    codes = sum(lin.q.numel() for lin in linears)
    result = {"ms_per_pass": ms,
              "vs_bf16_packed": {r: {w: t["bf16_packed"] / v for w, v in t.items() if w != "read"}
                                 for r, t in ms.items()},
              "vs_read": {r: {w: t["read"] / v for w, v in t.items() if w != "read"}
                          for r, t in ms.items() if "read" in t},
              "weight_bytes": {"vector": codes, "tiles": codes, "bf16_packed": 2 * codes},
              "config": {"layers": len(linears) // len(SHAPES), "repeats": repeats,
                         "threads": args.threads, "kernels": kernels.status(),
                         "decode_rows": DECODE_ROWS, "tile_rows": TILE_ROWS}}
    out = make_run_dir(args.out, "int8_rows")
    write_json(out / "int8_rows.json", result)
    for r, t in ms.items():
        print(f"rows {r:>3}: " + "  ".join(
            f"{w} {v:6.2f} ms" + (f" ({result['vs_bf16_packed'][r][w]:.2f}x)" if w != "read" else "")
            for w, v in t.items()))
    print_results_dir(out)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
