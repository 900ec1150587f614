"""Active capacity of a KV cache per storage dtype: how many tokens OPEN sessions hold, all
still decodable, before ``CacheFullError`` -- at equal ``pool_bytes``.

Closed prefixes are what quantization shrinks trivially; the question here is whether an
int8/int4 cache also holds more context for sessions that are still being decoded. The
measurement drives the public ``KVCache`` API the way ``node.models.llama.forward_cached`` does (one
``reserve`` per prompt, ``append_and_read`` per layer), with random K/V and no model:

1. open sessions one by one, prefill each with ``session_tokens`` random tokens, until a
   prefill is refused (that session is closed);
2. give every open session one decode step (reserve one token, write and attend every layer);
   when one is refused, the newest session not yet stepped is closed and the step retried;
3. the capacity is the tokens the stepped sessions hold.

    python -m experiments.kv_capacity --json            # SmolLM2-135M (256 MiB) and a tiny one
    python -m experiments.kv_capacity --geometry tiny --pool-mib 4 --session-tokens 256

Prompts are prefilled whole (one ``reserve``), so a quantized cache's full-precision arena
must also hold the prompt being prefilled until its old blocks are quantized.
"""

from __future__ import annotations

import argparse
import json

import torch

from cache import CacheConfig, CacheFullError, KVCache

DTYPES = ("fp32", "fp16", "int8", "int4")
SMOLLM2 = {"num_layers": 30, "num_heads": 3, "head_dim": 64}
"""SmolLM2-135M's K/V geometry (its config.json; docs/real-llm.md)."""
TINY = {"num_layers": 2, "num_heads": 2, "head_dim": 64}


def _step(kv: KVCache, sid: int, tokens: list[int], layers: int, g: torch.Generator) -> None:
    """Reserve ``tokens`` and write + attend random K/V in every layer."""
    kv.reserve(sid, tokens)
    c = kv.config
    for layer in range(layers):
        k = torch.randn(c.num_heads, len(tokens), c.head_dim, generator=g)
        v = torch.randn(c.num_heads, len(tokens), c.head_dim, generator=g)
        kv.append_and_read(sid, layer, k, v)


def active_capacity_tokens(kv_dtype: str, pool_bytes: int, *, num_layers: int, num_heads: int,
                           head_dim: int, block_size: int = 16, session_tokens: int = 512,
                           chunk_tokens: int = 0) -> int:
    """Tokens open sessions of ``session_tokens`` prompt tokens hold in a ``kv_dtype`` cache of
    ``pool_bytes`` when each of them has also taken one decode step (see the module
    docstring). ``chunk_tokens`` > 0 feeds each session in chunks of that many tokens (the
    turns of a conversation: one ``forward_cached`` per turn) instead of one prompt. Distinct
    random prompts (no prefix sharing), random K/V, other settings at their ``CacheConfig``
    defaults; deterministic (seeded)."""
    return capacity_of(CacheConfig(num_layers=num_layers, num_heads=num_heads,
                                   head_dim=head_dim, block_size=block_size, kv_dtype=kv_dtype,
                                   pool_bytes=pool_bytes), session_tokens, chunk_tokens)


def capacity_of(c: CacheConfig, session_tokens: int, chunk_tokens: int = 0) -> int:
    """``active_capacity_tokens`` of a cache built from ``c`` (any setting)."""
    kv, g, num_layers = KVCache(c), torch.Generator().manual_seed(0), c.num_layers
    opened, next_tok = [], 0
    while True:
        sid = kv.open_session()
        toks = list(range(next_tok, next_tok + session_tokens))  # distinct: no dedup
        next_tok += session_tokens
        step = chunk_tokens or session_tokens
        try:
            for i in range(0, session_tokens, step):
                _step(kv, sid, toks[i : i + step], num_layers, g)
        except CacheFullError:
            kv.close_session(sid)
            break
        opened.append(sid)
    waiting = list(opened)
    while waiting:
        try:
            _step(kv, waiting[0], [next_tok], num_layers, g)
            next_tok += 1
            waiting.pop(0)
        except CacheFullError:
            kv.close_session(waiting.pop())  # the newest session not yet stepped goes
    return sum(kv.length(s) for s in kv.sessions())


def capacity_table(pool_bytes: int, geometry: dict[str, int], session_tokens: int,
                   block_size: int = 16) -> dict:
    """``active_capacity_tokens`` for every dtype and the ratios to fp32."""
    got = {d: active_capacity_tokens(d, pool_bytes, block_size=block_size,
                                     session_tokens=session_tokens, **geometry) for d in DTYPES}
    fp32 = got["fp32"]
    return {"active_capacity_tokens": got,
            "ratio_vs_fp32": {d: round(n / fp32, 3) if fp32 else None for d, n in got.items()},
            "pool_bytes": pool_bytes, "session_tokens": session_tokens,
            "block_size": block_size, **geometry}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--geometry", choices=("both", "smollm2", "tiny"), default="both",
                   help="SmolLM2-135M's K/V geometry (--pool-mib, --session-tokens), a tiny "
                        "one (2 layers, 2 heads, head_dim 64; 16 MiB, 512 tokens), or both")
    p.add_argument("--pool-mib", type=int, default=256, help="pool_bytes in MiB (default 256)")
    p.add_argument("--session-tokens", type=int, default=512,
                   help="prompt tokens per session (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    tables = {}
    if a.geometry in ("both", "smollm2"):
        tables["SmolLM2-135M"] = capacity_table(a.pool_mib << 20, SMOLLM2, a.session_tokens)
    if a.geometry in ("both", "tiny"):
        tiny = (a.pool_mib, a.session_tokens) if a.geometry == "tiny" else (16, 512)
        tables["tiny"] = capacity_table(tiny[0] << 20, TINY, tiny[1])
    for name, t in tables.items():
        if not a.json:
            print(f"{name}: pool {t['pool_bytes'] >> 20} MiB, {t['session_tokens']}-token sessions")
            for d in DTYPES:
                print(f"  {d:5s} {t['active_capacity_tokens'][d]:8d} tokens  "
                      f"x{t['ratio_vs_fp32'][d]} fp32")
    first, *rest = tables.values()
    out = {**first, "geometry": next(iter(tables)), **({"tiny": rest[0]} if rest else {})}
    if a.geometry == "both":  # sessions longer than the arena, fed in 128-token turns
        conv = {d: active_capacity_tokens(d, 4 << 20, session_tokens=1024, chunk_tokens=128,
                                          **TINY) for d in DTYPES}
        out["conversation"] = {"active_capacity_tokens": conv, "pool_bytes": 4 << 20,
                               "session_tokens": 1024, "chunk_tokens": 128, **TINY}
        if not a.json:
            print(f"tiny, 4 MiB, 1024-token sessions in 128-token turns: {conv}")
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
