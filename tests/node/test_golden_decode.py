"""Golden decode: a session's greedy turns through the node's cached decode, pinned before the
house moves (issue 22: "the golden tests unchanged").

For K/V stored as fp32 and as int8, one lm node (``NodeSpec(0, 2, task="lm")``, the seeded
initial model) runs this script through ``CacheNode`` / ``node.engine.sessions``:

1. session A: system prompt (prefilled once), turn "def add(a, b):\\n", turn "    return",
   an empty turn (the model goes on), 12 greedy bytes each;
2. a write-back (``apply_mean_update`` of a fixed, seeded delta, version 1): A's K/V is stale;
3. session A again, turn "print(": the whole conversation is recomputed under the new weights;
4. session B with the same system prompt (its full blocks come from the prefix cache), turn
   "import os\\n".

Each turn's reply token ids, its ``recomputed`` and ``scored`` counts and its text log-loss
(``nll``) are compared with ``golden/decode_turns.json``, and so is each session's history
length. Token ids and counts must match exactly; ``nll`` within ``NLL_REL`` (1e-6 relative).
The int8 conversation is longer than the full-precision window (``fp_window`` = 32 tokens),
so its older blocks are read back quantized: its ``nll`` differs from fp32's by 2e-6 to 1e-5
relative (its greedy bytes happen to agree), which the tolerance tells apart. A refactor that
only reorders float sums may move ``nll`` by ~1e-7 relative; one that moves it past 1e-6 changed
what is computed.

Why the *initial* model: its greedy bytes depend on the whole context (dropping the first
token of the prompt changes the reply from its 2nd byte on), and its top-2 logit margins are
>= 1e-3, far above float reordering noise (~1e-7); a few epochs of training collapse the tiny
byte model to replying with spaces, which would pin nothing. One torch thread
(``one_thread``): one reduction order, reproducible bits.

Regenerate after a *deliberate* behaviour change (and say why in the commit)::

    FEDKV_REGEN_GOLDEN=1 python -m pytest tests/node/test_golden_decode.py

The test then writes the file and fails once ("regenerated"), so a regeneration never passes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node.cache_node import CacheNode, NodeSpec
from node.tasks.tasks import make_task

GOLDEN = Path(__file__).parent / "golden" / "decode_turns.json"
REGEN_ENV = "FEDKV_REGEN_GOLDEN"
NLL_REL = 1e-6
KV_DTYPES = ("fp32", "int8")
SYSTEM = b"# You are a helpful Python assistant.\n"  # 38 bytes: 2 full blocks of 16 + 6
REPLY = 12
FIRST_TURNS = (b"def add(a, b):\n", b"    return", b"")
AFTER_WRITEBACK = b"print("
SECOND_SESSION = b"import os\n"


def _turn(node: CacheNode, session_id: str, text: bytes) -> dict[str, Any]:
    r = node.sessions.turn(session_id, text, REPLY)
    return {"text": text.decode(), "reply": list(r.reply), "nll": r.nll, "scored": r.scored,
            "recomputed": r.recomputed}


def decode_script(kv_dtype: str) -> dict[str, Any]:
    """Run the module docstring's script on a fresh node; the JSON-able record of it."""
    task = make_task("lm", 0, 2, 42, 1.0)
    node = CacheNode(NodeSpec(0, 2, task="lm", kv_dtype=kv_dtype), task=task)
    a = node.create_session(SYSTEM)
    turns_a = [_turn(node, a, text) for text in FIRST_TURNS]
    delta = np.random.default_rng(0).normal(0.0, 1e-2, node.layout.size).astype(np.float32)
    node.apply_mean_update(delta, 1)
    turns_a.append(_turn(node, a, AFTER_WRITEBACK))
    b = node.create_session(SYSTEM)
    turns_b = [_turn(node, b, SECOND_SESSION)]
    quantized = int(node.cache.stats()["quantized_blocks"])
    assert (quantized > 0) == (kv_dtype != "fp32"), (kv_dtype, quantized)  # the int8 path ran
    return {"sessions": [{"turns": turns_a, "history_len": len(node.history(a))},
                         {"turns": turns_b, "history_len": len(node.history(b))}]}


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    out = []
    for dtype in sorted(set(want) | set(got)):
        if dtype not in want or dtype not in got:
            out.append(f"{dtype}: only in {'the run' if dtype in got else 'the golden file'}")
            continue
        for s, (ws, gs) in enumerate(zip(want[dtype]["sessions"], got[dtype]["sessions"], strict=True)):
            where = f"{dtype} session {s}"
            if ws["history_len"] != gs["history_len"]:
                out.append(f"{where}: history {gs['history_len']} tokens, want {ws['history_len']}")
            for t, (wt, gt) in enumerate(zip(ws["turns"], gs["turns"], strict=True)):
                for key in ("text", "reply", "scored", "recomputed"):
                    if wt[key] != gt[key]:
                        out.append(f"{where} turn {t} {key}: want {wt[key]!r}, got {gt[key]!r}")
                if not math.isclose(wt["nll"], gt["nll"], rel_tol=NLL_REL, abs_tol=NLL_REL):
                    out.append(f"{where} turn {t} nll: want {wt['nll']!r}, got {gt['nll']!r}")
    return out


def test_golden_decode_turns(one_thread) -> None:
    got = json.loads(json.dumps({dtype: decode_script(dtype) for dtype in KV_DTYPES}))
    if os.environ.get(REGEN_ENV) == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        pytest.fail(f"regenerated {GOLDEN} ({REGEN_ENV}=1): review the diff, then run without it")
    assert GOLDEN.exists(), f"no golden file; make it with {REGEN_ENV}=1"
    diff = differences(json.loads(GOLDEN.read_text()), got)
    assert not diff, "the decode differs from the golden turns:\n" + "\n".join(diff)


def test_int8_differs_from_fp32_only_in_the_nll() -> None:
    """The golden file itself: int8 ran quantized blocks (its nll is not fp32's) yet the same
    greedy bytes; and the write-back turn recomputed the whole conversation."""
    golden = json.loads(GOLDEN.read_text())
    fp, q = golden["fp32"]["sessions"][0]["turns"], golden["int8"]["sessions"][0]["turns"]
    assert [t["reply"] for t in fp] == [t["reply"] for t in q]
    assert any(not math.isclose(a["nll"], b["nll"], rel_tol=NLL_REL) for a, b in zip(fp, q))
    assert fp[3]["recomputed"] == len(SYSTEM) + sum(len(t) + REPLY for t in FIRST_TURNS)
