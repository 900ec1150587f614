"""The gate before serving (``node.serve_gate``) in a round's results: what an evaluating node
sends about the aggregate it just applied, and how the server sums it up per round.

A node sends its verdict as a bit (``gate-served``), a reason code (``node.serve_gate.REASONS``)
and the figures it judged on: its held-out loss under the served and the new version (the same
held-out data as ``eval-loss``, which every evaluate reply carries), and, for chat, the margin of
the public probe that fell most, before and after. No figure of private training data and no
parameter leaves the node; the server cannot make a node serve anything.
"""

from __future__ import annotations

import math
from typing import Any

from flwr.app import MetricRecord

from federation.wire_checks import as_flag, as_float, as_int
from node.serve_gate import REASONS, GateVerdict

GATE_FIELDS = ("gate-served", "gate-reason", "gate-heldout-before", "gate-heldout-after",
               "gate-probe-before", "gate-probe-after")
"""Optional fields of an evaluate reply's metrics (absent: the node applied no aggregate)."""


def node_fields(last_gate: tuple[int, GateVerdict] | None, version: int) -> dict[str, int | float]:
    """An evaluate reply's gate fields for the node at ``version``: its verdict on that version's
    aggregate ({} when the node did not judge it in this process, e.g. a repeated request)."""
    if last_gate is None or last_gate[0] != version:
        return {}
    v = last_gate[1]
    out: dict[str, int | float] = {"gate-served": int(v.served), "gate-reason": v.code,
                                   "gate-heldout-before": v.before.heldout, "gate-heldout-after": v.after.heldout}
    if v.after.probes:
        worst = min(range(len(v.after.probes)), key=lambda i: v.after.probes[i] - v.before.probes[i])
        out |= {"gate-probe-before": v.before.probes[worst], "gate-probe-after": v.after.probes[worst]}
    return {k: x for k, x in out.items() if not isinstance(x, float) or math.isfinite(x)}


def parse(m: MetricRecord, record: str) -> dict[str, float]:
    """The gate fields of a reply's metrics, checked (``wire_checks``); {} when it sent none."""
    if "gate-served" not in m:
        return {}
    out: dict[str, float] = {"gate-served": float(as_flag(f"{record}.gate-served", m["gate-served"])),
                             "gate-reason": float(as_int(f"{record}.gate-reason", m["gate-reason"], 0,
                                                         len(REASONS) - 1))}
    for key in GATE_FIELDS[2:]:
        if key in m:
            out[key] = as_float(f"{record}.{key}", m[key])
    return out


def summarize(reports: list[dict[str, float]]) -> dict[str, Any]:
    """The round's ``gate``: did every reporting node serve the new version, how many did not
    and why, and the mean figures ({} when no node reported)."""
    got = [r for r in reports if r]
    if not got:
        return {}
    unserved = [r for r in got if not r["gate-served"]]
    codes = {int(r["gate-reason"]) for r in unserved}
    reason = REASONS[(1 if any(c & 1 for c in codes) else 0) + (2 if any(c & 2 for c in codes) else 0)]

    def mean_of(key: str) -> float:
        vals = [r[key] for r in got if key in r]
        return sum(vals) / len(vals) if vals else math.nan

    return {"served": not unserved, "nodes": len(got), "unserved_nodes": len(unserved), "reason": reason,
            "heldout_before": mean_of("gate-heldout-before"), "heldout_after": mean_of("gate-heldout-after"),
            "probe_before": mean_of("gate-probe-before"), "probe_after": mean_of("gate-probe-after")}


def line(gate: dict[str, Any]) -> str:
    """The round line's gate part ("" when no node reported)."""
    if not gate:
        return ""
    n, k = gate["nodes"], gate["unserved_nodes"]
    if gate["served"]:
        return f"gate: served ({n}/{n} nodes)"
    pairs = [("held-out", "heldout_before", "heldout_after"), ("probe margin", "probe_before", "probe_after")]
    figures = [f"{name} {gate[a]:.3g}→{gate[b]:.3g}" for name, a, b in pairs
               if all(isinstance(gate.get(k), float) and math.isfinite(gate[k]) for k in (a, b))]
    return f"gate: NOT SERVED by {k}/{n} nodes ({gate['reason']}; {', '.join(figures)}; previous version served)"
