"""The public envelope of an update or aggregate, checked against the round's encoding.

``parse_for``: parse an envelope (``crypto.wire``) and check key, packing and ciphertext count
for a context, before anything is loaded. ``update_header_problem``: the server's field-by-field
check of a summand's public header before it adds it (issue 20). ``ciphertext_info``: the public
fields, for logs and tests.
"""

from __future__ import annotations

from typing import Any

from crypto.context import CkksContext
from crypto.errors import ContextMismatchError, NotACiphertextError, PackingMismatchError
from crypto.packing import PackingConfig
from crypto.slot_plan import SlotPlan
from crypto.wire import ENVELOPE_UPDATE, MODE_CODES, NO_LAYOUT, Envelope, parse_envelope

__all__ = ["ciphertext_info", "parse_for", "update_header_problem"]


def parse_for(ctx: CkksContext, packing: PackingConfig, plan: SlotPlan, data: bytes) -> Envelope:
    env = parse_envelope(data, max_ciphertext_bytes=plan.max_ciphertext_bytes)
    if env.key_id != ctx.key_id:
        raise ContextMismatchError(
            f"ciphertext was made under key {env.key_id.hex()}, this context is {ctx.key_id.hex()} "
            "(another dealer, parameter set or a rotated-out key)"
        )
    if env.packing_fp != packing.fingerprint() or env.mode != MODE_CODES[packing.mode]:
        raise PackingMismatchError("ciphertext was packed with another PackingConfig")
    if len(env.ciphertexts) != plan.n_ciphertexts(env.n_values):
        raise NotACiphertextError(
            f"{len(env.ciphertexts)} ciphertexts cannot hold {env.n_values} values "
            f"(expected {plan.n_ciphertexts(env.n_values)})"
        )
    return env


def ciphertext_info(data: bytes) -> dict[str, Any]:
    """Public header fields of an update/aggregate (what the server can see), for logs/tests."""
    env = parse_envelope(data, max_ciphertext_bytes=1 << 30)
    return {
        "kind": "update" if env.kind == ENVELOPE_UPDATE else "aggregate",
        "mode": next(k for k, v in MODE_CODES.items() if v == env.mode),
        "key_id": env.key_id.hex(),
        "n_values": env.n_values,
        "n_updates": env.n_updates,
        "n_ciphertexts": len(env.ciphertexts),
        "nbytes": len(data),
    }


def update_header_problem(data: bytes, context: CkksContext, packing: PackingConfig, n_values: int,
                          contributions: int) -> tuple[str, str] | None:
    """(field, what is wrong) for the first field of an update's public envelope (``crypto.wire``)
    that disagrees with the round's public encoding, or None when every field agrees.

    The server's check before it adds a summand (issue 20): every field is pinned to what the
    round declares, none to what an earlier summand said. ``CkksAggregator.add`` compares the
    layout digest with the first summand's only, so a first summand declaring a layout made every
    later honest update "another tensor layout" and dropped them all. ``context`` may be public;
    ``contributions`` is what the summand must stand for (1 for an update, m for m noise shares).
    Raises ``NotACiphertextError`` when the bytes do not parse at all."""
    plan = SlotPlan(context.params, packing)
    env = parse_envelope(data, max_ciphertext_bytes=plan.max_ciphertext_bytes)
    want_ct = plan.n_ciphertexts(n_values)
    checks = (
        ("kind", env.kind == ENVELOPE_UPDATE, "is an aggregate, not an update"),
        ("mode", env.mode == MODE_CODES[packing.mode], f"has packing mode code {env.mode}, the round's is "
                                                       f"{MODE_CODES[packing.mode]} ({packing.mode})"),
        ("key_id", env.key_id == context.key_id, f"was encrypted under key {env.key_id.hex()[:16]}…, the round's "
                                                 f"key is {context.key_id.hex()[:16]}…"),
        ("packing_fp", env.packing_fp == packing.fingerprint(), f"has packing fingerprint {env.packing_fp.hex()}, "
                                                                f"the round's is {packing.fingerprint().hex()}"),
        ("layout_fp", env.layout_fp == NO_LAYOUT, f"declares tensor layout {env.layout_fp.hex()}, the round's "
                                                  "updates are flat vectors (no layout)"),
        ("n_values", env.n_values == n_values, f"holds {env.n_values} values, the round's updates {n_values}"),
        ("n_updates", env.n_updates == contributions, f"carries {env.n_updates} share(s), {contributions} were asked"),
        ("n_ciphertexts", len(env.ciphertexts) == want_ct, f"has {len(env.ciphertexts)} ciphertexts, "
                                                           f"{n_values} values take {want_ct}"),
    )
    return next(((name, what) for name, ok, what in checks if not ok), None)
