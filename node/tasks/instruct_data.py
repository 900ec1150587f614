"""Instruction data no download needs: question/answer pairs from the standard library's docstrings.

For every public top-level function and class of a stdlib module (parsed with ``ast``, never
imported) that has a docstring: *"What does `json.dumps` do?"* -> the docstring's first
paragraph (whitespace collapsed, 24..400 characters). The modules are ``node.tasks.corpus``'s split:
each node gets the pairs of its share of top-level modules (non-IID: one node learns ``email``
and ``http``, another ``tkinter``) and evaluation uses the held-out modules, which no node
trains on. Deterministic for a given Python install and seed.

``tokenize_pair`` templates a pair with the model's chat template (a system prompt, the
question as the user turn, the answer as the assistant turn) and marks which tokens are the
answer: the loss and the metric (held-out **answer perplexity**) count those alone.
``ByteChatCodec`` is the tiny test model's template: ChatML over bytes, two special ids.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch
import torch.nn.functional as F

from node.models.chat import ChatCodec
from node.tasks.corpus import load_modules, split_corpus

SYSTEM_PROMPT = "You are a concise Python expert. Answer in one or two sentences."
"""The system message of every example (its blocks are the prefix sessions share)."""
IGNORE = -100
"""Label of a token the loss skips (prompt and padding)."""
_HEADER = re.compile(rb"^# ==== (.+?) ====\n", re.M)


@dataclass(frozen=True)
class QAPair:
    module: str
    """The top-level module the pair comes from (the unit of the non-IID split)."""
    question: str
    answer: str
    system: str | None = SYSTEM_PROMPT
    """The system message it is asked under; None: the chat template's default."""


def first_paragraph(doc: str, min_chars: int = 24, max_chars: int = 400) -> str | None:
    """The docstring's first paragraph, whitespace collapsed; None when too short or too long
    (a bare signature line, or a paragraph that is a whole page)."""
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = " ".join(para.split())
    return text if min_chars <= len(text) <= max_chars else None


def _dotted(rel_path: str) -> str:
    """``json/decoder.py`` -> ``json.decoder``; ``email/__init__.py`` -> ``email``."""
    parts = rel_path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _file_pairs(top: str, rel_path: str, source: bytes) -> list[QAPair]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    mod = _dotted(rel_path)
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_") or (doc := ast.get_docstring(node)) is None:
            continue
        if (answer := first_paragraph(doc)) is not None:
            out.append(QAPair(top, f"What does `{mod}.{node.name}` do?", answer))
    return out


@lru_cache(maxsize=8)
def module_pairs(top: str) -> tuple[QAPair, ...]:
    """Every pair of one top-level module (its files in path order)."""
    data = load_modules().get(top)
    if data is None:
        raise KeyError(f"no stdlib module {top!r}")
    heads = list(_HEADER.finditer(data))
    pairs: list[QAPair] = []
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(data)
        pairs += _file_pairs(top, h.group(1).decode(), data[h.end():end])
    return tuple(pairs)


@dataclass
class InstructSplit:
    shares: list[list[QAPair]]
    heldout: list[QAPair]
    share_modules: list[list[str]]
    heldout_modules: list[str]


def _gather(mods: Sequence[str], seed: int) -> list[QAPair]:
    """Every pair of ``mods``, shuffled by ``seed``."""
    pairs = [p for m in mods for p in module_pairs(m)]
    g = torch.Generator().manual_seed(seed)
    return [pairs[i] for i in torch.randperm(len(pairs), generator=g).tolist()]


@lru_cache(maxsize=16)
def share_pairs(num_shares: int, seed: int, index: int, max_bytes: int | None = None) -> tuple[QAPair, ...]:
    """Node ``index``'s pairs: its share of modules (``node.tasks.corpus``'s split of the whole
    stdlib, or of ``max_bytes`` of whole modules), shuffled with ``seed``; a share without any
    pair is an error. Parses that share's modules only."""
    if not 0 <= index < num_shares:
        raise ValueError(f"share index {index} not in [0, {num_shares})")
    mods = split_corpus(num_shares, seed=seed, max_bytes=max_bytes).share_modules[index]
    pairs = tuple(_gather(mods, seed * 1009 + index))
    if not pairs:
        raise ValueError(f"share {index} ({mods}) has no docstring pairs; use fewer nodes")
    return pairs


@lru_cache(maxsize=4)
def heldout_pairs(seed: int = 0, max_bytes: int | None = None) -> tuple[QAPair, ...]:
    """Pairs of the held-out modules (fixed whatever the number of nodes), shuffled by ``seed``."""
    return tuple(_gather(split_corpus(1, seed=seed, max_bytes=max_bytes).heldout_modules, seed))


def split_pairs(num_shares: int, seed: int = 0, max_bytes: int | None = None) -> InstructSplit:
    """Every node's pairs and the held-out pairs (``share_pairs``, ``heldout_pairs``)."""
    split = split_corpus(num_shares, seed=seed, max_bytes=max_bytes)
    return InstructSplit([list(share_pairs(num_shares, seed, i, max_bytes)) for i in range(num_shares)],
                         list(heldout_pairs(seed, max_bytes)), split.share_modules, split.heldout_modules)


class ChatTemplate(Protocol):
    """What tokenizing a pair needs of a codec (``node.models.chat.ChatCodec``, ``ByteChatCodec``)."""

    eos_ids: frozenset[int]

    def render(self, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> str: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: Sequence[int]) -> str: ...


def _messages(question: str, system: str | None) -> list[dict[str, str]]:
    user = [{"role": "user", "content": question}]
    return user if system is None else [{"role": "system", "content": system}, *user]


def prompt_ids(codec: ChatTemplate, question: str, system: str | None = SYSTEM_PROMPT) -> list[int]:
    """System message (None: the template's default), the question as user turn, the
    assistant header: what a reply follows."""
    return codec.encode(codec.render(_messages(question, system), True))


def tokenize_pair(codec: ChatTemplate, pair: QAPair, max_len: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of the templated conversation: labels are ``IGNORE`` on the prompt and
    the answer's own ids (its end-of-turn included) on the answer; cut to ``max_len``."""
    msgs = _messages(pair.question, pair.system)
    prompt = codec.encode(codec.render(msgs, True))
    full = codec.encode(codec.render([*msgs, {"role": "assistant", "content": pair.answer}]))
    if full[:len(prompt)] != prompt:
        raise ValueError("the chat template's prompt is not a token prefix of the conversation")
    if len(prompt) >= max_len:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room within max_len {max_len}")
    full = full[:max_len]
    return full, [IGNORE] * len(prompt) + full[len(prompt):]


def batch(codec: ChatTemplate, pairs: Sequence[QAPair], max_len: int,
          pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``ids`` and next-token ``labels`` ``[B, T]`` (labels shifted: position t
    predicts ids[t + 1]; padding and prompt are ``IGNORE``)."""
    rows = [tokenize_pair(codec, p, max_len) for p in pairs]
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y) - 1] = torch.tensor(y[1:])
    return ids, labels


def answer_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (nats/token) over the answer tokens alone (the model's cache-free forward;
    right padding cannot reach an earlier position under causal attention)."""
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


class ByteChatCodec(ChatCodec):
    """The tiny test model's chat template: ChatML (SmolLM2's format) over UTF-8 bytes, with
    ``<|im_start|>`` = 256 and ``<|im_end|>`` = 257 (the EOS); a 258-token vocabulary. Not a
    stub: a ``ChatCodec`` (so ``node.engine.sessions`` serves it) whose template and tokenizer are
    written out here, for a model without a Hugging Face tokenizer."""

    START, END = 256, 257
    vocab_size = 258
    pad_id = 0
    _SPECIAL = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")
    special_ids = {"<|im_start|>": START, "<|im_end|>": END}

    def __init__(self) -> None:
        self.tokenizer = None
        self.eos_ids = frozenset({self.END})

    def _plain(self, text: str) -> list[int]:
        """Message content: its UTF-8 bytes, special-token text included (``ChatCodec.prompt``)."""
        return list(text.encode("utf-8"))

    def conversation_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(self.render(messages))

    def render(self, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._SPECIAL.split(text):
            if piece == "<|im_start|>":
                out.append(self.START)
            elif piece == "<|im_end|>":
                out.append(self.END)
            else:
                out += piece.encode("utf-8")
        return out

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", "replace")


@torch.no_grad()
def greedy_reply(model, codec: ChatTemplate, question: str, max_new_tokens: int = 32,
                 system: str | None = SYSTEM_PROMPT) -> str:
    """The model's greedy reply to ``question`` (under ``system``), decoded through a
    private KV cache; ends at an EOS id or after ``max_new_tokens``."""
    from cache import KVCache

    prompt = prompt_ids(codec, question, system)
    kv = KVCache(model.cache_config(pool_bytes=max(4 << 20, _kv_bytes(model, len(prompt) + max_new_tokens))))
    sid = kv.open_session()
    logits = model.prefill(prompt, kv, sid)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(logits.argmax())
        if tok in codec.eos_ids:
            break
        out.append(tok)
        logits = model.forward_cached([tok], kv, sid)[-1]
    return codec.decode(out)


def _kv_bytes(model, tokens: int) -> int:
    """fp32 K/V bytes of ``tokens`` tokens (twice, for block rounding)."""
    c = model.cache_config()
    return 2 * 2 * 4 * c.num_layers * c.num_heads * c.head_dim * (tokens + 64)
